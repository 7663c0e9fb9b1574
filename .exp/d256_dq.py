import torch, triton
from flashref.triton import ops, configs, flash_attention_forward, flash_attention_backward
from flashref.triton.configs import TileConfig as T
B, H, N, d = 8, 8, 4096, 256
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=200)
for causal in (False, True):
    o, lse = flash_attention_forward(q, k, v, causal=causal)
    f = lambda: flash_attention_backward(q, k, v, o, lse, do, causal=causal, check_finite=False)
    f(); t = bench(f)
    dkdv = [v_ for k_, v_ in ops._CHOSEN.items() if k_[0] == "dkdv"][-1]
    dqc = [v_ for k_, v_ in ops._CHOSEN.items() if k_[0] == "dq"][-1]
    with ops.fixed_configs(dkdv=dkdv, dq=dqc):
        t0 = bench(f)
    print(f"causal={causal} autotuned {t:.3f} pinned {t0:.3f} dq={dqc}", flush=True)
    for cfg in [T(64, 32, 4, 3), T(64, 32, 4, 2), T(64, 64, 4, 2), T(64, 64, 8, 2), T(128, 64, 8, 2), T(128, 32, 8, 2),
                T(128, 32, 8, 3), T(64, 32, 8, 3), T(128, 64, 8, 1), T(64, 16, 4, 3), T(128, 16, 8, 3)]:
        try:
            with ops.fixed_configs(dkdv=dkdv, dq=cfg):
                f(); t2 = bench(f)
            print(f"  dq {cfg} {t2:.3f} ms ({t0 / t2:.3f}x)", flush=True)
        except Exception as e:
            print(f"  dq {cfg} failed {type(e).__name__} {str(e)[:120]}", flush=True)
