"""Online softmax: the running max ``m`` and running sum ``l``, and the exact merge of two partial states.

Taught in notebook ``02_online_softmax`` (Milakov and Gimelshein, 2018; Rabe and Staats, 2021).

A softmax over a row ``x`` needs ``m = max(x)`` and ``l = sum(exp(x - m))``. Both can be built one block
of ``x`` at a time, keeping only ``(m, l)``:

    m_new = max(m, max(x_block))
    l_new = l * exp(m - m_new) + sum(exp(x_block - m_new))

and two states built from disjoint parts of the row merge exactly:

    m = max(m_a, m_b),   l = l_a exp(m_a - m) + l_b exp(m_b - m).

For attention the state also carries ``o``, the running *unnormalized* weighted sum of value rows,
rescaled by the same factor ``exp(m - m_new)``; ``o / l`` at the end is the attention output.

Everything is vectorized over leading axes: a state holds one ``(m, l)`` (and one ``o`` row) per row of
scores, so the scores are arrays of shape ``(..., n)``. Masked scores are ``-inf``. A state that has seen
only ``-inf`` has ``m = -inf`` and ``l = 0``; the convention ``exp(-inf - (-inf)) := 0`` (an empty part
contributes nothing) keeps every step free of NaN, a block of all ``-inf`` included.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from flashref import validation


@dataclass(frozen=True)
class SoftmaxState:
    """The running statistics of a partial softmax, one entry per row.

    ``m``: running max of the scores seen, shape ``(...)`` (``-inf`` before any finite score).
    ``l``: running sum of ``exp(score - m)``, shape ``(...)``.
    ``o``: running sum of ``exp(score - m) * v_row``, shape ``(..., d)``, or None for a plain softmax.
    """
    m: np.ndarray
    l: np.ndarray
    o: np.ndarray | None = None


# --------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------

def _as_scores(x, name: str = "scores", allow_empty: bool = False) -> np.ndarray:
    """Scores as a float array (a NumPy array, or Python numbers and lists); integers are promoted to
    float64. NaN and +inf are refused (``-inf`` is the mask), as is an empty row (validation's rule),
    except where an empty block means "nothing to add" (``allow_empty``)."""
    x = _as_array(name, x)
    if x.dtype.kind in "iu":
        x = x.astype(np.float64)
    if x.dtype.kind != "f":
        raise TypeError(f"{name} must be real numbers (a float array), got dtype {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{name} must have at least one axis (the row of scores), got a scalar")
    if x.size == 0 and not allow_empty:
        raise ValueError(f"{name} must hold at least one score in every row, got shape {x.shape}")
    validation.check_finite({name: x}, allow_neg_inf=True)
    return x


def _as_array(name: str, x) -> np.ndarray:
    """A NumPy array, or Python numbers and lists made into one; ragged lists are named as the argument."""
    validation.check_numpy(name, x, array_like=True)
    try:
        return np.asarray(x)
    except ValueError as exc:  # NumPy's "setting an array element with a sequence": rows of different lengths
        raise ValueError(f"{name} must be a rectangular array (every row as long), got {type(x).__name__} "
                         f"that NumPy cannot make one of: {exc}") from None


def _check_state(name: str, state) -> "SoftmaxState":
    if not isinstance(state, SoftmaxState):
        raise TypeError(f"{name} must be a SoftmaxState (from init, update or merge), got {type(state).__name__}")
    return state


# --------------------------------------------------------------------------------------------------
# The recurrence
# --------------------------------------------------------------------------------------------------

def exp_shift(x, m):
    """``exp(x - m)`` with the convention that ``x = -inf`` gives 0 even when ``m = -inf``.

    ``m`` is always a max over a set containing ``x``'s finite values, so the only NaN case is
    ``-inf - (-inf)``; replacing ``m = -inf`` by 0 there turns it into ``exp(-inf) = 0``.
    """
    m = np.asarray(m)
    return np.exp(np.asarray(x) - np.where(np.isneginf(m), 0, m))


def init(shape=(), d: int | None = None, dtype=np.float64) -> SoftmaxState:
    """The empty state: ``m = -inf``, ``l = 0`` (and ``o = 0`` of width ``d`` when ``d`` is given)."""
    dims = tuple(shape) if isinstance(shape, (tuple, list)) else None
    if dims is None or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0 for n in dims):
        raise TypeError(f"shape must be a tuple of non-negative ints, got {type(shape).__name__}: {shape!r}")
    shape = tuple(int(n) for n in dims)
    if not np.issubdtype(np.dtype(dtype), np.floating):
        raise TypeError(f"dtype must be a floating-point dtype (m starts at -inf), got {np.dtype(dtype)}")
    if d is not None:
        d = validation.check_positive_int("d", d)
    m = np.full(shape, -np.inf, dtype=dtype)
    l = np.zeros(shape, dtype=dtype)
    o = None if d is None else np.zeros(shape + (d,), dtype=dtype)
    return SoftmaxState(m, l, o)


def update(state: SoftmaxState, scores_block, v_block=None) -> SoftmaxState:
    """Fold one block of scores (shape ``(..., b)``) into ``state``; return the new state.

    With ``state.o`` set, ``v_block`` (shape ``(..., b, d)`` or ``(b, d)``) is the value rows of the
    block, and ``o`` is rescaled by ``exp(m - m_new)`` before the block's ``P V`` is added.
    """
    _check_state("state", state)
    x = _as_scores(scores_block, "scores_block", allow_empty=True)
    rows = np.shape(state.m)
    if x.shape[:-1] != rows:
        want = "(" + ", ".join([*map(str, rows), "b"]) + ("," if not rows else "") + ")"
        raise ValueError(f"scores_block must have shape {want}: a row of b scores for each row of the state "
                         f"(state.m.shape = {rows}), got shape {x.shape}")
    m_new = np.maximum(state.m, np.max(x, axis=-1, initial=-np.inf))
    alpha = exp_shift(state.m, m_new)           # how much the old terms shrink
    p = exp_shift(x, m_new[..., None])          # the block's terms, on the new scale
    l_new = state.l * alpha + np.sum(p, axis=-1)
    if state.o is None:
        if v_block is not None:
            raise ValueError("v_block was given but the state has no o (make it with init(..., d=...))")
        return SoftmaxState(m_new, l_new)
    if v_block is None:
        raise ValueError("the state carries o, so update needs v_block (the value rows of the block)")
    v_block = _as_array("v_block", v_block)
    if v_block.dtype.kind not in "fiu":  # complex values would make o complex; strings cannot be summed
        raise TypeError(f"v_block must be real numbers, got dtype {v_block.dtype}")
    b, d = x.shape[-1], state.o.shape[-1]
    lead = rows[:-1]  # P's rows form a matrix with the last axis of the state's rows
    if v_block.ndim < 2 or v_block.shape[-2:] != (b, d) or not validation.broadcasts_to(v_block.shape[:-2], lead):
        want = f"(b, d) = ({b}, {d})" + (f" or {lead + (b, d)}" if lead else "")
        raise ValueError(f"v_block must have shape {want}: the block's b value rows, as wide as state.o (d = {d}), "
                         f"got shape {v_block.shape}")
    validation.check_finite({"v_block": v_block})
    o_new = state.o * alpha[..., None] + np.matmul(p, v_block)
    return SoftmaxState(m_new, l_new, o_new)


def merge(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    """The state of the union of the two disjoint parts ``a`` and ``b`` summarize; exact and associative
    (up to float rounding): ``m = max(m_a, m_b)``, ``l = l_a exp(m_a - m) + l_b exp(m_b - m)``."""
    _check_state("a", a)
    _check_state("b", b)
    if (a.o is None) != (b.o is None):
        raise ValueError("merge needs two states that both carry o or both do not")
    shapes = [(np.shape(x.m), np.shape(x.l), None if x.o is None else np.shape(x.o)) for x in (a, b)]
    if shapes[0] != shapes[1]:
        raise ValueError(f"b must have the shape of a (m, l{', o' if a.o is not None else ''}: "
                         f"{', '.join(map(str, shapes[0][:2 + (a.o is not None)]))}), got "
                         f"{', '.join(map(str, shapes[1][:2 + (a.o is not None)]))}")
    m = np.maximum(a.m, b.m)
    wa, wb = exp_shift(a.m, m), exp_shift(b.m, m)
    l = a.l * wa + b.l * wb
    if a.o is None:
        return SoftmaxState(m, l)
    return SoftmaxState(m, l, a.o * wa[..., None] + b.o * wb[..., None])


def merge_outputs(o_a, lse_a, o_b, lse_b, *, inplace=False, check_finite=True):
    """Merge two finished partial attentions over disjoint key sets, each given as its normalized output
    ``o`` (shape ``(..., d)``) and its log-sum-exp ``lse`` (shape ``(...)``): the same merge as
    :func:`merge`, in the form kernels return. With ``lse = logaddexp(lse_a, lse_b)``,

        o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b.

    A part that saw no key (``lse = -inf``) weighs 0; two such parts give ``o = 0``, ``lse = -inf``. The
    weights are taken in lse's precision and o keeps its own: an lse in float64 beside an fp32 o (as ring
    attention keeps them) gives float64 weights and an fp32 o.
    Works on NumPy arrays and on torch tensors alike (no copy to the host): the merge that tiles, GPUs of a
    ring (:mod:`flashref.ring_attention`) and key splits in decoding share. ``inplace=True`` writes the result
    into ``o_a`` and ``lse_a`` (which may be views) and returns them: no temporary as large as o, which matters
    when o is a GPU's whole shard of a long sequence. ``check_finite`` (on by default) refuses NaN or inf in
    o and NaN or +inf in lse, naming the argument; ring attention, which merges its own kernels' outputs, turns
    it off (on a GPU the check reads the inputs once and synchronizes)."""
    if type(o_a) is not type(o_b) or type(lse_a) is not type(lse_b) or type(o_a) is not type(lse_a):
        raise TypeError("merge_outputs needs o_a, lse_a, o_b and lse_b of one array type (all NumPy or all "
                        f"torch), got {type(o_a).__name__}, {type(lse_a).__name__}, {type(o_b).__name__}, "
                        f"{type(lse_b).__name__}")
    for name, x in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        if not (isinstance(x, np.ndarray) or type(x).__module__.startswith("torch") and hasattr(x, "shape")):
            raise TypeError(f"{name} must be a NumPy array or a torch.Tensor, got {type(x).__name__}")
        floating = np.issubdtype(x.dtype, np.floating) if isinstance(x, np.ndarray) else x.dtype.is_floating_point
        if not floating:
            raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")
    validation.check_bool("inplace", inplace)
    if validation.check_bool("check_finite", check_finite):
        validation.check_finite({"o_a": o_a, "o_b": o_b})
        validation.check_finite({"lse_a": lse_a, "lse_b": lse_b}, allow_neg_inf=True)
    if tuple(lse_a.shape) != tuple(lse_b.shape) or tuple(o_a.shape) != tuple(o_b.shape) \
            or tuple(o_a.shape[:-1]) != tuple(lse_a.shape):
        raise ValueError(f"merge_outputs needs o of shape lse.shape + (d,) on both sides, got o_a "
                         f"{tuple(o_a.shape)}, lse_a {tuple(lse_a.shape)}, o_b {tuple(o_b.shape)}, "
                         f"lse_b {tuple(lse_b.shape)}")
    if isinstance(o_a, np.ndarray):
        xp, lse = np, np.logaddexp(lse_a, lse_b)
    else:
        import torch as xp

        lse = xp.logaddexp(lse_a, lse_b)
    safe = xp.where(xp.isneginf(lse), xp.zeros_like(lse), lse)  # both empty: weights exp(-inf) = 0, not NaN
    w_a = xp.exp(lse_a - safe)[..., None]
    w_b = xp.exp(lse_b - safe)[..., None]
    if xp is np:
        out = np.result_type(o_a, o_b)
        w_a, w_b = w_a.astype(out, copy=False), w_b.astype(out, copy=False)
    else:
        out = o_a.dtype if inplace else xp.promote_types(o_a.dtype, o_b.dtype)
        w_a, w_b = w_a.to(out), w_b.to(out)
    if inplace:
        if xp is np:
            np.multiply(o_a, w_a, out=o_a)
            o_a += w_b * o_b
        else:
            o_a.mul_(w_a).addcmul_(o_b, w_b)
        lse_a[...] = lse
        return o_a, lse_a
    return w_a * o_a + w_b * o_b, lse


def lse_of(state: SoftmaxState) -> np.ndarray:
    """log-sum-exp of everything the state has seen: ``m + log(l)`` (``-inf`` for an all-masked row)."""
    _check_state("state", state)
    l = np.asarray(state.l)
    safe_l = np.where(l > 0, l, 1)
    return np.where(l > 0, state.m + np.log(safe_l), -np.inf)


def finalize(state: SoftmaxState):
    """Finish a state: ``lse`` for a plain softmax state, ``(o / l, lse)`` for an attention state.
    A row that saw only ``-inf`` gets ``lse = -inf`` and an output of zeros, not NaN."""
    _check_state("state", state)
    lse = lse_of(state)
    if state.o is None:
        return lse
    l = np.asarray(state.l)[..., None]
    return state.o / np.where(l > 0, l, 1), lse


# --------------------------------------------------------------------------------------------------
# Softmax of a row, three ways
# --------------------------------------------------------------------------------------------------

def safe_softmax(x) -> np.ndarray:
    """The textbook stable softmax over the last axis, three passes: max, sum, normalize."""
    x = _as_scores(x, "x")
    m = np.max(x, axis=-1, keepdims=True)                # pass 1: the max
    l = np.sum(exp_shift(x, m), axis=-1, keepdims=True)  # pass 2: the sum on the max's scale
    return exp_shift(x, m) / np.where(l > 0, l, 1)       # pass 3: normalize


def scan(x, block_size: int = 1) -> SoftmaxState:
    """Run the recurrence over the last axis of ``x`` in blocks of ``block_size``; return the final state
    (one pass over the data)."""
    x = _as_scores(x, "x")
    block_size = validation.check_block_size(block_size)
    state = init(x.shape[:-1], dtype=x.dtype)
    for start in range(0, x.shape[-1], block_size):
        state = update(state, x[..., start:start + block_size])
    return state


def logsumexp(x, block_size: int = 1) -> np.ndarray:
    """log-sum-exp over the last axis, computed by the blocked recurrence."""
    return lse_of(scan(x, block_size))


def softmax(x, block_size: int = 1) -> np.ndarray:
    """Softmax over the last axis in two passes: the recurrence gives ``(m, l)`` in one pass over blocks,
    then ``exp(x - m) / l``. (``exp(x - lse)`` would be the same in exact arithmetic, but rounding
    ``lse`` costs ``|lse| * eps`` in absolute terms, which matters for large scores.) An all-masked row
    gives zeros."""
    x = _as_scores(x, "x")
    state = scan(x, block_size)
    l = state.l[..., None]
    return exp_shift(x, state.m[..., None]) / np.where(l > 0, l, 1)


def running_trace(x, block_size: int = 1):
    """The state after each block, for plots: ``(ends, m, l)`` where ``ends[t]`` is the number of
    scores seen after block ``t`` and ``m[t]``, ``l[t]`` (shape ``(n_blocks, ...)``) the running max and
    sum then."""
    x = _as_scores(x, "x")
    block_size = validation.check_block_size(block_size)
    state = init(x.shape[:-1], dtype=x.dtype)
    ends, ms, ls = [], [], []
    for start in range(0, x.shape[-1], block_size):
        state = update(state, x[..., start:start + block_size])
        ends.append(min(start + block_size, x.shape[-1]))
        ms.append(state.m)
        ls.append(state.l)
    return np.array(ends), np.array(ms), np.array(ls)


# --------------------------------------------------------------------------------------------------
# Attention, one key block at a time
# --------------------------------------------------------------------------------------------------

def attention_by_key_blocks(q, k, v, block_k: int = 64, causal=False, sm_scale=None):
    """Attention in one pass over key/value blocks, carrying ``(m, l, o)`` per query row; returns
    ``(o, lse)`` like ``flashref.reference.attention(..., return_lse=True)``.

    Only an ``N_q x block_k`` slice of the scores exists at a time (all queries at once: the tiling of
    the queries as well comes in notebook ``03_tiled_forward``). Same conventions as the reference, but q, k and
    v share their heads (no grouped-query attention here).
    """
    from flashref import reference  # the scores and the mask are the reference's own

    validation.check_attention_inputs(q, k, v, allowed_ndims=(2, 4), allowed_dtypes=reference.FLOAT_DTYPES,
                                      numpy=True)
    validation.check_causal(causal)
    scale = validation.check_sm_scale(sm_scale, q.shape[-1])
    block_k = validation.check_positive_int("block_k", block_k)
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    N_q, N_k = q.shape[-2], k.shape[-2]
    mask = reference.causal_mask(N_q, N_k) if causal else None
    state = init(q.shape[:-1], d=v.shape[-1], dtype=q.dtype)
    for start in range(0, N_k, block_k):
        stop = min(start + block_k, N_k)
        s = reference.scores(q, k[..., start:stop, :], False, scale)
        if mask is not None:
            s = np.where(mask[:, start:stop], s, q.dtype.type(-np.inf))
        state = update(state, s, v[..., start:stop, :])
    o, lse = finalize(state)
    return o.astype(q.dtype, copy=False), lse.astype(q.dtype, copy=False)
