"""d = 256 teaching backward: dK/dV configs with and without the column split, timed on the GPU."""
import sys, time
import torch, triton
from flashref.triton import ops, configs, flash_attention_forward, flash_attention_backward
from flashref.triton.configs import TileConfig as T
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

B, H, N, d = 8, 8, 4096, 256
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
orig = configs.column_split
def bench(f):
    return triton.testing.do_bench(f, warmup=25, rep=200)
for causal in (False, True):
    fl = 4 * B * H * N * N * d * 2.5 / (2 if causal else 1)
    o, lse = flash_attention_forward(q, k, v, causal=causal)
    f = lambda: flash_attention_backward(q, k, v, o, lse, do, causal=causal, check_finite=False)
    ref = f()
    t = bench(f)
    print(f"causal={causal} autotuned bwd {t:.3f} ms {fl/t/1e9:.0f} TF chosen={[(kk[0], vv) for kk, vv in ops._CHOSEN.items()]}", flush=True)
    qq, kk_, vv_ = (x.clone().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        def sd():
            out = F.scaled_dot_product_attention(qq, kk_, vv_, is_causal=causal)
            out.backward(do)
        t_sd = bench(sd)
        out = F.scaled_dot_product_attention(qq, kk_, vv_, is_causal=causal)
        t_sdf = bench(lambda: F.scaled_dot_product_attention(qq, kk_, vv_, is_causal=causal))
    print(f"  sdpa flash fwd+bwd {t_sd:.3f} fwd {t_sdf:.3f} -> bwd {t_sd - t_sdf:.3f} ms", flush=True)
    for split, cands in ((2, [T(32, 128, 8, 2), T(64, 128, 8, 2), T(32, 64, 4, 2), T(64, 64, 8, 2), T(32, 64, 8, 2)]),
                         (1, [T(16, 64, 4, 2), T(32, 64, 4, 2), T(32, 64, 8, 2), T(64, 64, 8, 2), T(16, 32, 4, 2), T(32, 32, 4, 3), T(16, 64, 8, 2)])):
        configs.column_split = lambda block_d, deterministic=True, interpreted=False, s=split: s if (block_d >= 256 and deterministic) else 1
        for cfg in cands:
            try:
                with ops.fixed_configs(dkdv=cfg):
                    out = f()
                    err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out[1:], ref[1:]))
                    t2 = bench(f)
                print(f"  split={split} {cfg} bwd {t2:.3f} ms ({t / t2:.3f}x autotuned) max|diff dK,dV|={err:.2e}", flush=True)
            except Exception as e:
                print(f"  split={split} {cfg} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        configs.column_split = orig
