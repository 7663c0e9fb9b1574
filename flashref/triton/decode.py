"""Flash-decoding: attention of a few new queries against a long KV cache, with the keys split across
programs (notebook ``13_beyond_one_gpu_and_decoding``).

Why a second kernel. The forward kernel (notebook ``07_triton_forward``) gives one program to each tile of
BLOCK_M query rows of one (batch, head). When a model generates text it attends with ONE new query per
sequence (a few with speculative decoding or chunked prefill) to a cache of thousands of keys: the forward
launches B * H programs, each walking the whole cache alone. At B = 1 and H = 32 that is 32 programs on a
GPU of 132 SMs: three quarters of the chip, and of its memory bandwidth, sit idle, and decoding is nothing
but reading K and V from HBM.

The fix (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference", 2023): split the keys too.
Program (s, b, kv head) takes slice s of the keys of one batch row and computes, for every query of that
row, a partial output O_s and its log-sum-exp lse_s over those keys only, with the usual online softmax
(running max m, running sum l). A second small kernel merges the slices exactly, as notebook
``02_online_softmax`` merges two partial softmax states (:func:`flashref.online_softmax.merge_outputs`):

    lse = log sum_s exp(lse_s)          O = sum_s exp(lse_s - lse) O_s

No approximation: the same answer as one pass over all keys, up to rounding.

Two more things decoding needs, both in the same kernel:

- grouped-query attention (``H % H_kv == 0``): the GROUP = H / H_kv query heads that share one K/V head, and
  all their N_q queries, are packed into the rows of ONE Q tile, so each K/V tile is read from HBM once per
  group, not once per query head (for Llama-style H = 32, H_kv = 8, four times less traffic);
- a KV cache with a valid length per batch row (``cache_seqlens``), and causal masking aligned
  BOTTOM-RIGHT: query i of N_q sees keys ``j <= L_b - N_q + i``, so the last query sees the whole cache
  (FlashAttention's convention since 2.1; the top-left ``causal`` of :func:`flashref.triton.flash_attention`
  would let query 0 see key 0 only).

:class:`KVCache` holds a preallocated cache and appends to it, as a generation loop does.

Tiles: under Triton's CPU interpreter fixed small tiles (16 keys a tile, at most 32 packed rows). On a GPU
fixed configurations, not autotuned (:func:`gpu_config`): decoding reads K and V once, so what matters is
keeping enough loads in flight (on an H100 or H200 128 keys of d = 128 a tile, 3 pipeline stages; notebook 13
says why 128 rather than 64), and the tiles must fit the GPU's shared memory, which :func:`compile_kernels`
checks for a T4, an A100 and an H100 on a CPU machine (``tests/test_triton_decode.py``).
"""

from __future__ import annotations

import numbers
import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from flashref import validation
from flashref.triton import ops
from flashref.triton.forward import LN2, LOG2E, _dot, _load_rows

INTERPRETED = ops.INTERPRETED
MAX_HEAD_DIM = ops.MAX_HEAD_DIM
DTYPES = ops.DTYPES

# Under the interpreter: 16-key tiles and at most 32 packed query rows a program, so the tests' short caches
# still cross several tiles and splits, and a big GQA group needs several row blocks.
INTERPRETER_BLOCK_N = 16
INTERPRETER_MAX_ROWS = 32
GPU_MAX_ROWS = 64  # more packed rows than this are cut into row blocks (each rereads the K/V slice)
MERGE_SPLITS = 16  # splits merged per step of the merge kernel's loop


# --------------------------------------------------------------------------------------------------
# Kernel 1: one slice of the keys, all the queries of one GQA group
# --------------------------------------------------------------------------------------------------

# K and V come in through pointers, not the tensor-memory accelerator. Tried on an H200 (fp16, 32 query
# heads on 8 K/V heads, d = 128, one query): whole tiles loaded by TMA from host tensor descriptors of contiguous
# caches, the masked last tile by pointers, took from 1.3% more kernel time (B 4 with 4K keys) to 7% less (B 1 with
# 4K keys: 11.2 against 12.1 us; CUDA-graph replay after a reading flush), B 16 with 4K keys 64.4 against 65.1 us,
# within 1% either way from 64K keys on. But Triton 3.6's launcher turns each host descriptor into a tensor map in
# Python at every launch: 9-22 us more host time a call at eleven of twelve points (B 1 with 4K keys: 54 against
# 38 us), so do_bench, which a short call's host time sets, measured 34.4 against 15.9 us there. Reusing each
# cache's tensor map from call to call (the launcher's make_tensordesc_arg memoized) did not remove that cost: 70
# against 73 us of host time, 53.5 against 53.1 us by do_bench. An evict-first L2 hint on the K/V loads (the cache
# is streamed once) changed nothing either (H200, medians of seven do_bench windows in turns with the loads as they
# are and cuDNN): B 16 with 4K / 16K / 64K / 128K keys 76.8 / 255.0 / 957.4 / 1891.4 us against 77.3 / 254.5 / 957.9 /
# 1890.7 (cuDNN 76.1 / 254.2 / 956.7 / 1889.9), B 4 with 16K and B 1 with 64K within 0.05 us.
@triton.jit
def _decode_tile(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, start_n, L, last,
                 qk_scale, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr):
    """Fold the K/V tile at ``start_n`` into the online-softmax state (acc, l, m) of every packed row. A
    MASKED tile hides the keys past the cache length L and, when CAUSAL, the keys after each row's ``last``
    visible one (bottom-right: ``last = L - N_q + i``); the other tiles are seen whole by every row."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(k_base, offs_n, offs_d, stride_kn, stride_kd, L, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, MASKED=MASKED)
    v = _load_rows(v_base, offs_n, offs_d, stride_vn, stride_vd, L, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, MASKED=MASKED)
    s = _dot(q, tl.trans(k), DOT)  # S = Q K^T, raw; the base-2 score is s * qk_scale (sm_scale * log2(e))
    if MASKED:
        if CAUSAL:
            keep = offs_n[None, :] <= last[:, None]  # last <= L - 1, so this also hides keys past the cache
        else:
            keep = (offs_n < L)[None, :]
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # qk_scale > 0: the max of the scaled scores
    if MASKED and CAUSAL:
        # A row may see none of this slice's keys yet (a slice at the cache's end holds keys only the later
        # queries see): its m stays -inf, and the exponents are taken against 0 instead of giving NaN.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
    p = tl.exp2(tl.fma(s, qk_scale, -m_new[:, None]))  # P, one explicit FMA as in forward.py
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["H_kv", "N_q", "GROUP", "num_splits", "N_max"])
def flash_decode_split_kernel(Q, K, V, O_PART, LSE_PART, SEQLENS,
                              stride_qb, stride_qh, stride_qm, stride_qd,
                              stride_kb, stride_kh, stride_kn, stride_kd,
                              stride_vb, stride_vh, stride_vn, stride_vd,
                              stride_pb, stride_ph, stride_ps, stride_pm, stride_pd,
                              stride_lb, stride_lh, stride_ls, stride_lm,
                              H_kv, N_q, GROUP, num_splits, N_max, qk_scale,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr,
                              PDL: tl.constexpr = False, RAGGED: tl.constexpr = True):
    """Program (split, b * H_kv + kv head, row block) writes the partial O (normalized, fp32) and lse
    (natural log, fp32) of its key slice for BLOCK_M packed rows of the group: row r is query ``r % N_q`` of
    query head ``kv_head * GROUP + r // N_q``. The cache of batch row b holds ``L = SEQLENS[b]`` keys (RAGGED;
    otherwise every row holds ``L = N_max``), cut into ``num_splits`` slices of whole BLOCK_N tiles (the last
    slices may be empty when L is short). A row that sees no key of its slice stores O = 0 and lse = -inf,
    which weigh nothing in the merge.

    PDL (sm_90): the merge kernel, launched as this one's programmatic dependent, may start now; it waits for
    this grid's writes before reading them (:func:`flash_decode_merge_kernel`)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    split = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_kv
    hk = pid_bh % H_kv
    if RAGGED:
        L = tl.load(SEQLENS + b)
    else:  # a full cache: L is known here, so the first K/V loads wait for no load of L (a trip to DRAM)
        L = N_max

    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = rows // N_q
    i = rows - g * N_q  # the query of each packed row ...
    h = hk * GROUP + g  # ... and its query head
    real = rows < GROUP * N_q  # padding rows (the Q tile has at least 16 for tl.dot) are never stored
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = (Q + b.to(tl.int64) * stride_qb + h[:, None].to(tl.int64) * stride_qh + i[:, None] * stride_qm
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=real[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # This program's slice of the keys: whole tiles, the same number for every split of this batch row.
    per_split = tl.cdiv(tl.cdiv(L, BLOCK_N), num_splits) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, L)  # hi <= lo: an empty slice, no tile visited
    last = L - 1 + i * 0  # the last key each row sees
    seen_by_all = L  # keys below this are seen by every row
    if CAUSAL:  # bottom-right: query i sees keys j <= L - N_q + i
        last = L - N_q + i
        seen_by_all = L - N_q + 1
    # [lo, full_hi): tiles every row sees whole, no mask; [full_hi, hi): the causal edge and the ragged end.
    full_hi = lo + (tl.maximum(tl.minimum(hi, seen_by_all) - lo, 0) // BLOCK_N) * BLOCK_N
    for start_n in range(lo, full_hi, BLOCK_N):
        acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                     start_n, L, last, qk_scale, offs_d, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                                     BLOCK_N=BLOCK_N, MASKED=False, CAUSAL=CAUSAL, DOT=DOT)
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                     start_n, L, last, qk_scale, offs_d, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                                     BLOCK_N=BLOCK_N, MASKED=True, CAUSAL=CAUSAL, DOT=DOT)

    # O_s = acc / l and lse_s = m + log l of this slice; l = 0 (no key seen) gives O = 0, lse = -inf.
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    part = b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph + split * stride_ps + i * stride_pm
    tl.store(O_PART + part[:, None] + offs_d[None, :] * stride_pd, o,
             mask=real[:, None] & (offs_d[None, :] < HEAD_DIM))
    row = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + split * stride_ls + i * stride_lm
    tl.store(LSE_PART + row, lse, mask=real)


