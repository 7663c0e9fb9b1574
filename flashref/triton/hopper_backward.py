"""The backward pass on Hopper, in Gluon: a dK/dV kernel and a dQ kernel built from the forward's parts.

The teaching backward (:mod:`flashref.triton.backward`) leaves its schedule to Triton's compiler. These kernels do
for the gradients what :mod:`flashref.triton.hopper` does for the forward: TMA copies of the streamed tiles into a
ring of shared-memory slots guarded by mbarriers, and the products of a tile pair as asynchronous warpgroup
products (wgmma), the first two issued back to back so the second runs while the first one's exponentials wait.

dK/dV: a program owns ``BLOCK_N`` keys of one head; with K_j and V_j resident in shared memory it walks the query
tiles i that see them, in the transposed orientation (keys are the rows, so each product's accumulator rows are
this program's keys):

    S^T = K_j Q_i^T,  P^T = exp2(S^T * scale * log2 e - m2_i - l2_i),  dV_j += P^T dO_i,
    dP^T = V_j dO_i^T,  dS^T = P^T * (dP^T - D_i),  dK_j += dS^T Q_i

dQ: a program owns ``BLOCK_M`` queries, Q_i and dO_i resident, and walks the key tiles they see (three products a
tile: S, dP, then dQ_i += dS K_j). Both use the forward's row statistics (m2, l2) and D = rowsum(dO * O) from the
teaching preprocess kernel (the dK/dV kernels get each query tile's lse2 = m2 + l2 and D by TMA, in the ring slot
of its Q_i and dO_i); neither adds anything atomically, so the gradients are bitwise reproducible. fp16 and
bf16, head dims 64 and 128, top-left causal or not, a window, ALiBi, dropout (the forward's mask, drawn again
in each kernel's accumulator registers: transposed in dK/dV, :func:`flashref.triton.hopper._keep_t`), and a block
mask whose blocks hold their tiles (``lists=``, the teaching kernels' lists of visible blocks); no other
feature. At head dim 256 (causal or not, nothing else) dK/dV come from :mod:`flashref.triton.hopper_backward_wide`,
whose two warpgroups split the head dim, and dQ from the kernel here. :func:`hopper_backward` runs both; it is
what :func:`flashref.triton.flash_attention`'s backward runs on a Hopper GPU (notebook
``14_flashattention3_on_hopper``). With ``deterministic=False`` it runs :mod:`flashref.triton.hopper_backward_fused`
instead where that applies: one kernel, dQ added by TMA reduces.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from flashref.triton import hopper, relaunch
# The block-sparse lists' helpers live beside the forward, which walks them too.
from flashref.triton.hopper import _list_args, _list_range, _listed_tiles_before, _tile_of, lists_fit  # noqa: F401
from flashref.triton.hopper import head_origin
from flashref.triton.forward import LOG2E

HEAD_DIMS = (64, 128)  # every feature
#: Head dims the backward takes only with top-left causal masking or none (no window, ALiBi, dropout or block mask):
#: dK/dV from :mod:`flashref.triton.hopper_backward_wide`.
PLAIN_HEAD_DIMS = (256,)


@gluon.jit
def _load_pair(a_desc, b_desc, a_smem, b_smem, bars, base_row, tile, n, n_tiles, BLOCK: gl.constexpr,
               STAGES: gl.constexpr, col=0):
    """Start the TMA copies of the program's n-th pair of streamed tiles (Q and dO in the dK/dV kernel, K and V in
    the dQ kernel; the tile of index ``tile``, rows base_row + tile * BLOCK on, columns from ``col``:
    :func:`flashref.triton.hopper.head_origin`) into slot n % STAGES, one barrier for both (nothing from n_tiles
    on). n counts from the program's first tile, as the loop's waits do."""
    slot = n % STAGES
    go = n < n_tiles
    row = base_row + tile * BLOCK
    mbarrier.expect(bars.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=go)
    tma.async_copy_global_to_shared(a_desc, [row, col], bars.index(slot), a_smem.index(slot), pred=go)
    tma.async_copy_global_to_shared(b_desc, [row, col], bars.index(slot), b_smem.index(slot), pred=go)


@gluon.jit
def _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, bars, bh, base_row, tile,
               n, n_tiles, BLOCK: gl.constexpr, STAGES: gl.constexpr, STATS: gl.constexpr, col=0):
    """:func:`_load_pair` of Q and dO, and with STATS the query tile's row statistics too (lse2 = m2 + l2 and D,
    one fp32 number a row), into the same slot under the same barrier."""
    if STATS:
        slot = n % STAGES
        go = n < n_tiles
        row = base_row + tile * BLOCK
        nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse_desc.block_type.nbytes
                                + delta_desc.block_type.nbytes)
        mbarrier.expect(bars.index(slot), nbytes, pred=go)
        tma.async_copy_global_to_shared(q_desc, [row, col], bars.index(slot), q_smem.index(slot), pred=go)
        tma.async_copy_global_to_shared(do_desc, [row, col], bars.index(slot), do_smem.index(slot), pred=go)
        tma.async_copy_global_to_shared(lse_desc, [bh, tile * BLOCK], bars.index(slot), lse_smem.index(slot), pred=go)
        tma.async_copy_global_to_shared(delta_desc, [bh, tile * BLOCK], bars.index(slot), delta_smem.index(slot),
                                        pred=go)
    else:
        _load_pair(q_desc, do_desc, q_smem, do_smem, bars, base_row, tile, n, n_tiles, BLOCK, STAGES, col)


@gluon.jit
def _row_view(stat_smem, slot, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """Slot ``slot`` of a (STAGES, 1, BLOCK_M) ring of row statistics (TMA's unswizzled rows) as BLOCK_M numbers."""
    return stat_smem.index(slot)._reinterpret(gl.float32, [BLOCK_M],
                                              gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))


@gluon.jit
def _stat_rows(M2, Delta, lse_smem, delta_smem, slot, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
               STATS: gl.constexpr):
    """Where :func:`_dkdv_tile` reads step ``slot``'s row statistics: with STATS the lse2 and D that came by TMA
    into the slot (:func:`_row_view`), otherwise the global rows M2 and Delta."""
    lse2_rows = M2
    d_rows = Delta
    if STATS:
        lse2_rows = _row_view(lse_smem, slot, BLOCK_M, STAGES)
        d_rows = _row_view(delta_smem, slot, BLOCK_M, STAGES)
    return lse2_rows, d_rows


@gluon.constexpr_function
def _late_mask(dropout, head_d):
    """Whether a backward tile draws its dropout mask after both products (:func:`_dkdv_tile`'s ``LATE_MASK``): with
    dropout at d = 128, where a consumer's registers run out. (The one-kernel backward draws it late at both head
    dims: its ``LATE``.)"""
    return bool(dropout) and head_d > 64


