"""Every bad input to every public entry point gets a ValueError or TypeError that names the argument.

To cover another implementation, add it to FORWARDS (called as ``f(q, k, v, causal=..., sm_scale=...)``)
and, for a backward pass taking ``do``, to BACKWARDS (called as ``f(q, k, v, do, causal=..., sm_scale=...)``).
"""

from __future__ import annotations

import numpy as np
import pytest

from flashref import numpy_flash, online_softmax, reference


def _numpy_flash_backward(q, k, v, do, causal=False, sm_scale=None):
    """numpy_flash's backward also takes o and lse; give it ones of the right shape (when q has a
    shape), so that the error under test is the one about q, k, v or do."""
    shape = getattr(q, "shape", None)
    o = np.ones(shape) if shape is not None else None
    lse = np.ones(shape[:-1]) if shape is not None else None
    return numpy_flash.flash_attention_backward(q, k, v, o, lse, do, causal=causal, sm_scale=sm_scale)


FORWARDS = {
    "reference.attention": reference.attention,
    "online_softmax.attention_by_key_blocks": online_softmax.attention_by_key_blocks,
    "numpy_flash.flash_attention_forward[fa2]": lambda *a, **kw: numpy_flash.flash_attention_forward(*a, order="fa2", **kw),
    "numpy_flash.flash_attention_forward[fa1]": lambda *a, **kw: numpy_flash.flash_attention_forward(*a, order="fa1", **kw),
}
BACKWARDS = {
    "reference.attention_backward": reference.attention_backward,
    "numpy_flash.flash_attention_backward": _numpy_flash_backward,
}

GOOD_Q = (2, 3, 5, 4)
GOOD_K = (2, 3, 6, 4)


def arrays(shape_q=GOOD_Q, shape_k=GOOD_K, shape_v=None, dtypes=("float64",) * 3):
    rng = np.random.default_rng(0)
    shapes = (shape_q, shape_k, shape_k if shape_v is None else shape_v)
    return [rng.standard_normal(s).astype(dt) for s, dt in zip(shapes, dtypes)]


# (id, kwargs for arrays(), exception, words the message must contain)
BAD_QKV = [
    ("q 3-d", dict(shape_q=(3, 5, 4), shape_k=(3, 6, 4)), ValueError, "q must have shape"),
    ("q 1-d", dict(shape_q=(4,), shape_k=(6, 4)), ValueError, "q must have shape"),
    ("k 5-d", dict(shape_q=(5, 4), shape_k=(1, 1, 1, 6, 4), shape_v=(6, 4)), ValueError, "k must have shape"),
    ("v rank", dict(shape_q=(5, 4), shape_k=(6, 4), shape_v=(1, 1, 6, 4)), ValueError, "same rank"),
    ("batch mismatch", dict(shape_k=(1, 3, 6, 4)), ValueError, "batch and head"),
    ("heads mismatch", dict(shape_q=(2, 2, 5, 4)), ValueError, "head"),  # "batch and head", or GQA's H_kv rule
    ("k head dim", dict(shape_k=(2, 3, 6, 3), shape_v=(2, 3, 6, 4)), ValueError, "k must have the head dimension"),
    ("v head dim", dict(shape_v=(2, 3, 6, 5)), ValueError, "v must have the head dimension"),
    ("v rows", dict(shape_v=(2, 3, 7, 4)), ValueError, "v must have as many rows as k"),
    ("q empty", dict(shape_q=(2, 3, 0, 4)), ValueError, "q is an empty sequence"),
    ("k empty", dict(shape_k=(2, 3, 0, 4)), ValueError, "k is an empty sequence"),
    ("d zero", dict(shape_q=(5, 0), shape_k=(6, 0)), ValueError, "head dimension"),
    ("dtypes differ", dict(dtypes=("float64", "float32", "float64")), TypeError, "same dtype"),
    ("int dtype", dict(dtypes=("int64",) * 3), TypeError, "must have dtype .*float32 or float64, got int64"),
    ("int32 dtype", dict(dtypes=("int32",) * 3), TypeError, "dtype"),
    ("bool dtype", dict(dtypes=("bool",) * 3), TypeError, "dtype"),
    ("complex dtype", dict(dtypes=("complex128",) * 3), TypeError, "dtype"),
]

BAD_OPTIONS = [
    ("sm_scale nan", dict(sm_scale=float("nan")), ValueError, "sm_scale must be a finite number"),
    ("sm_scale inf", dict(sm_scale=float("inf")), ValueError, "sm_scale must be a finite number"),
    ("sm_scale -inf", dict(sm_scale=-np.inf), ValueError, "sm_scale must be a finite number"),
    ("sm_scale zero", dict(sm_scale=0.0), ValueError, "sm_scale must be a finite number > 0"),
    ("sm_scale negative", dict(sm_scale=-0.5), ValueError, "sm_scale must be a finite number > 0"),
    ("sm_scale beyond float32", dict(sm_scale=3e38), ValueError, "sm_scale must lie within"),
    ("sm_scale str", dict(sm_scale="0.5"), TypeError, "sm_scale must be a real number"),
    ("sm_scale bool", dict(sm_scale=True), TypeError, "sm_scale must be a real number"),
    ("sm_scale complex", dict(sm_scale=1j), TypeError, "sm_scale must be a real number"),
    ("sm_scale array", dict(sm_scale=np.array([0.5, 0.5])), TypeError, "sm_scale"),
    ("causal int", dict(causal=1), TypeError, "causal must be a bool"),
    ("causal str", dict(causal="True"), TypeError, "causal must be a bool"),
    ("causal None", dict(causal=None), TypeError, "causal must be a bool"),
]


