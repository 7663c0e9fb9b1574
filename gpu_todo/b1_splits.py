"""Stop 65: (1) flash_decode's split count at B 1 and 4 (d 128, H 32, H_kv 8, one query) against cuDNN, five
interleaved rounds, do_bench and CUDA-graph replay; (2) notebook 10's density sweep (cell 37) three times, in both
orders of the windows, to tell a slow first mask from the host's noise. python3 gpu_todo/b1_splits.py"""
import statistics
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from flashref.triton.decode import flash_decode, decode_plan
from flashref.bench.features_bench import graph_time_us

H, H_kv, d = 32, 8, 128
for B, N in [(1, 4096), (1, 16384), (1, 65536), (1, 131072), (4, 131072)]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, 1, d, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(B, H_kv, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    default = decode_plan(q, k)["num_splits"]
    fns = {"cudnn": None}
    for s in sorted({default, 8, 16, 24, 32, 48, 64}):
        fns[f"s{s}" + ("*" if s == default else "")] = (lambda s=s: flash_decode(q, k, v, check_finite=False, num_splits=s))
    def cud():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    fns["cudnn"] = cud
    ref = cud()
    for name, fn in fns.items():
        assert (fn().float() - ref.float()).abs().max().item() < 1e-2, name
    res = {n: [] for n in fns}
    gr = {}
    for rnd in range(5):
        for name, fn in fns.items():
            res[name].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3)
    for name, fn in fns.items():
        if name == "cudnn":
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                gr[name] = graph_time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        else:
            gr[name] = graph_time_us(fn)
    c = statistics.median(res["cudnn"])
    print(f"B {B} N {N}", flush=True)
    for name in fns:
        m = statistics.median(res[name])
        print(f"  {name:6s} {' '.join(f'{x:7.1f}' for x in res[name])}  med {m:7.1f}  cudnn/this {c / m:.3f}  graph {gr[name] or 0:7.1f} us", flush=True)
    del q, k, v

from flashref import block_masks as bm
from flashref.triton import flash_attention
N, d, H, size = 8192, 64, 16, 128
g = torch.Generator(device="cuda").manual_seed(5)
q, k, v = (torch.randn(1, H, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
n = bm.n_blocks(N, size)
t_dense = triton.testing.do_bench(lambda: flash_attention(q, k, v, causal=True, check_finite=False, kernel="triton"))
print(f"dense causal (triton) {t_dense:.3f} ms;  default kernel {triton.testing.do_bench(lambda: flash_attention(q, k, v, causal=True, check_finite=False)):.3f} ms")
for order in [(n, 16, 8, 4, 2, 1), (1, 2, 4, 8, 16, n), (n, 16, 8, 4, 2, 1)]:
    line = []
    for w in order:
        mask = bm.sliding_window(n, window=w, device=q.device)
        t = triton.testing.do_bench(lambda: flash_attention(q, k, v, causal=True, block_mask=mask, block_size=size, check_finite=False))
        tg = graph_time_us(lambda: flash_attention(q, k, v, causal=True, block_mask=mask, block_size=size, check_finite=False))
        line.append(f"w{w}: {t:.3f} ms (graph " + (f"{tg/1e3:.3f})" if tg else "-)"))
    print("  ".join(line), flush=True)
