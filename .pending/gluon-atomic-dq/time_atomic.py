"""The Gluon backward at d = 64: the deterministic split (dK/dV kernel + dQ kernel, seven products a tile) against
the dK/dV kernel with atomic dQ (five), and cuDNN's backward; B x N = 65536, H x d = 2048. Scratch for landing."""
import torch, triton
from flashref.triton import flash_attention_forward, ops
from flashref.triton import hopper_backward as hb
from flashref.bench.features_bench import graph_time_us

def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

for N, causal in [(4096, False), (4096, True), (16384, False), (16384, True)]:
    B, H, d = 65536 // N, 32, 64
    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16) for _ in range(4))
    o, lse = flash_attention_forward(q, k, v, causal)
    m2, l2 = ops._stats_from_lse(lse)
    delta = (o.float() * do.float()).sum(-1).contiguous()
    split = bench(lambda: hb.hopper_backward(q, k, v, do, m2, l2, delta, causal, 0.125))
    atomic = bench(lambda: hb.hopper_backward(q, k, v, do, m2, l2, delta, causal, 0.125, deterministic=False))
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        cudnn = bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
    flops = 2.5 * 4 * B * H * N * N * d * (0.5 if causal else 1)
    print(f"== N {N} causal {causal}: split {split:.3f} ms ({flops / split / 1e9:.0f} TFLOP/s), atomic {atomic:.3f} "
          f"({flops / atomic / 1e9:.0f}), cuDNN bwd {cudnn:.3f} ({flops / cudnn / 1e9:.0f}); split/atomic "
          f"{split / atomic:.2f}, cudnn/atomic {cudnn / atomic:.2f}", flush=True)
