"""Shared by the Triton tests: inputs, plain attention in low precision (the tolerance rule's baseline)."""

from __future__ import annotations

import torch

# The one plain PyTorch attention of the package: every step in the inputs' dtype (matmul, softmax, matmul).
from flashref.torch_attention import make_qkv, plain_attention  # noqa: F401  (make_qkv: the tests' inputs)


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