def _call(fn, q, k, v, backward, **kwargs):
    if backward:
        return fn(q, k, v, np.ones(q.shape, dtype=q.dtype) if hasattr(q, "shape") else None, **kwargs)
    return fn(q, k, v, **kwargs)


ENTRY_POINTS = [(name, fn, False) for name, fn in FORWARDS.items()] + \
               [(name, fn, True) for name, fn in BACKWARDS.items()]
ENTRY_IDS = [name for name, _, _ in ENTRY_POINTS]


@pytest.mark.parametrize("name,fn,backward", ENTRY_POINTS, ids=ENTRY_IDS)
@pytest.mark.parametrize("case,spec,exc,words", BAD_QKV, ids=[c[0] for c in BAD_QKV])
def test_bad_q_k_v(name, fn, backward, case, spec, exc, words):
    q, k, v = arrays(**spec)
    with pytest.raises(exc, match=words):
        _call(fn, q, k, v, backward)


@pytest.mark.parametrize("name,fn,backward", ENTRY_POINTS, ids=ENTRY_IDS)
@pytest.mark.parametrize("case,kwargs,exc,words", BAD_OPTIONS, ids=[c[0] for c in BAD_OPTIONS])
def test_bad_options(name, fn, backward, case, kwargs, exc, words):
    q, k, v = arrays()
    with pytest.raises(exc, match=words):
        _call(fn, q, k, v, backward, **kwargs)


@pytest.mark.parametrize("name,fn,backward", ENTRY_POINTS, ids=ENTRY_IDS)
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_not_an_array(name, fn, backward, which):
    q, k, v = arrays()
    args = dict(q=q, k=k, v=v)
    args[which] = args[which].tolist()
    with pytest.raises(TypeError, match=f"{which} must be a NumPy array, got list"):
        if backward:
            fn(args["q"], args["k"], args["v"], np.ones(GOOD_Q))
        else:
            fn(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("name,fn,backward", ENTRY_POINTS, ids=ENTRY_IDS)
def test_good_input_passes(name, fn, backward):
    """The same calls with good input succeed and compute attention (the float64 reference's output, or its
    gradients), so the failures above are about the bad argument only. For the reference's own entry points
    this only checks that the call succeeds: test_reference.py checks their values against PyTorch."""
    q, k, v = arrays()
    result = _call(fn, q, k, v, backward, causal=True, sm_scale=0.5)
    if backward:
        do = np.ones(q.shape)
        if fn is _numpy_flash_backward:  # its o and lse were placeholders: the gradients need the real ones
            o, lse = reference.attention(q, k, v, causal=True, sm_scale=0.5, return_lse=True)
            result = numpy_flash.flash_attention_backward(q, k, v, o, lse, do, causal=True, sm_scale=0.5)
        expected = reference.attention_backward(q, k, v, do, causal=True, sm_scale=0.5)
    else:
        expected = (reference.attention(q, k, v, causal=True, sm_scale=0.5),)
    result = result if isinstance(result, tuple) else (result,)
    assert len(result) >= len(expected)
    for got, want in zip(result, expected):  # (a forward's lse, after O, is not compared)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,fn", list(BACKWARDS.items()), ids=list(BACKWARDS))
@pytest.mark.parametrize("do_shape", [(2, 3, 5, 3), (2, 3, 6, 4), (3, 5, 4), (5, 4)])
def test_do_of_wrong_shape(name, fn, do_shape):
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"do must have the shape of [oq] \(2, 3, 5, 4\)"):
        fn(q, k, v, np.ones(do_shape))


@pytest.mark.parametrize("name,fn", list(BACKWARDS.items()), ids=list(BACKWARDS))
def test_do_of_wrong_kind(name, fn):
    q, k, v = arrays()
    with pytest.raises(TypeError, match="do must be a NumPy array"):
        fn(q, k, v, np.ones(GOOD_Q).tolist())
    with pytest.raises(TypeError, match="do must have the dtype"):
        fn(q, k, v, np.ones(GOOD_Q, dtype=np.float32))


def test_reference_return_lse_must_be_bool():
    q, k, v = arrays()
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        reference.attention(q, k, v, return_lse="yes")


