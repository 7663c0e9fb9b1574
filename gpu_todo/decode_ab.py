"""A/B in one process: flash_decode reading each row's length (cache_seqlens given, all N_max: the old kernel's
path) against a full cache (cache_seqlens=None: L from the arguments), with cuDNN, three interleaved rounds."""
import statistics, torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from flashref.triton.decode import flash_decode
POINTS = [(16, 8, 4096), (16, 8, 16384), (16, 8, 65536), (16, 8, 131072), (4, 32, 16384), (4, 8, 4096),
          (4, 8, 65536), (1, 8, 4096), (1, 8, 65536)]
for B, H_kv, N in POINTS:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(B, H_kv, N, 128, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    L = torch.full((B,), N, dtype=torch.int32, device="cuda")
    a = flash_decode(q, k, v, L, check_finite=False); b = flash_decode(q, k, v, check_finite=False)
    assert torch.equal(a, b)
    fns = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
           "read L": lambda: flash_decode(q, k, v, L, check_finite=False),
           "L given": lambda: flash_decode(q, k, v, check_finite=False)}
    res = {n: [] for n in fns}
    for _ in range(3):
        for n, f in fns.items():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                res[n].append(1e3 * triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median"))
    med = {n: statistics.median(x) for n, x in res.items()}
    print(f"B {B:2d} H_kv {H_kv:2d} N {N:6d} | " + " | ".join(f"{n} {' '.join(f'{t:7.1f}' for t in res[n])}" for n in fns)
          + f" || cudnn/read {med['cudnn']/med['read L']:.3f}  cudnn/given {med['cudnn']/med['L given']:.3f}", flush=True)
