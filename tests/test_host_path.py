"""The host side of a training step on the Gluon (H100) path, on any machine: every kernel launch is recorded
instead of run, and the dispatch is told the Hopper kernels can take the call. A step's launches are counted, and
a second step like the first must launch the same kernels with the same arguments (addresses aside), build no
TMA descriptor from scratch and check no rule again: what the host-time memos of :mod:`flashref.triton.ops`
and :mod:`flashref.triton.hopper` promise, checked without a clock (host time itself is measured on the GPU
machine, never asserted in a test)."""

from __future__ import annotations

import pytest
import torch

import flashref.triton  # noqa: F401  (before triton: the interpreter switch)
from flashref import block_masks
from flashref.triton import flash_attention, ops
from tests._triton_helpers import DEVICE

hopper = ops._gluon_module("hopper")
if isinstance(hopper, ImportError):  # a Triton without Gluon: nothing here can run
    pytest.skip(f"needs Triton's Gluon: {hopper}", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TensorDescriptor = hopper.TensorDescriptor  # Gluon's host-side TMA descriptor


def _summary(x):
    """What a launch argument is, without its address: a tensor's shape, strides and dtype; a descriptor's
    tensor, block and layout; a scalar itself."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), x.dtype)
    if isinstance(x, TensorDescriptor):
        return ("descriptor", _summary(x.base), tuple(x.shape), tuple(x.strides), tuple(x.block_shape),
                repr(x.layout))
    if isinstance(x, (bool, int, float, str, type(None))):
        return x
    return repr(x)


@pytest.fixture
def launches(monkeypatch):
    """The launches of the calls made under this fixture, as (kernel name, grid, arguments summarized); the
    dispatch takes the Gluon kernels (any Hopper refusal answered None), its memos start empty."""
    made = []

    def record(self, *args, grid, warmup, **kwargs):
        name = getattr(self, "__name__", None) or self.fn.__name__
        made.append((name, tuple(grid), tuple(map(_summary, args)),
                     tuple(sorted((k, _summary(v)) for k, v in kwargs.items()))))

    monkeypatch.setattr(JITFunction, "run", record)
    monkeypatch.setattr(InterpretedFunction, "run", record)
    # the device checks say yes, as in tests/test_backward_dispatch.py (the backward modules' build on hopper's)
    monkeypatch.setattr(ops, "_hopper_refusal", lambda *args, **kwargs: None)
    monkeypatch.setattr(hopper, "supported", lambda q, k, v: None)
    monkeypatch.setattr(ops, "_dq_stream", lambda device: None)  # (a CUDA stream: none here)
    for memo in ("_CHECKED", "_DISPATCH", "_MASKS_KEPT", "_LISTS_KEPT"):
        monkeypatch.setattr(ops, memo, {})
    monkeypatch.setattr(hopper, "_DESCRIPTOR_TEMPLATES", {})
    return made


CASES = {
    "dense causal": dict(causal=True),
    "block mask": dict(block_mask=block_masks.sliding_window(4, window=2, device=DEVICE), block_size=128),
    "dropout": dict(dropout_p=0.1, seed=7),
    "window": dict(window_size=(40, 0)),
    "atomic dQ": dict(causal=True, deterministic=False),
}


def _step(q, k, v, do, **kw):
    for x in (q, k, v):
        x.grad = None
    flash_attention(q, k, v, check_finite=False, **kw).backward(do)


def _inputs(N=512, d=64):
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, N, d, generator=g, dtype=torch.float16).to(DEVICE) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


@pytest.mark.parametrize("case", CASES)
def test_a_second_step_launches_what_the_first_did(launches, case):
    q, k, v, do = _inputs()
    _step(q, k, v, do, **CASES[case])
    first = [launch for launch in launches if not launch[0].startswith("visible")]  # a mask's lists: made once
    launches.clear()
    _step(q, k, v, do, **CASES[case])
    assert launches == first
    names = [name for name, *_ in first]
    assert names[0] in ("hopper_fwd_kernel", "hopper_ws_fwd_kernel")  # the Gluon forward, then the backward's
    backward = {"atomic dQ": {"hopper_fused_bwd_kernel"}}.get(case, {"hopper_bwd_dq_kernel"})
    assert backward <= set(names[1:]), names


def test_a_dense_training_step_launches_five_kernels(launches):
    """Forward; D = rowsum(dO * O); dQ; the padded statistics that dK/dV's copies read; dK/dV."""
    q, k, v, do = _inputs()
    _step(q, k, v, do, causal=True)
    names = [name for name, *_ in launches]
    assert names[:4] == ["hopper_fwd_kernel", "flash_bwd_preprocess_kernel", "hopper_bwd_dq_kernel",
                         "_padded_stats_kernel"], names
    assert len(names) == 5 and names[4] in ("hopper_bwd_dkdv_kernel", "hopper_ws_bwd_dkdv_kernel"), names


@pytest.mark.parametrize("case", CASES)
def test_a_second_step_checks_and_builds_nothing_again(launches, monkeypatch, case):
    """No rule checked, no dispatch question asked, no block mask checked, no descriptor validated from scratch:
    each was answered by the first step."""
    calls = {"rules": 0, "dispatch": 0, "masks": 0, "descriptors": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(ops, "_check_rules", counting("rules", ops._check_rules))
    monkeypatch.setattr(ops, "_choose_backward", counting("dispatch", ops._choose_backward))
    monkeypatch.setattr(ops.validation, "check_block_mask", counting("masks", ops.validation.check_block_mask))
    monkeypatch.setattr(TensorDescriptor, "from_tensor",
                        staticmethod(counting("descriptors", TensorDescriptor.from_tensor)))
    q, k, v, do = _inputs()
    _step(q, k, v, do, **CASES[case])
    assert calls["rules"] == 1 and calls["descriptors"] > 0 and (calls["masks"] > 0) == ("block_mask" in CASES[case])
    before = dict(calls)
    _step(q, k, v, do, **CASES[case])
    assert calls == before
