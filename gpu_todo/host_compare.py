"""H100: host time per call and do_bench, with the step plans off (main's path: relaunch only) and on, in turn
twice; a profile with plans on. Run: PYTHONPATH=$PWD python3 gpu_todo/host_compare.py (writes $OUT/prof_plan.txt)."""
import os, time, cProfile, pstats, io
import torch, triton
from flashref import block_masks
from flashref.triton import flash_attention, ops, relaunch
torch.manual_seed(0)
def inputs(B, H, N, d):
    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do
def case(B, H, N, d, pattern):
    n = block_masks.n_blocks(N, 128)
    kw = dict(check_finite=False)
    if pattern == "window":
        kw.update(causal=True, block_mask=block_masks.sliding_window(n, window=8, causal=True, device="cuda"))
    elif pattern == "bigbird":
        kw.update(block_mask=block_masks.bigbird(n, window=3, n_global=1, n_random=2, seed=0, device="cuda"))
    elif pattern == "dropout":
        kw.update(dropout_p=0.1, seed=1)
    else:
        kw.update(causal=True)
    q, k, v, do = inputs(B, H, N, d)
    def fwd():
        with torch.no_grad():
            return flash_attention(q, k, v, **kw)
    def step():
        flash_attention(q, k, v, **kw).backward(do)
    return fwd, step, [q, k, v]
for B, H, N, d, pattern in [(4, 16, 4096, 64, "window"), (4, 16, 4096, 64, "bigbird"), (1, 16, 16384, 128, "window"),
                            (1, 2, 1024, 64, "causal"), (8, 16, 4096, 64, "dropout")]:
    fwd, step, ts = case(B, H, N, d, pattern)
    full_key = ops._plan_key
    for on in (False, True, False, True):
        ops._plan_key = full_key if on else (lambda *args: None)
        ops._PLANS.clear()
        for name, fn in (("fwd", fwd), ("fwd+bwd", step)):
            for _ in range(5): fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=ts, return_mode="median")
            host = []
            for r in range(5):
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(20):
                    for x in ts: x.grad = None
                    fn()
                host.append((time.perf_counter() - t) / 20 * 1e3)
                torch.cuda.synchronize()
            print(f"{pattern} B{B} H{H} N{N} d{d} plans={on} {name}: do_bench {ms:.3f} ms, host/call {sorted(host)[2]:.3f} ms (min {min(host):.3f})", flush=True)
    if pattern == "window" and N == 4096:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(50):
            for x in ts: x.grad = None
            step()
        pr.disable(); torch.cuda.synchronize()
        for order in ("tottime", "cumulative"):
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(order).print_stats(45)
            open(f"{os.environ['OUT']}/prof_plan.txt", "a").write(s.getvalue())