@gluon.constexpr_function
def _wgmma_layout(num_warps, cols):
    """The register layout of a wgmma result with ``cols`` columns: each of the num_warps warps holds 16 rows."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, 16])


@gluon.jit
def _backward_smem(res_a_desc, res_b_desc, ring_a_desc, ring_b_desc, STAGES: gl.constexpr):
    """A backward program's shared memory: two resident tiles (K and V in the dK/dV kernel, Q and dO in the dQ
    kernel) with one barrier, and a ring of STAGES slots for the two streamed tiles, one barrier a slot. Each tile
    takes its descriptor's box and layout."""
    dtype: gl.constexpr = res_a_desc.dtype
    res_a = gl.allocate_shared_memory(dtype, res_a_desc.block_type.shape, res_a_desc.layout)
    res_b = gl.allocate_shared_memory(dtype, res_b_desc.block_type.shape, res_b_desc.layout)
    ring_a = gl.allocate_shared_memory(dtype, [STAGES] + ring_a_desc.block_type.shape, ring_a_desc.layout)
    ring_b = gl.allocate_shared_memory(dtype, [STAGES] + ring_b_desc.block_type.shape, ring_b_desc.layout)
    res_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(res_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    return res_a, res_b, ring_a, ring_b, res_bar, bars


@gluon.jit
def _p_operand(Pt, kept, dtype: gl.constexpr, p_layout: gl.constexpr, DROPOUT: gl.constexpr):
    """P^T as dV's A operand: with dropout, its kept entries only (P carries keep_scale: :func:`_dropped_dp`)."""
    if DROPOUT:
        Pt = gl.where(kept, Pt, 0.0)
    return gl.convert_layout(Pt.to(dtype), p_layout)


@gluon.jit
def _dropped_dp(dP, kept, DROPOUT: gl.constexpr):
    """dP through dropout's backward, the gradient of P~ = P * keep * keep_scale (keep_scale = 1 / (1 - p)): dS =
    P * (keep * keep_scale * dP - D). The kernels take the row statistics with keep_scale folded in
    (:func:`_fold_keep_scale`): their P is keep_scale * P and their D is D / keep_scale, so dS = P * (keep * dP - D)
    takes no multiply an entry, and dV sums keep * (keep_scale * P)^T dO as it goes. So dP is only masked here.
    Measured against the multiply (H200, fp16, B 8, H 16, N 4K, p = 0.1): the d = 64 dQ kernel alone 2.03 ms against
    2.11 non-causal, 1.09 against 1.13 causal (medians of three interleaved do_bench rounds), its registers 128
    against 130 and 151 (Triton 3.7: four programs an SM again, where the multiply left three); the forward +
    backward step with the warp-specialized forward (:func:`flashref.triton.hopper.dropout_config`) 6.50 ms against
    6.75 non-causal, 3.50 against 3.60 causal, and at d = 128 within the runs' spread (10.50 against 10.53, 5.80
    against 5.72)."""
    if DROPOUT:
        dP = gl.where(kept, dP, 0.0)
    return dP


@gluon.jit
def _fold_keep_scale(lse2, D, keep_scale):
    """lse2 - log2(keep_scale) and D / keep_scale: a dQ program's row statistics with dropout's 1 / (1 - p) folded
    in, once (:func:`_dropped_dp`; the dK/dV kernels take theirs folded: :func:`folded_stats`)."""
    return lse2 - gl.log2(gl.zeros_like(lse2) + keep_scale), D / keep_scale


@gluon.jit
def _scaled_scores(S, rows, cols, qk_scale, slope2, ALIBI: gl.constexpr):
    """The base-2 scores of a raw tile S, for query ``rows`` and key ``cols`` (broadcast to S's shape, either
    orientation): slope2 is the head's ALiBi slope times log2(e). ALiBi's bias is one FMA, ``S * scale - slope2
    |i - j|``, as the teaching kernels' (``forward._modified``)."""
    if ALIBI:
        S = gl.fma(S, qk_scale, -(slope2 * gl.abs(cols - rows).to(gl.float32)))
    else:
        S = S * qk_scale
    return S


@gluon.jit
def _in_window(keep, rows, cols, win_left, win_right, WINDOW: gl.constexpr):
    """``keep`` narrowed to the window: query i sees key j for ``i - win_left <= j <= i + win_right``, as the
    teaching kernels take it."""
    if WINDOW:
        keep = keep & (cols >= rows - win_left) & (cols <= rows + win_right)
    return keep


@gluon.jit
def _tile_lse2(M2, L2, stat, live, col_s: gl.constexpr, FULL: gl.constexpr, STATS: gl.constexpr):
    """A query tile's lse2 (log2-domain log-sum-exp), as :func:`_dkdv_tile` takes its rows (``stat``)."""
    if STATS:  # the tile's statistics came with it (M2: lse2's slot)
        lse2 = M2.load(col_s)
    elif FULL:  # every row below N_q (_full_query_tiles): loads without a predicate
        lse2 = gl.load(M2 + stat) + gl.load(L2 + stat)
    else:
        lse2 = gl.load(M2 + stat, mask=live, other=0.0) + gl.load(L2 + stat, mask=live, other=0.0)
    return lse2


@gluon.jit
def _tile_delta(Delta, stat, live, col_s: gl.constexpr, FULL: gl.constexpr, STATS: gl.constexpr):
    """A query tile's D = rowsum(dO * O), as :func:`_dkdv_tile` takes its rows (``stat``)."""
    if STATS:  # (Delta: D's slot)
        D = Delta.load(col_s)
    elif FULL:
        D = gl.load(Delta + stat)
    else:
        D = gl.load(Delta + stat, mask=live, other=0.0)
    return D


@gluon.jit
def _dkdv_tile(k_t, v_t, q_t, do_t, dk, dv, s_zero, keys, first_key, i, bh, M2, L2, Delta, N_q, qk_scale, slope2,
               win_left, win_right, seed, drop_below, masked, FULL: gl.constexpr, BLOCK_M: gl.constexpr,
               CAUSAL: gl.constexpr,
               WINDOW: gl.constexpr, ALIBI: gl.constexpr, DROPOUT: gl.constexpr, KEEP_LAYOUT: gl.constexpr,
               ROWS: gl.constexpr, s_layout: gl.constexpr, col_s: gl.constexpr, p_layout: gl.constexpr,
               STATS: gl.constexpr = False, LATE_MASK: gl.constexpr = False):
    """dK_j and dV_j (fp32, in registers) after query tile i, whose Q_i and dO_i are in shared memory, in the
    transposed orientation (the rows are keys)::

        S^T = K_j Q_i^T,  P^T = exp2(S^T * scale * log2 e - m2 - l2),  dV_j += P^T dO_i,
        dP^T = V_j dO_i^T,  dS^T = P^T * (dP^T - D),  dK_j += dS^T Q_i

    Query columns past N_q (the next head's rows, or TMA's zeros) get P = 0, so they add nothing. slope2,
    win_left and win_right: as :func:`_scaled_scores` and :func:`_in_window` take them. DROPOUT: the forward's
    mask for these keys (from ``first_key``) and queries, transposed (:func:`flashref.triton.hopper._keep_t`): dV
    sums the kept entries of P^T and dP^T = dP~^T * keep * keep_scale, as the teaching kernel computes them (the
    row statistics carry keep_scale: :func:`_dropped_dp`). ``masked`` may be False for the tiles
    :func:`_full_query_tiles` finds every query of to see every key here: no mask is computed then. STATS: M2 and
    Delta are the tile's lse2 and D in shared memory (:func:`_row_view`), L2 unused; otherwise the three are
    global fp32 rows, read here. A constant
    compiles one version of the tile; a runtime flag compiles both under a branch (:func:`dkdv_masks`). FULL: the
    caller knows (at compile time) that every query row of the tile lies below N_q, so the row statistics are
    loaded without a predicate (measured: the loop without a mask 16% fewer instructions at d = 64).

    LATE_MASK (with DROPOUT): both products are waited for before the mask is drawn, dP^T is dropped at once,
    lse2 is read after it and D only for dS^T. Drawn while the products run, the mask's words and Philox's
    rounds are live beside S^T, dP^T, lse2, D and the 128 registers of dK and dV a warp-specialized consumer
    holds at d = 128: ptxas spilled 256-292 bytes a thread there, and 0 (non-causal) and 108 (causal) so
    (Triton 3.7, a mask on every tile). On an H200 (B 8, H 16, N 4K, fp16, p = 0.1, profiler) the
    warp-specialized kernel so took 4.21 ms non-causal and 2.63 causal, against 5.66 and 3.85 with the mask
    drawn early, and 4.87 and 2.57 for the one-warpgroup kernel that ran dropout at d = 128 before
    (:func:`default_config`; another run of the same shapes). Without dropout the late order spills nothing
    either (0 bytes, against 0-52) but measured slower (H200, B 16, H 16, N 4K and 16K, d = 128, kernel alone,
    medians of three interleaved runs): dK/dV 1.05x the time non-causal, 1.02x causal, the one-kernel backward
    1.02-1.03x; there dP^T's product running under S^T's exponentials is worth more (:func:`_late_mask`)."""
    dtype: gl.constexpr = q_t.dtype
    # S^T and dP^T issued back to back: the second runs while the first's exponentials wait.
    St = warpgroup_mma(k_t, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dPt = warpgroup_mma(v_t, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    kept = None
    if DROPOUT and not LATE_MASK:  # Philox's integer work while both products run
        kept = hopper._keep_t(seed, bh, i * BLOCK_M, first_key, drop_below, BLOCK_M, ROWS, KEEP_LAYOUT, s_layout)
    queries = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s)
    live = queries < N_q
    stat = bh.to(gl.int64) * N_q + queries
    if LATE_MASK:  # (the docstring says why)
        St, dPt = warpgroup_mma_wait(0, deps=[St, dPt])
        kept = hopper._keep_t(seed, bh, i * BLOCK_M, first_key, drop_below, BLOCK_M, ROWS, KEEP_LAYOUT, s_layout)
        dPt = _dropped_dp(dPt, kept, DROPOUT)
        lse2 = _tile_lse2(M2, L2, stat, live, col_s, FULL, STATS)
    else:
        lse2 = _tile_lse2(M2, L2, stat, live, col_s, FULL, STATS)
        D = _tile_delta(Delta, stat, live, col_s, FULL, STATS)
        St = warpgroup_mma_wait(1, deps=[St])
    St = _scaled_scores(St, gl.expand_dims(queries, 0), gl.expand_dims(keys, 1), qk_scale, slope2, ALIBI)
    St = St - gl.expand_dims(lse2, 0)
    if masked:  # the ragged end, the causal diagonal, a window's edges
        keep = gl.expand_dims(live, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(queries, 0) >= gl.expand_dims(keys, 1))
        keep = _in_window(keep, gl.expand_dims(queries, 0), gl.expand_dims(keys, 1), win_left, win_right, WINDOW)
        St = gl.where(keep, St, float("-inf"))
    Pt = gl.exp2(St)
    p = _p_operand(Pt, kept, dtype, p_layout, DROPOUT)
    dv = warpgroup_mma(p, do_t, dv, is_async=True)
    if LATE_MASK:
        D = _tile_delta(Delta, stat, live, col_s, FULL, STATS)
    else:
        dPt = _dropped_dp(warpgroup_mma_wait(1, deps=[dPt]), kept, DROPOUT)
    dSt = Pt * (dPt - gl.expand_dims(D, 0))
    ds = gl.convert_layout(dSt.to(dtype), p_layout)
    dk = warpgroup_mma(ds, q_t, dk, is_async=True)
    # Waiting here for dK's product costs a gap on the tensor cores before the next S^T, but leaving it in
    # flight (the next S^T queued behind it) measured slower, 41-45 ms against 39 at d = 128, N = 16K: it
    # keeps more registers live.
    dv, dk, p, ds = warpgroup_mma_wait(0, deps=[dv, dk, p, ds])
    return dk, dv


@gluon.jit
def _row_starts(bh, H, N, rows, HEAD_D: gl.constexpr, TOKEN_MAJOR: gl.constexpr):
    """Where rows ``rows`` of head bh start in a gradient of q's or k's shape: a contiguous (B, H, N, d) tensor,
    or with TOKEN_MAJOR one in the (B, N, H, d) layout the inputs came in (as :func:`flashref.triton.hopper.
    head_origin` reads them), which a model's gradient then takes as it is, without a transposing copy."""
    if TOKEN_MAJOR:
        return (((bh // H).to(gl.int64) * N + rows) * H + bh % H) * HEAD_D
    return (bh.to(gl.int64) * N + rows) * HEAD_D


@gluon.jit
def _store_dkdv(DK, DV, dk, dv, first_key, bh, N_k, sm_scale, ROWS: gl.constexpr, HEAD_D: gl.constexpr,
                a_layout: gl.constexpr, FIRST_COL: gl.constexpr = 0, COLS: gl.constexpr = 0, H=1,
                TOKEN_MAJOR: gl.constexpr = False):
    """dK (scaled by sm_scale) and dV of keys [first_key, +ROWS) of head bh; rows past N_k are not stored. dk and
    dv hold columns [FIRST_COL, +COLS) of the head dim (COLS 0: all HEAD_D of them). TOKEN_MAJOR: DK and DV are in
    the (B, N, H, d) layout (:func:`_row_starts`)."""
    WIDTH: gl.constexpr = COLS if COLS > 0 else HEAD_D
    rows = first_key + gl.arange(0, ROWS, layout=gl.SliceLayout(1, a_layout))
    cols = FIRST_COL + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, a_layout))
    offs = gl.expand_dims(_row_starts(bh, H, N_k, rows, HEAD_D, TOKEN_MAJOR), 1) + gl.expand_dims(cols, 0)
    in_range = gl.expand_dims(rows < N_k, 1)
    gl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=in_range)
    gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=in_range)


@gluon.jit
def _query_tiles(start_n, N_q, win_left, win_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """(i_lo, n_tiles): query tiles [i_lo, i_lo + n_tiles) see key tile [start_n, +BLOCK_N). Causal (query i sees
    key j <= i) starts at the diagonal; a window (j - win_right <= i <= j + win_left) bounds both ends. n_tiles
    may be <= 0: no query sees these keys, and dK = dV = 0."""
    i_lo = 0
    i_end = gl.cdiv(N_q, BLOCK_M)
    if CAUSAL:
        i_lo = start_n // BLOCK_M
    if WINDOW:  # (causal has made win_right 0)
        i_lo = gl.maximum(start_n - win_right, 0) // BLOCK_M
        i_end = gl.minimum(i_end, gl.cdiv(gl.maximum(start_n + BLOCK_N + win_left, 0), BLOCK_M))
    return i_lo, i_end - i_lo


@gluon.jit
def _full_query_tiles(first_key, N_q, win_left, win_right, BLOCK_M: gl.constexpr, ROWS: gl.constexpr,
                      CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """(lo_full, hi_full): query tiles i in [lo_full, hi_full) see all of keys [first_key, +ROWS) with every query,
    so they need no mask. Tile i holds queries i * BLOCK_M to (i + 1) * BLOCK_M - 1: all below N_q; not before
    the last key (causal), nor before it minus win_right, nor past the first key plus win_left (a window). Key
    rows past N_k need no mask: their dK and dV are never stored. The tiles before lo_full are the diagonal or a
    window's near edge, those from hi_full the window's far edge or the ragged end."""
    lo_full = 0
    hi_full = N_q // BLOCK_M
    if CAUSAL:
        lo_full = gl.cdiv(first_key + ROWS - 1, BLOCK_M)
    if WINDOW:  # (causal has made win_right 0)
        lo_full = gl.cdiv(gl.maximum(first_key + ROWS - 1 - win_right, 0), BLOCK_M)
        hi_full = gl.minimum(hi_full, (first_key + win_left + 1) // BLOCK_M)
    return lo_full, hi_full


@gluon.jit
def _mask_segments(first_key, i_lo, n_tiles, t_lo, list_row, N_q, win_left, win_right, BLOCK_M: gl.constexpr,
                   ROWS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, LISTED: gl.constexpr,
                   BLOCK_SIZE: gl.constexpr, WARPS: gl.constexpr):
    """(0, a, b, n_tiles): of the loop's steps 0 to n_tiles - 1 (query tile i_lo + n), [0, a) and [b, n_tiles) need
    a mask and [a, b) do not (:func:`_full_query_tiles`). With a block mask (LISTED) step n takes listed tile
    t_lo + n; a list is in increasing order, so its tiles before lo_full are again the first steps and those from
    hi_full the last: a and b count the listed tiles before each. How a kernel uses them (a loop for each range,
    or a branch in one loop) is :func:`dkdv_masks`'s choice."""
    lo_full, hi_full = _full_query_tiles(first_key, N_q, win_left, win_right, BLOCK_M, ROWS, CAUSAL, WINDOW)
    if LISTED:
        lo_full = _listed_tiles_before(list_row, gl.maximum(lo_full, 0) * BLOCK_M, BLOCK_SIZE, BLOCK_M, WARPS)
        hi_full = _listed_tiles_before(list_row, gl.maximum(hi_full, 0) * BLOCK_M, BLOCK_SIZE, BLOCK_M, WARPS)
        i_lo = t_lo
    a = gl.minimum(gl.maximum(lo_full - i_lo, 0), n_tiles)
    b = gl.minimum(gl.maximum(hi_full - i_lo, a), n_tiles)
    return 0, a, b, n_tiles


@gluon.jit
def _step_is_masked(n, bounds, full, i_lo, t_lo, n_tiles, list_row, LISTED: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                    BLOCK_M: gl.constexpr):
    """Whether step n of a dK/dV kernel's one loop (``MASKS == "branch"``) needs the mask: a listed tile's own
    index against :func:`_full_query_tiles`'s range ``full`` (a block mask's tiles are not contiguous), else the
    step against :func:`_mask_segments`'s ``bounds``."""
    if LISTED:
        i = _tile_of(n, i_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_M)
        masked = (i < full[0]) | (i >= full[1])
    else:
        masked = (n < bounds[1]) | (n >= bounds[2])
    return masked


@gluon.jit
def _dkdv_step(n, masked, FULL: gl.constexpr, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, bars, q_desc,
               do_desc, lse_desc, delta_desc, q_base, n_tiles,
               dk, dv, s_zero, keys, start_n, i_lo, t_lo, list_row, bh, M2, L2, Delta, N_q, qk_scale, slope2, win_left,
               win_right, seed, drop_below, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
               CAUSAL: gl.constexpr, WINDOW: gl.constexpr, ALIBI: gl.constexpr, DROPOUT: gl.constexpr,
               KEEP_LAYOUT: gl.constexpr, ROWS: gl.constexpr, s_layout: gl.constexpr, col_s: gl.constexpr,
               p_layout: gl.constexpr, LISTED: gl.constexpr, BLOCK_SIZE: gl.constexpr, STATS: gl.constexpr, q_col=0):
    """Step n of :func:`hopper_bwd_dkdv_kernel`'s loop: query tile i_lo + n (listed tile t_lo + n with a block
    mask) from its ring slot, then the copies of the tile STAGES ahead into the slot it frees."""
    slot = n % STAGES
    # With a block mask both indices are loads from its list: issued before the wait, so that their latency
    # passes under it and under the products instead of delaying the row statistics and the next copies.
    i = _tile_of(n, i_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_M)
    ahead = _tile_of(n + STAGES, i_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_M)
    mbarrier.wait(bars.index(slot), (n // STAGES) & 1)
    lse2_rows, d_rows = _stat_rows(M2, Delta, lse_smem, delta_smem, slot, BLOCK_M, STAGES, STATS)
    dk, dv = _dkdv_tile(k_smem, v_smem, q_smem.index(slot), do_smem.index(slot), dk, dv, s_zero, keys, start_n, i,
                        bh, lse2_rows, L2, d_rows, N_q, qk_scale, slope2, win_left, win_right, seed, drop_below,
                        masked, FULL, BLOCK_M, CAUSAL, WINDOW, ALIBI, DROPOUT, KEEP_LAYOUT, ROWS, s_layout,
                        col_s, p_layout, STATS)
    _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, bars, bh, q_base, ahead,
               n + STAGES, n_tiles, BLOCK_M, STAGES, STATS, q_col)
    return dk, dv


@gluon.jit(do_not_specialize=["seed", "drop_below"])  # 1 and 0 stay runtime values
def hopper_bwd_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV, M2, L2, Delta, N_q, N_k,
                           sm_scale, qk_scale,
                           SLOPES, win_left, win_right, seed, drop_below, LISTS, stride_lb, stride_lh,
                           stride_li, H, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, ALIBI: gl.constexpr,
                           DROPOUT: gl.constexpr, KEEP_LAYOUT: gl.constexpr, MASKS: gl.constexpr,
                           LISTED: gl.constexpr, BLOCK_SIZE: gl.constexpr, STATS: gl.constexpr,
                           num_warps: gl.constexpr, TOKEN_MAJOR: gl.constexpr = False):
    """Program (pid_n, bh) writes dK and dV of keys [pid_n * BLOCK_N, +BLOCK_N) of head bh (with TOKEN_MAJOR Q, K, V
    and dO are read in the (B, N, H, d) layout of :func:`flashref.triton.hopper.head_origin`). The descriptors view
    Q, dO (B * H * N_q, d) and K, V (B * H * N_k, d); query columns past N_q (the next head's rows, or TMA's
    zeros) get P = 0, so they add nothing; key rows past N_k are never stored. LISTED: a block mask, whose
    transposed visible-block lists LISTS (strides per batch, head and key block; H heads) name the query blocks
    of BLOCK_SIZE rows that see this program's keys: only their tiles are loaded. STATS: lse_desc and delta_desc
    (:func:`_stat_descriptors`) bring each query tile's lse2 and D into the ring beside Q and dO; otherwise the
    tile loads M2, L2 and Delta from global memory (the descriptors unread)."""
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    start_n = pid_n * BLOCK_N

    # Scores tile: (keys x queries); accumulators: (keys x d). wgmma gives each warp 16 rows (keys).
    s_layout: gl.constexpr = _wgmma_layout(num_warps, BLOCK_M)
    a_layout: gl.constexpr = _wgmma_layout(num_warps, HEAD_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    k_smem, v_smem, q_smem, do_smem, kv_bar, bars = _backward_smem(k_desc, v_desc, q_desc, do_desc, STAGES)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], delta_desc.layout)

    i_lo, n_tiles = _query_tiles(start_n, N_q, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    # With a block mask n_tiles becomes the number of listed tiles in [i_lo, i_lo + n_tiles).
    list_row, t_lo, n_tiles = _list_range(LISTED, LISTS, bh, H, stride_lb, stride_lh, stride_li,
                                          start_n // BLOCK_SIZE, i_lo, n_tiles, BLOCK_SIZE, BLOCK_M, num_warps)
    q_base, col = head_origin(bh, H, N_q, HEAD_D, TOKEN_MAJOR)
    kv_base, _ = head_origin(bh, H, N_k, HEAD_D, TOKEN_MAJOR)

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_base + start_n, col], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [kv_base + start_n, col], kv_bar, v_smem)
    for s in gl.static_range(STAGES):
        first = _tile_of(s, i_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_M)
        _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, bars, bh, q_base,
                   first, s, n_tiles, BLOCK_M, STAGES, STATS, col)

    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, a_layout)
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, a_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    keys = start_n + gl.arange(0, BLOCK_N, layout=row_s)
    mbarrier.wait(kv_bar, 0)

    slope2 = 0.0
    if ALIBI:
        slope2 = gl.load(SLOPES + bh)
    bounds = _mask_segments(start_n, i_lo, n_tiles, t_lo, list_row, N_q, win_left, win_right, BLOCK_M, BLOCK_N,
                            CAUSAL, WINDOW, LISTED, BLOCK_SIZE, num_warps)
    full = _full_query_tiles(start_n, N_q, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    if MASKS == "loops":  # masked tiles, tiles without a mask, masked tiles: each loop its own code
        for part in gl.static_range(3):
            for n in range(bounds[part], bounds[part + 1]):
                dk, dv = _dkdv_step(n, part != 1, part == 1, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                                    bars, q_desc, do_desc, lse_desc, delta_desc, q_base, n_tiles, dk, dv, s_zero,
                                    keys, start_n, i_lo, t_lo, list_row, bh, M2, L2,
                                    Delta, N_q, qk_scale, slope2, win_left, win_right, seed, drop_below,
                                    BLOCK_M, STAGES, CAUSAL, WINDOW, ALIBI, DROPOUT, KEEP_LAYOUT, BLOCK_N, s_layout,
                                    col_s, p_layout, LISTED, BLOCK_SIZE, STATS, col)
    else:
        for n in range(0, n_tiles):
            masked = True  # a constant unless the branch decides: the mask's code then compiles away
            if MASKS == "branch":
                masked = _step_is_masked(n, bounds, full, i_lo, t_lo, n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_M)
            dk, dv = _dkdv_step(n, masked, False, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, bars, q_desc,
                                do_desc, lse_desc, delta_desc, q_base,
                                n_tiles, dk, dv, s_zero, keys, start_n, i_lo, t_lo, list_row, bh, M2, L2, Delta, N_q,
                                qk_scale, slope2, win_left, win_right, seed, drop_below, BLOCK_M, STAGES,
                                CAUSAL, WINDOW, ALIBI, DROPOUT, KEEP_LAYOUT, BLOCK_N, s_layout, col_s, p_layout, LISTED,
                                BLOCK_SIZE, STATS, col)

    mbarrier.invalidate(kv_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    _store_dkdv(DK, DV, dk, dv, start_n, bh, N_k, sm_scale, BLOCK_N, HEAD_D, a_layout, H=H, TOKEN_MAJOR=TOKEN_MAJOR)


@gluon.jit(do_not_specialize=["seed", "drop_below"])  # 1 and 0 stay runtime values
def hopper_bwd_dq_kernel(q_desc, k_desc, v_desc, do_desc, DQ, M2, L2, Delta, N_q, N_k, sm_scale, qk_scale,
                         SLOPES, win_left, win_right, seed, drop_below, keep_scale, LISTS, stride_lb, stride_lh,
                         stride_li, H, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, ALIBI: gl.constexpr,
                         DROPOUT: gl.constexpr, KEEP_LAYOUT: gl.constexpr, LISTED: gl.constexpr,
                         BLOCK_SIZE: gl.constexpr, num_warps: gl.constexpr, TOKEN_MAJOR: gl.constexpr = False):
    """Program (pid_m, bh) writes dQ of queries [pid_m * BLOCK_M, +BLOCK_M) of head bh (dQ contiguous; with
    TOKEN_MAJOR Q, K, V and dO are read in the layout of :func:`flashref.triton.hopper.head_origin`): Q_i and dO_i
    resident, K_j and V_j streamed through the ring, in the forward's orientation (queries are the rows):

        S = Q_i K_j^T,  P = exp2(S * scale * log2 e - m2 - l2),  dP = dO_i V_j^T,  dS = P * (dP - D),  dQ_i += dS K_j

    Key rows past N_k (the next head's, or TMA's zeros) get P = 0 and so dS = 0: they add nothing. DROPOUT:
    dP = dP~ * keep * keep_scale with the forward's mask (:func:`flashref.triton.hopper._keep`). LISTED: a block
    mask, whose visible-block lists LISTS (strides per batch, head and query block; H heads) name the key blocks of
    BLOCK_SIZE keys these queries see: only their tiles are loaded."""
    pid_m = gl.program_id(0)
    if CAUSAL:  # the last query tiles see the most keys: launch them first, so the short ones fill the tail
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    start_m = pid_m * BLOCK_M
    dtype: gl.constexpr = q_desc.dtype

    s_layout: gl.constexpr = _wgmma_layout(num_warps, BLOCK_N)
    a_layout: gl.constexpr = _wgmma_layout(num_warps, HEAD_D)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    q_smem, do_smem, k_smem, v_smem, q_bar, bars = _backward_smem(q_desc, do_desc, k_desc, v_desc, STAGES)

    # Key tiles [j_lo, j_end) hold keys these queries see: causal (key j visible from query i for j <= i) stops
    # after the diagonal; a window (i - win_left <= j <= i + win_right) bounds both ends.
    j_lo = 0
    j_end = gl.cdiv(N_k, BLOCK_N)
    if CAUSAL:
        j_end = gl.minimum(j_end, gl.cdiv(start_m + BLOCK_M, BLOCK_N))
    if WINDOW:
        j_lo = gl.maximum(start_m - win_left, 0) // BLOCK_N
        j_end = gl.minimum(j_end, gl.cdiv(gl.maximum(start_m + BLOCK_M + win_right, 0), BLOCK_N))
    n_tiles = j_end - j_lo  # may be <= 0: these queries see no key, dQ = 0
    # Key tiles [lo_full, n_full) need no mask (the forward's ranges: every query row sees every key of them);
    # the others take a branch. Against a mask on every tile (H100, as dkdv_masks): 0.72-0.77x the time causal
    # at d = 64, 0.90-0.92x at d = 128, 0.80-0.93x with a window, 0.89x causal with dropout, 0.97-1.04x
    # non-causal (one branch a tile, nothing to save).
    _, _, lo_full, n_full = hopper._key_tiles(start_m, N_k, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    # With a block mask n_tiles becomes the number of listed tiles in [j_lo, j_lo + n_tiles).
    list_row, t_lo, n_tiles = _list_range(LISTED, LISTS, bh, H, stride_lb, stride_lh, stride_li,
                                          start_m // BLOCK_SIZE, j_lo, n_tiles, BLOCK_SIZE, BLOCK_N, num_warps)
    q_base, col = head_origin(bh, H, N_q, HEAD_D, TOKEN_MAJOR)
    kv_base, _ = head_origin(bh, H, N_k, HEAD_D, TOKEN_MAJOR)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_base + start_m, col], q_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [q_base + start_m, col], q_bar, do_smem)
    for s in gl.static_range(STAGES):
        first = _tile_of(s, j_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_N)
        _load_pair(k_desc, v_desc, k_smem, v_smem, bars, kv_base, first, s, n_tiles, BLOCK_N, STAGES, col)

    queries = start_m + gl.arange(0, BLOCK_M, layout=row_s)
    live = queries < N_q
    stat = bh.to(gl.int64) * N_q + queries
    lse2 = gl.load(M2 + stat, mask=live, other=0.0) + gl.load(L2 + stat, mask=live, other=0.0)
    D = gl.load(Delta + stat, mask=live, other=0.0)
    if DROPOUT:  # keep_scale into this program's rows once (_dropped_dp)
        lse2, D = _fold_keep_scale(lse2, D, keep_scale)
    dq = gl.zeros([BLOCK_M, HEAD_D], gl.float32, a_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    slope2 = 0.0
    if ALIBI:
        slope2 = gl.load(SLOPES + bh)
    mbarrier.wait(q_bar, 0)

    for n in range(0, n_tiles):
        slot = n % STAGES
        # With a block mask both indices are loads from its list, issued before the wait (see _dkdv_step).
        j = _tile_of(n, j_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_N)
        ahead = _tile_of(n + STAGES, j_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_N)
        mbarrier.wait(bars.index(slot), (n // STAGES) & 1)
        k_t = k_smem.index(slot)
        v_t = v_smem.index(slot)
        S = warpgroup_mma(q_smem, k_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dP = warpgroup_mma(do_smem, v_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_s)
        S = warpgroup_mma_wait(1, deps=[S])
        S = _scaled_scores(S, gl.expand_dims(queries, 1), gl.expand_dims(keys, 0), qk_scale, slope2, ALIBI)
        S = S - gl.expand_dims(lse2, 1)
        if (j < lo_full) | (j >= n_full):  # the ragged end, the causal diagonal, a window's edges
            keep = gl.expand_dims(keys < N_k, 0)
            if CAUSAL:
                keep = keep & (gl.expand_dims(keys, 0) <= gl.expand_dims(queries, 1))
            keep = _in_window(keep, gl.expand_dims(queries, 1), gl.expand_dims(keys, 0), win_left, win_right, WINDOW)
            S = gl.where(keep, S, float("-inf"))
        P = gl.exp2(S)
        dP = warpgroup_mma_wait(0, deps=[dP])
        if DROPOUT:  # (drawn before the wait for S instead, the mask measured 0-9% slower at d = 128)
            kept = hopper._keep(seed, bh, start_m, j * BLOCK_N, drop_below, BLOCK_M, BLOCK_N, KEEP_LAYOUT, s_layout)
            dP = _dropped_dp(dP, kept, DROPOUT)
        ds = gl.convert_layout((P * (dP - gl.expand_dims(D, 1))).to(dtype), ds_layout)
        dq = warpgroup_mma(ds, k_t, dq, is_async=True)
        dq, ds = warpgroup_mma_wait(0, deps=[dq, ds])  # (in flight on into the next tile measured slower)
        _load_pair(k_desc, v_desc, k_smem, v_smem, bars, kv_base, ahead, n + STAGES, n_tiles, BLOCK_N, STAGES, col)

    mbarrier.invalidate(q_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, a_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, a_layout))
    offs = gl.expand_dims(_row_starts(bh, H, N_q, rows, HEAD_D, TOKEN_MAJOR), 1) + gl.expand_dims(cols, 0)
    gl.store(DQ + offs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=gl.expand_dims(rows < N_q, 1))


@gluon.jit
def _ws_smem(k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, RING: gl.constexpr, STAGES: gl.constexpr):
    """A warp-specialized backward program's shared memory: two K and two V tiles (one a consumer, or one a
    column half), a ring of RING Q and dO tiles and STAGES slots of row statistics, each in its descriptor's box
    and layout; the barrier of the K and V copies, and each slot's ``ready`` (the producer's copies) and
    ``empty`` (both consumers are done with it)."""
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [RING] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [RING] + do_desc.block_type.shape, do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumers must be done with a slot
    return k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, ready, empty


@gluon.jit
def _ws_dkdv_producer(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
                      delta_smem, kv_bar, ready, empty, bh, start_n, i_lo, n_tiles, t_lo, list_row, N_q, N_k,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LISTED: gl.constexpr,
                      BLOCK_SIZE: gl.constexpr, STATS: gl.constexpr, H=1, HEAD_D: gl.constexpr = 0,
                      TOKEN_MAJOR: gl.constexpr = False, wrap_at=1, WRAP: gl.constexpr = False):
    """One warp with few registers: the K and V rows of both consumers once, then every Q, dO tile pair (and with
    STATS the tile's lse2 and D) into the ring. A slot is refilled once both consumers have arrived on its empty
    barrier. WRAP: step n takes tile (i_lo + n) mod wrap_at (the ordered one-kernel backward's rotated visits)."""
    ROWS: gl.constexpr = BLOCK_N // 2
    q_base, col = head_origin(bh, H, N_q, HEAD_D, TOKEN_MAJOR)
    kv_base, _ = head_origin(bh, H, N_k, HEAD_D, TOKEN_MAJOR)
    mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for wg in gl.static_range(2):
        row = kv_base + start_n + wg * ROWS
        tma.async_copy_global_to_shared(k_desc, [row, col], kv_bar, k_smem.index(wg))
        tma.async_copy_global_to_shared(v_desc, [row, col], kv_bar, v_smem.index(wg))
    for n in range(0, n_tiles):
        # A fresh mbarrier counts as having completed the phase before its first, so round 0 passes at once.
        mbarrier.wait(empty.index(n % STAGES), ((n // STAGES) & 1) ^ 1)
        tile = _tile_of(n, i_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_M)
        if WRAP:
            tile = tile % wrap_at
        _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, ready, bh, q_base,
                   tile, n, n_tiles, BLOCK_M, STAGES, STATS, col)


@gluon.jit
def _opaque(x):
    """x, through an instruction the compiler cannot see into: a loop's tile index i_lo + n so hidden keeps LLVM
    from turning the row-statistics addresses into 64-bit induction variables (measured: ~190 more instructions
    a step and register spills in the warp-specialized dK/dV loop, as a block mask's loaded index has none)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _ws_dkdv_step(n, masked, FULL: gl.constexpr, k_t, v_t, q_smem, do_smem, lse_smem, delta_smem, ready, empty, dk,
                  dv, s_zero, keys,
                  first_key, i_lo, n_tiles, t_lo, list_row, bh, M2, L2, Delta, N_q, qk_scale, slope2, win_left,
                  win_right, seed, drop_below, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, WINDOW: gl.constexpr, ALIBI: gl.constexpr, DROPOUT: gl.constexpr,
                  KEEP_LAYOUT: gl.constexpr, ROWS: gl.constexpr, s_layout: gl.constexpr, col_s: gl.constexpr,
                  p_layout: gl.constexpr, LISTED: gl.constexpr, BLOCK_SIZE: gl.constexpr, OPAQUE: gl.constexpr,
                  STATS: gl.constexpr, LATE_MASK: gl.constexpr):
    """Step n of a consumer's loop: query tile i_lo + n (listed tile t_lo + n with a block mask) from its ring
    slot, which it then hands back. OPAQUE: the index passes through :func:`_opaque`; LATE_MASK: as
    :func:`_dkdv_tile` takes it."""
    slot = n % STAGES
    mbarrier.wait(ready.index(slot), (n // STAGES) & 1)
    i = _tile_of(n, i_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_M)
    if OPAQUE:
        i = _opaque(i)
    lse2_rows, d_rows = _stat_rows(M2, Delta, lse_smem, delta_smem, slot, BLOCK_M, STAGES, STATS)
    dk, dv = _dkdv_tile(k_t, v_t, q_smem.index(slot), do_smem.index(slot), dk, dv, s_zero, keys, first_key, i, bh,
                        lse2_rows, L2, d_rows, N_q, qk_scale, slope2, win_left, win_right, seed, drop_below,
                        masked, FULL, BLOCK_M, CAUSAL, WINDOW, ALIBI, DROPOUT, KEEP_LAYOUT, ROWS, s_layout,
                        col_s, p_layout, STATS, LATE_MASK)
    mbarrier.arrive(empty.index(slot), count=1)
    return dk, dv


@gluon.jit
def _ws_dkdv_consumer(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_bar, ready, empty, DK, DV, M2, L2,
                      Delta, bh, start_n,
                      i_lo, n_tiles, t_lo, list_row, N_q, N_k, sm_scale, qk_scale, SLOPES, win_left, win_right, seed,
                      drop_below, WG: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                      ALIBI: gl.constexpr, DROPOUT: gl.constexpr, KEEP_LAYOUT: gl.constexpr, MASKS: gl.constexpr,
                      LISTED: gl.constexpr, BLOCK_SIZE: gl.constexpr, STATS: gl.constexpr, H=1,
                      TOKEN_MAJOR: gl.constexpr = False):
    """Consumer warpgroup WG (4 warps) owns keys [start_n + WG * BLOCK_N/2, +BLOCK_N/2): the loop of
    :func:`hopper_bwd_dkdv_kernel` on every tile pair of the ring, which it then hands back (empty barrier); its dK
    and dV rows in the inputs' layout (TOKEN_MAJOR: :func:`_row_starts`)."""
    ROWS: gl.constexpr = BLOCK_N // 2
    s_layout: gl.constexpr = _wgmma_layout(4, BLOCK_M)
    a_layout: gl.constexpr = _wgmma_layout(4, HEAD_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    k_t = k_smem.index(WG)
    v_t = v_smem.index(WG)
    first_key = start_n + WG * ROWS
    keys = first_key + gl.arange(0, ROWS, layout=row_s)
    dk = gl.zeros([ROWS, HEAD_D], gl.float32, a_layout)
    dv = gl.zeros([ROWS, HEAD_D], gl.float32, a_layout)
    s_zero = gl.zeros([ROWS, BLOCK_M], gl.float32, s_layout)
    slope2 = 0.0
    if ALIBI:
        slope2 = gl.load(SLOPES + bh)
    # (A block mask's steps take the branch on their own tile's index, _step_is_masked: counting listed tiles
    # for the bounds is a reduction over the list that a consumer warpgroup would run alone.)
    bounds = _mask_segments(first_key, i_lo, n_tiles, t_lo, list_row, N_q, win_left, win_right, BLOCK_M, ROWS,
                            CAUSAL, WINDOW, False, BLOCK_SIZE, 4)
    full = _full_query_tiles(first_key, N_q, win_left, win_right, BLOCK_M, ROWS, CAUSAL, WINDOW)
    gl.static_assert(not (LISTED and MASKS == "loops"), "the consumers do not count a block mask's tiles: no loops")
    # The tile index made opaque where that measured faster (H100, d = 128, fp16, kernel alone): 1.07-1.13x
    # without causal masking (the loop lost ~200 instructions and its spills), 1.05-1.07x with a window (the
    # branch); causal with a mask on every tile it measured 0.91-0.93x, so there it stays a plain sum.
    OPAQUE: gl.constexpr = (not LISTED) and (MASKS == "branch" or not CAUSAL)
    LATE_MASK: gl.constexpr = _late_mask(DROPOUT, HEAD_D)  # (_dkdv_tile: what the consumers' registers hold)
    mbarrier.wait(kv_bar, 0)
    if MASKS == "loops":  # as hopper_bwd_dkdv_kernel's loops
        for part in gl.static_range(3):
            for n in range(bounds[part], bounds[part + 1]):
                dk, dv = _ws_dkdv_step(n, part != 1, part == 1, k_t, v_t, q_smem, do_smem, lse_smem, delta_smem, ready,
                                       empty, dk, dv, s_zero,
                                       keys, first_key, i_lo, n_tiles, t_lo, list_row, bh, M2, L2, Delta, N_q, qk_scale,
                                       slope2, win_left, win_right, seed, drop_below, BLOCK_M, STAGES,
                                       CAUSAL, WINDOW, ALIBI, DROPOUT, KEEP_LAYOUT, ROWS, s_layout, col_s, p_layout,
                                       LISTED, BLOCK_SIZE, OPAQUE, STATS, LATE_MASK)
    else:
        for n in range(0, n_tiles):
            masked = True  # a constant unless the branch decides: the mask's code then compiles away
            if MASKS == "branch":
                masked = _step_is_masked(n, bounds, full, i_lo, t_lo, n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_M)
            dk, dv = _ws_dkdv_step(n, masked, False, k_t, v_t, q_smem, do_smem, lse_smem, delta_smem, ready, empty, dk,
                                   dv, s_zero, keys,
                                   first_key, i_lo, n_tiles, t_lo, list_row, bh, M2, L2, Delta, N_q, qk_scale, slope2,
                                   win_left, win_right, seed, drop_below, BLOCK_M, STAGES, CAUSAL, WINDOW,
                                   ALIBI, DROPOUT, KEEP_LAYOUT, ROWS, s_layout, col_s, p_layout, LISTED, BLOCK_SIZE,
                                   OPAQUE, STATS, LATE_MASK)
    _store_dkdv(DK, DV, dk, dv, first_key, bh, N_k, sm_scale, ROWS, HEAD_D, a_layout, H=H, TOKEN_MAJOR=TOKEN_MAJOR)


@gluon.jit(do_not_specialize=["seed", "drop_below"])  # 1 and 0 stay runtime values
def hopper_ws_bwd_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV, M2, L2, Delta, N_q, N_k,
                              sm_scale, qk_scale,
                              SLOPES, win_left, win_right, seed, drop_below, LISTS, stride_lb,
                              stride_lh, stride_li, H, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                              ALIBI: gl.constexpr, DROPOUT: gl.constexpr, KEEP_LAYOUT: gl.constexpr,
                              MASKS: gl.constexpr, LISTED: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                              STATS: gl.constexpr, num_warps: gl.constexpr, TOKEN_MAJOR: gl.constexpr = False):
    """The warp-specialized dK/dV kernel: program (pid_n, bh) owns BLOCK_N keys of head bh, split between two
    consumer warpgroups (the kernel's own 4 warps and a worker warpgroup), each with the K and V rows of its half;
    one worker warp copies every Q, dO tile pair once for both. As the forward's warp-specialized kernel, the
    launch caps registers at 168 a thread so that 12 warps fit an SM, and the partitions move them: 24 for the
    producer, 240 for each consumer (two fp32 accumulators of BLOCK_N/2 x d). TOKEN_MAJOR: the producer reads Q, K,
    V and dO in the layout of :func:`flashref.triton.hopper.head_origin`."""
    gl.static_assert(num_warps == 4, "the kernel's own warps are one consumer warpgroup")
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    start_n = pid_n * BLOCK_N
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, ready, empty = _ws_smem(
        k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, STAGES, STAGES)
    i_lo, n_tiles = _query_tiles(start_n, N_q, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    # A block mask (see hopper_bwd_dkdv_kernel): the program's BLOCK_N keys lie in one mask block.
    list_row, t_lo, n_tiles = _list_range(LISTED, LISTS, bh, H, stride_lb, stride_lh, stride_li,
                                          start_n // BLOCK_SIZE, i_lo, n_tiles, BLOCK_SIZE, BLOCK_M, num_warps)
    gl.warp_specialize([
        (_ws_dkdv_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_bar, ready, empty, DK, DV,
                             M2, L2, Delta, bh, start_n, i_lo, n_tiles, t_lo, list_row, N_q, N_k, sm_scale, qk_scale,
                             SLOPES, win_left, win_right, seed, drop_below, 0, HEAD_D, BLOCK_M, BLOCK_N,
                             STAGES, CAUSAL, WINDOW, ALIBI, DROPOUT, KEEP_LAYOUT, MASKS, LISTED, BLOCK_SIZE, STATS, H,
                             TOKEN_MAJOR)),
        (_ws_dkdv_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                             lse_smem, delta_smem, kv_bar, ready, empty, bh, start_n, i_lo, n_tiles, t_lo, list_row,
                             N_q, N_k, BLOCK_M, BLOCK_N, STAGES, LISTED, BLOCK_SIZE, STATS, H, HEAD_D, TOKEN_MAJOR)),
        (_ws_dkdv_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_bar, ready, empty, DK, DV,
                             M2, L2, Delta, bh, start_n, i_lo, n_tiles, t_lo, list_row, N_q, N_k, sm_scale, qk_scale,
                             SLOPES, win_left, win_right, seed, drop_below, 1, HEAD_D, BLOCK_M, BLOCK_N,
                             STAGES, CAUSAL, WINDOW, ALIBI, DROPOUT, KEEP_LAYOUT, MASKS, LISTED, BLOCK_SIZE, STATS, H,
                             TOKEN_MAJOR)),
    ], [1, 4], [24, 240])


def default_config(head_dim: int, part: str = "dkdv") -> dict:
    """The tiles the ``part`` kernel ("dkdv" or "dq") launches with, with dropout or without.

    dK/dV, the best of three on an H100 (fp16, B x N = 65536, H x d = 2048, N = 4K and 16K, causal and not): at
    d = 64, 64 keys a program in one warpgroup, 64 queries a step, Q and dO in a ring of 2 (measured 1.13-1.33x
    the teaching dK/dV kernel's speed); the warp-specialized kernel is no faster there (405-462 against 418-461
    TFLOP/s). At d = 128 one warpgroup must step 32 queries (64 spill: dK and dV's fp32 accumulators alone take
    128 registers a thread), so the warp-specialized kernel wins: two consumer warpgroups of 64 keys each step 64
    queries with 240 registers a thread, a producer warp copying Q and dO once for both (489-559 TFLOP/s against
    436-463 for one warpgroup of 64 keys, 32 queries a step, a ring of 3: ``hopper --parts backward-kernels``).
    dQ: 64 queries a program in one warpgroup (one fp32 accumulator), 64 keys a step, K and V in a ring of 2, the
    best of four (or within 2% of it) at each head dim. Measured (profiler, same shapes) 1.15-1.20x the teaching
    dQ kernel's time without causal masking, 0.91-1.09x with it (the slowest at N = 16K, d = 64), before the
    causal launch order was reversed. At d = 256 the same dQ tile measured 1.04-1.05x the teaching dQ kernel's
    speed (B 8, H 8, N 4K; 64 x 32 0.85-0.88x, with a ring of 3 0.76-0.84x), and dK/dV take
    :func:`flashref.triton.hopper_backward_wide.default_config`. Other dQ tiles (2026-11-27, d = 64 and 128, N 4K
    and 16K): 128 keys a step 0.86-0.95x, 128 queries on 8 warps 0.86-0.95x, a ring of 3 0.80-0.94x the shipped.
    With dropout the same tiles. Until 2026-11-29 dK/dV at d = 128 ran dropout on one warpgroup of 64 keys stepping
    32 queries (1.12-1.24x the teaching kernel's speed on an H100, B 8, H 16, N 4K, p = 0.1), because the
    warp-specialized kernel spilled 0.8-1 KB a thread with the mask's words (0.65-0.70x the teaching kernel's
    speed), then 256-292 bytes once each query tile's lse2 and D came by TMA (0.94-0.96x the one-warpgroup tile).
    With the mask drawn after both products (``LATE_MASK`` in :func:`_dkdv_tile`) it spills 0-108 bytes and took
    4.21 ms against the one-warpgroup kernel's 4.87 non-causal, 2.63 against 2.57 causal (H200, profiler, same
    shapes, the one-warpgroup figures from another run): it runs dropout too. (``stats_tma`` measured
    1.04-1.23x the dK/dV kernel's speed without dropout, 0.996-1.02x with it, against loading the statistics in
    the loop, H100, same shapes; and :func:`flashref.triton.hopper._keep_t`'s drawing each Philox call once took
    the d = 64 dK/dV kernel from 15.0 to 12.9 ms, B 16, H 32, N 4K, p = 0.1.) At d = 64 three programs an SM
    (``maxnreg`` 168) measured 1.00-1.02x, a ring of 3 0.88-0.91x, the warp-specialized kernel with 2 x 64 keys
    0.90-1.01x: the tile stays."""
    if part not in ("dkdv", "dq"):
        raise ValueError(f"part must be 'dkdv' or 'dq', got {part!r}")
    if part == "dq":
        return dict(block_m=64, block_n=64, num_warps=4, stages=2)
    if head_dim in PLAIN_HEAD_DIMS:
        return _wide().default_config()
    if head_dim <= 64:
        return dict(block_m=64, block_n=64, num_warps=4, stages=2)
    return dict(block_m=64, block_n=128, num_warps=4, stages=2, warp_specialize=True)


def dkdv_masks(warp_specialize: bool, window: bool, dropout: bool = False, listed: bool = False) -> str:
    """How the dK/dV kernel spends its masks (``MASKS``): ``"every"`` tile masked, as the teaching kernel's; a
    ``"branch"`` in one loop around the tile with and without the mask; or separate ``"loops"`` for the masked
    tiles (the causal diagonal, a window's edges, the ragged end) and those without a mask. The results are the
    same bits. Measured on an H100 (fp16, B x N = 32K, 16 or 32 heads, medians of triton's do_bench in two runs;
    causal window of 1024 keys at N = 8K and 16K): one warpgroup (d = 64) is fastest with separate loops, 0.95-0.98x
    the time with a mask on every tile causal, 0.98-0.99x non-causal, 0.79-0.81x with the window (0.86x a
    two-sided window of 511 keys with ALiBi). The warp-specialized kernel (d = 128) is not: its consumers hold 240
    registers and spill more with either (ptxas: 336 bytes a thread causal with a mask on every tile, 432 with
    a branch, 572 with loops), and measured 1.05-1.08x (loops) and 1.12x (branch) the time causal, 0.98x and
    1.06x non-causal; but with a window the branch took 0.77-0.79x the time (loops 0.84-0.85x): there the mask
    on every tile costs more than the spills. Measured again once the consumers' tile index became opaque where
    it helps (:func:`_opaque`; kernel alone, do_bench, best of three interleaved rounds, N = 2K-16K): without
    causal masking the time over every tile's was 1.04-1.09x with loops and 0.95-1.05x with the branch (two
    timings of the same kernel differed by up to 6% in that run); causal, 1.11-1.14x with loops and 1.15-1.19x
    with the branch; with a window the branch is still the fastest (every tile 1.15-1.42x its time). With
    dropout the one-warpgroup kernel takes separate loops too (each holds the mask's Philox rounds; ptxas: 236-253
    registers, no spills, at d = 64 and 128): on an H200 (B 8, H 16, N 4K, fp16, p = 0.1, the kernel alone, medians
    of five interleaved rounds) 1.06x the speed of a mask on every tile at d = 64 and 1.16x causal, 1.03-1.04x at
    d = 128 and 1.04-1.07x causal (two runs), the branch 1.01-1.11x. The warp-specialized kernel keeps a mask on
    every tile with dropout: its branch measured 5.04 ms against 4.21 non-causal, 2.69 against 2.63 causal (H200,
    d = 128, B 8, H 16, N 4K, p = 0.1, the mask drawn late: :func:`_dkdv_tile`'s ``LATE_MASK``)."""
    if not warp_specialize:  # (with a block mask too: its masked tiles are the first and the last it lists)
        return "loops"
    if listed:  # a block mask: the consumers take each tile's own index, a branch or (ptxas: 524 bytes of spills)
        return "every"  # every tile
    if dropout:  # the branch measured slower (above)
        return "every"
    return "branch" if window else "every"


def supported(q, k, v) -> str | None:
    """None when :func:`hopper_backward` can take these (checked) q, k, v, else why not: the forward's conditions
    (:func:`flashref.triton.hopper.supported`) with head dims 64, 128 and 256 (256 without a window, ALiBi,
    dropout or block mask: :data:`PLAIN_HEAD_DIMS`)."""
    why = hopper.supported(q, k, v)
    if why is None and q.shape[3] not in HEAD_DIMS + PLAIN_HEAD_DIMS:
        why = f"needs a head dim in {HEAD_DIMS + PLAIN_HEAD_DIMS}, got {q.shape[3]}"
    return why


def _wide():
    """:mod:`flashref.triton.hopper_backward_wide`, imported when first needed: it builds on this module."""
    from flashref.triton import hopper_backward_wide

    return hopper_backward_wide


def _check_plain(d: int, window, alibi: bool, dropout: bool, lists) -> None:
    """At the :data:`PLAIN_HEAD_DIMS` the kernels take top-left causal masking or none: a ValueError for the rest
    (``alibi`` and ``dropout``: whether the call brings slopes and dropout scalars)."""
    used = [name for name, on in (("window", window is not None), ("slopes2", alibi), ("dropout", dropout),
                                  ("lists", lists is not None)) if on]
    if d in PLAIN_HEAD_DIMS and used:
        raise ValueError(f"at head dim {d} the Gluon backward takes no {', '.join(used)} (head dims {HEAD_DIMS} do)")


def _descriptors(q, k, v, do, cfg: dict, cols: int | None = None, shared: dict | None = None, token: bool = False):
    """TMA descriptors of Q, K, V and dO viewed as (B * H * N, d) rows, or with ``token`` (all four
    :func:`flashref.triton.hopper.token_major`) as (B * N, H * d) rows: Q and dO in tiles of block_m rows, K and V
    of block_n; ``cols`` columns wide (default d; the d = 256 kernel copies halves). ``shared``: a dict that one
    backward passes to both of its kernels, so a descriptor of the same tensor and tile is made once (and a
    non-contiguous dO copied once): each made afresh costs host time, in Triton's launch too."""
    d = q.shape[3]
    cols = cols or d
    gdt = gl.float16 if q.dtype == torch.float16 else gl.bfloat16
    descs = []
    for x, rows in ((q, cfg["block_m"]), (k, cfg["block_n"]), (v, cfg["block_n"]), (do, cfg["block_m"])):
        key = (id(x), rows, cols, token)  # the tensors outlive the backward that holds ``shared``
        if shared is None or key not in shared:
            desc = hopper.descriptor(hopper.rows_view(x, token), (rows, cols), hopper.shared_layout((rows, cols), gdt))
            if shared is None:
                descs.append(desc)
                continue
            shared[key] = desc
        descs.append(shared[key])
    return descs


def _stat_descriptors(m2, l2, delta, block_m: int, stats: bool = True, dropout=None) -> list:
    """TMA descriptors of the query rows' statistics lse2 = m2 + l2 and D, each as (B * H, N_q rounded up to whole
    tiles of block_m) fp32: a head's rows padded, so that every tile's copy starts at a multiple of block_m (16-byte
    aligned) and stays within its head; a tile of 1 x block_m. With ``dropout`` (its ``(seed, drop_below,
    keep_scale)``), keep_scale folded in (:func:`folded_stats`). Without ``stats`` (the kernels then load them
    from global memory), zeros stand in."""
    B, H, N_q = m2.shape
    n_pad = hopper.host_cdiv(N_q, block_m) * block_m
    if stats:
        padded = _padded_stats(m2, l2, delta, n_pad, *fold_constants(_drop_args(dropout)[2]))
    else:
        padded = torch.zeros((2, B * H, n_pad), dtype=torch.float32, device=m2.device)
    layout = _stat_layout()
    return [hopper.descriptor(padded[i], (1, block_m), layout) for i in range(2)]


@functools.cache
def _stat_layout():
    """The statistics rows' shared layout (fp32, no swizzle), built once."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32)


PADDED_STATS_BLOCK = 1024  # entries a program of _padded_stats_kernel writes


def fold_constants(keep_scale: float) -> tuple:
    """(log2(keep_scale), 1 / keep_scale): what dropout's row statistics subtract from lse2 and multiply D by
    (:func:`_dropped_dp`); 0 and 1 without dropout, which change nothing."""
    return math.log2(keep_scale), 1.0 / keep_scale


def folded_stats(m2, l2, delta, keep_scale: float) -> tuple:
    """(m2 + l2 - log2(keep_scale), zeros, D / keep_scale): the statistics of :func:`_padded_stats` with dropout,
    unpadded, in the (m2, l2, delta) form the dK/dV kernels load from global memory (``stats_tma=False``): the same
    fp32 operations in the same order, so both ways give the same bits."""
    shift2, d_scale = fold_constants(keep_scale)
    lse2 = (m2 + l2) - shift2
    return lse2, torch.zeros_like(lse2), delta * d_scale


def _padded_stats(m2, l2, delta, n_pad: int, shift2: float = 0.0, d_scale: float = 1.0):
    """(2, B * H, n_pad) fp32: lse2 = m2 + l2 - shift2, then D * d_scale (dropout's :func:`fold_constants`, else
    nothing), each head's row padded with zeros from N_q to n_pad
    (:func:`_padded_stats_kernel`: one launch where zeros, an add and two copies took four. The descriptors with it
    measured 59-71 us of host time a backward against 86-97, on the H100 machine's host: the launch still costs most
    of it)."""
    B, H, N_q = m2.shape
    padded = torch.empty((2, B * H, n_pad), dtype=torch.float32, device=m2.device)
    relaunch.launch(_padded_stats_kernel, (hopper.host_cdiv(n_pad, PADDED_STATS_BLOCK), B * H), m2.contiguous(),
                    l2.contiguous(), delta.contiguous(), padded, N_q, n_pad, shift2, d_scale, BLOCK=PADDED_STATS_BLOCK)
    return padded


@triton.jit(do_not_specialize=["N_q", "N_pad"])
def _padded_stats_kernel(M2, L2, Delta, ROWS, N_q, N_pad, shift2, d_scale, BLOCK: tl.constexpr):
    """Entries [pid_0 * BLOCK, +BLOCK) of head bh's two rows: ROWS[0, bh] = m2 + l2 - shift2 and ROWS[1, bh] = D *
    d_scale up to N_q (:func:`fold_constants`), zeros after (a tile that
    reads them belongs to queries past N_q, which the kernels mask: finite, so 0 * D stays 0). M2, L2, Delta:
    contiguous (B * H, N_q)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bh = tl.program_id(1).to(tl.int64)
    live = i < N_q
    src = bh * N_q + i
    lse2 = tl.where(live, tl.load(M2 + src, mask=live, other=0.0) + tl.load(L2 + src, mask=live, other=0.0) - shift2,
                    0.0)
    D = tl.load(Delta + src, mask=live, other=0.0) * d_scale
    dst = bh * N_pad + i
    tl.store(ROWS + dst, lse2, mask=i < N_pad)
    tl.store(ROWS + tl.num_programs(1).to(tl.int64) * N_pad + dst, D, mask=i < N_pad)


def _meta(d: int, causal: bool, cfg: dict, window, alibi: bool, dropout: bool = False, keep_layout=None) -> dict:
    return dict(HEAD_D=d, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], STAGES=cfg["stages"],
                CAUSAL=bool(causal), WINDOW=window is not None, ALIBI=bool(alibi), DROPOUT=bool(dropout),
                KEEP_LAYOUT=keep_layout if dropout else None, num_warps=cfg["num_warps"])


def _mod_args(q, window, slopes2) -> tuple:
    """(SLOPES, win_left, win_right): the score modifications as the kernels take them. ``window`` = (win_left,
    win_right) as :class:`flashref.triton.ops.Features` holds it (query i sees key j for ``i - win_left <= j <= i
    + win_right``), or None; ``slopes2``: ALiBi slopes times log2(e), fp32 (B, H) (any strides), or None. The
    kernels read one slope a head at program bh = b * H + h."""
    from flashref.triton.ops import _stand_ins  # (made once a device: a fill at every call would be a launch)

    B, H = q.shape[:2]
    slopes = _stand_ins(q.device)[2]  # never read without ALiBi
    if slopes2 is not None:
        slopes = slopes2.float().expand(B, H).contiguous()
    win_left, win_right = window if window is not None else (0, 0)
    return slopes, int(win_left), int(win_right)


def _drop_args(dropout) -> tuple:
    """(seed, drop_below, keep_scale): ``dropout`` as :meth:`flashref.triton.ops.Features.scalars` gives them, or
    stand-ins when None."""
    return tuple(dropout) if dropout is not None else (0, 0, 1.0)


def _mask_args(dropout) -> tuple:
    """(seed, drop_below): what the dK/dV and one-kernel kernels take of ``dropout``. They draw the forward's mask
    but get keep_scale folded into the row statistics on the host (:func:`folded_stats`, :func:`_padded_stats`),
    where the dQ kernel folds it itself (:func:`_fold_keep_scale`)."""
    return _drop_args(dropout)[:2]


def hopper_dkdv(q, k, v, do, m2, l2, delta, causal: bool, scale: float, cfg: dict | None = None, *, window=None,
                slopes2=None, dropout=None, masks: str | None = None, lists=None, stats_tma: bool = True,
                shared: dict | None = None, token: bool = False):
    """(dk, dv) from the Gluon kernel, for checked, :func:`supported` inputs; m2, l2, delta: (B, H, N_q) fp32.
    ``cfg`` as :func:`default_config` gives it; with ``warp_specialize=True``, the warp-specialized kernel
    (:func:`hopper_ws_bwd_dkdv_kernel`: block_n keys a program, two consumers' worth, num_warps 4). ``window``
    and ``slopes2`` as :func:`_mod_args` takes them; ``dropout``: ``(seed, drop_below, keep_scale)``, or None.
    ``masks``: ``"every"``, ``"branch"`` or ``"loops"`` (the same bits, another speed), default
    :func:`dkdv_masks`'s choice. ``lists``: a block mask, as ``(transposed visible-block lists, block_size)``
    (:func:`_list_args`; :func:`lists_fit` must hold): only the query tiles of visible blocks are loaded.
    ``stats_tma`` (default True): each query tile's lse2 and D come by TMA beside Q and dO; False loads them from
    global memory in the loop (the same bits). At head dim 256: :func:`flashref.triton.hopper_backward_wide.
    hopper_wide_dkdv`, with neither ``masks`` nor the modifications. ``shared``: as :func:`_descriptors` takes it.
    ``token``: q, k, v and do are all :func:`flashref.triton.hopper.token_major` and are read in place (not at
    head dim 256); dk and dv then come in k's (B, N, H, d) layout, as the kernels write them (:func:`_row_starts`)."""
    launch = DkdvLaunch(q, k, causal, scale, cfg, window=window, alibi=slopes2 is not None,
                        dropout=dropout is not None, masks=masks, lists=lists, stats_tma=stats_tma, token=token)
    return launch(q, k, v, do, m2, l2, delta, slopes2=slopes2, dropout=dropout, shared=shared)


class DkdvLaunch:
    """The part of :func:`hopper_dkdv` that depends only on the call's signature, worked out once: the config, the
    kernel and its constexprs, the grid, the fixed arguments. Calling it allocates dK and dV, pads the statistics,
    makes the descriptors and launches; a plan of one call signature (:class:`flashref.triton.ops.StepPlan`) keeps
    it. ``alibi`` and ``dropout`` say whether calls bring slopes and dropout scalars (their values come with each
    call). At head dim 256 it calls :func:`flashref.triton.hopper_backward_wide.hopper_wide_dkdv`."""

    def __init__(self, q, k, causal: bool, scale: float, cfg: dict | None = None, *, window=None, alibi=False,
                 dropout=False, masks: str | None = None, lists=None, stats_tma: bool = True, token: bool = False):
        B, H, N_q, d = q.shape
        N_k = k.shape[2]
        _check_plain(d, window, alibi, dropout, lists)
        self.wide, self.token = None, bool(token)
        if d in PLAIN_HEAD_DIMS:
            if masks is not None or not stats_tma:
                raise ValueError(f"at head dim {d} the dK/dV kernel takes neither masks nor stats_tma=False")
            if token:
                raise ValueError(f"at head dim {d} the dK/dV kernel reads (B, H, N, d) rows only, not token-major "
                                 f"inputs (token=True)")
            self.wide = (causal, scale, cfg)
            return
        cfg = cfg or default_config(d, "dkdv")
        if masks not in (None, "every", "branch", "loops"):
            raise ValueError(f"masks must be None, 'every', 'branch' or 'loops', got {masks!r}")
        masks = masks or dkdv_masks(bool(cfg.get("warp_specialize")), window is not None, dropout, lists is not None)
        if lists is not None and masks == "loops" and cfg.get("warp_specialize"):
            raise ValueError("masks='loops' with a block mask needs the one-warpgroup kernel: the warp-specialized one "
                             "takes 'branch' or 'every'")
        if lists is not None and not lists_fit(cfg, "dkdv", lists[1]):
            raise ValueError(f"block_size {lists[1]} does not map onto the dK/dV tiles {cfg['block_n']} x "
                             f"{cfg['block_m']}")
        list_args, list_meta = _list_args(q, lists)
        self.dk_shape, self.stats_tma, self.alibi, self.window = (B, H, N_k, d), stats_tma, alibi, window
        self.fixed = (N_q, N_k, scale, scale * LOG2E)
        self.mods = None if alibi else _mod_args(q, window, None)
        self.list_args, self.block_m = list_args, cfg["block_m"]
        grid = (hopper.host_cdiv(N_k, cfg["block_n"]), B * H)
        if cfg.get("warp_specialize"):
            self.tiles = dict(cfg, block_n=cfg["block_n"] // 2)  # each TMA copy of K or V is one consumer's rows
            meta = _meta(d, causal, cfg, window, alibi, dropout,
                         hopper.keep_t_layout(self.tiles["block_n"], cfg["block_m"], 4))
            self.launch = relaunch.Bound(hopper_ws_bwd_dkdv_kernel, grid, **meta, MASKS=masks, **list_meta,
                                         STATS=stats_tma, TOKEN_MAJOR=self.token, maxnreg=hopper.WS_MAXNREG)
        else:
            self.tiles = cfg
            meta = _meta(d, causal, cfg, window, alibi, dropout,
                         hopper.keep_t_layout(cfg["block_n"], cfg["block_m"], cfg["num_warps"]))
            cap = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}  # (168: three programs an SM)
            self.launch = relaunch.Bound(hopper_bwd_dkdv_kernel, grid, **meta, MASKS=masks, **list_meta,
                                         STATS=stats_tma, TOKEN_MAJOR=self.token, **cap)

    def __call__(self, q, k, v, do, m2, l2, delta, *, slopes2=None, dropout=None, shared: dict | None = None):
        """(dk, dv) of this call (``slopes2``, ``dropout`` and ``shared`` as :func:`hopper_dkdv` takes them)."""
        if self.wide is not None:
            return _wide().hopper_wide_dkdv(q, k, v, do, m2, l2, delta, *self.wide)
        # with token, in k's (B, N, H, d) layout (the kernels write it there): what a model's gradient takes as is
        dk = hopper.empty_output(k, True) if self.token else torch.empty(self.dk_shape, dtype=q.dtype, device=q.device)
        dv = torch.empty_like(dk)  # dk's strides too: token-major where dk is
        mods = self.mods if not self.alibi else _mod_args(q, self.window, slopes2)
        stat_descs = _stat_descriptors(m2, l2, delta, self.block_m, self.stats_tma, dropout)
        if dropout is not None and not self.stats_tma:  # the kernel loads them: folded here, as the copies are
            m2, l2, delta = folded_stats(m2, l2, delta, dropout[2])
        self.launch(*_descriptors(q, k, v, do, self.tiles, shared=shared, token=self.token), *stat_descs, dk, dv,
                    m2.contiguous(), l2.contiguous(), delta, *self.fixed, *mods, *_mask_args(dropout), *self.list_args)
        return dk, dv


def hopper_dq(q, k, v, do, m2, l2, delta, causal: bool, scale: float, cfg: dict | None = None, *, window=None,
              slopes2=None, dropout=None, lists=None, shared: dict | None = None, token: bool = False):
    """dq from the Gluon kernel, for checked, :func:`supported` inputs; m2, l2, delta: (B, H, N_q) fp32;
    ``window`` and ``slopes2`` as :func:`_mod_args` takes them; ``dropout`` as :func:`hopper_dkdv` takes it;
    ``lists``: a block mask, as ``(visible-block lists, block_size)``: only the visible key tiles are loaded.
    ``shared``: as :func:`_descriptors` takes it; ``token`` as :func:`hopper_dkdv` takes it (dq then comes in q's
    (B, N, H, d) layout too)."""
    launch = DqLaunch(q, k, causal, scale, cfg, window=window, alibi=slopes2 is not None, dropout=dropout is not None,
                      lists=lists, token=token)
    return launch(q, k, v, do, m2, l2, delta, slopes2=slopes2, dropout=dropout, shared=shared)


class DqLaunch:
    """The part of :func:`hopper_dq` that depends only on the call's signature, worked out once (as
    :class:`DkdvLaunch` for dK/dV). Calling it allocates dQ, makes the descriptors and launches."""

    def __init__(self, q, k, causal: bool, scale: float, cfg: dict | None = None, *, window=None, alibi=False,
                 dropout=False, lists=None, token: bool = False):
        B, H, N_q, d = q.shape
        _check_plain(d, window, alibi, dropout, lists)
        self.token = bool(token)
        cfg = cfg or default_config(d, "dq")
        if lists is not None and not lists_fit(cfg, "dq", lists[1]):
            raise ValueError(f"block_size {lists[1]} does not map onto the dQ tiles "
                             f"{cfg['block_m']} x {cfg['block_n']}")
        list_args, list_meta = _list_args(q, lists)
        self.cfg, self.dq_shape, self.alibi, self.window, self.list_args = cfg, (B, H, N_q, d), alibi, window, list_args
        self.fixed = (N_q, k.shape[2], scale, scale * LOG2E)
        self.mods = None if alibi else _mod_args(q, window, None)
        meta = _meta(d, causal, cfg, window, alibi, dropout,
                     hopper.keep_layout(cfg["block_m"], cfg["block_n"], cfg["num_warps"]))
        cap = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}  # (a tile's cap, as DkdvLaunch takes it)
        self.launch = relaunch.Bound(hopper_bwd_dq_kernel, (hopper.host_cdiv(N_q, cfg["block_m"]), B * H), **meta,
                                     **list_meta, TOKEN_MAJOR=self.token, **cap)

    def __call__(self, q, k, v, do, m2, l2, delta, *, slopes2=None, dropout=None, shared: dict | None = None):
        """dq of this call (``slopes2``, ``dropout`` and ``shared`` as :func:`hopper_dq` takes them)."""
        dq = hopper.empty_output(q, True) if self.token else torch.empty(self.dq_shape, dtype=q.dtype, device=q.device)
        mods = self.mods if not self.alibi else _mod_args(q, self.window, slopes2)
        self.launch(*_descriptors(q, k, v, do, self.cfg, shared=shared, token=self.token), dq, m2.contiguous(),
                    l2.contiguous(), delta,
                    *self.fixed, *mods, *_drop_args(dropout), *self.list_args)
        return dq


def hopper_backward(q, k, v, do, m2, l2, delta, causal: bool, scale: float, *, window=None, slopes2=None,
                    dropout=None, lists=None, token: bool = False):
    """(dq, dk, dv) from the two Gluon kernels at their default tiles, for checked, :func:`supported` inputs
    (``delta`` = rowsum(dO * O), as the teaching preprocess kernel computes it): what
    :func:`flashref.triton.flash_attention`'s backward runs on an H100. Deterministic: each gradient element is
    written by one program. A sliding window (``window``) and ALiBi (``slopes2``), as :func:`_mod_args` takes
    them, change the scores as the teaching kernels do, so either forward's statistics feed this backward; so does
    ``dropout`` = ``(seed, drop_below, keep_scale)``, with the forward's mask. ``lists``: a block mask, as
    ``((visible-block lists, transposed lists), block_size)`` (:func:`flashref.triton.ops.visible_block_lists`).
    ``token``: q, k, v and do are all :func:`flashref.triton.hopper.token_major`, read in place (d of 64 and 128),
    and dq, dk, dv come in their layout."""
    mods = dict(window=window, slopes2=slopes2, dropout=dropout, token=token)
    dkdv_lists = dq_lists = None
    if lists is not None:
        (rows, cols), block_size = lists
        dq_lists, dkdv_lists = (rows, block_size), (cols, block_size)
    shared = {}  # the descriptors both kernels take alike, made once
    dk, dv = hopper_dkdv(q, k, v, do, m2, l2, delta, causal, scale, **mods, lists=dkdv_lists, shared=shared)
    return hopper_dq(q, k, v, do, m2, l2, delta, causal, scale, **mods, lists=dq_lists, shared=shared), dk, dv
