"""The Triton backward kernels of FlashAttention (notebook ``08_triton_backward``).

With S = sm_scale Q K^T, P = softmax(S) and O = P V, the gradients are

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D) with D = rowsum(dO * O),
    dQ = sm_scale dS K,   dK = sm_scale dS^T Q.

P is never stored: each kernel recomputes a tile of it from Q, K and the forward's row statistics,
``P = exp(sm_scale Q K^T - lse)``, computed in base 2 as ``exp2((s - m) - log2(l))`` with the forward's
own max m and sum l (two fp32 numbers per row, O(N)), so large logits lose nothing to the rounding of lse.
Three launches:

- ``flash_bwd_preprocess_kernel``: D = rowsum(dO * O), one fp32 number per query row (O(N) memory);
- ``flash_bwd_dkdv_kernel``: one program per K/V tile accumulates dK and dV over the Q tiles;
- ``flash_bwd_dq_kernel``: one program per Q tile accumulates dQ over the K/V tiles.

Each output element is written by exactly one program, so there are no atomic additions and the result
is bitwise deterministic; the price is computing Q K^T and dO V^T twice (once per kernel): 7 tile products
where 5 would do. With ``ATOMIC_DQ`` the dK/dV kernel also adds its share of dQ = sm_scale dS K into an
fp32 buffer with atomic additions, as FlashAttention-2 does, and the dQ kernel is not launched: 5 products,
but the order of the additions, and so the last bits of dQ, change from run to run.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashref.triton.forward import (_block_elements, _document, _dot, _in_window, _keep, _keep_t,
                                     _listed_range, _listed_start, _load_rows, _modified, _tile_ranges,
                                     _tile_visible)


@triton.jit
def _exponent(qk, qk_scale, m2, l2):
    """The base-2 exponent of P recomputed from the raw q.k tile: (qk * qk_scale - m) - log2(l).

    qk * qk_scale - m is one explicit fused multiply-add, written the same way in the forward kernel. The
    compiler is otherwise free to contract it or not, and was seen on the H100 to do so in some kernels
    and tiles and not others: the product then rounds in one place and not in the other, and with fp32
    logits of 1e3 (|s| ~ 4e3 in base 2) that one rounding moves P by 3e-4, so dV was 1000x less exact
    than plain attention's. With the FMA written out, every kernel rounds the exponent once, the same way.
    """
    return tl.fma(qk, qk_scale, -m2) - l2


@triton.jit(do_not_specialize=["H", "N_q"])
def flash_bwd_preprocess_kernel(O, DO, Delta,
                                stride_ob, stride_oh, stride_om, stride_od,
                                stride_dob, stride_doh, stride_dom, stride_dod,
                                H, N_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] in fp32."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < N_q) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + pid_bh.to(tl.int64) * N_q + offs_m, delta, mask=offs_m < N_q)


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_base, do_base, dq_base, m2_base, l2_base, delta_base,
               stride_qm, stride_qd, stride_dom, stride_dod, stride_dqm, stride_dqd,
               start_m, start_n, N_q, N_k, sm_scale, qk_scale, offs_n, offs_d, offs_e,
               bm_base, stride_bmi, stride_bmj, seed, bh, drop_below, keep_scale,
               win_left, win_right, cap_in, cap_out, slope2,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT: tl.constexpr,
               HAS_BM: tl.constexpr, BM_TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, DROPOUT: tl.constexpr,
               WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, D_SPLIT: tl.constexpr):
    """Add the contribution of the query tile at ``start_m`` to this K/V tile's dK and dV (transposed form:
    rows are keys, columns are queries), and with ATOMIC_DQ this tile's share of the query tile's dQ. A
    block mask finer than the tile is applied element by element; with DROPOUT the forward's keep-mask is
    regenerated for the transposed tile. SOFTCAP / ALIBI recompute the forward's modified score
    (forward._modified), and dS is multiplied by the cap's derivative 1 - tanh^2. With D_SPLIT > 1 the
    program keeps only columns ``offs_e`` of dK and dV: S and dP still need whole rows of Q and dO, and the
    products into dK and dV take those columns of Q and dO."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(q_base, offs_m, offs_d, stride_qm, stride_qd, N_q, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                   MASKED=MASKED)
    do = _load_rows(do_base, offs_m, offs_d, stride_dom, stride_dod, N_q, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                    MASKED=MASKED)
    if D_SPLIT == 1:
        q_e = q
        do_e = do
    else:  # read again (from L2: the rows were just loaded), in the layout of this program's columns
        q_e = _load_rows(q_base, offs_m, offs_e, stride_qm, stride_qd, N_q, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                         MASKED=MASKED)
        do_e = _load_rows(do_base, offs_m, offs_e, stride_dom, stride_dod, N_q, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                          MASKED=MASKED)
    if MASKED:  # l2 = +inf on padded rows makes their P exactly 0
        m2 = tl.load(m2_base + offs_m, mask=offs_m < N_q, other=0.0)
        l2 = tl.load(l2_base + offs_m, mask=offs_m < N_q, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=offs_m < N_q, other=0.0)
    else:
        m2 = tl.load(m2_base + offs_m)
        l2 = tl.load(l2_base + offs_m)
        delta = tl.load(delta_base + offs_m)
    qk_t = _dot(k, tl.trans(q), DOT)
    scale = qk_scale
    if SOFTCAP or ALIBI:
        qk_t, t_t = _modified(qk_t, offs_m, offs_n, qk_scale, cap_in, cap_out, slope2, SOFTCAP, ALIBI, True)
        scale = 1.0
    x_t = _exponent(qk_t, scale, m2[None, :], l2[None, :])
    if MASKED:
        if CAUSAL:  # mask the exponent, not P: masked scores may be huge and exp2 would overflow
            x_t = tl.where(offs_n[:, None] <= offs_m[None, :], x_t, float("-inf"))
        if WINDOW:
            x_t = tl.where(_in_window(offs_m[None, :], offs_n[:, None], win_left, win_right), x_t, float("-inf"))
    if HAS_BM:
        if not BM_TILE:
            x_t = tl.where(tl.trans(_block_elements(bm_base, stride_bmi, stride_bmj, offs_m, offs_n, N_q, N_k,
                                                    BLOCK_SIZE)), x_t, float("-inf"))
    if ATOMIC_DQ:  # key slots past N_k (a ragged last tile) read k = 0, so their exponent is 0 - lse, which
        # overflows when lse is very negative; their dK/dV rows are never stored, but inf * 0 would reach dQ
        x_t = tl.where(offs_n[:, None] < N_k, x_t, float("-inf"))
    p_t = tl.exp2(x_t)
    # dV's product before dP's, as FlashAttention-2 orders them: P's fp16 copy dies before dP is live.
    if DROPOUT:  # P~ = P * keep / (1 - p) carries O (dV is scaled at the end); dP = dP~ * keep / (1 - p)
        keep_t = _keep_t(seed, bh, start_m, start_n, BLOCK_M, BLOCK_N, drop_below)
        dv += _dot(tl.where(keep_t, p_t, 0.0).to(do.dtype), do_e, DOT)
        dp_t = tl.where(keep_t, _dot(v, tl.trans(do), DOT) * keep_scale, 0.0)
    else:
        dv += _dot(p_t.to(do.dtype), do_e, DOT)
        dp_t = _dot(v, tl.trans(do), DOT)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:  # dS with respect to the raw score: times d(c tanh(s / c)) / ds
        ds_t = ds_t * (1.0 - t_t * t_t)
    ds_t = ds_t.to(q.dtype)
    dk += _dot(ds_t, q_e, DOT)
    if ATOMIC_DQ:  # every K/V tile's program adds into the same dQ rows, in whatever order they run
        dq = _dot(tl.trans(ds_t), k, DOT) * sm_scale
        dq_ptrs = dq_base + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
        tl.atomic_add(dq_ptrs, dq, mask=(offs_m[:, None] < N_q) & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, dq_base, m2_base, l2_base, delta_base,
                stride_qm, stride_qd, stride_dom, stride_dod, stride_dqm, stride_dqd,
                start_n, lo, hi, N_q, N_k, sm_scale, qk_scale, offs_n, offs_d, offs_e,
                bm_base, stride_bmi, stride_bmj, list_row, seed, bh, drop_below, keep_scale,
                win_left, win_right, cap_in, cap_out, slope2,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT: tl.constexpr,
                HAS_BM: tl.constexpr, BM_TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, DROPOUT: tl.constexpr,
                LISTED: tl.constexpr, LIST_SIZE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                ALIBI: tl.constexpr, D_SPLIT: tl.constexpr):
    """Add the query tiles with first row in [lo, hi) to this K/V tile's dK and dV; when LISTED only the
    visible ones, read from this key block's list of visible query blocks (``list_row``), or the plain loop
    when all of them are visible (as _fwd_tiles). Otherwise a tile the block mask hides is skipped."""
    EXACT: tl.constexpr = BM_TILE and LIST_SIZE == BLOCK_SIZE  # as in forward._fwd_tiles
    if LISTED:
        it_lo, it_hi, every = _listed_range(list_row, lo, hi, LIST_SIZE, BLOCK_M, EXACT)
        if every:
            for start_m in range(lo, hi, BLOCK_M):
                dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, dq_base, m2_base, l2_base, delta_base, stride_qm,
                                    stride_qd, stride_dom, stride_dod, stride_dqm, stride_dqd, start_m, start_n, N_q,
                                    N_k, sm_scale, qk_scale, offs_n, offs_d, offs_e, bm_base, stride_bmi, stride_bmj,
                                    seed, bh, drop_below, keep_scale, win_left, win_right, cap_in, cap_out, slope2,
                                    HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                    MASKED=MASKED, CAUSAL=CAUSAL, ATOMIC_DQ=ATOMIC_DQ, DOT=DOT, HAS_BM=False,
                                    BM_TILE=EXACT, BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT, WINDOW=WINDOW,
                                    SOFTCAP=SOFTCAP, ALIBI=ALIBI, D_SPLIT=D_SPLIT)
        else:
            for it in range(it_lo, it_hi):
                start_m = _listed_start(list_row, it, LIST_SIZE, BLOCK_M)
                dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, dq_base, m2_base, l2_base, delta_base, stride_qm,
                                    stride_qd, stride_dom, stride_dod, stride_dqm, stride_dqd, start_m, start_n, N_q,
                                    N_k, sm_scale, qk_scale, offs_n, offs_d, offs_e, bm_base, stride_bmi, stride_bmj,
                                    seed, bh, drop_below, keep_scale, win_left, win_right, cap_in, cap_out, slope2,
                                    HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                    MASKED=MASKED, CAUSAL=CAUSAL, ATOMIC_DQ=ATOMIC_DQ, DOT=DOT, HAS_BM=HAS_BM,
                                    BM_TILE=EXACT, BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT, WINDOW=WINDOW,
                                    SOFTCAP=SOFTCAP, ALIBI=ALIBI, D_SPLIT=D_SPLIT)
    else:
        for start_m in range(lo, hi, BLOCK_M):
            visible = True
            if HAS_BM:
                visible = _tile_visible(bm_base, stride_bmi, stride_bmj, start_m, start_n, N_q, N_k, BLOCK_SIZE,
                                        BLOCK_M, BLOCK_N, BM_TILE)
            if visible:
                dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, dq_base, m2_base, l2_base, delta_base, stride_qm,
                                    stride_qd, stride_dom, stride_dod, stride_dqm, stride_dqd, start_m, start_n, N_q,
                                    N_k, sm_scale, qk_scale, offs_n, offs_d, offs_e, bm_base, stride_bmi, stride_bmj,
                                    seed, bh, drop_below, keep_scale, win_left, win_right, cap_in, cap_out, slope2,
                                    HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                    MASKED=MASKED, CAUSAL=CAUSAL, ATOMIC_DQ=ATOMIC_DQ, DOT=DOT, HAS_BM=HAS_BM,
                                    BM_TILE=BM_TILE, BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT, WINDOW=WINDOW,
                                    SOFTCAP=SOFTCAP, ALIBI=ALIBI, D_SPLIT=D_SPLIT)
    return dk, dv


