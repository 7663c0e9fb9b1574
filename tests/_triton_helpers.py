"""Shared by the Triton tests: inputs, plain attention in low precision (the tolerance rule's baseline)."""

from __future__ import annotations

import torch

# The one plain PyTorch attention of the package: every step in the inputs' dtype (matmul, softmax, matmul).
from flashref.torch_attention import plain_attention


def make_qkv(B, H, N_q, N_k, d, dtype, device, seed=0, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(B, H, N_q, d, generator=g) * scale).to(device=device, dtype=dtype)
    k = torch.randn(B, H, N_k, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, H, N_k, d, generator=g).to(device=device, dtype=dtype)
    do = torch.randn(B, H, N_q, d, generator=g).to(device=device, dtype=dtype)
    return q, k, v, do


def plain_forward_backward(q, k, v, do, causal=False, sm_scale=None):
    """Plain attention's output and gradients, computed in the dtype of the inputs."""
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = plain_attention(qq, kk, vv, causal, sm_scale)
    o.backward(do)
    return o.detach(), qq.grad, kk.grad, vv.grad


def flash_forward_backward(fn, q, k, v, do, causal=False, sm_scale=None):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = fn(qq, kk, vv, causal=causal, sm_scale=sm_scale)
    o.backward(do)
    return o.detach(), qq.grad, kk.grad, vv.grad
