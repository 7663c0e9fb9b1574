"""Where the host time of one flashref fwd+bwd goes on the GPU machine (cProfile over many calls)."""
import cProfile, pstats, sys, time, torch
from flashref import block_masks
from flashref.triton import flash_attention
B, H, N, d = 1, 16, 16384, 64
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
n = block_masks.n_blocks(N, 128)
sw = block_masks.sliding_window(n, window=2, causal=True, device="cuda")
mode = sys.argv[1] if len(sys.argv) > 1 else "sw"
kw = dict(causal=True, block_mask=sw) if mode == "sw" else dict(causal=True)
def step():
    o = flash_attention(q, k, v, check_finite=False, **kw)
    o.backward(do)
    q.grad = k.grad = v.grad = None
for _ in range(30): step()
torch.cuda.synchronize()
for rep in range(3):
    t0 = time.perf_counter()
    for _ in range(200): step()
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    print(f"{mode}: host {1e6*(t1-t0)/200:.1f} us a call issued, {1e6*(t2-t0)/200:.1f} us with the sync")
pr = cProfile.Profile(); pr.enable()
for _ in range(200): step()
torch.cuda.synchronize(); pr.disable()
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(35); st.sort_stats("cumtime").print_stats(45)
