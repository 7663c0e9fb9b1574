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

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

from flashref.kernel_tiles import tile_counts  # noqa: F401  (plain Python, importable without triton)

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): ln(x) = log2(x) * LN2 (a constexpr, so kernels can read it)

# How tl.dot multiplies (the DOT argument of every kernel; see _dot).
DOT_NATIVE = tl.constexpr(0)  # the tensor cores' own precision: fp16 and bf16 inputs, fp32 sums
DOT_IEEE = tl.constexpr(1)  # fp32 inputs in full fp32 (no TF32)
DOT_FP64 = tl.constexpr(2)  # only under the CPU interpreter: products and sums in fp64, rounded once


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """a @ b with an fp32 result. DOT_NATIVE: the tensor cores' native precision (fp16/bf16 inputs);
    DOT_IEEE: fp32 inputs in full fp32 ("ieee", no TF32); DOT_FP64: only under the CPU interpreter, every
    dtype.

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
    if DOT == DOT_IEEE:
        return tl.dot(a, b, input_precision="ieee")
    elif DOT == DOT_FP64:
        return tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    else:
        return tl.dot(a, b)


def philox_rounds(environ=os.environ) -> int:
    """Philox's rounds for dropout: 7, unless ``FLASHREF_PHILOX_ROUNDS`` (0 to 16) says otherwise, read once at
    import. The variable is for measuring what the generator costs (``python -m flashref.bench features --parts
    dropout-rounds`` runs each count in a process of its own): fewer rounds are cheaper and less random, and 0
    gives the counter itself, no randomness at all. Every kernel and :func:`flashref.triton.dropout_mask` read
    the same count, so the backward still replays the forward's mask bit for bit."""
    text = environ.get("FLASHREF_PHILOX_ROUNDS", "7")
    if not text.strip().isdigit() or not 0 <= int(text) <= 16:
        raise ValueError(f"FLASHREF_PHILOX_ROUNDS must be a whole number from 0 to 16, got {text!r}")
    return int(text)


# Dropout's random numbers: Philox-4x32 with 7 rounds (as FlashAttention-2 uses; Random123 found 7 rounds
# already pass BigCrush), and each call's 128 random bits cut into eight 16-bit numbers, each serving two entries
# of P (see pair_shift).
PHILOX_ROUNDS = tl.constexpr(philox_rounds())
DROP_BITS = 16


def drop_threshold(dropout_p: float) -> int:
    """The kernels keep an entry of P when its 16-bit random number is >= this: round(dropout_p * 2**16),
    at most 2**16 - 1. The dropped fraction is then this / 2**16, within 2**-17 of ``dropout_p`` (below
    1 - 2**-16)."""
    return min(int(round(dropout_p * 2**DROP_BITS)), 2**DROP_BITS - 1)


def pair_shift(drop_below: int) -> int:
    """C, the turn by which the second entry of a pair reads the pair's shared 16-bit number u: it is kept when
    (u + C) mod 2**16 >= drop_below, the first when u >= drop_below. Each is kept with odds K / 2**16
    (K = 2**16 - drop_below); both when u lies in [drop_below, 2**16 - C), K - C values. C = drop_below -
    round(drop_below**2 / 2**16) makes that round(K**2 / 2**16): as near independence (K**2 / 2**32) as 16-bit
    numbers can be, within 2**-17, which correlates the two by at most 2**-17 / (p (1 - p)) (8.5e-5 at p = 0.1).
    (For p within 2**-16 of 1, K = 1 and no number keeps both.) :func:`_pair_shift` computes it in the kernels."""
    return drop_below - (drop_below * drop_below + 2**(DROP_BITS - 1) >> DROP_BITS)


