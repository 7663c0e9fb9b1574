"""Where the block-sparse backward's time goes (H100): per-kernel CUDA time from the profiler, wall time per
call (do_bench), host time; flashref vs Flex on the features bench's masks. Scratch, not committed."""
import time, sys
import torch, triton
from torch.profiler import profile, ProfilerActivity
from flashref import block_masks
from flashref.bench.features_bench import _inputs, _flex, flex_block_mask
from flashref.triton import flash_attention
from flashref.triton import ops

def kernels(fn, iters=5):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    tot = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            tot[e.name[:60]] = tot.get(e.name[:60], 0) + e.device_time / iters
    return sorted(tot.items(), key=lambda x: -x[1])[:8]

def host_us(fn, n=50):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    h = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return h

for (B, H, N, d) in [(4, 16, 4096, 64), (1, 16, 16384, 128)]:
    q, k, v, do = _inputs(B, H, H, N, d)
    n = block_masks.n_blocks(N, 128)
    pats = {"sliding window": (block_masks.sliding_window(n, window=8, causal=True, device="cuda"), True),
            "bigbird": (block_masks.bigbird(n, window=3, n_global=1, n_random=2, seed=0, device="cuda"), False)}
    for pat, (mask, causal) in pats.items():
        fbm = flex_block_mask(mask, N, 128, causal)
        impls = {
            "flashref": lambda: flash_attention(q, k, v, causal=causal, block_mask=mask, block_size=128, check_finite=False).backward(do),
            "flashref teaching bwd": lambda: flash_attention(q, k, v, causal=causal, block_mask=mask, block_size=128, check_finite=False, kernel="triton").backward(do),
            "flex": lambda: _flex()(q, k, v, block_mask=fbm).backward(do),
        }
        for name, fn in impls.items():
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=[q, k, v], return_mode="median")
            h = host_us(fn)
            print(f"== B{B} H{H} N{N} d{d} {pat:15s} {name:16s} {ms:7.3f} ms  host {h:6.0f} us", flush=True)
            for kname, us in kernels(fn):
                print(f"      {us/1e3:7.3f} ms  {kname}")
    del q, k, v, do
    torch.cuda.empty_cache()
