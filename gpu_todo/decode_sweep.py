"""Issue 15: the split-KV decode kernel's tile configs (d = 128) against cuDNN at the batch-16 points that tie it
(B 16, N_k 4K / 16K / 128K), same run, three interleaved rounds. python3 gpu_todo/decode_sweep.py"""
import sys, time, statistics, json
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from flashref.triton import decode
from flashref.triton.decode import flash_decode, decode_plan

CONFIGS = [(64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 8, 2), (32, 4, 4), (32, 4, 6), (128, 8, 3),
           (128, 4, 3), (64, 8, 4), (64, 4, 5)]
SPLITS = [1, 2, 3, 4]  # forced slice counts under the shipped config (64, 4, 3)
SHAPES = [(16, 4096), (16, 16384), (16, 131072), (4, 65536), (1, 65536), (1, 4096)]
H, H_kv, d = 32, 8, 128
out = []
for B, N in SHAPES:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, 1, d, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(B, H_kv, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    res = {}
    for rnd in range(3):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            res.setdefault("cudnn", []).append(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"))
        for cfg in CONFIGS:
            decode.GPU_CONFIGS["large"][128] = [cfg]
            try:
                o = flash_decode(q, k, v, check_finite=False)
                err = (o.float() - ref.float()).abs().max().item()
                plan = decode_plan(q, k)
                fn = lambda: flash_decode(q, k, v, check_finite=False)
                ms = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
                res.setdefault(str(cfg), []).append(ms)
                res.setdefault(str(cfg) + " plan", [f"{plan['block_n']},{plan['num_warps']},{plan['num_stages']},s{plan['num_splits']} err {err:.1e}"])
            except Exception as e:
                res.setdefault(str(cfg), []).append(None)
                res[str(cfg) + " err"] = [repr(e)[:200]]
        decode.GPU_CONFIGS["large"][128] = [(64, 4, 3)]
        for ns in SPLITS:
            fn = lambda: flash_decode(q, k, v, check_finite=False, num_splits=ns)
            res.setdefault(f"splits={ns}", []).append(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"))
    byt = 2 * B * H_kv * N * d * 2
    print(f"B {B} N {N}  ({byt/1e6:.0f} MB)", flush=True)
    for name, vals in res.items():
        if name.endswith("plan") or name.endswith("err"):
            print("     ", name, vals[0]); continue
        ok = [x for x in vals if x]
        if ok:
            med = statistics.median(ok)
            print(f"  {name:14s} {' '.join(f'{x*1e3:8.1f}' for x in ok)} us  med {med*1e3:8.1f}  {byt/med/1e9:7.0f} GB/s  cudnn/this {statistics.median(res['cudnn'])/med:.3f}", flush=True)
    out.append(dict(B=B, N=N, res=res))
