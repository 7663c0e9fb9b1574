"""The Triton forward kernel of FlashAttention (notebook ``07_triton_forward``).

One program computes one tile of O: BLOCK_M query rows of one (batch, head). The Q tile stays in
registers/SRAM while the program walks over K and V in tiles of BLOCK_N rows, keeping the online-softmax
statistics m (running max) and l (running sum) per query row in fp32. O is divided by l once, at the end,
and lse = m + log(l) (natural log) is saved for the backward pass: O(N) extra memory.

Written with plain pointer arithmetic and masks (no block pointers), so the same source runs compiled on
every GPU and in Triton's CPU interpreter. Scores are kept in base 2: ``exp2(x * log2(e))`` is ``exp(x)``
and maps to one hardware instruction, so ``log2(e)`` is folded into the softmax scale.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashref.kernel_tiles import tile_counts  # noqa: F401  (plain Python, importable without triton)

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): ln(x) = log2(x) * LN2


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """a @ b with an fp32 result. DOT = 0: the tensor cores' native precision (fp16/bf16 inputs);
    1: fp32 inputs in full fp32 ("ieee", no TF32); 2: only under the CPU interpreter, every dtype.

    Why the interpreter needs its own mode: the backward pass recomputes S = Q K^T, once as Q K^T (dQ
    kernel, as in the forward) and once transposed, as K Q^T (dK/dV kernel), and P = exp2(S - m - log2 l)
    is only right if each recomputed score is bit for bit the forward's (with logits scaled by 1e3, one
    fp32 ulp of S moves P by 3e-4; plain attention computes S once and never meets this). On a GPU every
    score is the same chain of multiply-adds along d whichever operand comes first. The interpreter hands
    tl.dot to NumPy's BLAS, where the order of those additions depends on the matrix shape and on the
    kernel OpenBLAS picks for the CPU: its Haswell and Zen kernels round Q K^T and (K Q^T)^T differently
    in about a third of the elements. So under the interpreter the tiles are widened to fp64, where the
    products of fp32, fp16 and bf16 numbers are exact and the sum carries 29 more bits than fp32, and the
    result is rounded once to fp32: the same score whatever the shape, orientation or CPU. (It also
    avoids the interpreter's bf16 dot, which in Triton 3.9 multiplies the raw bits.)"""
    if DOT == 1:
        return tl.dot(a, b, input_precision="ieee")
    elif DOT == 2:
        return tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    else:
        return tl.dot(a, b)


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               start_m, lo, hi, N_k, qk_scale,
               offs_m, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr):
    """Fold the K/V tiles [lo, hi) into (acc, l_i, m_i). MASKED tiles check key bounds and, when CAUSAL,
    the diagonal; the others are full tiles that every query row of the block may see, and skip masks."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if MASKED:
            kv_mask = (offs_n[:, None] < N_k) & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        qk = _dot(q, tl.trans(k), DOT)  # raw q.k; the base-2 score is qk * qk_scale (sm_scale * log2(e))
        if MASKED:
            keep = offs_n[None, :] < N_k
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None])
            qk = tl.where(keep, qk, float("-inf"))
        # qk_scale > 0 and rounding is monotone, so max(qk) * qk_scale is exactly the largest rounded
        # score: the max needs no scaled copy of the tile, and only one score tile stays live.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
        # One explicit fused multiply-add, here and in both backward kernels: left to itself the compiler
        # contracts qk * qk_scale - m into an FMA in some kernels and tiles and not in others, and then the
        # backward's recomputed exponent differs from the forward's by a rounding of the score (3e-4 in P
        # for logits of 1e3 in fp32; see _exponent in backward.py).
        p = tl.exp2(tl.fma(qk, qk_scale, -m_new[:, None]))
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc += _dot(p.to(v.dtype), v, DOT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["H", "N_q", "N_k", "TUNE_N"])  # one compile serves every length
def flash_fwd_kernel(Q, K, V, O, LSE, M2, L2,
                     stride_qb, stride_qh, stride_qm, stride_qd,
                     stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd,
                     stride_ob, stride_oh, stride_om, stride_od,
                     H, N_q, N_k, qk_scale, TUNE_N,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, DOT: tl.constexpr):
    """Program (pid_m, pid_bh) writes O[b, h, pid_m*BLOCK_M : +BLOCK_M, :], its lse (natural log), and the
    base-2 row max M2 and log2 of the row sum L2 that the backward pass uses.

    Needs BLOCK_M % BLOCK_N == 0, so every K tile left of the block's first row is fully visible
    (causal) and only the tiles on the diagonal need a mask.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh

    q_mask = (offs_m[:, None] < N_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Phase 1: full tiles, no mask. Causal: keys left of the block's first query row.
    full_end = (N_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        full_end = tl.minimum(full_end, start_m)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               start_m, 0, full_end, N_k, qk_scale, offs_m, offs_d,
                               HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, DOT)
    # Phase 2: the diagonal tiles (causal) and the ragged last tile; tiles above the diagonal never run.
    hi = N_k
    if CAUSAL:
        hi = tl.minimum(N_k, start_m + BLOCK_M)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               start_m, full_end, hi, N_k, qk_scale, offs_m, offs_d,
                               HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, DOT)

    # Every row sees key 0 (top-left causal), so l_i > 0 for real rows; padded rows are never stored.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # back to natural log
    row = pid_bh.to(tl.int64) * N_q + offs_m
    tl.store(LSE + row, lse, mask=offs_m < N_q)
    # For the backward pass: the base-2 max and log2(l) kept apart. Recomputing P as
    # exp2((s - m) - log2(l)) repeats the forward's own rounding of s - m; going through lse would add the
    # rounding of one large number (|lse| ~ 1e4 for logits scaled by 1e3 costs ~1e-3 in P).
    tl.store(M2 + row, m_i, mask=offs_m < N_q)
    tl.store(L2 + row, tl.log2(l_safe), mask=offs_m < N_q)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, acc.to(O.dtype.element_ty),
             mask=q_mask)