# Which entries share a Philox call is chosen for the tensor cores' register layout. An accumulator tile of
# mma / wgmma gives each thread, in every 16 x 16 block, rows r and r + 8 and columns 2c, 2c + 1, 2c + 8 and
# 2c + 9, and the thread four lanes over rows r + 1 and r + 9 of the same columns. Those sixteen entries (i, j),
# differing in bits 0 and 3 of i and of j, share one call: its eight 16-bit numbers, each serving a pair (i, j),
# (i + 8, j ^ 8) (see _keep). So the two threads that hold a block hold its whole call; any other grouping
# (sixteen consecutive keys, say) leaves each thread with bits that belong to threads elsewhere, and the compiler
# moves them through shared memory every tile (measured: about as many instructions as Philox itself).
@triton.jit
def _keep(seed, bh, start_m, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, drop_below):
    """The dropout keep-mask of the (queries start_m : +BLOCK_M) x (keys start_n : +BLOCK_N) tile of head
    ``bh`` (both starts multiples of 16): True where the entry of P is kept, with probability
    1 - drop_below / 2**16.

    Counter-based: Philox maps (seed; j without bits 0 and 3, i without bits 0 and 3, head) to four 32-bit
    words, eight 16-bit numbers. Entry (i, j) takes half ``i % 2`` of word ``2 * (bit3(i) ^ bit3(j)) + j % 2``:
    each number serves two entries, one with bit 3 of i clear (kept when the number u >= drop_below) and one
    with it set (kept when (u + C) mod 2**16 >= drop_below, C = :func:`pair_shift`). So any kernel can
    regenerate exactly the forward's mask for any tile, and nothing of size N^2 is ever stored; the dK/dV
    kernel, whose tiles hold keys in rows, computes the same function with _keep_t. This kernel's threads
    draw a call for each half of it they use (so the two threads that share a call both draw it; the Hopper
    kernels draw each call once and trade halves). ``flashref.triton.dropout_mask`` runs this one."""
    a = tl.arange(0, BLOCK_M // 16)
    b = tl.arange(0, 8)  # bits 0-2 of i
    c = tl.arange(0, BLOCK_N // 16)
    e = tl.arange(0, 4)  # bits 1-2 of j
    row = ((start_m // 16 + a)[:, None, None, None] * 4 + (b // 2)[None, :, None, None]).to(tl.uint32)
    col = ((start_n // 16 + c)[None, None, :, None] * 4 + e[None, None, None, :]).to(tl.uint32)
    r0, r1, r2, r3 = _philox(seed, bh, col + row * 0, row + col * 0)
    shift = (16 - 16 * (b & 1)).to(tl.uint32)[None, :, None, None]  # half i % 2, moved to the top
    u0, u1, u2, u3 = r0 << shift, r1 << shift, r2 << shift, r3 << shift
    t = drop_below.to(tl.uint32) << 16
    top = tl.join(tl.join(u0, u1), tl.join(u2, u3)) >= t  # bit3(i) = 0: (a, b, c, e, bit0(j), bit3(j))
    bottom = tl.join(tl.join(u2, u3), tl.join(u0, u1)) + (_pair_shift(drop_below) << 16) >= t  # bit3(i) = 1
    keep = tl.join(top, bottom)  # (a, b, c, e, bit0(j), bit3(j), bit3(i)): a join's new axis is last
    keep = tl.permute(keep, (0, 6, 1, 2, 5, 3, 4))  # (a, bit3(i), b, c, bit3(j), e, bit0(j)): i, j in order
    return tl.reshape(keep, (BLOCK_M, BLOCK_N))


@triton.jit
def _keep_t(seed, bh, start_m, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, drop_below):
    """_keep's mask, transposed: the (keys start_n : +BLOCK_N) x (queries start_m : +BLOCK_M) tile, as the
    dK/dV kernel holds it. Its threads hold rows (keys) r and r + 8 and, per 16 columns, queries 2c, 2c + 1,
    2c + 8, 2c + 9; the word of each entry is picked by bit 0 of its key, the half by bit 0 of its query."""
    a = tl.arange(0, BLOCK_N // 16)
    b = tl.arange(0, 8)  # bits 0-2 of j
    c = tl.arange(0, BLOCK_M // 16)
    e = tl.arange(0, 8)  # bits 0-2 of i
    key = ((start_n // 16 + a)[:, None, None, None] * 4 + (b // 2)[None, :, None, None]).to(tl.uint32)
    qry = ((start_m // 16 + c)[None, None, :, None] * 4 + (e // 2)[None, None, None, :]).to(tl.uint32)
    r0, r1, r2, r3 = _philox(seed, bh, key + qry * 0, qry + key * 0)
    odd = (b & 1)[None, :, None, None] == 1  # bit 0 of j: words 1 and 3, not 0 and 2
    shift = (16 - 16 * (e & 1)).to(tl.uint32)[None, None, None, :]  # half i % 2, moved to the top
    x0 = tl.where(odd, r1, r0) << shift  # bit3(i) ^ bit3(j) = 0
    x1 = tl.where(odd, r3, r2) << shift
    t = drop_below.to(tl.uint32) << 16
    top = tl.join(x0, x1) >= t  # bit3(i) = 0: (a, b, c, e, bit3(j))
    bottom = tl.join(x1, x0) + (_pair_shift(drop_below) << 16) >= t  # bit3(i) = 1
    keep = tl.join(top, bottom)  # (a, b, c, e, bit3(j), bit3(i))
    keep = tl.permute(keep, (0, 4, 1, 2, 5, 3))  # (a, bit3(j), b, c, bit3(i), e): j, i in order
    return tl.reshape(keep, (BLOCK_N, BLOCK_M))


@triton.jit
def _pair_shift(drop_below):
    """:func:`pair_shift` of the runtime threshold, as a uint32 (drop_below < 2**16: its square fits)."""
    d = drop_below.to(tl.uint32)
    return d - ((d * d + 32768) >> 16)


@triton.jit
def _philox(seed, bh, col, row):
    """Philox-4x32 (PHILOX_ROUNDS rounds: 7) of counter (col, row, head, 0) under key ``seed``: four independent
    32-bit words."""
    return tl.philox(seed, col, row, row * 0 + bh.to(tl.uint32), row * 0, n_rounds=PHILOX_ROUNDS)


# libdevice's tanh on a GPU; the CPU interpreter cannot call libdevice (see _tanh).
TANH_LIBDEVICE = tl.constexpr(os.environ.get("TRITON_INTERPRET", "") != "1")


@triton.jit
def _tanh(x):
    """tanh in fp32: libdevice's on a GPU (within 2 ulp). The CPU interpreter cannot call libdevice, so there
    it is built from exp2: ``(1 - t) / (1 + t)`` with ``t = exp(-2|x|)``, and for |x| < 1/4, where 1 - t
    would cancel, the odd Taylor series to x^11 (its next term is below 3e-10 relative)."""
    if TANH_LIBDEVICE:
        return libdevice.tanh(x)
    else:
        a = tl.abs(x)
        t = tl.exp2(a * -2.8853900817779268)  # -2 log2(e)
        y2 = x * x
        series = a * (1.0 + y2 * (-1.0 / 3 + y2 * (2.0 / 15 + y2 * (-17.0 / 315 + y2 * (62.0 / 2835
                                                                                       + y2 * (-1382.0 / 155925))))))
        r = tl.where(a < 0.25, series, (1.0 - t) / (1.0 + t))
        return tl.where(x < 0, -r, r)


@triton.jit
def _modified(qk, offs_m, offs_n, qk_scale, cap_in, cap_out, slope2, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
              TRANSPOSED: tl.constexpr):
    """The base-2 score of a raw q.k tile with the score modifications (:mod:`flashref.score_mods`), and
    ``tanh(sm_scale q.k / c)`` for the softcap's derivative (``qk`` itself without a softcap):

        s = c log2(e) tanh(sm_scale q.k / c) - a log2(e) |i - j|     (cap_in = sm_scale / c, cap_out = c log2 e)

    TRANSPOSED: rows are keys (the dK/dV kernel). Every kernel computes s with these very operations, the
    last one an explicit FMA, so the backward's recomputed score is the forward's bit for bit."""
    t = qk
    if SOFTCAP:
        t = _tanh(qk * cap_in)
    if ALIBI:
        if TRANSPOSED:
            dist = tl.abs(offs_n[:, None] - offs_m[None, :])
        else:
            dist = tl.abs(offs_n[None, :] - offs_m[:, None])
        bias = slope2 * dist.to(tl.float32)
        if SOFTCAP:
            s = tl.fma(t, cap_out, -bias)
        else:
            s = tl.fma(qk, qk_scale, -bias)
    else:
        s = t * cap_out
    return s, t


@triton.jit
def _in_window(rows, cols, win_left, win_right):
    """Whether query ``rows`` sees key ``cols`` (broadcast): ``i - left <= j <= i + right``."""
    return (cols >= rows - win_left) & (cols <= rows + win_right)


@triton.jit
def _tile_ranges(start, N_inner, before, after, BLOCK_OUTER: tl.constexpr, BLOCK_INNER: tl.constexpr,
                 BOUNDED_BEFORE: tl.constexpr, BOUNDED_AFTER: tl.constexpr):
    """Which inner tiles (keys of a query block, or queries of a key block) the outer block
    ``[start, start + BLOCK_OUTER)`` visits, when outer row y sees inner row x for ``y - before <= x <= y +
    after`` (a causal mask or a window; an unbounded side is not BOUNDED). Returns ``lo <= full_lo <= full_hi
    <= hi``: tiles in ``[full_lo, full_hi)`` are full (every pair visible, every row in bounds) and need no
    mask; those in ``[lo, full_lo)`` and ``[full_hi, hi)`` need the element mask; the rest are never loaded.
    lo, full_lo and full_hi are multiples of BLOCK_INNER."""
    last = start + BLOCK_OUTER - 1
    lo = 0
    full_lo = 0
    hi = N_inner
    full_hi = (N_inner // BLOCK_INNER) * BLOCK_INNER
    if BOUNDED_AFTER:
        hi = tl.minimum(hi, last + after + 1)
        full_hi = tl.minimum(full_hi, ((start + after + 1) // BLOCK_INNER) * BLOCK_INNER)
    if BOUNDED_BEFORE:
        lo = (tl.maximum(start - before, 0) // BLOCK_INNER) * BLOCK_INNER
        full_lo = ((tl.maximum(last - before, 0) + BLOCK_INNER - 1) // BLOCK_INNER) * BLOCK_INNER
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    # Otherwise lo = full_lo = 0 stay constants (the unmasked loop then starts at a known 0, as it did before
    # windows existed), and 0 <= full_hi <= hi holds already.
    return lo, full_lo, full_hi, hi


@triton.jit
def _load_rows(base, offs_r, offs_d, stride_r, stride_d, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASKED: tl.constexpr):
    """The tile of rows ``offs_r`` (all columns) of one head's (rows, HEAD_DIM) matrix at ``base``, padded
    to BLOCK_D columns with zeros. MASKED: rows from ``n_rows`` on read as zeros too (the ragged last tile);
    otherwise every row exists, and when BLOCK_D == HEAD_DIM the load needs no mask at all."""
    ptrs = base + offs_r[:, None] * stride_r + offs_d[None, :] * stride_d
    if MASKED:
        x = tl.load(ptrs, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif BLOCK_D != HEAD_DIM:
        x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _block_visible(bm_base, stride_bmi, stride_bmj, start_m, start_n, BLOCK_SIZE: tl.constexpr):
    """Whether the block-mask block holding the tile at (start_m, start_n) is visible (tile mode: the tile
    lies inside one block of the mask, because BLOCK_SIZE is a multiple of both tile sides)."""
    return tl.load(bm_base + (start_m // BLOCK_SIZE) * stride_bmi + (start_n // BLOCK_SIZE) * stride_bmj) != 0


@triton.jit
def _block_elements(bm_base, stride_bmi, stride_bmj, offs_m, offs_n, N_q, N_k, BLOCK_SIZE: tl.constexpr):
    """The block mask expanded to one tile, element by element (when a tile spans several mask blocks). The
    tile's keys span at most NB blocks of the mask: each row loads those NB bytes into the bits of one int,
    and each entry takes its bit, a shift where a load of its own would cost far more (2.8-6.7x the tile's
    time in the forward, measured on an H200 at d = 64 and 128). Tiny blocks (NB > 32) load entry by entry."""
    inside = (offs_m[:, None] < N_q) & (offs_n[None, :] < N_k)
    NB: tl.constexpr = (offs_n.shape[0] - 1) // BLOCK_SIZE + 2
    if NB <= 32:
        first = tl.min(offs_n, 0) // BLOCK_SIZE  # the mask block of the tile's first key
        rows = bm_base + (offs_m // BLOCK_SIZE) * stride_bmi
        bits = tl.zeros_like(offs_m)
        for t in tl.static_range(NB):
            seen = tl.load(rows + (first + t) * stride_bmj, mask=(offs_m < N_q) & ((first + t) * BLOCK_SIZE < N_k),
                           other=0)
            bits = bits | ((seen != 0).to(tl.int32) << t)
        shift = offs_n // BLOCK_SIZE - first
        return inside & (((bits[:, None] >> shift[None, :]) & 1) != 0)
    else:
        ptrs = bm_base + (offs_m // BLOCK_SIZE)[:, None] * stride_bmi + (offs_n // BLOCK_SIZE)[None, :] * stride_bmj
        return tl.load(ptrs, mask=inside, other=0) != 0


@triton.jit
def _tile_visible(bm_base, stride_bmi, stride_bmj, start_m, start_n, N_q, N_k, BLOCK_SIZE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BM_TILE: tl.constexpr):
    """Whether the block mask shows any entry of the tile at (start_m, start_n): one load when the tile lies
    inside one mask block (BM_TILE), else the tile's entries, so a tile of hidden blocks is skipped in either
    mode."""
    if BM_TILE:
        return _block_visible(bm_base, stride_bmi, stride_bmj, start_m, start_n, BLOCK_SIZE)
    else:
        entries = _block_elements(bm_base, stride_bmi, stride_bmj, start_m + tl.arange(0, BLOCK_M),
                                  start_n + tl.arange(0, BLOCK_N), N_q, N_k, BLOCK_SIZE)
        return tl.max(entries.to(tl.int32)) != 0


@triton.jit
def _listed_tiles_before(row, limit, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr):
    """How many tiles of a visible-block list lie before ``limit`` (a multiple of TILE). ``row`` points at
    one list: its count, then the visible block indices in increasing order, each block TILE-tiled, so the
    tiles before ``limit`` are a prefix of the list's tiles. Read 128 entries at a time, as vectors."""
    count = tl.load(row)
    n = 0
    for e0 in range(0, count, 128):
        e = e0 + tl.arange(0, 128)
        start = tl.load(row + 1 + e, mask=e < count, other=0) * BLOCK_SIZE
        before = tl.minimum(tl.maximum(limit - start, 0), BLOCK_SIZE) // TILE
        n += tl.sum(tl.where(e < count, before, 0), 0)
    return n


@triton.jit
def _listed_range(list_row, lo, hi, LIST_SIZE: tl.constexpr, TILE: tl.constexpr, EXACT: tl.constexpr):
    """(it_lo, it_hi, every): the tiles of a visible-block list in [lo, hi) (see _listed_tiles_before), and
    whether every tile of [lo, hi) is listed, so the plain loop can take them (no list reads). Only for exact
    lists: with coarse ones ``every`` stays the constant False, and the caller compiles its listed loop alone
    (one pipelined loop, one set of K/V buffers in shared memory, not two)."""
    it_lo = _listed_tiles_before(list_row, lo, LIST_SIZE, TILE)
    it_hi = _listed_tiles_before(list_row, hi, LIST_SIZE, TILE)
    every = False
    if EXACT:
        every = (it_hi - it_lo) * TILE == hi - lo
    return it_lo, it_hi, every


@triton.jit
def visible_lists_kernel(BM, LISTS, stride_bmb, stride_bmh, stride_bmi, stride_bmj, stride_lb, stride_lh, stride_li,
                         H, n_j, CHUNK: tl.constexpr):
    """LISTS[b, h, i] = [count, the j with BM[b, h, i, j] != 0 in increasing order]: one program per row i
    of the block mask, a running count and a prefix sum placing each visible j."""
    i = tl.program_id(0)
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    src = BM + b.to(tl.int64) * stride_bmb + h.to(tl.int64) * stride_bmh + i.to(tl.int64) * stride_bmi
    dst = LISTS + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + i.to(tl.int64) * stride_li
    count = 0
    for j0 in range(0, n_j, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        visible = (tl.load(src + j * stride_bmj, mask=j < n_j, other=0) != 0).to(tl.int32)
        tl.store(dst + count + tl.cumsum(visible, 0), j, mask=visible != 0)  # entry 1 + (visibles before j)
        count += tl.sum(visible, 0)
    tl.store(dst, count)


@triton.jit
def _listed_start(row, it, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr):
    """The first row (key or query) of tile ``it`` of a visible-block list (see _listed_tiles_before)."""
    return tl.load(row + 1 + it // (BLOCK_SIZE // TILE)) * BLOCK_SIZE + (it % (BLOCK_SIZE // TILE)) * TILE


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
              start_m, start_n, N_q, N_k, qk_scale, offs_m, offs_d,
              bm_base, stride_bmi, stride_bmj, seed, bh, drop_below, win_left, win_right, cap_in, cap_out, slope2,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr,
              HAS_BM: tl.constexpr, BM_TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, DROPOUT: tl.constexpr,
              WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Fold the K/V tile at ``start_n`` into (acc, l_i, m_i) of the query block at ``start_m``. A MASKED
    tile checks key bounds and, when CAUSAL or WINDOW, which keys each row sees; the others are full tiles
    that every query row of the block may see. With a block mask applied element by element (HAS_BM, not
    BM_TILE), or in a masked tile of a window, rows may have seen no key yet: where the max is still -inf the
    exponents are taken against 0 (the max itself stays -inf).
    SOFTCAP / ALIBI modify the scores (_modified) before any mask: a masked score is -inf whatever the cap
    would make of it."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(k_base, offs_n, offs_d, stride_kn, stride_kd, N_k, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                   MASKED=MASKED)
    v = _load_rows(v_base, offs_n, offs_d, stride_vn, stride_vd, N_k, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                   MASKED=MASKED)
    qk = _dot(q, tl.trans(k), DOT)  # raw q.k; the base-2 score is qk * qk_scale (sm_scale * log2(e))
    scale = qk_scale
    if SOFTCAP or ALIBI:  # qk becomes the modified base-2 score itself
        qk, _ = _modified(qk, offs_m, offs_n, qk_scale, cap_in, cap_out, slope2, SOFTCAP, ALIBI, False)
        scale = 1.0
    if MASKED:
        keep = offs_n[None, :] < N_k
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        if WINDOW:
            keep = keep & _in_window(offs_m[:, None], offs_n[None, :], win_left, win_right)
        qk = tl.where(keep, qk, float("-inf"))
    if HAS_BM:
        if not BM_TILE:
            qk = tl.where(_block_elements(bm_base, stride_bmi, stride_bmj, offs_m, offs_n, N_q, N_k, BLOCK_SIZE),
                          qk, float("-inf"))
    # scale > 0 and rounding is monotone, so max(qk) * scale is exactly the largest rounded score: the
    # max needs no scaled copy of the tile, and only one score tile stays live.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale)
    m_sub = m_new  # the max the exponents subtract
    if HAS_BM or (WINDOW and MASKED):
        # A row that has seen no key yet keeps m = -inf, and its exponents are taken against 0 (not NaN). Only
        # the exponents: carrying 0 on as the max would make a later tile's scores far below 0 (ALiBi's bias
        # at the window's edge) round P to 0 in the fp16 P V product while l still counts them.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)  # rescales what was summed under the old max
    # One explicit fused multiply-add, here and in both backward kernels: left to itself the compiler
    # contracts qk * qk_scale - m into an FMA in some kernels and tiles and not in others, and then the
    # backward's recomputed exponent differs from the forward's by a rounding of the score (3e-4 in P for
    # logits of 1e3 in fp32; see _exponent in backward.py).
    p = tl.exp2(tl.fma(qk, scale, -m_sub[:, None]))
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DROPOUT:  # l sums P before dropout; O sums the kept entries, and is scaled by 1 / (1 - p) at the end
        p = tl.where(_keep(seed, bh, start_m, start_n, offs_m.shape[0], BLOCK_N, drop_below), p, 0.0)
    acc += _dot(p.to(v.dtype), v, DOT)
    return acc, l_i, m_new


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               start_m, lo, hi, N_q, N_k, qk_scale, offs_m, offs_d,
               bm_base, stride_bmi, stride_bmj, list_row, seed, bh, drop_below,
               win_left, win_right, cap_in, cap_out, slope2,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr,
               HAS_BM: tl.constexpr, BM_TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, DROPOUT: tl.constexpr,
               LISTED: tl.constexpr, LIST_SIZE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
               ALIBI: tl.constexpr):
    """Fold the K/V tiles with first key in [lo, hi) into (acc, l_i, m_i). When LISTED, only the visible
    ones, read from this query block's list of visible key blocks (``list_row``), so the loop meets no
    hidden tile and its loads stay pipelined; when the lists are exact and every tile of [lo, hi) is
    listed, the plain loop (no list, no check). Otherwise a tile the block mask hides is skipped, and the
    mask is applied element by element where a tile spans several of its blocks (not BM_TILE).

    The lists are of blocks of LIST_SIZE rows and keys. EXACT: those are the mask's own blocks, each holding
    whole tiles, so a listed tile is all visible. Otherwise they are coarser blocks, listed where any mask
    block they overlap is visible (a block_size that does not hold the tiles whole, ops.coarse_block_mask),
    and a listed tile takes the mask element by element."""
    EXACT: tl.constexpr = BM_TILE and LIST_SIZE == BLOCK_SIZE
    if LISTED:
        it_lo, it_hi, every = _listed_range(list_row, lo, hi, LIST_SIZE, BLOCK_N, EXACT)
        if every:
            for start_n in range(lo, hi, BLOCK_N):
                acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn,
                                          stride_vd, start_m, start_n, N_q, N_k, qk_scale, offs_m, offs_d, bm_base,
                                          stride_bmi, stride_bmj, seed, bh, drop_below, win_left, win_right, cap_in,
                                          cap_out, slope2, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
                                          MASKED=MASKED, CAUSAL=CAUSAL, DOT=DOT, HAS_BM=False, BM_TILE=EXACT,
                                          BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT, WINDOW=WINDOW, SOFTCAP=SOFTCAP,
                                          ALIBI=ALIBI)
        else:
            for it in range(it_lo, it_hi):
                start_n = _listed_start(list_row, it, LIST_SIZE, BLOCK_N)
                acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn,
                                          stride_vd, start_m, start_n, N_q, N_k, qk_scale, offs_m, offs_d, bm_base,
                                          stride_bmi, stride_bmj, seed, bh, drop_below, win_left, win_right, cap_in,
                                          cap_out, slope2, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
                                          MASKED=MASKED, CAUSAL=CAUSAL, DOT=DOT, HAS_BM=HAS_BM, BM_TILE=EXACT,
                                          BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT, WINDOW=WINDOW, SOFTCAP=SOFTCAP,
                                          ALIBI=ALIBI)
    else:
        for start_n in range(lo, hi, BLOCK_N):
            visible = True
            if HAS_BM:
                visible = _tile_visible(bm_base, stride_bmi, stride_bmj, start_m, start_n, N_q, N_k, BLOCK_SIZE,
                                        offs_m.shape[0], BLOCK_N, BM_TILE)
            if visible:
                acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn,
                                          stride_vd, start_m, start_n, N_q, N_k, qk_scale, offs_m, offs_d, bm_base,
                                          stride_bmi, stride_bmj, seed, bh, drop_below, win_left, win_right, cap_in,
                                          cap_out, slope2, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
                                          MASKED=MASKED, CAUSAL=CAUSAL, DOT=DOT, HAS_BM=HAS_BM, BM_TILE=BM_TILE,
                                          BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT, WINDOW=WINDOW, SOFTCAP=SOFTCAP,
                                          ALIBI=ALIBI)
    return acc, l_i, m_i


@triton.jit
def _document(CU, b):
    """Where document b of a packed batch starts, and its length: rows CU[b] : CU[b + 1]."""
    start = tl.load(CU + b)
    return start, tl.load(CU + b + 1) - start


@triton.jit(do_not_specialize=["H", "N_q", "N_k", "TUNE_N", "GROUP", "seed", "drop_below", "win_left", "win_right"])
def flash_fwd_kernel(Q, K, V, O, LSE, M2, L2, BM, LISTS,
                     stride_qb, stride_qh, stride_qm, stride_qd,
                     stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd,
                     stride_ob, stride_oh, stride_om, stride_od,
                     stride_bmb, stride_bmh, stride_bmi, stride_bmj,
                     stride_lb, stride_lh, stride_li,
                     H, N_q, N_k, qk_scale, TUNE_N, GROUP, seed, drop_below, keep_scale,
                     ALIBI_SLOPES, CU_Q, CU_K, stride_ab, stride_ah, win_left, win_right, cap_in, cap_out,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, DOT: tl.constexpr,
                     HAS_BM: tl.constexpr, BLOCK_SIZE: tl.constexpr, LIST_SIZE: tl.constexpr, DROPOUT: tl.constexpr,
                     WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, VARLEN: tl.constexpr):
    """Program (pid_m, pid_bh) writes O[b, h, pid_m*BLOCK_M : +BLOCK_M, :], its lse (natural log), and the
    base-2 row max M2 and log2 of the row sum L2 that the backward pass uses.

    Needs BLOCK_M % BLOCK_N == 0, so every K tile left of the block's first row is fully visible
    (causal) and only the tiles on the diagonal need a mask. Query head h reads K/V head h // GROUP
    (grouped-query attention; GROUP = 1 is plain multi-head attention). BM is the block mask (int8,
    strides 0 along broadcast dims), read only when HAS_BM; LISTS holds, per query block of the mask, the
    count and the increasing indices of its visible key blocks (blocks of LIST_SIZE: the mask's own when
    BLOCK_SIZE is a multiple of every config's tile sides, configs.list_granule; else coarser ones, see
    _fwd_tiles), so the full
    tiles are walked from the list. With DROPOUT, P is dropped with probability
    drop_below / 2**16 from the Philox stream of ``seed``. A row that sees no key stores O = 0, lse = -inf, and
    M2 = 0, L2 = +inf, which make the backward's recomputed P exactly 0.

    The score modifications (:mod:`flashref.score_mods`): WINDOW, query i sees keys
    ``i - win_left <= j <= i + win_right`` (an unbounded side comes as N_q + N_k; with CAUSAL, win_right is
    0), and only the key tiles inside the window are visited; SOFTCAP and ALIBI as in _modified, with
    base-2 slopes ``ALIBI_SLOPES[b, h]``. VARLEN: a packed batch, read as one sequence of N_q (N_k) rows
    that program row b cuts into document b, rows ``CU_Q[b] : CU_Q[b + 1]`` of the queries and
    ``CU_K[b] : CU_K[b + 1]`` of the keys; its statistics go to row ``h * N_q + CU_Q[b] + i``.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(ALIBI_SLOPES + b * stride_ab + h * stride_ah)
    N_rows = N_q  # the statistics' row stride
    q_start = 0
    if VARLEN:  # b is the document; the tensors hold one batch row
        q_start, N_q = _document(CU_Q, b)
        k_start, N_k = _document(CU_K, b)
        N_k = tl.where(start_m < N_q, N_k, 0)  # a block past the document's end visits no key
        b = b * 0
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    if VARLEN:
        q_base += q_start.to(tl.int64) * stride_qm
        o_base += q_start.to(tl.int64) * stride_om
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn
    bm_base = BM + b.to(tl.int64) * stride_bmb + h.to(tl.int64) * stride_bmh
    BM_TILE: tl.constexpr = (BLOCK_SIZE % BLOCK_M == 0) and (BLOCK_SIZE % BLOCK_N == 0)
    LISTED: tl.constexpr = HAS_BM and (LIST_SIZE % BLOCK_M == 0) and (LIST_SIZE % BLOCK_N == 0)
    list_row = LISTS + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + (start_m // LIST_SIZE) * stride_li

    q = _load_rows(q_base, offs_m, offs_d, stride_qm, stride_qd, N_q, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, MASKED=True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys in [full_lo, full_hi) are seen by every row of the block: no mask. Causal: the keys left of the
    # block's first query row. [lo, full_lo) (a window's left edge) and [full_hi, hi) (the diagonal, a
    # window's right edge, the ragged last tile) are masked; keys outside [lo, hi) are never loaded.
    lo, full_lo, full_hi, hi = _tile_ranges(start_m, N_k, win_left, win_right, BLOCK_M, BLOCK_N,
                                            BOUNDED_BEFORE=WINDOW, BOUNDED_AFTER=CAUSAL or WINDOW)
    if WINDOW:
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                   start_m, lo, full_lo, N_q, N_k, qk_scale, offs_m, offs_d, bm_base, stride_bmi,
                                   stride_bmj, list_row, seed, pid_bh, drop_below, win_left, win_right, cap_in, cap_out,
                                   slope2, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=True,
                                   CAUSAL=CAUSAL, DOT=DOT, HAS_BM=HAS_BM, BM_TILE=BM_TILE, BLOCK_SIZE=BLOCK_SIZE,
                                   DROPOUT=DROPOUT, LISTED=False, LIST_SIZE=LIST_SIZE, WINDOW=WINDOW, SOFTCAP=SOFTCAP,
                                   ALIBI=ALIBI)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, start_m,
                               full_lo, full_hi, N_q, N_k, qk_scale, offs_m, offs_d, bm_base, stride_bmi, stride_bmj,
                               list_row, seed, pid_bh, drop_below, win_left, win_right, cap_in, cap_out, slope2,
                               HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=False, CAUSAL=CAUSAL,
                               DOT=DOT, HAS_BM=HAS_BM, BM_TILE=BM_TILE, BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT,
                               LISTED=LISTED, LIST_SIZE=LIST_SIZE, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, start_m,
                               full_hi, hi, N_q, N_k, qk_scale, offs_m, offs_d, bm_base, stride_bmi, stride_bmj,
                               list_row, seed, pid_bh, drop_below, win_left, win_right, cap_in, cap_out, slope2,
                               HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=True, CAUSAL=CAUSAL,
                               DOT=DOT, HAS_BM=HAS_BM, BM_TILE=BM_TILE, BLOCK_SIZE=BLOCK_SIZE, DROPOUT=DROPOUT,
                               LISTED=False, LIST_SIZE=LIST_SIZE, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI)

    # Without a block mask or a window every row sees key 0 (top-left causal), so l_i > 0 for real rows;
    # padded rows are never stored. With one, a row may see nothing: l_i = 0, m_i = -inf.
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    acc = acc / l_safe[:, None]
    if DROPOUT:  # P~ = P * keep / (1 - p): one scaling of O instead of one per entry of P
        acc = acc * keep_scale
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))  # back to natural log
    row = (b * H + h).to(tl.int64) * N_rows + q_start + offs_m  # = pid_bh * N_q + offs_m without VARLEN
    tl.store(LSE + row, lse, mask=offs_m < N_q)
    # For the backward pass: the base-2 max and log2(l) kept apart. Recomputing P as
    # exp2((s - m) - log2(l)) repeats the forward's own rounding of s - m; going through lse would add the
    # rounding of one large number (|lse| ~ 4e3 in base 2 for logits scaled by 1e3 costs ~2e-4 in P).
    tl.store(M2 + row, tl.where(seen, m_i, 0.0), mask=offs_m < N_q)
    tl.store(L2 + row, tl.where(seen, tl.log2(l_safe), float("inf")), mask=offs_m < N_q)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, acc.to(O.dtype.element_ty),
             mask=(offs_m[:, None] < N_q) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def dropout_mask_kernel(KEEP, seed, drop_below, N_q, N_k, BLOCK: tl.constexpr):
    """KEEP[bh, i, j] = the keep bit of _keep for head bh: the kernels' own mask, for tests and teaching."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bh = tl.program_id(2)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = pid_n * BLOCK + tl.arange(0, BLOCK)
    keep = _keep(seed, bh, pid_m * BLOCK, pid_n * BLOCK, BLOCK, BLOCK, drop_below)
    ptrs = KEEP + bh.to(tl.int64) * N_q * N_k + rows[:, None].to(tl.int64) * N_k + cols[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < N_q) & (cols[None, :] < N_k))