@triton.jit(do_not_specialize=["H", "N_q", "N_k", "TUNE_N", "GROUP", "SPLIT", "seed", "drop_below", "win_left",
                               "win_right"])
def flash_bwd_dkdv_kernel(Q, K, V, DO, DK, DV, DQ, M2, L2, Delta, BM, LISTS,
                          stride_qb, stride_qh, stride_qm, stride_qd,
                          stride_kb, stride_kh, stride_kn, stride_kd,
                          stride_vb, stride_vh, stride_vn, stride_vd,
                          stride_dob, stride_doh, stride_dom, stride_dod,
                          stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                          stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                          stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                          stride_bmb, stride_bmh, stride_bmi, stride_bmj,
                          stride_lb, stride_lh, stride_li,
                          H, N_q, N_k, sm_scale, qk_scale, TUNE_N, GROUP, SPLIT, seed, drop_below, keep_scale,
                          ALIBI_SLOPES, CU_Q, CU_K, stride_ab, stride_ah, win_left, win_right, cap_in, cap_out,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT: tl.constexpr,
                          HAS_BM: tl.constexpr, BLOCK_SIZE: tl.constexpr, LIST_SIZE: tl.constexpr,
                          DROPOUT: tl.constexpr,
                          WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, VARLEN: tl.constexpr,
                          ONE_HEAD: tl.constexpr, D_SPLIT: tl.constexpr):
    """Program (pid_n, pid_bhk) writes dK and dV of keys pid_n*BLOCK_N : +BLOCK_N of K/V head hk. Needs
    BLOCK_N % BLOCK_M == 0. With grouped-query attention (GROUP query heads per K/V head) it walks the
    query rows of every head of its group, so dK and dV are summed over the group in registers, and K and
    V are never repeated in memory. When a group is large and K/V heads few (multi-query attention), SPLIT
    programs share one K/V tile, each taking GROUP / SPLIT of the group's heads and writing its partial sums
    (fp32) to head hk * SPLIT + split of DK and DV, which the caller adds up: more programs than K/V tiles
    to keep the GPU busy. With ATOMIC_DQ it also adds into DQ (fp32, zeroed by the caller); otherwise DQ is
    not touched. LISTS: per key block (of LIST_SIZE, as in the forward kernel), the count and increasing
    indices of the query blocks that see it (the forward's lists, transposed). The score modifications and
    VARLEN as in the forward kernel; key j is seen by queries ``j - win_right <= i <= j + win_left``, and
    only those query tiles are visited. ONE_HEAD: GROUP == SPLIT (each program has one query head).

    D_SPLIT: programs pid_n * D_SPLIT + c share a K/V tile, program c keeping columns c * BLOCK_D / D_SPLIT :
    +BLOCK_D / D_SPLIT of dK and dV. Each recomputes the tile's S and dP (more arithmetic), and in return its
    fp32 accumulators are 1 / D_SPLIT as large, so wide heads (d = 256) can keep 64 or more resident keys in
    registers. Not with ATOMIC_DQ (dQ needs every column of K)."""
    tl.static_assert(D_SPLIT == 1 or not ATOMIC_DQ, "D_SPLIT > 1 needs the deterministic dQ kernel")
    BLOCK_E: tl.constexpr = BLOCK_D // D_SPLIT
    pid_n = tl.program_id(0) // D_SPLIT
    offs_e = (tl.program_id(0) % D_SPLIT) * BLOCK_E + tl.arange(0, BLOCK_E)  # this program's dK, dV columns
    pid_bhk = tl.program_id(1)
    H_kv = H // GROUP
    b = pid_bhk // (H_kv * SPLIT)
    hk = (pid_bhk // SPLIT) % H_kv
    split = pid_bhk % SPLIT
    heads = GROUP // SPLIT
    if ONE_HEAD:  # GROUP == SPLIT, as in multi-head attention: one head a program, so no loop around the tile
        heads = 1  # loops. With a trip count known only at run time, ptxas spilled 100-400 bytes a thread on sm_90.
    start_n = pid_n * BLOCK_N
    doc = b
    N_rows = N_q  # the statistics' row stride
    q_start = 0
    if VARLEN:  # doc is the document; the tensors hold one batch row
        q_start, N_q = _document(CU_Q, doc)
        k_start, N_k = _document(CU_K, doc)
        N_q = tl.where(start_n < N_k, N_q, 0)  # a block past the document's end visits no query
        b = b * 0
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    BM_TILE: tl.constexpr = (BLOCK_SIZE % BLOCK_M == 0) and (BLOCK_SIZE % BLOCK_N == 0)
    LISTED: tl.constexpr = HAS_BM and (LIST_SIZE % BLOCK_M == 0) and (LIST_SIZE % BLOCK_N == 0)
    kv_mask = (offs_n[:, None] < N_k) & (offs_e[None, :] < HEAD_DIM)
    k_base = K + b64 * stride_kb + hk64 * stride_kh
    v_base = V + b64 * stride_vb + hk64 * stride_vh
    out_h = (hk * SPLIT + split).to(tl.int64)  # = hk without a split
    dk_base = DK + b64 * stride_dkb + out_h * stride_dkh
    dv_base = DV + b64 * stride_dvb + out_h * stride_dvh
    if VARLEN:
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn
        dk_base += k_start.to(tl.int64) * stride_dkn
        dv_base += k_start.to(tl.int64) * stride_dvn
    k = _load_rows(k_base, offs_n, offs_d, stride_kn, stride_kd, N_k, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, MASKED=True)
    v = _load_rows(v_base, offs_n, offs_d, stride_vn, stride_vd, N_k, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, MASKED=True)
    dk = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
    # Queries in [full_lo, full_hi) see every key of this tile: no mask. Causal: those below the diagonal
    # tiles. [lo, full_lo) (the diagonal, a window's edge) and [full_hi, hi) (a window's other edge, the
    # ragged last tile) are masked; queries outside [lo, hi) never see this tile and are not visited.
    lo, full_lo, full_hi, hi = _tile_ranges(start_n, N_q, win_right, win_left, BLOCK_N, BLOCK_M,
                                            BOUNDED_BEFORE=CAUSAL or WINDOW, BOUNDED_AFTER=WINDOW)

    for g in range(0, heads):
        h = hk * GROUP + split * heads + g
        h64 = h.to(tl.int64)
        bh = b * H + h
        q_base = Q + b64 * stride_qb + h64 * stride_qh
        do_base = DO + b64 * stride_dob + h64 * stride_doh
        dq_base = DQ + b64 * stride_dqb + h64 * stride_dqh
        if VARLEN:
            q_base += q_start.to(tl.int64) * stride_qm
            do_base += q_start.to(tl.int64) * stride_dom
            dq_base += q_start.to(tl.int64) * stride_dqm
        row0 = bh.to(tl.int64) * N_rows + q_start
        m2_base = M2 + row0
        l2_base = L2 + row0
        delta_base = Delta + row0
        bm_base = BM + b64 * stride_bmb + h64 * stride_bmh
        list_row = LISTS + b64 * stride_lb + h64 * stride_lh + (start_n // LIST_SIZE) * stride_li
        slope2 = 0.0
        if ALIBI:
            slope2 = tl.load(ALIBI_SLOPES + doc * stride_ab + h * stride_ah)

        if CAUSAL or WINDOW:
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, dq_base, m2_base, l2_base, delta_base, stride_qm,
                                 stride_qd, stride_dom, stride_dod, stride_dqm, stride_dqd, start_n, lo, full_lo,
                                 N_q, N_k, sm_scale, qk_scale, offs_n, offs_d, offs_e, bm_base, stride_bmi,
                                 stride_bmj, list_row, seed, bh, drop_below, keep_scale, win_left, win_right, cap_in,
                                 cap_out, slope2, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M,
                                 BLOCK_N=BLOCK_N, MASKED=True, CAUSAL=CAUSAL, ATOMIC_DQ=ATOMIC_DQ, DOT=DOT,
                                 HAS_BM=HAS_BM, BM_TILE=BM_TILE, BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT, LISTED=False,
                                 LIST_SIZE=LIST_SIZE, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI, D_SPLIT=D_SPLIT)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, dq_base, m2_base, l2_base, delta_base, stride_qm,
                             stride_qd, stride_dom, stride_dod, stride_dqm, stride_dqd, start_n, full_lo, full_hi,
                             N_q, N_k, sm_scale, qk_scale, offs_n, offs_d, offs_e, bm_base, stride_bmi, stride_bmj,
                             list_row, seed, bh, drop_below, keep_scale, win_left, win_right, cap_in, cap_out, slope2,
                             HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, MASKED=False,
                             CAUSAL=CAUSAL, ATOMIC_DQ=ATOMIC_DQ, DOT=DOT, HAS_BM=HAS_BM, BM_TILE=BM_TILE,
                             BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT, LISTED=LISTED, LIST_SIZE=LIST_SIZE,
                             WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI, D_SPLIT=D_SPLIT)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, dq_base, m2_base, l2_base, delta_base, stride_qm,
                             stride_qd, stride_dom, stride_dod, stride_dqm, stride_dqd, start_n, full_hi, hi, N_q,
                             N_k, sm_scale, qk_scale, offs_n, offs_d, offs_e, bm_base, stride_bmi, stride_bmj,
                             list_row, seed, bh, drop_below, keep_scale, win_left, win_right, cap_in, cap_out, slope2,
                             HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, MASKED=True,
                             CAUSAL=CAUSAL, ATOMIC_DQ=ATOMIC_DQ, DOT=DOT, HAS_BM=HAS_BM, BM_TILE=BM_TILE,
                             BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT, LISTED=False, LIST_SIZE=LIST_SIZE, WINDOW=WINDOW,
                             SOFTCAP=SOFTCAP, ALIBI=ALIBI, D_SPLIT=D_SPLIT)

    dk = dk * sm_scale
    if DROPOUT:
        dv = dv * keep_scale
    tl.store(dk_base + offs_n[:, None] * stride_dkn + offs_e[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(dv_base + offs_n[:, None] * stride_dvn + offs_e[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _dq_tile(dq, q, do, m2, l2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
             start_m, start_n, N_q, N_k, qk_scale, offs_m, offs_d,
             bm_base, stride_bmi, stride_bmj, seed, bh, drop_below, keep_scale,
             win_left, win_right, cap_in, cap_out, slope2,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr,
             HAS_BM: tl.constexpr, BM_TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, DROPOUT: tl.constexpr,
             WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Add the contribution of the K/V tile at ``start_n`` to the dQ of the Q tile at ``start_m`` (the
    modifications as in _dkdv_tile)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(k_base, offs_n, offs_d, stride_kn, stride_kd, N_k, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                   MASKED=MASKED)
    v = _load_rows(v_base, offs_n, offs_d, stride_vn, stride_vd, N_k, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                   MASKED=MASKED)
    qk = _dot(q, tl.trans(k), DOT)
    scale = qk_scale
    if SOFTCAP or ALIBI:
        qk, t = _modified(qk, offs_m, offs_n, qk_scale, cap_in, cap_out, slope2, SOFTCAP, ALIBI, False)
        scale = 1.0
    x = _exponent(qk, scale, m2[:, None], l2[:, None])
    if MASKED:
        keep = offs_n[None, :] < N_k
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        if WINDOW:
            keep = keep & _in_window(offs_m[:, None], offs_n[None, :], win_left, win_right)
        x = tl.where(keep, x, float("-inf"))
    if HAS_BM:
        if not BM_TILE:
            x = tl.where(_block_elements(bm_base, stride_bmi, stride_bmj, offs_m, offs_n, N_q, N_k,
                                         BLOCK_SIZE), x, float("-inf"))
    p = tl.exp2(x)
    dp = _dot(do, tl.trans(v), DOT)
    if DROPOUT:
        dp = tl.where(_keep(seed, bh, start_m, start_n, offs_m.shape[0], BLOCK_N, drop_below), dp * keep_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq += _dot(ds.to(k.dtype), k, DOT)
    return dq


@triton.jit
def _dq_tiles(dq, q, do, m2, l2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
              start_m, lo, hi, N_q, N_k, qk_scale, offs_m, offs_d,
              bm_base, stride_bmi, stride_bmj, list_row, seed, bh, drop_below, keep_scale,
              win_left, win_right, cap_in, cap_out, slope2,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr,
              HAS_BM: tl.constexpr, BM_TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, DROPOUT: tl.constexpr,
              LISTED: tl.constexpr, LIST_SIZE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
              ALIBI: tl.constexpr):
    """Add the K/V tiles with first key in [lo, hi) to this Q tile's dQ; when LISTED only the visible ones,
    from this query block's list of visible key blocks, or the plain loop when all are visible (as the
    forward's _fwd_tiles)."""
    EXACT: tl.constexpr = BM_TILE and LIST_SIZE == BLOCK_SIZE  # as in forward._fwd_tiles
    if LISTED:
        it_lo, it_hi, every = _listed_range(list_row, lo, hi, LIST_SIZE, BLOCK_N, EXACT)
        if every:
            for start_n in range(lo, hi, BLOCK_N):
                dq = _dq_tile(dq, q, do, m2, l2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                              start_m, start_n, N_q, N_k, qk_scale, offs_m, offs_d, bm_base, stride_bmi, stride_bmj,
                              seed, bh, drop_below, keep_scale, win_left, win_right, cap_in, cap_out, slope2,
                              HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=MASKED, CAUSAL=CAUSAL,
                              DOT=DOT, HAS_BM=False, BM_TILE=EXACT, BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT,
                              WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
        else:
            for it in range(it_lo, it_hi):
                start_n = _listed_start(list_row, it, LIST_SIZE, BLOCK_N)
                dq = _dq_tile(dq, q, do, m2, l2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                              start_m, start_n, N_q, N_k, qk_scale, offs_m, offs_d, bm_base, stride_bmi, stride_bmj,
                              seed, bh, drop_below, keep_scale, win_left, win_right, cap_in, cap_out, slope2,
                              HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=MASKED, CAUSAL=CAUSAL,
                              DOT=DOT, HAS_BM=HAS_BM, BM_TILE=EXACT, BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT,
                              WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    else:
        for start_n in range(lo, hi, BLOCK_N):
            visible = True
            if HAS_BM:
                visible = _tile_visible(bm_base, stride_bmi, stride_bmj, start_m, start_n, N_q, N_k, BLOCK_SIZE,
                                        offs_m.shape[0], BLOCK_N, BM_TILE)
            if visible:
                dq = _dq_tile(dq, q, do, m2, l2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                              start_m, start_n, N_q, N_k, qk_scale, offs_m, offs_d, bm_base, stride_bmi, stride_bmj,
                              seed, bh, drop_below, keep_scale, win_left, win_right, cap_in, cap_out, slope2,
                              HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=MASKED, CAUSAL=CAUSAL,
                              DOT=DOT, HAS_BM=HAS_BM, BM_TILE=BM_TILE, BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT,
                              WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    return dq


@triton.jit(do_not_specialize=["H", "N_q", "N_k", "TUNE_N", "GROUP", "seed", "drop_below", "win_left", "win_right"])
def flash_bwd_dq_kernel(Q, K, V, DO, DQ, M2, L2, Delta, BM, LISTS,
                        stride_qb, stride_qh, stride_qm, stride_qd,
                        stride_kb, stride_kh, stride_kn, stride_kd,
                        stride_vb, stride_vh, stride_vn, stride_vd,
                        stride_dob, stride_doh, stride_dom, stride_dod,
                        stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                        stride_bmb, stride_bmh, stride_bmi, stride_bmj,
                        stride_lb, stride_lh, stride_li,
                        H, N_q, N_k, sm_scale, qk_scale, TUNE_N, GROUP, seed, drop_below, keep_scale,
                        ALIBI_SLOPES, CU_Q, CU_K, stride_ab, stride_ah, win_left, win_right, cap_in, cap_out,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        CAUSAL: tl.constexpr, DOT: tl.constexpr,
                        HAS_BM: tl.constexpr, BLOCK_SIZE: tl.constexpr, LIST_SIZE: tl.constexpr,
                        DROPOUT: tl.constexpr,
                        WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, VARLEN: tl.constexpr):
    """Program (pid_m, pid_bh) writes dQ of queries pid_m*BLOCK_M : +BLOCK_M. Needs BLOCK_M % BLOCK_N == 0.
    LISTS as the forward kernel's (visible key blocks per query block); the score modifications and VARLEN
    as in the forward kernel, and the same key tiles visited."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(ALIBI_SLOPES + b * stride_ab + h * stride_ah)
    N_rows = N_q
    q_start = 0
    if VARLEN:
        q_start, N_q = _document(CU_Q, b)
        k_start, N_k = _document(CU_K, b)
        N_k = tl.where(start_m < N_q, N_k, 0)
        b = b * 0
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    BM_TILE: tl.constexpr = (BLOCK_SIZE % BLOCK_M == 0) and (BLOCK_SIZE % BLOCK_N == 0)
    LISTED: tl.constexpr = HAS_BM and (LIST_SIZE % BLOCK_M == 0) and (LIST_SIZE % BLOCK_N == 0)
    list_row = LISTS + b64 * stride_lb + h64 * stride_lh + (start_m // LIST_SIZE) * stride_li
    q_mask = (offs_m[:, None] < N_q) & (offs_d[None, :] < HEAD_DIM)
    q_base = Q + b64 * stride_qb + h64 * stride_qh
    do_base = DO + b64 * stride_dob + h64 * stride_doh
    dq_base = DQ + b64 * stride_dqb + h64 * stride_dqh
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    if VARLEN:
        q_base += q_start.to(tl.int64) * stride_qm
        do_base += q_start.to(tl.int64) * stride_dom
        dq_base += q_start.to(tl.int64) * stride_dqm
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn
    q = _load_rows(q_base, offs_m, offs_d, stride_qm, stride_qd, N_q, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, MASKED=True)
    do = _load_rows(do_base, offs_m, offs_d, stride_dom, stride_dod, N_q, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                    MASKED=True)
    row = (b * H + h).to(tl.int64) * N_rows + q_start + offs_m
    m2 = tl.load(M2 + row, mask=offs_m < N_q, other=0.0)
    l2 = tl.load(L2 + row, mask=offs_m < N_q, other=0.0)
    delta = tl.load(Delta + row, mask=offs_m < N_q, other=0.0)
    bm_base = BM + b64 * stride_bmb + h64 * stride_bmh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = _tile_ranges(start_m, N_k, win_left, win_right, BLOCK_M, BLOCK_N,
                                            BOUNDED_BEFORE=WINDOW, BOUNDED_AFTER=CAUSAL or WINDOW)
    if WINDOW:
        dq = _dq_tiles(dq, q, do, m2, l2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, start_m,
                       lo, full_lo, N_q, N_k, qk_scale, offs_m, offs_d, bm_base, stride_bmi, stride_bmj, list_row, seed,
                       pid_bh, drop_below, keep_scale, win_left, win_right, cap_in, cap_out, slope2,
                       HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=True, CAUSAL=CAUSAL, DOT=DOT,
                       HAS_BM=HAS_BM, BM_TILE=BM_TILE, BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT, LISTED=False,
                       LIST_SIZE=LIST_SIZE, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    dq = _dq_tiles(dq, q, do, m2, l2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, start_m,
                   full_lo, full_hi, N_q, N_k, qk_scale, offs_m, offs_d, bm_base, stride_bmi, stride_bmj, list_row,
                   seed, pid_bh, drop_below, keep_scale, win_left, win_right, cap_in, cap_out, slope2,
                   HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=False, CAUSAL=CAUSAL, DOT=DOT,
                   HAS_BM=HAS_BM, BM_TILE=BM_TILE, BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT, LISTED=LISTED,
                   LIST_SIZE=LIST_SIZE, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    dq = _dq_tiles(dq, q, do, m2, l2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, start_m,
                   full_hi, hi, N_q, N_k, qk_scale, offs_m, offs_d, bm_base, stride_bmi, stride_bmj, list_row, seed,
                   pid_bh, drop_below, keep_scale, win_left, win_right, cap_in, cap_out, slope2,
                   HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=True, CAUSAL=CAUSAL, DOT=DOT,
                   HAS_BM=HAS_BM, BM_TILE=BM_TILE, BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT, LISTED=False,
                   LIST_SIZE=LIST_SIZE, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    dq = dq * sm_scale
    tl.store(dq_base + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
             mask=q_mask)