# --------------------------------------------------------------------------------------------------
# Kernel 2: merge the slices (notebook 02's merge of partial softmax states)
# --------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["H", "N_q", "num_splits"])
def flash_decode_merge_kernel(O_PART, LSE_PART, O, LSE,
                              stride_pb, stride_ph, stride_ps, stride_pm, stride_pd,
                              stride_lb, stride_lh, stride_ls, stride_lm,
                              stride_ob, stride_oh, stride_om, stride_od,
                              H, N_q, num_splits,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                              PDL: tl.constexpr = False):
    """Program (b * H + h) * N_q + i merges the ``num_splits`` partial (O_s, lse_s) of query i of head h:
    ``lse = log sum_s exp(lse_s)``, ``O = sum_s exp(lse_s - lse) O_s`` (:func:`flashref.online_softmax.
    merge_outputs`, applied to all slices at once). It reads BLOCK_S slices at a time with a running max, so
    any number of splits works; with one split the weights are exp(0) = 1 and O is copied exactly.

    PDL (sm_90, launched with ``launch_pdl``): the kernel is resident before the split kernel ends and waits here
    for its writes, so its launch overlaps the split kernel's last programs instead of following them."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    i = pid % N_q
    bh = pid // N_q
    b = bh // H
    h = bh % H
    offs_d = tl.arange(0, BLOCK_D)
    o_base = O_PART + b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph + i * stride_pm
    l_base = LSE_PART + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + i * stride_lm

    m = float("-inf")  # the largest lse_s so far
    total = 0.0  # sum of exp(lse_s - m)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # sum of exp(lse_s - m) O_s
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        lse_s = tl.load(l_base + s * stride_ls, mask=s < num_splits, other=float("-inf"))
        o_s = tl.load(o_base + s[:, None] * stride_ps + offs_d[None, :] * stride_pd,
                      mask=(s[:, None] < num_splits) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        m_new = tl.maximum(m, tl.max(lse_s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every slice so far empty: weights 0, not NaN
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse_s - m_safe)
        total = total * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o_s, 0)
        m = m_new
    seen = total > 0.0
    t_safe = tl.where(seen, total, 1.0)
    o = acc / t_safe
    lse = tl.where(seen, tl.where(m == float("-inf"), 0.0, m) + tl.log(t_safe), float("-inf"))
    tl.store(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + i * stride_om + offs_d * stride_od,
             o.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)
    tl.store(LSE + pid, lse)


# --------------------------------------------------------------------------------------------------
# Launch plan: tiles, warps, and how many splits
# --------------------------------------------------------------------------------------------------

# The split kernel's candidate configs (block_n, num_warps, num_stages), best first, for head dims up to 64,
# 128 and 256: about 16 KB a K tile (32 KB at d = 128 where it fits), K and V in 3 stages. On a
# T4 (no asynchronous copies, 64 KB): smaller tiles, 2 stages. Swept at d = 128 where the keys take one split
# (H100, fp16, CUDA graphs, two rounds; B 16 with 4K, 16K and 64K keys, B 4 with 16K on 8 or 32 K/V heads, B 1 with
# 64K): (64, 4, 3) was the fastest or within 0.5% of the fastest of (64, 4, 4), (64, 4, 5), (128, 4, 3),
# (128, 8, 3), (64, 8, 4) and (32, 4, 6) at every shape. On an H200 (4.8 TB/s against the H100's 3.35) a tile
# of 128 keys pays: the same sweep with the split rule below, B 1 / 4 / 16 with 4K to 128K keys on 8 K/V heads
# and B 4 16K, B 1 64K on 32, put (128, 4, 3) at 0.948-1.002x cuDNN's speed (cuDNN's kernel time over
# flashref's; geometric mean 0.987) against 0.950-0.999x (0.967) for (64, 4, 3); it holds one program an SM
# (136 KB of shared memory with 16 query rows, 208 KB with 64: compile_kernels' figures for sm_90; an A100's
# 164 KB takes the first too). Checked again where one split holds the keys (H200, B 16 with 4K, 16K and 64K keys,
# medians of five do_bench windows): (128, 4, 3) was the fastest of nine configs, 0.98-1.00x cuDNN, with
# (128, 4, 2) 0.84-0.90x, (128, 4, 4) and (128, 8, 3) within 1.5% behind, 2, 3 or 4 splits 0.89-0.99x; cuDNN's
# kernel there has the same grid (128 programs of 4 warps, tiles of 16 x 128 x 128, ncu). Kernel against kernel
# under ncu with the clocks left free (1.73-1.81 GHz) and a reading flush before each call (medians of six), B 16
# with 1K / 2K / 4K / 8K / 16K keys: 21.5 / 36.0 / 65.8 / 125.0 / 243.1 us against cuDNN's 20.7 / 35.8 / 65.3 /
# 126.4 / 242.1, within 1 us either way, though cuDNN's kernel executes 11-31% more instructions.
GPU_CONFIGS = {
    "large": {64: [(128, 4, 3), (64, 4, 3), (64, 4, 2), (32, 4, 1)],
              128: [(128, 4, 3), (64, 4, 3), (64, 4, 2), (32, 4, 2), (16, 4, 1)],
              256: [(32, 4, 3), (32, 4, 2), (16, 4, 2), (16, 4, 1)]},
    "t4": {64: [(64, 4, 2), (32, 4, 2), (16, 4, 1)], 128: [(32, 4, 2), (16, 4, 2), (16, 4, 1)],
           256: [(16, 4, 2), (16, 4, 1)]},
}


def gpu_config(head_dim: int, capability: int, elem_bytes: int = 2, block_m: int = 16,
               shared_limit: int | None = None) -> dict:
    """The fixed launch configuration of the split kernel on a GPU of compute ``capability`` (75, 80, 90):
    ``block_n`` keys a tile, ``num_warps``, ``num_stages`` (loads kept in flight) and ``block_m`` packed query
    rows (the one asked for, halved while nothing fits): the first of :data:`GPU_CONFIGS` whose shared memory
    (:func:`flashref.triton.configs.shared_bytes_estimate` of a forward with ``block_m`` resident query rows,
    which matches this kernel's compiled figure) fits ``shared_limit`` (default: that GPU's,
    :data:`flashref.triton.configs.GPUS`). Not autotuned: the kernel streams K and V once, so the choice is
    about bytes in flight, and :func:`compile_kernels` checks the choices fit a T4, an A100 and an H100."""
    from flashref.triton import configs

    block_d = max(16, ops._pow2(head_dim))
    if shared_limit is None:
        shared_limit = max([g["shared_bytes"] for g in configs.GPUS.values() if g["capability"] <= capability]
                           or [configs.GPUS["T4"]["shared_bytes"]])
    pool = GPU_CONFIGS["t4" if capability < 80 else "large"][64 if block_d <= 64 else 128 if block_d <= 128 else 256]
    while True:
        for block_n, warps, stages in pool:
            cfg = configs.TileConfig(block_m, block_n, warps, stages)
            if configs.shared_bytes_estimate("forward", cfg, block_d, elem_bytes, capability) <= shared_limit:
                return dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        if block_m <= 16:  # the smallest: the compiler has the last word (and _launch_split drops stages)
            return dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        block_m //= 2


def split_count(programs: int, tiles: int, sms: int, good: float = 0.95, resident: int = 1) -> int:
    """How many slices to cut the keys into when ``programs`` programs (batch rows x K/V heads x row blocks)
    would each walk ``tiles`` key tiles alone, on a GPU of ``sms`` SMs that each hold ``resident`` of these
    programs at once.

    A wave is ``s * programs`` against ``sms * resident`` slots, and a last wave only partly full leaves slots
    idle for a whole program's time. The wave efficiency of ``s`` splits is ``s * programs / (ceil(s *
    programs / slots) * slots)``. The answer is the fewest splits whose efficiency is at least ``good`` of the
    best one up to two waves (fewer splits: less to merge), never more splits than tiles. On an H100 (132 SMs)
    with 8 K/V heads, one program an SM: B = 1 gives 16 splits (128 programs), B = 4 gives 4, B = 16 gives 1;
    with ``resident=2``, 32, 8 and 2. :func:`flash_decode` counts one program an SM: with the 64-key tile an
    H100's SM had room for two of them at d = 128, but a sweep of fixed split counts
    (``book/data/decode_split_sweep.json``) measured two an SM 2-17% slower than one at B = 1 with one query
    (7-51% with 16), and a decode run with two an SM was 0-4% slower than the run before it with one at B = 4
    and 16 (``book/data/decode_bench.json`` in git's history)."""
    validation.check_positive_int("programs", programs)
    validation.check_positive_int("sms", sms)
    validation.check_positive_int("resident", resident)
    slots = sms * resident
    most = max(1, min(int(tiles), ops._cdiv(2 * slots, programs)))
    efficiency = {s: s * programs / (ops._cdiv(s * programs, slots) * slots) for s in range(1, most + 1)}
    best = max(efficiency.values())
    return min(s for s, e in efficiency.items() if e >= good * best)


#: Key tiles a split walks at the least (when the cache is short): below this a program's fixed costs (its
#: Q tile, the pipeline's first loads, storing its partial) outweigh the keys it streams.
MIN_SPLIT_TILES = 4


def decode_plan(q, k_cache, num_splits=None) -> dict:
    """How :func:`flash_decode` launches for these shapes: the packed rows a program takes (``block_m``, at
    least 16 for tl.dot), the ``row_blocks`` a GQA group is cut into, ``block_n``, ``num_splits`` (given, or
    chosen), and on a GPU ``num_warps`` and ``num_stages``.

    ``num_splits=None`` chooses by :func:`split_count` from the GPU's SM count, one split program an SM, each
    split walking at least :data:`MIN_SPLIT_TILES` key tiles of the longest cache (a split of the shortest rows
    may still be empty: it visits no key tile and stores lse = -inf). Under the interpreter: ``min(4, key
    tiles)``, enough to exercise the merge."""
    B, H, N_q, d = q.shape
    H_kv, N_max = k_cache.shape[1], k_cache.shape[2]
    rows = (H // H_kv) * N_q
    max_rows = INTERPRETER_MAX_ROWS if INTERPRETED else GPU_MAX_ROWS
    plan = dict(block_m=min(max(16, ops._pow2(rows)), max_rows), block_d=max(16, ops._pow2(d)))
    if INTERPRETED:
        plan.update(block_n=INTERPRETER_BLOCK_N)
    else:
        from flashref.triton import configs

        capability, limit = configs.device_capability(q.device), configs.device_shared_limit(q.device)
        if configs.t4_mode():  # FLASHREF_T4_CONFIGS=1: what a T4 would launch, on any GPU
            capability, limit = min(capability, 75), min(limit, configs.GPUS["T4"]["shared_bytes"])
        plan.update(gpu_config(d, capability, q.element_size(), plan["block_m"], limit))
        plan["pdl"] = PDL["on"] and capability >= 90 and HAS_PDL  # (not in T4 mode: a T4 has none)
    plan["row_blocks"] = ops._cdiv(rows, plan["block_m"])
    tiles = ops._cdiv(N_max, plan["block_n"])
    if num_splits is None:
        if INTERPRETED:
            num_splits = min(4, tiles)
        else:
            num_splits = split_count(B * H_kv * plan["row_blocks"], max(1, tiles // MIN_SPLIT_TILES),
                                     ops._sm_count(q.device))
    plan["num_splits"] = int(num_splits)
    return plan


# --------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------

def _check_decode(q, k_cache, v_cache, cache_seqlens, causal, sm_scale, num_splits, return_lse, check_finite):
    """Shapes, dtypes and devices named as the caller named them (q, k_cache, v_cache, cache_seqlens), then
    ops._check's device rules. Returns (scale, seqlens as int32 on q's device; with cache_seqlens=None a stand-in
    the kernel never reads)."""
    named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        validation.check_dense(name, x)
        if x.ndim != 4:
            raise ValueError(f"{name} must have shape {'(B, H, N_q, d)' if name == 'q' else '(B, H_kv, N_max, d)'}, "
                             f"got {x.ndim}-d shape {tuple(x.shape)}")
        if x.numel() == 0:
            raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    B, H, N_q, d = q.shape
    _, H_kv, N_max, d_k = k_cache.shape
    if k_cache.shape[0] != B:
        raise ValueError(f"k_cache must have q's batch size B = {B}, got shape {tuple(k_cache.shape)}")
    if d_k != d:
        raise ValueError(f"k_cache must have q's head dimension d = {d}, got shape {tuple(k_cache.shape)}")
    if H % H_kv:
        raise ValueError(f"k_cache must have a number of heads H_kv that divides q's H = {H} (grouped-query "
                         f"attention), got H_kv = {H_kv}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dimension d = {d} is larger than this implementation supports ({MAX_HEAD_DIM})")
    for name, x in named:
        if str(x.dtype).replace("torch.", "") not in DTYPES:
            raise TypeError(f"{name} must have dtype {' or '.join(DTYPES)}, got {x.dtype}")
    for name, x in named[1:]:
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")
    validation.check_bool("return_lse", return_lse)
    validation.check_bool("check_finite", check_finite)
    _, scale = ops._check(q, k_cache, v_cache, causal, sm_scale, check_finite=False)  # devices, bf16, sm_scale
    if num_splits is not None:
        validation.check_positive_int("num_splits", num_splits)
    for name, x in named[1:]:  # the kernel offsets keys within one (batch, head) in 32 bits
        if (N_max - 1) * abs(x.stride(2)) + (d - 1) * abs(x.stride(3)) >= 2**31:
            raise ValueError(f"{name} is too long for 32-bit offsets within one head: N_max = {N_max} rows of "
                             f"stride {x.stride(2)}")

    if cache_seqlens is None:
        if causal and N_q > N_max:
            raise ValueError(f"causal decoding needs at least N_q = {N_q} keys in the cache (query i sees keys "
                             f"j <= L - N_q + i), but k_cache holds N_max = {N_max}")
        seqlens = ops._stand_ins(q.device)[3]  # never read: the kernel takes N_max as every row's length
    else:
        if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype not in (torch.int32, torch.int64):
            got = type(cache_seqlens).__name__ if not isinstance(cache_seqlens, torch.Tensor) else \
                f"a tensor of dtype {cache_seqlens.dtype}"
            raise TypeError(f"cache_seqlens must be None or an int32 (or int64) torch.Tensor of shape (B,), got {got}")
        validation.check_dense("cache_seqlens", cache_seqlens)
        if tuple(cache_seqlens.shape) != (B,):
            raise ValueError(f"cache_seqlens must have shape (B,) = ({B},), got {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens must be on q's device ({q.device}), got {cache_seqlens.device}")
        seqlens = cache_seqlens.to(torch.int32).contiguous()
        if check_finite:  # reads the lengths on the host (one synchronization); False trusts them
            lowest = N_q if causal else 1
            for b, L in enumerate(cache_seqlens.tolist()):
                if not lowest <= L <= N_max:
                    why = f" (causal: at least N_q = {N_q})" if causal and L < N_q and L >= 1 else ""
                    raise ValueError(f"cache_seqlens[{b}] = {L} is out of range: each length must be in "
                                     f"[{lowest}, N_max = {N_max}]{why}")
    if check_finite:  # last: the check that reads the data; only the valid part of each cache row
        arrays = {"q": q}
        if cache_seqlens is None:
            arrays.update(k_cache=k_cache, v_cache=v_cache)
        else:
            for b, L in enumerate(cache_seqlens.tolist()):
                arrays[f"k_cache[{b}, :, :{L}]"] = k_cache[b, :, :L]
                arrays[f"v_cache[{b}, :, :{L}]"] = v_cache[b, :, :L]
        validation.check_finite(arrays)
    return scale, seqlens


# --------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------

_STAGES_CHOSEN: dict = {}


def _launch_split(grid, args, meta, plan, device):
    """Launch the split kernel; on a GPU with the plan's warps and stages, one stage fewer each time the
    compiler says the shared memory does not suffice (remembered per shape). Returns what Triton's launch
    returns: on a GPU the compiled kernel."""
    if INTERPRETED:
        return flash_decode_split_kernel[grid](*args, **meta)
    key = (device, meta["BLOCK_D"], meta["BLOCK_M"], meta["BLOCK_N"], args[0].dtype)
    stages = [_STAGES_CHOSEN[key]] if key in _STAGES_CHOSEN else list(range(plan["num_stages"], 0, -1))
    for n, s in enumerate(stages):
        try:
            compiled = flash_decode_split_kernel[grid](*args, **meta, num_warps=plan["num_warps"], num_stages=s)
        except OutOfResources:
            if n == len(stages) - 1:
                raise
            continue
        _STAGES_CHOSEN[key] = s
        return compiled


def _split_args(q, k_cache, v_cache, seqlens, scale, plan, direct=False):
    """The split kernel's partial buffers, grid and runtime arguments for one call. ``direct`` (one split
    only): the buffers are the call's outputs themselves, ``o`` in q's dtype (the kernel's store rounds its
    fp32 O to it) and ``lse``, viewed with a split axis of length 1, so no merge has to run."""
    B, H, N_q, d = q.shape
    H_kv = k_cache.shape[1]
    S = plan["num_splits"]
    if direct:
        if S != 1:
            raise ValueError(f"a direct launch writes the outputs of one split, got num_splits={S}")
        o_part = torch.empty((B, H, N_q, d), dtype=q.dtype, device=q.device).unsqueeze(2)
        lse_part = torch.empty((B, H, N_q), dtype=torch.float32, device=q.device).unsqueeze(2)
    else:
        o_part = torch.empty((B, H, S, N_q, d), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, H, S, N_q), dtype=torch.float32, device=q.device)
    args = (q, k_cache, v_cache, o_part, lse_part, seqlens, *q.stride(), *k_cache.stride(), *v_cache.stride(),
            *o_part.stride(), *lse_part.stride(), H_kv, N_q, H // H_kv, S, k_cache.shape[2], scale * LOG2E)
    return o_part, lse_part, (S, B * H_kv, plan["row_blocks"]), args


def _merge_args(o_part, lse_part, dtype):
    B, H, S, N_q, d = o_part.shape
    o = torch.empty((B, H, N_q, d), dtype=dtype, device=o_part.device)
    lse = torch.empty((B, H, N_q), dtype=torch.float32, device=o_part.device)
    args = (o_part, lse_part, o, lse, *o_part.stride(), *lse_part.stride(), *o.stride(), H, N_q, S)
    return o, lse, (B * H * N_q,), args


def _split_meta(q, causal, plan, ragged=True):
    """The split kernel's constexprs. ``ragged``: each batch row's length is read from ``cache_seqlens``; False
    (``cache_seqlens=None``): every row holds all N_max keys, which the kernel then takes from its arguments."""
    return dict(HEAD_DIM=q.shape[3], BLOCK_D=plan["block_d"], BLOCK_M=plan["block_m"], BLOCK_N=plan["block_n"],
                CAUSAL=causal, DOT=ops._dot_mode(q.dtype), PDL=plan.get("pdl", False), RAGGED=ragged)


def _merge_meta(d, block_d, num_splits, pdl=False):
    return dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=min(MERGE_SPLITS, max(2, ops._pow2(num_splits))), PDL=pdl)


#: Programmatic dependent launch of the merge kernel where the GPU has it (sm_90); a switch for measuring it.
#: The second launch stays: a split kernel whose last program of each group merged the group's partials itself
#: (counted in by an acquire-release atomic; one launch; commit 64722dc, removed since) was never faster on an
#: H200 (``book/data/decode_merge_bench.json``, 32 query heads on 8 K/V heads, d = 128): one token at B = 1 took
#: 19.1 us against 16.8 at 4K keys and 35.5 against 34.0 at 16K, within 2% from B = 4 or 64K keys on. One program
#: merging its group row after row costs more than a launch that PDL already overlaps with the split kernel's end.
#: PDL itself, measured with the one-warp merge (H200, same shapes, medians of five): on against off, B 1
#: with 4K keys 16.4 against 18.3 us by do_bench (12.9 against 14.2 us of kernel time after a reading flush), 16K
#: 32.3 against 33.9, 64K 78.9 against 80.7; B 4 with 4K 31.2 against 33.0, 16K 77.8 against 79.7: on was the
#: faster at all six points, by do_bench and by kernel time. The split kernel itself is launched plainly: as a
#: programmatic dependent of the kernel before it, waiting (``gdc_wait``) before its first read, it was no faster (H200,
#: medians of five, do_bench / graph replay after a reading flush, against a plain launch in the same run): B 16 with
#: 4K keys 76.4 / 63.4 us against 75.9 / 64.0, 16K 249.9 / 236.4 against 249.4 / 237.0, 64K 935.9 / 925.5 against
#: 935.6 / 923.9; at B 1 with 4K to 64K keys and B 4 with 4K and 16K, within 0.6 us either way.
PDL = {"on": True}
#: Whether this Triton has the griddepcontrol builtins (``tl.extra.cuda.gdc_wait``; Triton 3.3 and newer).
HAS_PDL = hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")


def _split_forward(q, k_cache, v_cache, seqlens, causal, scale, plan, compiled=None, direct=False, ragged=True):
    """Kernel 1 alone: the partial outputs ``(B, H, num_splits, N_q, d)`` and their lse ``(B, H, num_splits,
    N_q)``, both fp32 (what the merge reads; the tests merge them with notebook 02's function too). A dict
    ``compiled`` receives the compiled kernel (on a GPU). ``direct`` (one split): the final ``o`` ``(B, H, N_q,
    d)`` in q's dtype and ``lse`` ``(B, H, N_q)`` instead (see :func:`_split_args`). ``ragged=False``: every
    row's length is N_max (``seqlens`` is then not read, see :func:`_split_meta`)."""
    o_part, lse_part, grid, args = _split_args(q, k_cache, v_cache, seqlens, scale, plan, direct)
    kernel = _launch_split(grid, args, _split_meta(q, causal, plan, ragged), plan, q.device)
    if compiled is not None:
        compiled["split"] = kernel
    return (o_part.squeeze(2), lse_part.squeeze(2)) if direct else (o_part, lse_part)


#: Warps of a merge program. One: a program's slices (up to 16) and d columns fit one warp's registers, and its sums
#: over the slices then stay in each thread, with no trip through shared memory. The whole call's kernel time from
#: CUDA-graph replay after a reading flush (H200, fp16, 32 query heads on 8 K/V heads, one query, medians of
#: five), one / two / four warps, and cuDNN: d = 128, B 1 with 16K keys 23.0 / 23.5 / 24.6 us (23.9); B 4 with
#: 4K 22.1 / 23.5 / 24.1 (23.2); at B 1 with 4K, 64K and 128K keys and B 4 with 16K and 64K one warp was the fastest
#: or tied, 0.3-1.9 us faster than four. d = 64 (two warps before) and 256 (four), B 1 with 16K keys and B 4 with 4K:
#: one warp 0.5-0.9 us faster than before.
MERGE_WARPS = 1


def _merge(o_part, lse_part, dtype, block_d, compiled=None, pdl=False):
    o, lse, grid, args = _merge_args(o_part, lse_part, dtype)
    extra = {} if INTERPRETED else {"num_warps": MERGE_WARPS, "launch_pdl": pdl}
    kernel = flash_decode_merge_kernel[grid](*args, **_merge_meta(o_part.shape[4], block_d, o_part.shape[2], pdl),
                                             **extra)
    if compiled is not None:
        compiled["merge"] = kernel
    return o, lse


# --------------------------------------------------------------------------------------------------
# The launch cache: decoding is a loop of identical tiny calls
# --------------------------------------------------------------------------------------------------

# At B = 1 and a 4K cache the two kernels run for about 12 microseconds on an H100, while checking the inputs,
# planning and two launches through Triton's dispatcher (which works out each argument's specialization and
# looks the compiled kernel up) take hundreds of microseconds of Python: decoding one token would be bound by
# the CPU. A generation loop calls with the same shapes, strides and dtypes every step, so everything but the
# data is worked out once per such signature and the next calls go straight to the compiled kernels.

_LAUNCHES: dict = {}
_MAX_LAUNCHES = 512  # signatures kept (a loop over growing dense caches makes a new one per length)
_fast_path = {"on": True}  # switched off for good if this Triton's compiled kernels refuse the call


def _signature(q, k_cache, v_cache, cache_seqlens, causal, sm_scale, num_splits, return_lse):
    """Everything the checks, the plan and Triton's specialization of the kernels depend on, except the data:
    for each tensor its shape, strides, dtype, device and whether its address is 16-byte aligned (Triton
    compiles a faster kernel when it is); the options with their types (``True`` and ``1`` hash alike but
    are not the same answer to the checks). None where an argument is not what the fast path can key on."""
    tensors = (q, k_cache, v_cache) if cache_seqlens is None else (q, k_cache, v_cache, cache_seqlens)
    try:
        layout = tuple((x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0) for x in tensors)
        key = (layout, cache_seqlens is None, type(causal), causal, type(sm_scale), sm_scale, type(num_splits),
               num_splits, type(return_lse), return_lse)
        hash(key)
    except (AttributeError, TypeError, RuntimeError):  # not a tensor; unhashable; no address (a sparse tensor)
        return None
    return key


def _round_up(n: int, m: int = 64) -> int:
    return -(-n // m) * m


class _Launch:
    """The kernels of one signature (the split kernel, and the merge unless one split wrote the outputs
    directly) as the first call (checked in full) launched them: their grids, tile sizes and scale, every
    argument that the signature fixes (strides, sizes, constexprs), and on a GPU the compiled kernels
    themselves. Calling it launches them again on new data of that signature.

    A call allocates the output ``o``, and where it merges one float32 workspace that holds the partial O, the
    partial lse and (unless returned) lse, each part starting on a 256-byte boundary (the kernels were
    compiled for 16-byte aligned pointers). On a GPU the kernels get the parts as plain addresses: a
    caching-allocator call is the dearest step of a fast call (7-8 us of host time each, measured on the
    H100 machine), and an address skips the launcher's per-pointer driver query. The workspace is freed
    when the call returns; the stream orders the next use of its memory after these kernels, as for any
    temporary tensor."""

    def __init__(self, q, k_cache, v_cache, causal, scale, plan, compiled, ragged, seqlens):
        self.scale, self.plan, self.direct = scale, plan, plan["num_splits"] == 1
        self.dtype, self.device = q.dtype, q.device
        B, H, N_q, d = q.shape
        S = plan["num_splits"]
        self.o_shape, self.lse_shape = (B, H, N_q, d), (B, H, N_q)
        # the workspace: O parts (B, H, S, N_q, d), lse parts (B, H, S, N_q), lse (B, H, N_q), in float32 elements
        self.lse_part_at = _round_up(B * H * S * N_q * d)
        self.lse_at = self.lse_part_at + _round_up(B * H * S * N_q)
        self.workspace = self.lse_at + _round_up(B * H * N_q)
        o_part, lse_part, grid, args = _split_args(q, k_cache, v_cache, seqlens, scale, plan, self.direct)
        self.split_tail = args[6:]  # strides, sizes and the scale: fixed by the signature
        self.grid = (*grid, 1, 1)[:3]  # a compiled kernel's launcher reads all three grid dimensions
        if not self.direct:
            _, _, merge_grid, merge_args = _merge_args(o_part, lse_part, q.dtype)
            self.merge_tail, self.merge_grid = merge_args[4:], (*merge_grid, 1, 1)[:3]
        split_meta = _split_meta(q, causal, plan, ragged)
        merge_meta = _merge_meta(d, plan["block_d"], S, plan.get("pdl", False))
        if INTERPRETED:  # the interpreter compiles nothing: launch through it again, with the same constexprs
            self.split = lambda args: flash_decode_split_kernel[self.grid](*args, **split_meta)
            self.merge = lambda args: flash_decode_merge_kernel[self.merge_grid](*args, **merge_meta)
        else:
            split_meta, merge_meta = tuple(split_meta.values()), tuple(merge_meta.values())
            split = compiled["split"][self.grid]  # the runners, bound to their grids once
            self.split = lambda args: split(*args, *split_meta)
            if not self.direct:
                merge = compiled["merge"][self.merge_grid]
                self.merge = lambda args: merge(*args, *merge_meta)
        self.seqlens = seqlens  # cache_seqlens=None: the stand-in the kernel never reads; else None

    def parts(self, work):
        """The workspace's O parts, lse parts and lse: views of ``work`` under the interpreter (which reads
        tensors), their addresses on a GPU."""
        B, H, N_q, d = self.o_shape
        S = self.plan["num_splits"]
        if INTERPRETED:
            return (work[:B * H * S * N_q * d].view(B, H, S, N_q, d),
                    work[self.lse_part_at:self.lse_part_at + B * H * S * N_q].view(B, H, S, N_q),
                    work[self.lse_at:self.lse_at + B * H * N_q].view(B, H, N_q))
        base = work.data_ptr()
        return base, base + 4 * self.lse_part_at, base + 4 * self.lse_at

    def __call__(self, q, k_cache, v_cache, cache_seqlens, return_lse):
        seqlens = self.seqlens if cache_seqlens is None else cache_seqlens.to(torch.int32).contiguous()
        o = torch.empty(self.o_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device) if return_lse else None
        if self.direct:  # the split kernel writes o and lse (its own, if not returned) with a split axis of 1
            lse_out = lse if lse is not None else torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
            o_part, lse_part = (o.unsqueeze(2), lse_out.unsqueeze(2)) if INTERPRETED else (o, lse_out)
            self.split(_addresses(q, k_cache, v_cache, o_part, lse_part, seqlens) + self.split_tail)
        else:
            work = torch.empty(self.workspace, dtype=torch.float32, device=self.device)
            o_part, lse_part, own_lse = self.parts(work)
            self.split(_addresses(q, k_cache, v_cache, o_part, lse_part, seqlens) + self.split_tail)
            self.merge(_addresses(o_part, lse_part, o, own_lse if lse is None else lse) + self.merge_tail)
        return (o, lse) if return_lse else o


def _addresses(*tensors) -> tuple:
    """The kernels' pointer arguments: on a GPU each tensor's address (an int passes through as one), under
    the interpreter the tensors themselves."""
    if INTERPRETED:
        return tensors
    return tuple(t if isinstance(t, int) else t.data_ptr() for t in tensors)


def _fast(key, q, k_cache, v_cache, cache_seqlens, return_lse):
    """The cached launch of ``key``'s signature, or None (not seen yet, or this Triton refused it once)."""
    launch = _LAUNCHES.get(key) if key is not None and _fast_path["on"] else None
    if launch is None:
        return None
    try:
        return launch(q, k_cache, v_cache, cache_seqlens, return_lse)
    except TypeError:  # a Triton whose compiled kernels take other arguments: refused before launching
        _fast_path["on"] = False
        return None


def flash_decode(q, k_cache, v_cache, cache_seqlens=None, *, sm_scale=None, causal=False, num_splits=None,
                 return_lse=False, check_finite=True):
    """Attention of a few queries against a KV cache, split over the keys (flash-decoding); no autograd.

    ``q``: ``(B, H, N_q, d)`` (N_q = 1 for plain decoding, a few for speculative decoding or chunked
    prefill; any N_q >= 1 works). ``k_cache``, ``v_cache``: ``(B, H_kv, N_max, d)`` with ``H % H_kv == 0``:
    query head h reads K/V head ``h // (H // H_kv)`` (``enable_gqa=True``'s convention), float16, bfloat16
    (compute capability 8.0+) or float32 (computed in full fp32, no TF32), any strides, ``d <= 256``.
    ``cache_seqlens``: int32 (or int64) tensor ``(B,)`` on q's device, the valid length L_b of each batch
    row's cache (keys ``0 .. L_b - 1``; what lies after is never read); None: all N_max.

    ``causal=True`` is aligned BOTTOM-RIGHT: query i sees keys ``j <= L_b - N_q + i`` (the new queries are
    the last N_q positions of the sequence; FlashAttention's convention since 2.1), which needs
    ``L_b >= N_q``. ``causal=False``: every query sees all L_b keys. ``sm_scale`` defaults to ``1/sqrt(d)``.

    ``num_splits``: how many slices the keys of each batch row are cut into (one program per slice, K/V
    head and row block, then a merge); None chooses from the GPU's SM count (:func:`decode_plan`); 1 is the
    unsplit kernel, which writes ``o`` and ``lse`` itself (no merge runs). Returns ``o`` like q, and with
    ``return_lse`` also ``lse`` ``(B, H, N_q)``, fp32, natural log. ``check_finite`` (default True): refuse NaN
    or inf in q and in the valid part of the caches, and read ``cache_seqlens`` on the host to check each is in
    ``[1, N_max]`` (``[N_q, N_max]`` when causal); False skips both (no synchronization: what a generation loop,
    and the benchmark, pass), and then a call whose shapes, strides and dtypes were already checked once goes
    straight to the compiled kernels (the launch cache above says why).
    Notebook ``13_beyond_one_gpu_and_decoding``.
    """
    key = None
    if check_finite is False and _fast_path["on"]:
        key = _signature(q, k_cache, v_cache, cache_seqlens, causal, sm_scale, num_splits, return_lse)
        out = _fast(key, q, k_cache, v_cache, cache_seqlens, return_lse)
        if out is not None:
            return out
    scale, seqlens = _check_decode(q, k_cache, v_cache, cache_seqlens, causal, sm_scale, num_splits, return_lse,
                                   check_finite)
    plan = decode_plan(q, k_cache, num_splits)
    compiled = {}
    ragged = cache_seqlens is not None  # else the kernel takes N_max as every row's length, reading none
    with torch.no_grad():
        if plan["num_splits"] == 1:  # one split holds every key: it writes O and lse itself, no merge
            o, lse = _split_forward(q, k_cache, v_cache, seqlens, causal, scale, plan, compiled, direct=True,
                                    ragged=ragged)
        else:
            o_part, lse_part = _split_forward(q, k_cache, v_cache, seqlens, causal, scale, plan, compiled,
                                              ragged=ragged)
            o, lse = _merge(o_part, lse_part, q.dtype, plan["block_d"], compiled, plan.get("pdl", False))
    if key is not None and (INTERPRETED or None not in compiled.values()):
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.clear()
        _LAUNCHES[key] = _Launch(q, k_cache, v_cache, causal, scale, plan, compiled, ragged,
                                 None if ragged else seqlens)
    return (o, lse) if return_lse else o


# --------------------------------------------------------------------------------------------------
# A KV cache for generation loops
# --------------------------------------------------------------------------------------------------

class KVCache:
    """A preallocated KV cache: ``k_cache`` and ``v_cache`` ``(B, H_kv, max_len, d)`` (zeros), and the valid
    length of each batch row, ``seqlens`` (int32 ``(B,)`` on the device; ``lengths``, the same on the host).
    A generation loop appends the new tokens' keys and values and attends with their queries:

        cache = KVCache(B, H_kv, max_len, d, dtype=torch.float16, device="cuda")
        cache.append(k_prompt, v_prompt)           # prefill: (B, H_kv, n, d)
        o = cache.attend(q_prompt)                 # causal, bottom-right: the prompt's own attention
        cache.append(k_new, v_new)                 # then one token at a time
        o = cache.attend(q_new)                    # (B, H, 1, d) against everything so far

    The buffers are never reallocated: appending writes after each row's current length, and attending
    passes the valid lengths to :func:`flash_decode`, which never reads past them. Notebook
    ``13_beyond_one_gpu_and_decoding``.
    """

    def __init__(self, batch, heads_kv, max_len, head_dim, dtype=torch.float16, device=None):
        for name, n in (("batch", batch), ("heads_kv", heads_kv), ("max_len", max_len), ("head_dim", head_dim)):
            validation.check_positive_int(name, n)
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim = {head_dim} is larger than the kernels support ({MAX_HEAD_DIM})")
        if not isinstance(dtype, torch.dtype) or str(dtype).replace("torch.", "") not in DTYPES:
            raise TypeError(f"dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype!r}")
        device = ops.check_device(device)
        shape = (int(batch), int(heads_kv), int(max_len), int(head_dim))
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * int(batch)  # on the host: the checks never read a length back from the GPU
        self.seqlens = torch.zeros(int(batch), dtype=torch.int32, device=device)

    @property
    def max_len(self) -> int:
        return self.k_cache.shape[2]

    @property
    def k(self):
        """The filled part of the keys, ``(B, H_kv, max(lengths), d)`` (a view; shorter rows end earlier)."""
        return self.k_cache[:, :, :max(self.lengths)]

    @property
    def v(self):
        """The filled part of the values, as :attr:`k`."""
        return self.v_cache[:, :, :max(self.lengths)]

    def reset(self) -> None:
        """Forget every token (the buffers are kept and overwritten by later appends)."""
        self.lengths = [0] * len(self.lengths)
        self.seqlens.zero_()

    def append(self, k, v, lengths=None, *, check_finite=True) -> None:
        """Write ``k``, ``v`` ``(B, H_kv, n, d)`` after each row's current length. ``lengths`` (a list of B
        ints, each in [0, n]; default all n): how many of the n new tokens of each row are real, for a batch
        of prompts of different lengths padded to n. Too many tokens for ``max_len`` is a ValueError.
        ``check_finite`` (default True) refuses NaN or inf in k and v, which reads them back (a wait for the
        GPU); a generation loop passes False, and then appending never waits."""
        B, H_kv, _, d = self.k_cache.shape
        for name, x in (("k", k), ("v", v)):
            validation.check_tensor(name, x)
            if x.ndim != 4 or x.shape[0] != B or x.shape[1] != H_kv or x.shape[3] != d:
                raise ValueError(f"{name} must have shape (B, H_kv, n, d) = ({B}, {H_kv}, n, {d}), "
                                 f"got {tuple(x.shape)}")
            if x.dtype != self.k_cache.dtype or x.device != self.k_cache.device:
                raise TypeError(f"{name} must have the cache's dtype {self.k_cache.dtype} and device "
                                f"{self.k_cache.device}, got {x.dtype} on {x.device}")
        if tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
        n = k.shape[2]
        if lengths is None:
            lengths = [n] * B
        elif (not isinstance(lengths, (list, tuple)) or len(lengths) != B
              or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 0 <= x <= n for x in lengths)):
            raise ValueError(f"lengths must be None or a list of B = {B} integers in [0, n = {n}], got {lengths!r}")
        for b, (L, m) in enumerate(zip(self.lengths, lengths)):
            if L + m > self.max_len:
                raise ValueError(f"k: appending {m} tokens to row {b}, which holds {L}, would overflow max_len = "
                                 f"{self.max_len}")
        validation.check_bool("check_finite", check_finite)
        if check_finite:
            validation.check_finite({"k": k, "v": v})
        if len(set(self.lengths)) == 1 and len(set(lengths)) == 1:  # all rows alike: one copy each
            L, m = self.lengths[0], lengths[0]
            self.k_cache[:, :, L:L + m] = k[:, :, :m]
            self.v_cache[:, :, L:L + m] = v[:, :, :m]
            self.seqlens += m  # on the device: no copy from the host
            self.lengths = [L + int(m)] * B
        else:
            for b, (L, m) in enumerate(zip(self.lengths, lengths)):
                self.k_cache[b, :, L:L + m] = k[b, :, :m]
                self.v_cache[b, :, L:L + m] = v[b, :, :m]
            self.lengths = [L + int(m) for L, m in zip(self.lengths, lengths)]
            self.seqlens.copy_(torch.tensor(self.lengths, dtype=torch.int32))

    def attend(self, q, causal=True, sm_scale=None, *, num_splits=None, return_lse=False, check_finite=True):
        """:func:`flash_decode` of ``q`` ``(B, H, N_q, d)`` against the cache; ``causal`` (default True) is
        bottom-right: the N_q queries are the last N_q tokens appended, query i sees the keys up to its own
        position. The lengths are checked on the host (no synchronization); ``check_finite`` (default True)
        refuses NaN or inf in q, which reads q back (a generation loop passes False); the cached values were
        checked when appended. The whole buffers go to the kernels with the lengths, so every step of a loop
        has the same shapes and reuses :func:`flash_decode`'s launch cache."""
        if isinstance(q, torch.Tensor) and q.ndim == 4:  # named against the cache (flash_decode would name k_cache)
            B, H_kv, _, d = self.k_cache.shape
            cache = f"(the cache holds (B, H_kv, max_len, d) = {tuple(self.k_cache.shape)})"
            if q.shape[0] != B:
                raise ValueError(f"q must have the cache's batch size B = {B} {cache}, got q.shape {tuple(q.shape)}")
            if q.shape[3] != d:
                raise ValueError(f"q must have the cache's head dimension d = {d} {cache}, got q.shape "
                                 f"{tuple(q.shape)}")
            if q.shape[1] % H_kv:
                raise ValueError(f"q must have a number of heads H that the cache's H_kv = {H_kv} divides "
                                 f"(grouped-query attention) {cache}, got q.shape {tuple(q.shape)}")
            if q.dtype != self.k_cache.dtype:
                raise TypeError(f"q must have the cache's dtype {self.k_cache.dtype}, got {q.dtype}")
            if q.device != self.k_cache.device:
                raise ValueError(f"q must be on the cache's device {self.k_cache.device}, got {q.device}")
        lowest = q.shape[2] if causal and isinstance(q, torch.Tensor) and q.ndim == 4 else 1
        for b, L in enumerate(self.lengths):
            if L < lowest:
                raise ValueError(f"q: row {b} of the cache holds {L} tokens, fewer than the {lowest} "
                                 f"{'queries (causal)' if causal else 'needed'}: append first")
        validation.check_bool("check_finite", check_finite)
        if check_finite and isinstance(q, torch.Tensor):
            validation.check_finite({"q": q})
        return flash_decode(q, self.k_cache, self.v_cache, self.seqlens, sm_scale=sm_scale, causal=causal,
                            num_splits=num_splits, return_lse=return_lse, check_finite=False)


# --------------------------------------------------------------------------------------------------
# Compiling for GPUs we do not have (the compile test)
# --------------------------------------------------------------------------------------------------

_TY = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def compile_kernels(capability: int, head_dim: int = 128, dtype: str = "float16", causal: bool = True,
                    group: int = 4, n_q: int = 1) -> dict:
    """Compile both kernels for a GPU of compute ``capability`` (75, 80, 90) on any machine, as a launch on
    contiguous tensors with :func:`gpu_config` would; returns ``{"split": compiled, "merge": compiled}``
    (``.metadata.shared``: shared memory in bytes). Needs the kernels defined without the interpreter: run
    with ``FLASHREF_TRITON_COMPILE_ONLY=1`` and ``TRITON_INTERPRET`` unset (see
    :mod:`flashref.triton.compile_check`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashref.triton.forward import DOT_IEEE, DOT_NATIVE

    if os.environ.get("TRITON_INTERPRET", "") == "1":
        raise RuntimeError("kernels defined under TRITON_INTERPRET=1 cannot be compiled: run with "
                           "FLASHREF_TRITON_COMPILE_ONLY=1 and TRITON_INTERPRET unset")
    block_d = max(16, ops._pow2(head_dim))
    cfg = gpu_config(head_dim, capability, 4 if dtype == "float32" else 2,
                     min(max(16, ops._pow2(group * n_q)), GPU_MAX_ROWS))
    block_m = cfg["block_m"]
    ptr = f"*{_TY[dtype]}"
    # Contiguous tensors of a typical call (meta tensors: shapes and strides only), for the strides' values.
    B, H_kv, N_max, S = 2, 8, 4096, 8
    q = torch.empty((B, H_kv * group, n_q, head_dim), device="meta")
    kv = torch.empty((B, H_kv, N_max, head_dim), device="meta")
    o_part = torch.empty((B, H_kv * group, S, n_q, head_dim), device="meta")
    lse_part = torch.empty((B, H_kv * group, S, n_q), device="meta")
    split_strides = [*q.stride(), *kv.stride(), *kv.stride(), *o_part.stride(), *lse_part.stride()]
    merge_strides = [*o_part.stride(), *lse_part.stride(), *q.stride()]
    target = GPUTarget("cuda", capability, 32)
    out = {}
    for name, fn, types, strides, constexprs, options in (
        ("split", flash_decode_split_kernel, [ptr] * 3 + ["*fp32", "*fp32", "*i32"] + ["i32"] * 26 + ["fp32"],
         split_strides,
         dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=cfg["block_n"], CAUSAL=causal,
              DOT=(DOT_IEEE if dtype == "float32" else DOT_NATIVE).value, PDL=capability >= 90 and HAS_PDL,
              RAGGED=True),  # KVCache's kernel; a full cache's (False) differs only in where L comes from
         dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])),
        ("merge", flash_decode_merge_kernel, ["*fp32", "*fp32", ptr, "*fp32"] + ["i32"] * 16, merge_strides,
         dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=MERGE_SPLITS, PDL=capability >= 90 and HAS_PDL),
         dict(num_warps=MERGE_WARPS, launch_pdl=capability >= 90 and HAS_PDL)),
    ):
        runtime = [n for n in fn.arg_names if n not in constexprs]
        if len(runtime) != len(types):
            raise AssertionError(f"{name}: {len(runtime)} runtime arguments, signature has {len(types)}")
        signature = dict(zip(runtime, types))
        values = dict(zip([n for n in runtime if n.startswith("stride_")], strides))
        # Specialize as a launch does: an integer equal to 1 becomes a constant, pointers and integers
        # divisible by 16 are marked so (compile_check._launch_specialization says why it matters); the
        # do_not_specialize sizes get neither.
        attrs = {}
        for n in runtime:
            if signature[n].startswith("*") or (n in values and values[n] % 16 == 0):
                attrs[(fn.arg_names.index(n),)] = [["tt.divisibility", 16]]
            elif values.get(n) == 1:
                constexprs[n] = 1
        signature.update({n: "constexpr" for n in constexprs})
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        out[name] = triton.compile(src, target=target, options=options)
    return out
