"""flashref.triton.launch: the key under which a compiled kernel is launched again must separate every case
Triton compiles separately (CPU), and the direct launch must give what Triton's own launch gives, bit for
bit, including on inputs Triton specializes differently (GPU)."""

from __future__ import annotations

import pytest
import torch

import flashref.triton  # noqa: F401  (switches the interpreter on where there is no GPU, before triton loads)
from flashref.triton.launch import _spec
from tests._triton_helpers import make_qkv


def test_spec_separates_what_triton_specializes():
    x = torch.zeros(64, dtype=torch.float16)
    assert _spec(x, False) == _spec(torch.ones(64, dtype=torch.float16), False)
    assert _spec(x, False) != _spec(x.float(), False)  # dtype
    if x.data_ptr() % 16 == 0:
        assert _spec(x, False) != _spec(x[1:], False)  # 16-byte alignment
    assert _spec(1, False) != _spec(3, False)  # an int equal to 1
    assert _spec(16, False) != _spec(17, False)  # divisibility by 16
    assert _spec(17, False) == _spec(33, False)
    assert _spec(2**31, False) != _spec(2**31 - 16, False)  # i32 against i64
    assert _spec(True, False) != _spec(1, False)
    assert _spec(64, True) != _spec(128, True)  # constexprs by value
    assert _spec(0.5, False) == _spec(0.25, False)  # floats are not specialized


def test_apply_takes_flash_attentions_arguments_and_checks_them():
    from flashref.triton import FlashAttentionFunction, flash_attention

    q, k, v, _ = make_qkv(1, 2, 19, 23, 16, torch.float32, "cpu", seed=3)
    expected = flash_attention(q, k, v, check_finite=False)
    assert torch.equal(FlashAttentionFunction.apply(q, k, v), expected)  # sm_scale=None: 1/sqrt(d)
    assert torch.equal(FlashAttentionFunction.apply(q, k, v, False, None), expected)
    with pytest.raises(ValueError, match="sm_scale"):
        FlashAttentionFunction.apply(q, k, v, False, float("nan"))
    with pytest.raises(TypeError, match="deterministic"):
        FlashAttentionFunction.apply(q, k, v, False, None, "yes")


def _forward_backward(fn, q, k, v, do, causal):
    """As tests._triton_helpers.flash_forward_backward, but without copying q (which would align it)."""
    q = q.detach().requires_grad_()
    k, v = (x.detach().clone().requires_grad_() for x in (k, v))
    o = fn(q, k, v, causal=causal)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_direct_launch_equals_tritons_launch(causal):
    from flashref.triton import flash_attention, ops

    q, k, v, do = make_qkv(2, 3, 300, 257, 64, torch.float16, "cuda", seed=5)
    # An input whose data is not 16-byte aligned compiles separately: it must not reuse the aligned kernel.
    q_odd = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape).copy_(q)
    runs = {}
    for direct in (False, True):
        for r in ops._RELAUNCHERS.values():
            r.enabled = direct
        try:
            runs[direct] = [_forward_backward(flash_attention, x, k, v, do, causal) for x in (q, q_odd, q)]
        finally:
            for r in ops._RELAUNCHERS.values():
                r.enabled = True
    kernels = (ops.flash_fwd_kernel, ops.flash_bwd_preprocess_kernel, ops.flash_bwd_dkdv_kernel, ops.flash_bwd_dq_kernel)
    assert all(ops._RELAUNCHERS[kernel].compiled for kernel in kernels)  # the direct path was taken
    assert q_odd.data_ptr() % 16 != 0
    for by_triton, direct in zip(runs[False], runs[True]):
        for a, b in zip(by_triton, direct):
            assert torch.equal(a, b)
