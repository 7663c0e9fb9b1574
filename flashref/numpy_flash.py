"""Tiled (flash) attention in NumPy: the forward in two loop orders and the backward with recomputation.

Taught in notebooks/03_tiled_forward.ipynb (the forward, both loop orders, the tile grid) and
notebooks/05_backward_recomputation.ipynb (the backward).

Every function here works one tile at a time: a block of ``block_q`` query rows against a block of
``block_k`` keys, so the largest score array that ever exists is ``block_q x block_k`` (times the batch
and head dimensions, which are vectorized inside each tile). The ``N_q x N_k`` matrices S and P of
standard attention (:mod:`flashref.reference`) are never allocated; ``tests/test_numpy_flash_memory.py``
proves it with ``tracemalloc``.

Shapes are ``(N, d)`` or ``(B, H, N, d)``; ``N_q`` may differ from ``N_k``; block sizes need not divide
N. ``causal=True`` is top-left aligned (query i attends keys j <= i): tiles entirely above the diagonal
are skipped, never touched, and only tiles that straddle the diagonal are masked. Arithmetic happens in
the input's dtype for float32 and float64. float16 inputs are computed as a GPU kernel computes them:
tiles in float32 (fp32 accumulation), the output O rounded back to float16 and lse kept in float32.
"""

from __future__ import annotations

import numpy as np

from flashref import varlen
from flashref.score_mods import ScoreMods
from flashref.validation import (check_attention_inputs, check_block_mask, check_causal, check_dropout_mask,
                                 check_dropout_p, check_finite, check_numpy, check_positive_int, check_same_shape,
                                 check_sm_scale, split_causal)

#: Default tile sizes, tuned for speed on a CPU (``python -m flashref.bench numpy``): a 128 x 1024
#: float32 score tile is 512 KiB, big enough that NumPy's per-call overhead is amortized, small enough
#: to stay in a CPU's L2 cache.
BLOCK_Q = 128
BLOCK_K = 1024

ORDERS = ("fa1", "fa2")
_DTYPES = ("float16", "float32", "float64")


# ----------------------------------------------------------------------------------------------------
# Checks and the tile grid
# ----------------------------------------------------------------------------------------------------

def _check_inputs(q, k, v, causal, sm_scale, block_q, block_k):
    """The checks every entry point runs first; returns ``(N_q, N_k, d, scale, block_q, block_k)``."""
    N_q, N_k, d = check_attention_inputs(q, k, v, allowed_ndims=(2, 4), allowed_dtypes=_DTYPES, numpy=True, gqa=True)
    check_causal(causal)
    scale = check_sm_scale(sm_scale, d)
    return N_q, N_k, d, scale, check_positive_int("block_q", block_q), check_positive_int("block_k", block_k)


