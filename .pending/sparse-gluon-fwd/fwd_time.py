"""Block-sparse forward: the Gluon forward walking lists (auto) vs the teaching forward (kernel="triton") vs Flex,
and the all-True mask vs the dense kernel. Scratch."""
import torch, triton
from flashref import block_masks
from flashref.bench.features_bench import _inputs, _flex, flex_block_mask
from flashref.triton import flash_attention, forward_kernel

def t(fn):
    with torch.no_grad():
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

for (B, H, N, d) in [(4, 16, 4096, 64), (1, 16, 16384, 64), (1, 16, 16384, 128), (1, 8, 65536, 64)]:
    q, k, v, do = _inputs(B, H, H, N, d)
    n = block_masks.n_blocks(N, 128)
    pats = {"sliding": (block_masks.sliding_window(n, window=8, causal=True, device="cuda"), True),
            "bigbird": (block_masks.bigbird(n, window=3, n_global=1, n_random=2, seed=0, device="cuda"), False),
            "causal": (block_masks.causal_blocks(n, device="cuda"), True)}
    for pat, (mask, causal) in pats.items():
        fbm = flex_block_mask(mask, N, 128, causal)
        a = t(lambda: flash_attention(q, k, v, causal=causal, block_mask=mask, check_finite=False))
        b = t(lambda: flash_attention(q, k, v, causal=causal, block_mask=mask, check_finite=False, kernel="triton"))
        f = t(lambda: _flex()(q, k, v, block_mask=fbm))
        print(f"== B{B} H{H} N{N} d{d} {pat:8s} fwd: gluon({forward_kernel(q, k, v, causal=causal, block_mask=mask)}) "
              f"{a:.3f}  teaching {b:.3f}  flex {f:.3f}  -> flex/gluon {f/a:.2f} teaching/gluon {b/a:.2f}", flush=True)
    if (N, d) == (16384, 64):
        full = torch.ones(1, 1, n, n, dtype=torch.bool, device="cuda")
        for causal in (False, True):
            a = t(lambda: flash_attention(q, k, v, causal=causal, block_mask=full, check_finite=False))
            dn = t(lambda: flash_attention(q, k, v, causal=causal, check_finite=False))
            print(f"== all-True mask causal={causal}: {a:.3f} vs dense {dn:.3f} ({a/dn:.3f}x)", flush=True)
    del q, k, v, do
    torch.cuda.empty_cache()