def test_torch_tensor_is_refused_by_numpy_reference():
    torch = pytest.importorskip("torch")
    q = torch.zeros(4, 2, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q must be a NumPy array, got a torch.Tensor"):
        reference.attention(q, q, q)


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(N_q=0), ValueError, "N_q must be at least 1"),
    (dict(N_q=8.0), TypeError, "N_q must be an int"),
    (dict(N_q=8, N_k=-1), ValueError, "N_k must be at least 1"),
    (dict(N_q=8, heads=0), ValueError, "heads"),
    (dict(N_q=8, batch=True), TypeError, "batch must be an int"),
    (dict(N_q=8, dtype="int8"), ValueError, "dtype must be one of"),
    (dict(N_q=8, dtype=np.int32), ValueError, "dtype must be one of"),
])
def test_bad_byte_count_arguments(kwargs, exc, words):
    for fn in (reference.score_matrix_bytes, reference.materialized_bytes):
        with pytest.raises(exc, match=words):
            fn(**kwargs)


def test_bad_block_k_of_key_block_attention():
    q, k, v = arrays()
    with pytest.raises(ValueError, match="block_k must be a positive integer, got 0"):
        online_softmax.attention_by_key_blocks(q, k, v, 0)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_check_finite_allows_neg_inf_only_when_asked(kind):
    """-inf is a masked score when allow_neg_inf; NaN and +inf never pass; torch tensors take the same
    rule as NumPy arrays (they have a path of their own, reduced on the device)."""
    from flashref.validation import check_finite

    make = np.array if kind == "numpy" else pytest.importorskip("torch").tensor
    masked = make([[0.5, -np.inf], [1.0, 2.0]])
    check_finite({"s": masked}, allow_neg_inf=True)
    with pytest.raises(ValueError, match=r"s must be finite \(no NaN or inf\), got -inf at index \(0, 1\)"):
        check_finite({"s": masked})
    for bad, shown in ((np.nan, "NaN"), (np.inf, r"\+inf")):
        x = make([[0.5, -np.inf], [bad, 2.0]])
        with pytest.raises(ValueError, match=rf"s must be finite or -inf \(a masked score\), got {shown} at index \(1, 0\)"):
            check_finite({"ok": make([1.0]), "s": x}, allow_neg_inf=True)


def test_check_numpy_array_like():
    """array_like lets Python numbers and lists through (scores), and still refuses torch tensors."""
    from flashref.validation import check_numpy

    assert check_numpy("scores", [1.0, 2.0], array_like=True) == [1.0, 2.0]
    with pytest.raises(TypeError, match="scores must be a NumPy array, got list"):
        check_numpy("scores", [1.0, 2.0])
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"scores must be a NumPy array, got a torch.Tensor"):
        check_numpy("scores", torch.ones(2), array_like=True)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")  # np.asmatrix, on purpose
def test_what_the_audit_found_is_named():
    """A NumPy bool names its type (not "got bool"), NumPy subclasses with other arithmetic are refused, and an
    integer beyond any float is a ValueError naming the argument, not an OverflowError."""
    from flashref import numpy_flash, reference

    q = np.random.default_rng(0).standard_normal((5, 4))
    with pytest.raises(TypeError, match=r"causal must be a bool, got numpy\.bool: np\.True_"):
        reference.attention(q, q, q, causal=np.True_)
    for sub in (np.asmatrix(q), np.ma.masked_array(q, mask=q > 1)):
        for fn in (reference.attention, numpy_flash.flash_attention_forward):
            with pytest.raises(TypeError, match="q must be a plain NumPy array, got numpy"):
                fn(sub, q, q)
    for kwargs, name in ((dict(sm_scale=10**400), "sm_scale"), (dict(softcap=10**400), "softcap"),
                         (dict(dropout_p=10**400, dropout_mask=np.ones((5, 5), bool)), "dropout_p")):
        with pytest.raises(ValueError, match=name):
            reference.attention(q, q, q, **kwargs)


def test_parameters_the_kernels_cannot_hold_in_float32():
    """A softcap, sm_scale or ALiBi slope that is finite in float64 but inf in the kernels' float32 arithmetic
    (times log2(e), or 1/softcap) is refused naming the argument, not turned into NaN output."""
    from flashref import reference, validation

    q = np.random.default_rng(0).standard_normal((1, 2, 5, 4))
    for kwargs, name in ((dict(softcap=3e38), "softcap"), (dict(softcap=1e-45), "softcap"),
                         (dict(alibi_slopes=np.array([3e38, 1.0])), "alibi_slopes"),
                         (dict(sm_scale=validation.MAX_SCALE * 1.01), "sm_scale")):
        with pytest.raises(ValueError, match=name):
            reference.attention(q, q, q, **kwargs)
    # the bounds themselves are taken
    assert np.isfinite(np.float32(validation.MAX_SCALE) * np.float32(np.log2(np.e)))
    assert np.isfinite(np.float32(1.0) / np.float32(validation.MIN_SOFTCAP))
    assert np.isfinite(reference.attention(q, q, q, softcap=validation.MIN_SOFTCAP)).all()
