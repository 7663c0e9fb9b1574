"""Which backward flash_attention runs (flashref.triton.backward_kernel) where the Hopper kernels could run, checked
on any machine: the device checks (``ops._hopper_refusal`` and ``hopper.supported``, which the backward modules'
``supported`` build on) are made to say yes, and the rules that remain, the ones notebook 14 states, decide. On an H100 tests/test_triton_gpu.py checks the same
calls with nothing stood in."""

from __future__ import annotations

import pytest
import torch

import flashref.triton  # noqa: F401  (before triton: the interpreter switch)
from flashref.triton import backward_kernel, hopper, hopper_backward_fused, ops


@pytest.fixture
def as_if_on_an_h100(monkeypatch):
    monkeypatch.setattr(ops, "_hopper_refusal", lambda q, k, v, feat, backward=False: None)
    monkeypatch.setattr(hopper, "supported", lambda q, k, v: None)
    monkeypatch.setattr(ops, "_DISPATCH", {})  # the dispatch's remembered answers, made here, forgotten after
    monkeypatch.setattr(ops, "_sm_count", lambda device: 132)  # an H100's (the ordered backward's residency rule)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU machine the kernels want CUDA tensors


def _qkv(d, n=300):
    return [torch.zeros(1, 2, n, d, dtype=torch.float16, device=DEVICE) for _ in range(3)]


# (head dim, keywords) -> (deterministic backward, deterministic=False backward)
CASES = [
    (64, {}, "hopper", "hopper-fused"),
    (128, dict(causal=True), "hopper", "hopper-fused"),
    # the fused kernel draws the mask at d = 64, and at d = 128 after S^T and dP^T (_fused_step); deterministic,
    # with its dQ adds in a fixed order
    (64, dict(dropout_p=0.1), "hopper-ordered", "hopper-fused"),
    (128, dict(dropout_p=0.1), "hopper-ordered", "hopper-fused"),
    (64, dict(dropout_p=0.1, causal=True), "hopper-ordered", "hopper-fused"),
    (64, dict(dropout_p=0.1, alibi_slopes=torch.ones(2)), "hopper", "hopper"),
    (64, dict(window_size=(16, 0)), "hopper", "triton"),
    (128, dict(alibi_slopes=torch.ones(2)), "hopper", "triton"),
    (64, dict(block_mask=torch.ones(1, 2, 3, 3, dtype=torch.bool)), "hopper", "triton"),
    (256, {}, "hopper", "hopper"),  # no fused kernel there: the deterministic pair, faster than the atomic dQ
    (256, dict(causal=True), "hopper", "hopper"),
    (256, dict(window_size=(16, 0)), "triton", "triton"),
    (256, dict(dropout_p=0.1), "triton", "triton"),
]


@pytest.mark.parametrize("d, kw, det, nondet", CASES, ids=[f"d{d}-{'-'.join(kw) or 'plain'}" for d, kw, *_ in CASES])
def test_which_backward_runs(as_if_on_an_h100, d, kw, det, nondet):
    q, k, v = _qkv(d)
    kw = {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
    assert backward_kernel(q, k, v, **kw) == det
    assert backward_kernel(q, k, v, **kw, deterministic=False) == nondet
    assert backward_kernel(q, k, v, **kw, kernel="triton") == "triton"
    assert backward_kernel(q, k, v, **kw, deterministic=False, kernel="triton") == "triton"


def test_without_the_fused_kernel_deterministic_false_keeps_the_teaching_atomic_dq(as_if_on_an_h100, monkeypatch):
    """Where the fused kernel cannot run (an older Gluon without the TMA reduce), deterministic=False at d = 64
    and 128 falls back to the teaching kernel's atomic dQ, never to an error."""
    monkeypatch.delattr(hopper_backward_fused.gluon_ir.GluonOpBuilder, "create_async_tma_reduce")
    assert "TMA reduce" in hopper_backward_fused.supported(*_qkv(64))
    for d in (64, 128):
        assert backward_kernel(*_qkv(d), deterministic=False) == "triton"
        assert backward_kernel(*_qkv(d)) == "hopper"


def test_the_ordered_kernel_takes_what_cannot_deadlock(as_if_on_an_h100):
    """Deterministic dropout runs the ordered one-kernel backward where
    :func:`flashref.triton.hopper_backward_fused.ordered_supported` allows: causal at any length; without causal
    masking while a head's key blocks fit the GPU's multiprocessors (132 here), else the pair. A part of the backward
    alone (ring attention's) runs the pair's kernel for it."""
    long = 132 * 128 + 1
    assert backward_kernel(*_qkv(64, long), dropout_p=0.1) == "hopper"
    assert backward_kernel(*_qkv(64, long), causal=True, dropout_p=0.1) == "hopper-ordered"
    assert backward_kernel(*_qkv(64, long - 1), dropout_p=0.1) == "hopper-ordered"
    q, k, v = _qkv(64, 100)
    k2 = torch.zeros(1, 2, 300, 64, dtype=torch.float16, device=DEVICE)
    assert backward_kernel(q, k2, k2, dropout_p=0.1) == "hopper"  # 3 key blocks, 2 query tiles