def tile_ranges(n: int, block: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of the blocks of ``block`` rows covering ``n`` rows; the last one may be short."""
    block = check_positive_int("block", block)
    return [(start, min(start + block, n)) for start in range(0, n, block)]


def tile_is_skipped(q_range, k_range, causal: bool) -> bool:
    """Causal: a tile whose smallest key index exceeds its largest query index is all masked."""
    return causal and k_range[0] > q_range[1] - 1


def tile_needs_mask(q_range, k_range, causal: bool) -> bool:
    """Causal: a tile holding some key index above some query index straddles the diagonal."""
    return causal and k_range[1] - 1 > q_range[0]


def visited_tiles(N_q: int, N_k: int, block_q: int, block_k: int, causal: bool = False, order: str = "fa2"):
    """The ``(i, j)`` tiles (query block i, key block j) the forward visits, in visit order.

    The same list the forward appends to its ``trace=`` argument, without doing any arithmetic; the
    notebooks and exercises count tiles with it.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    q_tiles = tile_ranges(N_q, check_positive_int("block_q", block_q))
    k_tiles = tile_ranges(N_k, check_positive_int("block_k", block_k))
    pairs = ([(i, j) for i in range(len(q_tiles)) for j in range(len(k_tiles))] if order == "fa2"
             else [(i, j) for j in range(len(k_tiles)) for i in range(len(q_tiles))])
    return [(i, j) for i, j in pairs if not tile_is_skipped(q_tiles[i], k_tiles[j], causal)]


def tile_sram_bytes(block_q: int, block_k: int, d: int, itemsize: int = 2, acc_itemsize: int = 4) -> dict:
    """Bytes of fast memory one forward tile step needs, part by part (notebook 03, "How much fast memory a tile
    needs").

    The input tiles Q_i (block_q x d), K_j and V_j (block_k x d) in the input precision (``itemsize``
    bytes, 2 for fp16), and in the accumulation precision (``acc_itemsize``, 4 for fp32): the score
    tile S_ij (P_ij overwrites it), the output accumulator O_i and the row statistics m_i and l_i.
    """
    for name, value in (("block_q", block_q), ("block_k", block_k), ("d", d), ("itemsize", itemsize),
                        ("acc_itemsize", acc_itemsize)):
        check_positive_int(name, value)
    return {"Q_i": block_q * d * itemsize, "K_j": block_k * d * itemsize, "V_j": block_k * d * itemsize,
            "S_ij": block_q * block_k * acc_itemsize, "O_i": block_q * d * acc_itemsize,
            "m_i, l_i": 2 * block_q * acc_itemsize}


def _causal_mask(q_range, k_range) -> np.ndarray:
    """Boolean ``(rows, cols)`` mask of the tile: True where key index > query index (masked out)."""
    rows = np.arange(q_range[0], q_range[1])[:, None]
    cols = np.arange(k_range[0], k_range[1])[None, :]
    return cols > rows


class _Extras:
    """The optional parts of a call (grouped-query heads, block mask, dropout, score modifications), checked,
    with what each tile needs: the visible part of the block mask and of the window, the dropout keep-mask
    sliced to the tile, and the scores' cap and bias."""

    def __init__(self, q, k, dropout_mask, dropout_p, block_mask, block_size, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, causal_right=None):
        N_q, N_k = q.shape[-2], k.shape[-2]
        self.groups = q.shape[1] // k.shape[1] if q.ndim == 4 else 1
        self.mods = ScoreMods(window_size, softcap, alibi_slopes, lead=q.shape[:-2], causal_right=causal_right)
        self.slopes = None if self.mods.slopes is None else self._group_shape(self.mods.slopes)
        self.block_size = block_size
        self.blocks = None
        if block_mask is not None:
            check_numpy("block_mask", block_mask)
            self.blocks = check_block_mask(block_mask, q.shape[:-2], N_q, N_k, block_size)
        self.p = check_dropout_p(dropout_p)
        shape = (*q.shape[:-2], N_q, N_k)
        self.keep = check_dropout_mask(dropout_mask, self.p, shape, "NumPy draws none")
        if self.keep is not None:
            self.keep = np.broadcast_to(self.keep, shape)

    def grouped(self, x, is_q: bool):
        """Grouped-query attention without copying K and V: q as (B, H_kv, G, N, d) and K, V as
        (B, H_kv, 1, N, d), so the tile products broadcast K and V over each group."""
        if self.groups == 1:
            return x
        B, H, N, d = x.shape
        return x.reshape(B, H // self.groups if is_q else H, self.groups if is_q else 1, N, d)

    def visible(self, q_range, k_range):
        """The block mask and the window on this tile (element by element, shaped like S), None when there
        is neither, or False when no (batch, head) sees any of it (the tile is skipped)."""
        if self.mods.tile_outside_window(q_range, k_range):
            return False
        window = self.mods.window(np.arange(*q_range), np.arange(*k_range))
        if self.blocks is None:
            return window
        bs = self.block_size
        rows = np.arange(*q_range) // bs
        cols = np.arange(*k_range) // bs
        tile = self.blocks[..., rows[:, None], cols[None, :]]
        if window is not None:
            tile = tile & window
        if not tile.any():
            return False
        return self._group_shape(tile)

    def modify(self, s, q_range, k_range):
        """The tile's scaled scores capped and biased (:mod:`flashref.score_mods`), or s itself."""
        if not self.mods.changes_scores:
            return s
        return self.mods.modify(s, np.arange(*q_range), np.arange(*k_range), slopes=self.slopes)

    def kept(self, q_range, k_range):
        return None if self.keep is None else \
            self._group_shape(self.keep[..., q_range[0]:q_range[1], k_range[0]:k_range[1]])

    def _group_shape(self, x):
        if self.groups == 1 or x.ndim != 4:
            return x
        B, H = x.shape[:2]
        return x.reshape(B, H // self.groups if H > 1 else 1, self.groups if H > 1 else 1, *x.shape[2:])


def _scores(q_tile, k_tile, scale, q_range, k_range, causal, visible=None, ex=None):
    """S tile = scale * Q_i K_j^T (capped and biased by ``ex``'s score modifications), with -inf where the
    causal mask (or the block mask, or the window) hides a key."""
    s = q_tile @ np.swapaxes(k_tile, -1, -2)
    s *= scale
    if ex is not None:
        s = ex.modify(s, q_range, k_range)
    if tile_needs_mask(q_range, k_range, causal):
        s[..., _causal_mask(q_range, k_range)] = -np.inf
    if visible is not None:
        s = np.where(visible, s, s.dtype.type(-np.inf))
    return s


def _drop(p, keep, scale):
    """P~ = P * keep / (1 - dropout_p) on one tile (P itself without dropout)."""
    return p if keep is None else np.where(keep, p * p.dtype.type(scale), p.dtype.type(0))


def _finite_or_zero(m):
    """The row max to subtract: a row whose entries are all -inf so far subtracts 0, so that
    exp(-inf - 0) = 0 instead of exp(-inf - (-inf)) = NaN."""
    return np.where(np.isneginf(m), 0, m).astype(m.dtype, copy=False)


# ----------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------

def flash_attention_forward(q, k, v, causal=False, sm_scale=None, block_q=BLOCK_Q, block_k=BLOCK_K,
                            order="fa2", trace=None, *, dropout_mask=None, dropout_p=0.0, block_mask=None,
                            block_size=128, observe=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                            causal_align="top_left"):
    """Tiled attention forward: returns ``(o, lse)``, ``o`` shaped like q and ``lse`` shaped ``q.shape[:-1]``.

    ``order="fa2"`` (FlashAttention-2): outer loop over query blocks, the running max m, sum l and the
    unnormalized accumulator stay in local variables ("on chip") and O is normalized once at the end.
    ``order="fa1"`` (Algorithm 1 of FlashAttention): outer loop over key/value blocks, inner loop over
    query blocks; O, l and m live in full-size ("HBM") arrays, read and written back at every tile, and
    O is kept normalized after every step, as in the paper.

    ``trace``, if a list, receives the ``(i, j)`` index of every tile visited, in order. ``observe``, if
    given, is called after every tile as ``observe(i, j, m, l, o)`` with copies of the running max, the
    running sum and the output so far, normalized (acc / l), of the tile's query rows: what the animated
    tile walk of notebook ``03_tiled_forward`` draws (:mod:`flashref.tile_walk`).
    ``lse`` is the natural-log log-sum-exp of the scaled scores of each query row.

    The keywords are those of :func:`flashref.reference.attention`: k and v may have fewer heads than q
    (grouped-query attention; the tile products broadcast them over each group, no copy); ``block_mask``
    hides blocks of keys from blocks of queries, and a tile that no (batch, head) sees is skipped; a row
    that sees no key gets o = 0 and lse = -inf; ``dropout_mask`` with ``dropout_p`` drops entries of P;
    ``window_size``, ``softcap`` and ``alibi_slopes`` modify the scores (:mod:`flashref.score_mods`), and a
    tile wholly outside the window is skipped like a causal one. ``causal_align="bottom_right"`` aligns the
    causal mask to the bottom-right corner (:func:`flashref.reference.causal_mask`).
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    N_q, N_k, d, scale, block_q, block_k = _check_inputs(q, k, v, causal, sm_scale, block_q, block_k)
    if trace is not None and not isinstance(trace, list):
        raise TypeError(f"trace must be a list or None, got {type(trace).__name__}")
    if observe is not None and not callable(observe):
        raise TypeError(f"observe must be a callable or None, got {type(observe).__name__}")
    causal, causal_right = split_causal(causal, causal_align, N_q, N_k)  # bottom-right: a window's side
    ex = _Extras(q, k, dropout_mask, dropout_p, block_mask, block_size, window_size, softcap, alibi_slopes,
                 causal_right)
    run = _forward_fa2 if order == "fa2" else _forward_fa1
    shape, half = q.shape, q.dtype == np.float16
    if half:  # fp32 accumulation, as on a GPU
        q, k, v = (x.astype(np.float32) for x in (q, k, v))
    o, lse = run(ex.grouped(q, True), ex.grouped(k, False), ex.grouped(v, False), causal, scale,
                 tile_ranges(N_q, block_q), tile_ranges(N_k, block_k), trace, ex, observe)
    o, lse = o.reshape(shape), lse.reshape(shape[:-1])
    return (o.astype(np.float16), lse) if half else (o, lse)


def _observed(observe, i, j, m, l, o):
    if observe is not None:
        with np.errstate(invalid="ignore", divide="ignore"):
            observe(i, j, m.copy(), l.copy(), np.where((l > 0)[..., None], o, 0.0))


def _forward_fa2(q, k, v, causal, scale, q_tiles, k_tiles, trace, ex, observe=None):
    """FlashAttention-2 order. Per query block i, with accumulator acc = sum_j exp(S_ij - m) V_j:

        m_new = max(m, rowmax(S_ij));  alpha = exp(m - m_new);  P = exp(S_ij - m_new)
        l = alpha * l + rowsum(P);     acc = alpha * acc + P V_j;  m = m_new
    and at the end O_i = acc / l, lse_i = m + log(l).
    """
    o = np.empty_like(q)
    lse = np.empty(q.shape[:-1], dtype=q.dtype)
    for i, q_range in enumerate(q_tiles):
        q_tile = q[..., q_range[0]:q_range[1], :]
        m = np.full(q_tile.shape[:-1], -np.inf, dtype=q.dtype)   # running row max, "on chip"
        l = np.zeros(q_tile.shape[:-1], dtype=q.dtype)           # running row sum of exp(S - m)
        acc = np.zeros(q_tile.shape, dtype=q.dtype)              # unnormalized output rows
        for j, k_range in enumerate(k_tiles):
            if tile_is_skipped(q_range, k_range, causal):
                break  # every later key block is further right of the diagonal
            visible = ex.visible(q_range, k_range)
            if visible is False:
                continue  # the block mask or the window hides this tile from every (batch, head): never loaded
            if trace is not None:
                trace.append((i, j))
            s = _scores(q_tile, k[..., k_range[0]:k_range[1], :], scale, q_range, k_range, causal, visible, ex)
            m_new = np.maximum(m, s.max(axis=-1))
            m_sub = _finite_or_zero(m_new)
            alpha = np.exp(m - m_sub)
            s -= m_sub[..., None]
            p = np.exp(s, out=s)                                 # P tile, in place of S
            l = alpha * l + p.sum(axis=-1)
            acc = acc * alpha[..., None]
            acc += _drop(p, ex.kept(q_range, k_range), 1 / (1 - ex.p)) @ v[..., k_range[0]:k_range[1], :]
            m = m_new
            if observe is not None:
                _observed(observe, i, j, m, l, acc / np.where(l > 0, l, 1)[..., None])
        seen = l > 0  # False only for a row the block mask or the window hides from every key
        o[..., q_range[0]:q_range[1], :] = acc / np.where(seen, l, 1)[..., None]
        with np.errstate(divide="ignore"):
            lse[..., q_range[0]:q_range[1]] = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)
    return o, lse


def _forward_fa1(q, k, v, causal, scale, q_tiles, k_tiles, trace, ex, observe=None):
    """Algorithm 1 of FlashAttention. O, l, m are "HBM" arrays; for each key block j and query block i:
    read O_i, l_i, m_i; compute the tile's own max m~ and sum l~ of P~ = exp(S_ij - m~); then

        m_new = max(m_i, m~);  l_new = exp(m_i - m_new) l_i + exp(m~ - m_new) l~
        O_i  <- (l_i exp(m_i - m_new) O_i + exp(m~ - m_new) P~ V_j) / l_new
    and write O_i, l_i = l_new, m_i = m_new back.
    """
    o = np.zeros(q.shape, dtype=q.dtype)                          # "HBM", kept normalized
    l = np.zeros(q.shape[:-1], dtype=q.dtype)
    m = np.full(q.shape[:-1], -np.inf, dtype=q.dtype)
    for j, k_range in enumerate(k_tiles):
        k_tile, v_tile = k[..., k_range[0]:k_range[1], :], v[..., k_range[0]:k_range[1], :]
        for i, q_range in enumerate(q_tiles):
            if tile_is_skipped(q_range, k_range, causal):
                continue  # query blocks above this key block see none of its keys
            visible = ex.visible(q_range, k_range)
            if visible is False:
                continue
            if trace is not None:
                trace.append((i, j))
            rows = slice(q_range[0], q_range[1])
            o_i, l_i, m_i = o[..., rows, :], l[..., rows], m[..., rows]   # read from HBM
            s = _scores(q[..., rows, :], k_tile, scale, q_range, k_range, causal, visible, ex)
            m_tile = s.max(axis=-1)
            s -= _finite_or_zero(m_tile)[..., None]
            p = np.exp(s, out=s)
            l_tile = p.sum(axis=-1)
            m_new = np.maximum(m_i, m_tile)
            m_sub = _finite_or_zero(m_new)
            alpha, beta = np.exp(m_i - m_sub), np.exp(m_tile - m_sub)
            l_new = alpha * l_i + beta * l_tile
            denom = np.where(l_new == 0, 1, l_new)[..., None]    # a row with no key yet keeps O = 0
            pv = _drop(p, ex.kept(q_range, k_range), 1 / (1 - ex.p)) @ v_tile
            o[..., rows, :] = ((l_i * alpha)[..., None] * o_i + beta[..., None] * pv) / denom
            l[..., rows], m[..., rows] = l_new, m_new           # write back to HBM
            if observe is not None:
                _observed(observe, i, j, m_new, l_new, o[..., rows, :])
    with np.errstate(divide="ignore"):
        return o, np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), -np.inf).astype(q.dtype)


# ----------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------

def flash_attention_backward(q, k, v, o, lse, do, causal=False, sm_scale=None, block_q=BLOCK_Q,
                             block_k=BLOCK_K, trace=None, *, dropout_mask=None, dropout_p=0.0, block_mask=None,
                             block_size=128, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             causal_align="top_left"):
    """Gradients ``(dq, dk, dv)`` of tiled attention, recomputing each tile's P from Q, K and ``lse``.

    With D = rowsum(dO * O) (equal to rowsum(P * dP)), for every tile (i, j) not skipped by the causal
    mask: P = exp(scale Q_i K_j^T - lse_i), dV_j += P^T dO_i, dP = dO_i V_j^T, dS = P * (dP - D_i),
    dQ_i += scale dS K_j, dK_j += scale dS^T Q_i. Outer loop over key blocks (dK_j, dV_j accumulate
    locally), inner over query blocks (dQ_i accumulates in a full-size array), as FlashAttention-2.
    ``trace``, if a list, receives the ``(i, j)`` tiles visited. The keywords as in
    :func:`flash_attention_forward`; with dropout, V's gradient takes the dropped P~ and dP the same
    keep-mask, and with grouped-query attention dK and dV sum over each group; with a softcap, dS is
    multiplied by the cap's derivative ``1 - tanh(scale q.k / c)^2`` before dQ and dK.
    """
    N_q, N_k, d, scale, block_q, block_k = _check_inputs(q, k, v, causal, sm_scale, block_q, block_k)
    _check_backward_arrays(q, o, lse, do)
    if trace is not None and not isinstance(trace, list):
        raise TypeError(f"trace must be a list or None, got {type(trace).__name__}")
    features = dict(dropout_mask=dropout_mask, dropout_p=dropout_p, block_mask=block_mask, block_size=block_size,
                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    if q.dtype == np.float16:  # fp32 accumulation, gradients rounded back to float16
        grads = flash_attention_backward(*(x.astype(np.float32) for x in (q, k, v, o, lse, do)), causal=causal,
                                         sm_scale=scale, block_q=block_q, block_k=block_k, trace=trace,
                                         causal_align=causal_align, **features)
        return tuple(g.astype(np.float16) for g in grads)
    causal, causal_right = split_causal(causal, causal_align, N_q, N_k)  # bottom-right: a window's side
    ex = _Extras(q, k, **features, causal_right=causal_right)
    shape_q, shape_k = q.shape, k.shape
    q, o, do = ex.grouped(q, True), ex.grouped(o, True), ex.grouped(do, True)
    k, v = ex.grouped(k, False), ex.grouped(v, False)
    lse = lse.reshape(q.shape[:-1])
    lse = np.where(np.isneginf(lse), np.inf, lse)                # a row that saw no key: P = exp(s - inf) = 0
    q_tiles, k_tiles = tile_ranges(N_q, block_q), tile_ranges(N_k, block_k)
    delta = np.sum(do * o, axis=-1)                              # D, one per query row
    dq = np.zeros_like(q)
    dk = np.empty_like(k)
    dv = np.empty_like(v)
    keep_scale = 1 / (1 - ex.p)
    for j, k_range in enumerate(k_tiles):
        cols = slice(k_range[0], k_range[1])
        k_tile, v_tile = k[..., cols, :], v[..., cols, :]
        dk_tile, dv_tile = np.zeros_like(k_tile), np.zeros_like(v_tile)
        for i, q_range in enumerate(q_tiles):
            if tile_is_skipped(q_range, k_range, causal):
                continue
            visible = ex.visible(q_range, k_range)
            if visible is False:
                continue
            if trace is not None:
                trace.append((i, j))
            rows = slice(q_range[0], q_range[1])
            q_tile, do_tile = q[..., rows, :], do[..., rows, :]
            s = _scores(q_tile, k_tile, scale, q_range, k_range, causal, visible, ex)
            s -= lse[..., rows, None]
            p = np.exp(s, out=s)                                 # recomputed P tile (masked: 0)
            keep = ex.kept(q_range, k_range)
            dv_tile += _sum_to(np.swapaxes(_drop(p, keep, keep_scale), -1, -2) @ do_tile, dv_tile.shape)
            dp = _drop(do_tile @ np.swapaxes(v_tile, -1, -2), keep, keep_scale)
            dp -= delta[..., rows, None]
            ds = np.multiply(p, dp, out=dp)                      # dS = P * (dP - D)
            if ex.mods.softcap > 0:                              # through the cap: dS * (1 - tanh^2)
                ds = ex.mods.softcap_grad(ds, scale * (q_tile @ np.swapaxes(k_tile, -1, -2)))
            ds *= scale
            dq[..., rows, :] += ds @ k_tile
            dk_tile += _sum_to(np.swapaxes(ds, -1, -2) @ q_tile, dk_tile.shape)
        dk[..., cols, :], dv[..., cols, :] = dk_tile, dv_tile
    return dq.reshape(shape_q), dk.reshape(shape_k), dv.reshape(shape_k)


def flash_attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                                   causal=False, sm_scale=None, block_q=BLOCK_Q, block_k=BLOCK_K, *,
                                   window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Tiled forward over a packed batch (:func:`flashref.reference.attention_varlen`'s arguments): each
    document through :func:`flash_attention_forward`, so no tile mixes two documents. Returns ``(o, lse)``,
    ``o`` of q's shape ``(total_q, H, d)`` and ``lse`` of shape ``(H, total_q)``."""
    docs = varlen.documents(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o = np.empty_like(q)
    lse = np.empty((q.shape[1], q.shape[0]), dtype=np.float32 if q.dtype == np.float16 else q.dtype)
    for b, (rows, cols) in enumerate(docs):
        o_b, lse_b = flash_attention_forward(
            varlen.unpack(q, rows), varlen.unpack(k, cols), varlen.unpack(v, cols), causal, sm_scale, block_q,
            block_k, window_size=window_size, softcap=softcap,
            alibi_slopes=varlen.document_slopes(alibi_slopes, b, len(docs), q.shape[1]))
        varlen.pack(o, o_b, rows)
        varlen.pack(lse, lse_b, rows)
    return o, lse


def flash_attention_varlen_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                                    max_seqlen_k=None, causal=False, sm_scale=None, block_q=BLOCK_Q, block_k=BLOCK_K,
                                    *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Gradients ``(dq, dk, dv)`` of :func:`flash_attention_varlen_forward`, each document through
    :func:`flash_attention_backward` (``lse`` of shape ``(H, total_q)``, as the forward returns it)."""
    docs = varlen.documents(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for name, x in (("o", o), ("do", do)):
        check_numpy(name, x)
        check_same_shape(name, x, "q", q)
    check_numpy("lse", lse)
    if lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse must have shape (H, total_q) = {(q.shape[1], q.shape[0])}, got {lse.shape}")
    check_finite({"o": o, "do": do})  # the packed arrays: indices as the caller gave them
    check_finite({"lse": lse}, allow_neg_inf=True)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    for b, (rows, cols) in enumerate(docs):
        grads = flash_attention_backward(
            varlen.unpack(q, rows), varlen.unpack(k, cols), varlen.unpack(v, cols), varlen.unpack(o, rows),
            lse[None, :, rows[0]:rows[1]], varlen.unpack(do, rows), causal, sm_scale, block_q, block_k,
            window_size=window_size, softcap=softcap,
            alibi_slopes=varlen.document_slopes(alibi_slopes, b, len(docs), q.shape[1]))
        for packed, g, r in zip((dq, dk, dv), grads, (rows, cols, cols)):
            varlen.pack(packed, g, r)
    return dq, dk, dv


def _sum_to(x, shape):
    """x summed over the axes it was broadcast along (the query heads of a group, for dK and dV)."""
    return x if x.shape == tuple(shape) else x.sum(axis=2, keepdims=True)


def _check_backward_arrays(q, o, lse, do):
    for name, x in (("o", o), ("lse", lse), ("do", do)):
        check_numpy(name, x)
    check_same_shape("o", o, "q", q)
    check_same_shape("do", do, "q", q)
    if not hasattr(lse, "shape"):
        raise TypeError(f"lse must be an array, got {type(lse).__name__}")
    if tuple(lse.shape) != tuple(q.shape[:-1]):
        raise ValueError(f"lse must have shape q.shape[:-1] = {tuple(q.shape[:-1])} (one per query row), "
                         f"got {tuple(lse.shape)}")
    for name, x in (("o", o), ("lse", lse), ("do", do)):
        allowed = (q.dtype, np.float32) if name == "lse" and q.dtype == np.float16 else (q.dtype,)
        if x.dtype not in allowed:
            extra = " or float32" if len(allowed) > 1 else ""
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}){extra}, got {x.dtype}")
    check_finite({"o": o, "do": do})
    check_finite({"lse": lse}, allow_neg_inf=True)  # -inf: a row the block mask or the window hides from every key
