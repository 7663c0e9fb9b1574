"""validation's rule for bad values, held by every public function: NaN or inf in the data is a ValueError
naming the argument and the first bad element, never NaN rows, a RuntimeWarning or an opaque error; a
score given to the online-softmax functions may be -inf (the mask) and nothing else that is not finite;
an empty row of scores is a ValueError. The NumPy entry points are those of test_validation; the Triton
kernels run here in the interpreter (compiled on the GPU machine), the CuPy kernel in test_cupy_gpu."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

from flashref import numpy_flash, online_softmax as osm, reference
from tests.test_validation import ENTRY_POINTS, arrays

BAD_VALUES = [("NaN", np.nan), ("+inf", np.inf), ("-inf", -np.inf)]


@pytest.fixture(autouse=True)
def _warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# every (entry point, data argument) pair: forwards take q, k, v; backwards do as well
DATA_ARGS = [(name, fn, backward, which) for name, fn, backward in ENTRY_POINTS
             for which in ("q", "k", "v", "do")[:4 if backward else 3]]


@pytest.mark.parametrize("shown,value", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
@pytest.mark.parametrize("name,fn,backward,which", DATA_ARGS, ids=[f"{a[0]}-{a[3]}" for a in DATA_ARGS])
def test_numpy_entry_points_refuse_non_finite_data(name, fn, backward, which, shown, value):
    q, k, v = arrays()
    data = dict(q=q, k=k, v=v, do=np.ones(q.shape))
    data[which][1, 2, 3, 0] = value
    with pytest.raises(ValueError, match=rf"^{which} must be finite \(no NaN or inf\), got {re.escape(shown)} at index \(1, 2, 3, 0\)$"):
        if backward:
            fn(data["q"], data["k"], data["v"], data["do"])
        else:
            fn(data["q"], data["k"], data["v"])


@pytest.mark.parametrize("which", ["o", "lse"])
def test_numpy_flash_backward_refuses_a_non_finite_forward_result(which):
    q, k, v = arrays()
    o, lse = numpy_flash.flash_attention_forward(q, k, v)
    saved = dict(o=o, lse=lse)
    saved[which][0, 0, 0] = np.nan
    with pytest.raises(ValueError, match=rf"^{which} must be finite"):
        numpy_flash.flash_attention_backward(q, k, v, saved["o"], saved["lse"], np.ones_like(o))


@pytest.mark.parametrize("fn", [osm.softmax, osm.safe_softmax, osm.logsumexp, osm.scan], ids=lambda f: f.__name__)
def test_scores_may_be_minus_inf_but_not_nan_or_plus_inf(fn):
    masked = fn(np.array([[0.0, -np.inf, 1.0], [-np.inf, 2.0, -np.inf]]))
    values = (masked.m, masked.l) if isinstance(masked, osm.SoftmaxState) else (masked,)
    assert all(np.all(np.isfinite(x)) for x in values)
    for shown, value in BAD_VALUES[:2]:
        with pytest.raises(ValueError, match=rf"^x must be finite or -inf \(a masked score\), got {re.escape(shown)} at index \(1, 0\)$"):
            fn(np.array([[0.0, 1.0], [value, 2.0]]))


def test_softmax_of_a_masked_row_is_zero_weights_not_nan():
    p = osm.softmax(np.array([0.0, -np.inf, 1.0]))
    assert p[1] == 0.0 and abs(p.sum() - 1.0) < 1e-15


@pytest.mark.parametrize("fn", [osm.softmax, osm.safe_softmax, osm.logsumexp, osm.scan], ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", [(0,), (3, 0)])
def test_an_empty_row_of_scores_is_named(fn, shape):
    with pytest.raises(ValueError, match=r"^x must hold at least one score in every row, got shape"):
        fn(np.zeros(shape))


def test_an_empty_block_is_nothing_to_add():
    """update() folds in a block of scores: an empty block is allowed and changes nothing."""
    s = osm.update(osm.init(), np.array([1.0, 2.0]))
    s2 = osm.update(s, np.zeros(0))
    assert s2.m == s.m and s2.l == s.l


def test_online_softmax_refuses_torch_tensors():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"x must be a NumPy array, got a torch.Tensor"):
        osm.softmax(torch.zeros(3))
    assert np.allclose(osm.softmax([0.0, 0.0]), [0.5, 0.5])  # Python lists of numbers are scores too


# ------------------------------------------------------------------ Triton (interpreter here, compiled on a GPU)

@pytest.fixture
def triton_ops():
    import torch

    from flashref import triton as ft  # torch and triton are test requirements: no skipping
    return torch, ft, "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shown,value", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_triton_refuses_non_finite_inputs(triton_ops, which, shown, value):
    torch, ft, device = triton_ops
    data = {n: torch.randn(1, 2, 5, 16, device=device) for n in "qkv"}
    data[which][0, 1, 3, 7] = value
    for fn in (ft.flash_attention, ft.flash_attention_forward):
        with pytest.raises(ValueError, match=rf"^{which} must be finite \(no NaN or inf\), got {re.escape(shown)} at index \(0, 1, 3, 7\)$"):
            fn(data["q"], data["k"], data["v"])


def test_triton_check_finite_false_skips_the_check(triton_ops):
    torch, ft, device = triton_ops
    q, k, v = (torch.randn(1, 1, 5, 16, device=device) for _ in range(3))
    q[0, 0, 2, 0] = float("nan")
    warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's NumPy notices the NaN; a GPU would not
    o = ft.flash_attention(q, k, v, check_finite=False)
    assert torch.isnan(o[0, 0, 2]).all() and torch.isfinite(o[0, 0, [0, 1, 3, 4]]).all()
    with pytest.raises(TypeError, match="check_finite must be a bool"):
        ft.flash_attention(q, k, v, check_finite="no")


def test_triton_backward_refuses_a_non_finite_gradient(triton_ops):
    torch, ft, device = triton_ops
    q, k, v = (torch.randn(1, 1, 5, 16, device=device, requires_grad=True) for _ in range(3))
    do = torch.ones(1, 1, 5, 16, device=device)
    do[0, 0, 4, 1] = float("inf")
    o = ft.flash_attention(q, k, v)
    with pytest.raises(ValueError, match=r"^do \(the gradient of o\) must be finite .*got \+inf at index \(0, 0, 4, 1\)$"):
        o.backward(do)
    o, lse = ft.flash_attention_forward(q.detach(), k.detach(), v.detach())
    with pytest.raises(ValueError, match=r"^do must be finite"):
        ft.flash_attention_backward(q.detach(), k.detach(), v.detach(), o, lse, do)
    lse[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^lse must be finite"):
        ft.flash_attention_backward(q.detach(), k.detach(), v.detach(), o, lse, torch.ones_like(o))
