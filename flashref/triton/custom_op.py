"""The Triton kernels as a ``torch.library`` custom op, so that ``torch.compile`` traces a model through
attention without a graph break.

    from flashref.triton.custom_op import attention
    o = attention(q, k, v, causal=True)   # differentiable; under torch.compile, torch.ops.flashref.attention_forward

``torch.compile`` cannot look inside a Triton launch wrapped in a ``torch.autograd.Function`` that does
Python bookkeeping (autotuning, cached lists), so it would break the graph there. A custom op is opaque
to it instead: the compiler needs only the op's *fake* implementation (the shapes and dtypes of its
outputs) and its autograd formula, both registered below. The forward op returns ``(o, lse)``; the
backward op recomputes P from q, k and lse (:func:`flashref.triton.flash_attention_backward`).
Notebook ``11_attention_in_a_model``.
"""

from __future__ import annotations

import torch

from flashref.triton import ops


@torch.library.custom_op("flashref::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of :func:`flashref.triton.flash_attention_forward`, its inputs unchecked: :func:`attention`
    checks them (shapes, dtypes, devices, ``sm_scale``) before it calls this op, which a compiled graph then runs
    with no host work beyond the launch; called directly, the op trusts its caller. On the Gluon
    path q, k, v in a model's (B, N, H, d) layout are read in place and o comes in it (:func:`flashref.triton.ops.
    compiled_layout`)."""
    return ops.custom_forward(q, k, v, causal, sm_scale)


def _empty_like(x: torch.Tensor, token: bool) -> torch.Tensor:
    """An empty tensor of x's (B, H, N, d) shape as the real ops allocate it: contiguous, or with ``token`` in the
    (B, N, H, d) layout they write when they read q, k, v in place (:func:`flashref.triton.hopper.empty_output`)."""
    B, H, N, d = x.shape
    return x.new_empty((B, N, H, d)).transpose(1, 2) if token else x.new_empty(x.shape)


@attention_forward.register_fake
def _(q, k, v, causal, sm_scale):
    # What the real op returns: o like q (see _empty_like); lse (B, H, N_q) in fp32.
    return _empty_like(q, ops.compiled_layout(q, k, v, causal, sm_scale)), q.new_empty(q.shape[:3],
                                                                                       dtype=torch.float32)


@torch.library.custom_op("flashref::attention_backward", mutates_args=())
def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                       do: torch.Tensor, causal: bool, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`flashref.triton.flash_attention_backward` (deterministic; dO read in place, and the
    gradients written, in q, k, v's layout where the forward read them in place). Unchecked, as the forward op:
    autograd calls it with the tensors the checked forward saved."""
    return ops.custom_backward(q, k, v, o, lse, do, causal, sm_scale)


@attention_backward.register_fake
def _(q, k, v, o, lse, do, causal, sm_scale):
    # What the real op returns: each gradient like its input, laid out as the forward's o (see _empty_like).
    token = ops.compiled_layout(q, k, v, causal, sm_scale)
    return tuple(_empty_like(x, token) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, sm_scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.sm_scale = causal, sm_scale


def _backward(ctx, do, dlse):
    # lse is an output only so that the backward can reuse it; nothing differentiates through it.
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, ctx.causal, ctx.sm_scale)
    return dq, dk, dv, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, causal=False, sm_scale=None):
    """``o = softmax(sm_scale q k^T) v``: what a model calls when it may be compiled. Same shapes, dtypes and
    checks as :func:`flashref.triton.flash_attention` (GQA: fewer K/V heads), NaN not looked for.

    While ``torch.compile`` traces, the call goes through the custom op. Run eagerly it goes straight to
    :func:`flashref.triton.flash_attention`'s autograd Function: a custom op's Python dispatch measured
    0.65 ms of CPU time per forward + backward on the H100 machine (1.69 against 1.03 ms), more than the
    kernels of a 4K-token layer take on the GPU."""
    from flashref.triton.ops import _check, flash_attention

    if not torch.compiler.is_compiling():
        return flash_attention(q, k, v, causal, sm_scale, check_finite=False)
    _, scale = _check(q, k, v, causal, sm_scale, check_finite=False)
    return attention_forward(q, k, v, bool(causal), scale)[0]
