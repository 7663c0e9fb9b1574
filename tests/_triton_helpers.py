"""Shared by the Triton tests: inputs, plain attention in low precision (the tolerance rule's baseline)."""

from __future__ import annotations

import math

import torch


def make_qkv(B, H, N_q, N_k, d, dtype, device, seed=0, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(B, H, N_q, d, generator=g) * scale).to(device=device, dtype=dtype)
    k = torch.randn(B, H, N_k, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, H, N_k, d, generator=g).to(device=device, dtype=dtype)
    do = torch.randn(B, H, N_q, d, generator=g).to(device=device, dtype=dtype)
    return q, k, v, do


def plain_attention(q, k, v, causal=False, sm_scale=None):
    """softmax(scale Q K^T) V with every step in the inputs' dtype (matmul, softmax, matmul)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


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
