"""What the host side remembers between calls (flashref.triton.ops: the checked metadata, the dispatch's answers)
and what it still does at every call: a remembered answer never lets a bad argument or bad data through."""

from __future__ import annotations

import pytest
import torch

import flashref.triton  # noqa: F401  (before triton: the interpreter switch)
from flashref.triton import backward_kernel, flash_attention_forward, forward_kernel, ops
from tests._triton_helpers import DEVICE


def _qkv(n=20, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, n, d, generator=g, dtype=dtype).to(DEVICE) for _ in range(3)]


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(ops, "_CHECKED", {})
    monkeypatch.setattr(ops, "_DISPATCH", {})


def test_a_call_like_an_earlier_one_is_checked_from_memory_but_its_data_every_time(fresh):
    q, k, v = _qkv()
    assert ops._check(q, k, v, True, None) == (16, 0.25)
    assert len(ops._CHECKED) == 1
    q[0, 1, 3, 2] = float("nan")
    with pytest.raises(ValueError, match=r"q must be finite.*index"):
        flash_attention_forward(q, k, v, causal=True)
    assert len(ops._CHECKED) == 1  # the same metadata: no second entry


@pytest.mark.parametrize("causal, sm_scale, error", [
    (1, None, "causal must be"), (True, True, "sm_scale must be a real number"),
    (True, [0.5], "sm_scale must be a real number"), (True, float("nan"), "sm_scale must be a finite number")])
def test_arguments_equal_to_remembered_ones_are_still_refused(fresh, causal, sm_scale, error):
    """1 == True and hash(1) == hash(True): the remembered key holds each scalar's type beside its value."""
    q, k, v = _qkv()
    ops._check(q, k, v, True, None)
    ops._check(q, k, v, True, 1.0)
    with pytest.raises((TypeError, ValueError), match=error):
        ops._check(q, k, v, causal, sm_scale)


def test_other_shapes_or_dtypes_are_checked_again(fresh):
    q, k, v = _qkv()
    ops._check(q, k, v, False, None)
    with pytest.raises(ValueError, match="k must have the head dimension of q"):
        ops._check(q, k[..., :8], v, False, None)
    with pytest.raises(TypeError, match="q, k and v must have the same dtype"):
        ops._check(q, k.double(), v, False, None)


def test_what_is_remembered_is_bounded(fresh):
    for n in range(1, ops._CHECKED_MAX + 10):
        ops._check(*_qkv(n), False, None, check_finite=False)
    assert len(ops._CHECKED) == ops._CHECKED_MAX
    assert ops._check_key(*_qkv(ops._CHECKED_MAX + 9), False, None, False) in ops._CHECKED  # the newest kept
    assert ops._check_key(*_qkv(1), False, None, False) not in ops._CHECKED  # the oldest gone


def test_the_dispatch_answers_by_the_features_used_and_remembers_each(fresh):
    q, k, v = _qkv()
    assert forward_kernel(q, k, v) == forward_kernel(q, k, v, dropout_p=0.1) == "triton"  # (no Hopper GPU here)
    assert backward_kernel(q, k, v, deterministic=False) == "triton"
    kinds = sorted(key[0] for key in ops._DISPATCH)
    assert kinds == ["backward", "forward", "forward"]  # dropout or not: two questions, each asked once
    with pytest.raises(ValueError, match="kernel must be one of"):
        forward_kernel(q, k, v, kernel="gluon")  # the kernel name is checked before anything is remembered


def test_a_descriptor_from_its_template_equals_tritons_own():
    """hopper.descriptor: field for field what TensorDescriptor.from_tensor makes, the template holds no tensor,
    and a misaligned tensor is refused as from_tensor refuses it."""
    import dataclasses
    import gc
    import weakref

    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashref.triton import hopper

    layout = hopper.shared_layout((64, 64), gl.float16)
    for rows in (128, 320):
        first, second = (torch.randn(rows, 64, dtype=torch.float16) for _ in range(2))
        for x in (first, second):  # the first makes the template, the second is made from it
            got, want = hopper.descriptor(x, (64, 64), layout), TensorDescriptor.from_tensor(x, [64, 64], layout)
            assert got.base is x
            assert {f.name: getattr(got, f.name) for f in dataclasses.fields(got)} == \
                {f.name: getattr(want, f.name) for f in dataclasses.fields(want)}
    gone = torch.randn(192, 64, dtype=torch.float16)
    alive = weakref.ref(gone)
    hopper.descriptor(gone, (64, 64), layout)
    del gone
    gc.collect()
    assert alive() is None  # the template kept no reference to it
    storage = torch.randn(129 * 64 + 1, dtype=torch.float16)
    hopper.descriptor(storage[:128 * 64].view(128, 64), (64, 64), layout)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        hopper.descriptor(storage[1:128 * 64 + 1].view(128, 64), (64, 64), layout)


def test_a_block_mask_is_checked_once_for_each_call_shape_and_forgotten_with_it(fresh, monkeypatch):
    import gc

    from flashref import validation

    monkeypatch.setattr(ops, "_MASKS_KEPT", {})
    checked = []
    real = validation.check_block_mask
    monkeypatch.setattr(validation, "check_block_mask", lambda *a, **kw: checked.append(a[2:]) or real(*a, **kw))
    q, k, _ = _qkv(n=40)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool, device=DEVICE)
    for _ in range(3):
        feat = ops.Features(q, k, block_mask=mask, block_size=16)
        assert feat.block_mask.shape == (1, 2, 3, 3) and feat.block_mask.dtype == torch.int8
    assert checked == [(40, 40, 16)]  # once
    with pytest.raises(ValueError, match="block_mask must have shape"):
        ops.Features(*_qkv(n=60)[:2], block_mask=mask, block_size=16)  # the same mask, another length
    mask[0, 0, 2, 0] = False  # in place: checked again (its version moved), and the view shows it
    feat = ops.Features(q, k, block_mask=mask, block_size=16)
    assert len(checked) == 3 and feat.block_mask[0, 1, 2, 0] == 0
    del mask, feat
    gc.collect()
    assert not ops._MASKS_KEPT
