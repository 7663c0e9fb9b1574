"""FlashAttention-3's ideas on Hopper, in Gluon: a forward kernel built one switch at a time.

The teaching kernel (:mod:`flashref.triton.forward`) leaves the schedule to Triton's compiler. Gluon
(``triton.experimental.gluon``) hands it to us: we allocate shared memory, fill it with the tensor-memory
accelerator (TMA), count arrivals on mbarriers, and say when to wait for the asynchronous warpgroup
products (wgmma). The switches of :func:`hopper_forward`, each measured on its own:

``stages``
    K and V tiles in a ring of ``stages`` shared-memory slots, loaded by TMA ahead of use and awaited
    on one mbarrier per slot (K and V each have one, so Q K^T can start while V is on its way).
    ``stages=1`` loads a tile only when the last one is consumed.
``block_m``, ``block_n``, ``num_warps``
    The tile and the warps of a program. 4 warps are one warpgroup, one wgmma issuer; 8 are two.
    Smaller programs leave room for two or more on one SM, whose softmax and products then overlap:
    while one program computes exponentials, another keeps the tensor cores busy.
``overlap``
    Intra-warpgroup overlap, written as FlashAttention-3 does: S_j = Q K_j^T and O += P_{j-1} V_{j-1}
    are issued, the program waits for S_j only, runs softmax j, then waits for O. Without warp specialization
    it needs ``stages >= 3``, and read in the SASS, ptxas (CUDA 13) moves the wait for O up to before softmax
    j's exponentials, so P V and the exponentials do not overlap after all. What remains is two products queued
    back to back (S_j behind P_{j-1} V_{j-1}), worth a few percent where the registers still allow the same
    occupancy. With ``warp_specialize`` each consumer runs this order with the wait for O in a basic block of
    its own (:func:`_ws_rounds` with ``OVERLAP``), where ptxas leaves it after the exponentials: the overlap is real.
``warp_specialize``
    A second kernel (:func:`hopper_ws_fwd_kernel`) whose warps do different jobs, as FlashAttention-3's do: one
    producer warp issues every TMA copy and waits only for free slots; two consumer warpgroups of 64 rows each
    issue products and compute softmax. ``setmaxnreg`` moves registers from the producer (24 a thread) to the
    consumers (240). A consumer's round issues P_{t-1} V_{t-1} and S_t back to back, waits for both, then runs
    softmax t (with ``overlap``, softmax t runs under P_{t-1} V_{t-1}).
``pingpong``
    With ``warp_specialize``: the consumers take turns, an mbarrier handing the tensor cores from one to the other,
    so one warpgroup's exponentials run while the other's products do.

FP8 (:func:`hopper_fp8_forward`, or :func:`quantize_fp8` then :func:`fp8_attention`): the warp-specialized kernel
with e4m3 Q, K and V (transposed) and per-block scales, P rounded to e4m3, softmax in fp32; ``incoherent``
rotates Q and K by a random Hadamard matrix first, which spreads an outlier channel over all of them.

Supported: fp16 and bf16, head dims 64, 128 and 256, any N_q and N_k (N = 1 too), top-left causal or not, and
a window (``window_size``, which also carries a bottom-right causal mask): each program visits only the key tiles
some row of it sees, and masks only the tiles on a window's edges; or dropout (``launch_forward(dropout=)``, the
teaching kernel's Philox mask bit for bit, drawn in the accumulator's own registers: :func:`_keep`); or a block
mask (``launch_forward(lists=)``: each program walks its query block's list of visible key blocks, on
:func:`block_mask_config`'s tile, warp-specialized at d = 128 and 256 for blocks of 128 or a multiple, where
the producer warp reads the list).
No other feature (GQA, softcap, ALiBi: those stay on the teaching kernel). Outputs match
:func:`flashref.triton.flash_attention_forward`: O, the natural-log lse, and the backward's (m2, l2).
It needs an sm_90 GPU; :func:`supported` says whether a call qualifies. :func:`flashref.triton.flash_attention`
runs it (``kernel="auto"``, the default, or ``"hopper"``) for the calls it supports: inputs in a model's
(B, N, H, d) layout read in place, other strided ones copied to contiguous ones first.
Taught in notebook ``14_flashattention3_on_hopper``; ``python -m flashref.bench hopper`` and ``compile_check hopper``
hold its measurements.
"""

from __future__ import annotations

import copy
import functools
import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashref import fp8
from flashref.fp8 import FP8_MAX, FP8_Q_ROWS, Fp8Inputs, random_rotation  # noqa: F401 (public here too)
from flashref.triton import relaunch
from flashref.triton.forward import LN2, LOG2E, PHILOX_ROUNDS


HEAD_DIMS = (64, 128, 256)
WS_MAXNREG = 168  # 65536 registers / (12 warps * 32 threads), rounded down to a multiple of 8


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple, dtype) -> gl.NVMMASharedLayout:
    """The swizzled shared-memory layout a TMA descriptor of ``block`` (rows, columns) of ``dtype`` uses, made once
    a signature: building a Gluon layout is pure Python (about 10 us), paid at every launch otherwise."""
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def shared_layout(block, dtype) -> gl.NVMMASharedLayout:
    """:func:`_shared_layout` of a list or tuple ``block``."""
    return _shared_layout(tuple(block), dtype)


def host_cdiv(a: int, b: int) -> int:
    """ceil(a / b) in host code: ``triton.cdiv`` is a constexpr function there, whose call wrapper costs more host
    time than the division (five a training step)."""
    return -(-a // b)


# Descriptors already validated, one a (shape, strides, dtype, block, layout), with no tensor: see descriptor().
_DESCRIPTOR_TEMPLATES: dict = {}
_DESCRIPTOR_TEMPLATES_MAX = 256


def descriptor(x: torch.Tensor, block, layout) -> TensorDescriptor:
    """``TensorDescriptor.from_tensor(x, block, layout)``, cheaper from the second call on. A descriptor is its
    tensor's address, shape, strides and dtype, the block and the layout; Triton validates them all each time it
    makes one (pure Python, several microseconds, nine descriptors a training step). The first descriptor of a
    (shape, strides, dtype, block, layout) is made and validated that way and kept without its tensor; later
    ones copy it and set their tensor, after the one check that depends on the address (16-byte alignment: a
    misaligned tensor goes through ``from_tensor``, which refuses it). The layout is keyed by its identity (hashing
    a Gluon layout is pure Python too); its template holds it, so no other layout can take its id meanwhile."""
    key = (x.shape, x.stride(), x.dtype, tuple(block), id(layout))
    template = _DESCRIPTOR_TEMPLATES.get(key)
    if template is None or x.data_ptr() % 16:
        made = TensorDescriptor.from_tensor(x, list(block), layout)
        if len(_DESCRIPTOR_TEMPLATES) >= _DESCRIPTOR_TEMPLATES_MAX:
            _DESCRIPTOR_TEMPLATES.pop(next(iter(_DESCRIPTOR_TEMPLATES)))
        _DESCRIPTOR_TEMPLATES[key] = template = copy.copy(made)
        template.base = None  # the template must not keep x's memory alive
        return made
    made = object.__new__(TensorDescriptor)  # (no __init__: nothing validated again)
    made.__dict__.update(template.__dict__)
    made.base = x
    return made


def token_major(x: torch.Tensor, aligned: bool = True) -> bool:
    """Whether a (B, H, N, d) ``x`` that is not contiguous lies in memory as (B, N, H, d) rows that a TMA
    descriptor can read as a 2-D (B * N, H * d) view (:func:`head_origin`): head h at columns [h * d, +d) of each
    token's row, a batch row's N rows one after the other, rows 16-byte aligned. A model's projection gives
    exactly that: ``x.view(B, N, H, d).transpose(1, 2)``, and the q, k, v of one (B, N, 3, H, d) buffer, whose rows
    hold the other two between a token's heads. ``aligned=False`` reads the strides only, not the address (what a
    compiler's fake tensor, which has none, can answer)."""
    if x.dim() != 4 or x.is_contiguous():
        return False
    B, H, N, d = x.shape
    s0, s1, s2, s3 = x.stride()
    rows_ok = s2 >= H * d and (s2 * x.element_size()) % 16 == 0
    return (s3 == 1 and (s1 == d or H == 1) and (s0 == N * s2 or B == 1) and rows_ok
            and (not aligned or x.data_ptr() % 16 == 0))


def rows_view(x: torch.Tensor, token: bool) -> torch.Tensor:
    """The 2-D view of (B, H, N, d) ``x`` that its TMA descriptors read: (B * H * N, d) of the contiguous tensor,
    or with ``token`` (:func:`token_major`) the (B * N, H * d) rows of its memory."""
    B, H, N, d = x.shape
    if token:
        return x.as_strided((B * N, H * d), (x.stride(2), 1))
    return x.contiguous().view(-1, d)


def empty_output(q: torch.Tensor, token: bool) -> torch.Tensor:
    """O for q: (B, H, N, d) contiguous, or with ``token`` in the (B, N, H, d) layout the kernels then write
    (a model's ``o.transpose(1, 2).reshape(B, N, H * d)`` is a view of it, not a copy)."""
    B, H, N, d = q.shape
    if token:
        return torch.empty((B, N, H, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    return torch.empty((B, H, N, d), dtype=q.dtype, device=q.device)


# ---- Dropout: the teaching kernel's Philox mask, computed in the wgmma accumulator's own registers ---------------
@functools.lru_cache(maxsize=None)  # pure in its integers: built once a tile shape
def keep_layout(block_m: int, block_n: int, num_warps: int) -> gl.DistributedLinearLayout:
    """Where the dropout counters of a (block_m, block_n) tile of scores live: a layout of the 4-D tensor
    (i // 16, i % 8, j // 32, (j // 2) % 4) that puts each counter in a thread whose wgmma accumulator holds
    eight of its sixteen entries of P (see ``flashref.triton.forward._keep``): rows i and i + 8 of columns j,
    j + 1, j + 8, j + 9, where the thread four lanes over holds rows i + 1 and i + 9. A pair of such threads holds
    the 16-column blocks 2m and 2m + 1 of their rows: each draws the call of one block (:func:`_keep`) and they trade
    halves. Lanes carry (j // 2) % 4 and i % 8, warps the 16-row blocks, registers the pairs of 16-column blocks;
    joining the four Philox words and the two halves of each back into the tile then gives the accumulator's
    layout itself, so P is masked without moving a bit between threads but the trade."""
    return _counter_layout(block_m, block_n, num_warps)


@functools.lru_cache(maxsize=None)
def keep_t_layout(block_n: int, block_m: int, num_warps: int) -> gl.DistributedLinearLayout:
    """:func:`keep_layout` for the dK/dV kernels' transposed tiles (keys in rows, queries in columns): a layout of the
    4-D tensor (j // 16, j % 8, i // 32, (i // 2) % 4). A thread's accumulator holds rows (keys) j and j + 8 and
    columns (queries) i, i + 1, i + 8, i + 9; keys j + 1 and j + 9 are four lanes over. The pair draws a call each
    (query blocks 2m and 2m + 1) and trades the words of each other's keys (:func:`_keep_t`)."""
    return _counter_layout(block_n, block_m, num_warps)


def _counter_layout(rows: int, cols: int, num_warps: int) -> gl.DistributedLinearLayout:
    """The (rows // 16, 8, cols // 32, 4) counter layout of a (rows, cols) wgmma accumulator tile with
    ``num_warps`` warps of 16 rows (warps beyond the row blocks hold copies)."""
    if cols % 32 or rows % 16:
        raise ValueError(f"the dropout mask is drawn in tiles of 16 rows and 32 columns, got {rows} x {cols}")
    a_bits, w_bits, c_bits = (int(math.log2(x)) for x in (rows // 16, num_warps, cols // 32))
    warp_bases = [[1 << t, 0, 0, 0] for t in range(min(w_bits, a_bits))] + [[0, 0, 0, 0]] * max(0, w_bits - a_bits)
    reg_bases = [[0, 0, 1 << t, 0] for t in range(c_bits)] + [[1 << t, 0, 0, 0] for t in range(w_bits, a_bits)]
    lane_bases = [[0, 0, 0, 1], [0, 0, 0, 2], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]]
    return gl.DistributedLinearLayout(reg_bases, lane_bases, warp_bases, [], [rows // 16, 8, cols // 32, 4])


@gluon.jit
def _philox(seed, c0, c1, c2, c3, N_ROUNDS: gl.constexpr):
    """Philox-4x32 of counter (c0, c1, c2, c3) under the 64-bit key ``seed``: ``tl.philox``'s rounds, bit for bit."""
    seed = seed.to(gl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(gl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(gl.uint32)
    for _ in gl.static_range(N_ROUNDS):
        hi0, lo0 = _mul_wide(c2, _TIMES_M0)
        hi1, lo1 = _mul_wide(c0, _TIMES_M1)
        c0 = hi0 ^ c1 ^ k0
        c2 = hi1 ^ c3 ^ k1
        c1 = lo0
        c3 = lo1
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


# Philox's two multipliers as PTX: the 64-bit product of a 32-bit word, split into its halves ($0 high, $1 low).
_TIMES_M0 = gl.constexpr("{ .reg .b64 t; mul.wide.u32 t, $2, 0xCD9E8D57; mov.b64 {$1, $0}, t; }")
_TIMES_M1 = gl.constexpr("{ .reg .b64 t; mul.wide.u32 t, $2, 0xD2511F53; mov.b64 {$1, $0}, t; }")


@gluon.jit
def _mul_wide(a, TIMES_M: gl.constexpr):
    """(high, low) 32-bit halves of the 64-bit product of ``a`` and a Philox multiplier (``TIMES_M``, one of the
    two above) in one ``IMAD.WIDE.U32``: written as ``umulhi`` and a multiply (``tl.philox``'s way) they compile
    to ``IMAD.HI.U32`` and ``IMAD``, two instructions (read in the SASS). The same bits either way. On the H100
    (B 8, H 16, N 4K, p = 0.1, medians of three do_bench windows, against the two-instruction form in the same
    run): the d = 64 dropout backward 1.07x faster without causal masking and the forward 1.06x with it; at
    d = 128 and elsewhere within 2% (0.99-1.02x), the run's spread."""
    return gl.inline_asm_elementwise(TIMES_M, "=r,=r,r", [a], dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)


@gluon.jit
def _axes4(A: gl.constexpr, B: gl.constexpr, C: gl.constexpr, E: gl.constexpr, L4: gl.constexpr):
    """``arange`` along each axis of an (A, B, C, E) tensor of layout L4, each expanded to 4-D so that they
    broadcast against one another: the index tensors the dropout counters are built from."""
    a = gl.arange(0, A, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    b = gl.arange(0, B, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, L4))))
    e = gl.arange(0, E, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, L4))))
    return (gl.expand_dims(gl.expand_dims(gl.expand_dims(a, 1), 2), 3),
            gl.expand_dims(gl.expand_dims(gl.expand_dims(b, 0), 2), 3),
            gl.expand_dims(gl.expand_dims(gl.expand_dims(c, 0), 0), 3),
            gl.expand_dims(gl.expand_dims(gl.expand_dims(e, 0), 0), 0))


@gluon.jit
def _pair_shift(drop_below):
    """``flashref.triton.forward.pair_shift`` of the runtime threshold, as a uint32: the turn by which the second
    entry of each number's pair reads it."""
    d = drop_below.to(gl.uint32)
    return d - ((d * d + 32768) >> 16)


@gluon.jit
def _kept_pairs(w_top, w_bottom, drop_below):
    """The keep bits of both halves of each word (low half first, on a new last axis) for the rows with bit 3 of
    the query clear (``w_top``: the number as drawn) and set (``w_bottom``: turned by :func:`_pair_shift`),
    stacked on a new last axis: the comparisons of ``flashref.triton.forward._keep``."""
    t = drop_below.to(gl.uint32) << 16  # each 16-bit half compared in place, the low one shifted up first
    turn = _pair_shift(drop_below)
    top = gl.join((w_top << 16) >= t, w_top >= t)
    bottom = gl.join(((w_bottom + turn) << 16) >= t, w_bottom + (turn << 16) >= t)
    return gl.join(top, bottom)


@gluon.jit
def _keep(seed, bh, start_m, start_n, drop_below, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          KEEP_LAYOUT: gl.constexpr, s_layout: gl.constexpr):
    """The teaching kernel's dropout keep-mask of the (queries start_m : +BLOCK_M) x (keys start_n : +BLOCK_N)
    tile of head ``bh`` (``flashref.triton.forward._keep``, the same bits), in the accumulator layout ``s_layout``;
    ``KEEP_LAYOUT`` is :func:`keep_layout`'s for this tile and warp count.

    A call's sixteen entries lie in one 16 x 16 block, in two threads four lanes apart (rows i and i + 1), and a
    word's two halves belong to those two rows. So the thread of even i draws the call of column block 2m and its
    partner that of block 2m + 1; they swap words (:func:`_swap_with_lane_4_apart`), and one ``prmt`` a word puts
    this thread's halves side by side, block 2m's low (:func:`_own_halves`): each call is drawn once."""
    # a: i // 16, b: bits 0-2 of i, m: j // 32, e: bits 1-2 of j
    a, b, m, e = _axes4(BLOCK_M // 16, 8, BLOCK_N // 32, 4, KEEP_LAYOUT)
    parity = (b & 1).to(gl.uint32)
    row = ((start_m // 16 + a) * 4 + (b >> 1)).to(gl.uint32)  # i without bits 0 and 3
    col = ((start_n // 16 + m * 2) * 4 + e).to(gl.uint32) + parity * 4  # j without them, in block 2m + parity
    zero = row * 0 + col * 0
    r0, r1, r2, r3 = _philox(seed, col + zero, row + zero, zero + bh.to(gl.uint32), zero, PHILOX_ROUNDS)
    # even lane: lo(r) | lo(partner) << 16 (bytes 0 1 4 5); odd lane: hi(partner) | hi(r) << 16 (bytes 6 7 2 3)
    selector = gl.where(parity == 0, 0x5410, 0x3276).to(gl.uint32) + zero
    y0 = _own_halves(r0, selector)
    y1 = _own_halves(r1, selector)
    y2 = _own_halves(r2, selector)
    y3 = _own_halves(r3, selector)
    top = gl.join(gl.join(y0, y1), gl.join(y2, y3))  # (a, b, m, e, bit0(j), bit3(j)) where bit 3 of i is clear
    bottom = gl.join(gl.join(y2, y3), gl.join(y0, y1))  # the words of j ^ 8: where it is set
    keep = _kept_pairs(top, bottom, drop_below)  # (a, b, m, e, bit0(j), bit3(j), bit4(j), bit3(i))
    keep = gl.permute(keep, (0, 7, 1, 2, 6, 5, 3, 4))  # (a, bit3(i), b, m, bit4(j), bit3(j), e, bit0(j)): in order
    return gl.convert_layout(gl.reshape(keep, (BLOCK_M, BLOCK_N)), s_layout)  # the same layout: no data moves


@gluon.jit
def _dropped(P, seed, bh, start_m, start_n, drop_below, DROPOUT: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, KEEP_LAYOUT: gl.constexpr, s_layout: gl.constexpr):
    """P with the entries :func:`_keep` drops set to 0 (P itself without DROPOUT): what every forward loop does to
    a tile's P once l has summed it (as the teaching kernel does); O is scaled by keep_scale once, at the end."""
    if DROPOUT:
        P = gl.where(_keep(seed, bh, start_m, start_n, drop_below, BLOCK_M, BLOCK_N, KEEP_LAYOUT, s_layout), P, 0.0)
    return P


@gluon.jit
def _swap_with_lane_4_apart(x):
    """The 32-bit ``x`` of the lane four apart (lane ^ 4, ``shfl.sync.bfly``): in a wgmma accumulator the lanes
    that hold rows r and r + 1 of the same columns are four apart."""
    return gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 4, 31, 0xffffffff;", "=r,r", [x], dtype=gl.uint32,
                                     is_pure=True, pack=1)


@gluon.jit
def _own_halves(r, selector):
    """This lane's half of its own word r and of its partner's (lane ^ 4), block 2m's low: ``selector`` 0x5410 on
    the even lane (the low halves: its own word is block 2m's), 0x3276 on the odd one (the high halves)."""
    p = _swap_with_lane_4_apart(r)
    return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [r, p, selector], dtype=gl.uint32,
                                     is_pure=True, pack=1)


@gluon.jit
def _keep_t(seed, bh, start_m, start_n, drop_below, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            KEEP_LAYOUT: gl.constexpr, s_layout: gl.constexpr):
    """:func:`_keep`'s mask of the same queries and keys, transposed: the (keys start_n : +BLOCK_N) x (queries
    start_m : +BLOCK_M) tile that the dK/dV kernels hold, in their accumulator layout ``s_layout`` (``KEEP_LAYOUT`` is
    :func:`keep_t_layout`'s), bit for bit the teaching kernel's (``flashref.triton.forward._keep_t``).

    Here the two threads of a call hold keys j and j + 1 (four lanes apart), and a call's words 0 and 2 belong to
    the even key, 1 and 3 to the odd one; each thread holds both queries of every word's halves. So the thread of
    even j draws query block 2m's call and its partner block 2m + 1's, and each sends the two words of the other's
    key (:func:`_swap_with_lane_4_apart`): two shuffles for two calls, and each call drawn once."""
    # a: j // 16, b: bits 0-2 of j, m: i // 32, e: bits 1-2 of i
    a, b, m, e = _axes4(BLOCK_N // 16, 8, BLOCK_M // 32, 4, KEEP_LAYOUT)
    odd = (b & 1) == 1
    key = ((start_n // 16 + a) * 4 + (b >> 1)).to(gl.uint32)
    qry = ((start_m // 16 + m * 2) * 4 + e).to(gl.uint32) + (b & 1).to(gl.uint32) * 4  # query block 2m + (j % 2)
    zero = key * 0 + qry * 0
    r0, r1, r2, r3 = _philox(seed, key + zero, qry + zero, zero + bh.to(gl.uint32), zero, PHILOX_ROUNDS)
    x0 = _trade_words(r0, r1, odd)  # word 2 (bit3(i) ^ bit3(j)) + j % 2: (block 2m, block 2m + 1)
    x1 = _trade_words(r2, r3, odd)
    top = gl.join(x0, x1)  # (a, b, m, e, bit4(i), bit3(j)) where bit 3 of i is clear
    bottom = gl.join(x1, x0)  # where it is set
    keep = _kept_pairs(top, bottom, drop_below)  # (a, b, m, e, bit4(i), bit3(j), bit0(i), bit3(i))
    keep = gl.permute(keep, (0, 5, 1, 2, 4, 7, 3, 6))  # (a, bit3(j), b, m, bit4(i), bit3(i), e, bit0(i)): in order
    return gl.convert_layout(gl.reshape(keep, (BLOCK_N, BLOCK_M)), s_layout)


@gluon.jit
def _trade_words(even, odd_word, odd):
    """Of a call's words for the even key (``even``) and the odd one (``odd_word``), drawn by this thread for its
    query block (2m for an even key's thread, 2m + 1 for an odd one's): this thread's key's word of block 2m and
    of block 2m + 1, joined on a new last axis, one of them from the partner four lanes over."""
    theirs = _swap_with_lane_4_apart(gl.where(odd, even, odd_word))
    mine = gl.where(odd, odd_word, even)
    return gl.join(gl.where(odd, theirs, mine), gl.where(odd, mine, theirs))


@gluon.jit(do_not_specialize=["seed", "drop_below"])  # 1 and 0 stay runtime values
def hopper_keep_kernel(KEEP, seed, drop_below, N_q, N_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       KEEP_LAYOUT: gl.constexpr, TRANSPOSED: gl.constexpr, num_warps: gl.constexpr):
    """KEEP[bh, i, j] = :func:`_keep`'s bit (TRANSPOSED: :func:`_keep_t`'s), tile by tile in the kernels' layout:
    for tests that it is the teaching kernel's mask (``flashref.triton.dropout_mask``) bit for bit."""
    bh = gl.program_id(2)
    start_m = gl.program_id(0) * BLOCK_M
    start_n = gl.program_id(1) * BLOCK_N
    if TRANSPOSED:  # keys in rows, as the dK/dV kernels hold them
        t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        kept = _keep_t(seed, bh, start_m, start_n, drop_below, BLOCK_M, BLOCK_N, KEEP_LAYOUT, t_layout)
        qry = gl.expand_dims(start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, t_layout)), 0)
        key = gl.expand_dims(start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, t_layout)), 1)
    else:
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        kept = _keep(seed, bh, start_m, start_n, drop_below, BLOCK_M, BLOCK_N, KEEP_LAYOUT, s_layout)
        qry = gl.expand_dims(start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)), 1)
        key = gl.expand_dims(start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
    ptrs = KEEP + bh.to(gl.int64) * N_q * N_k + qry * N_k + key
    gl.store(ptrs, kept.to(gl.int8), mask=(qry < N_q) & (key < N_k))


def keep_mask(seed: int, B: int, H: int, N_q: int, N_k: int, drop_below: int, block_m: int = 64,
              block_n: int = 128, num_warps: int = 4, transposed: bool = False) -> torch.Tensor:
    """The Gluon kernels' dropout keep-mask ``(B, H, N_q, N_k)`` (bool, on the current GPU) for ``seed`` and the
    16-bit threshold ``drop_below``, drawn with (block_m queries, block_n keys) tiles and ``num_warps`` warps, as
    the forward and dQ kernels draw it, or (``transposed``) keys in rows, as the dK/dV kernels do."""
    keep = torch.empty((B, H, N_q, N_k), dtype=torch.int8, device="cuda")
    layout = keep_t_layout(block_n, block_m, num_warps) if transposed else keep_layout(block_m, block_n, num_warps)
    hopper_keep_kernel[(host_cdiv(N_q, block_m), host_cdiv(N_k, block_n), B * H)](
        keep, seed, drop_below, N_q, N_k, BLOCK_M=block_m, BLOCK_N=block_n, KEEP_LAYOUT=layout,
        TRANSPOSED=transposed, num_warps=num_warps)
    return keep.bool()


# ---- Block-sparse: the loops walk lists of the visible blocks ------------------------------------------------
# flashref.triton.ops.visible_block_lists gives, for each block of rows of the mask, [count, j_1 < ... < j_count,
# padding]: the forward and the dQ kernel read the list of their query block (the key blocks it sees), the dK/dV
# kernels the list of their key block in the transposed mask (the query blocks that see it). A block holds
# BLOCK_SIZE / TILE of the streamed tiles, so step n of a loop takes listed tile t = t_lo + n; [t_lo, t_hi) are the
# listed tiles inside the range that causality or a window leaves (as
# :func:`flashref.triton.forward._listed_tiles_before` counts them).

@gluon.jit
def _listed_tiles_before(row, limit, BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr, WARPS: gl.constexpr):
    """How many tiles of the visible-block list at ``row`` lie before row (or key) ``limit``, a multiple of TILE:
    every listed block is TILE-tiled and the list is in increasing order, so they are a prefix of its tiles."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    count = gl.load(row)
    n = gl.to_tensor(0)
    for e0 in range(0, count, 32 * WARPS):
        e = e0 + gl.arange(0, 32 * WARPS, layout=layout)
        start = gl.load(row + 1 + e, mask=e < count, other=0) * BLOCK_SIZE
        before = gl.minimum(gl.maximum(limit - start, 0), BLOCK_SIZE) // TILE
        n += gl.sum(gl.where(e < count, before, 0), axis=0)
    return n


@gluon.jit
def _tile_of(n, first, t_lo, t_hi, list_row, LISTED: gl.constexpr, BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr):
    """The index of the streamed tile a loop's step n takes: ``first + n`` without a block mask, else listed tile
    t_lo + n (clamped to the last one, so that a prefetch past the end reads inside the list; it copies nothing)."""
    if LISTED:
        t = gl.minimum(t_lo + n, gl.maximum(t_hi - 1, 0))
        return gl.load(list_row + 1 + t // (BLOCK_SIZE // TILE)) * (BLOCK_SIZE // TILE) + t % (BLOCK_SIZE // TILE)
    else:
        return first + n


@gluon.jit
def _list_range(LISTED: gl.constexpr, LISTS, bh, H, stride_lb, stride_lh, stride_li, block, first, n_tiles,
                BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr, WARPS: gl.constexpr):
    """(list_row, t_lo, n): with a block mask (LISTED), the list of mask block ``block`` of head bh, and its
    listed tiles inside tiles [first, first + n_tiles): n of them from the list's tile t_lo. Without one, the
    loop's own range: (LISTS, 0, n_tiles), which :func:`_tile_of` never reads. WARPS: the warps running it."""
    list_row = LISTS
    t_lo = 0
    n = n_tiles
    if LISTED:
        list_row = LISTS + (bh // H).to(gl.int64) * stride_lb + (bh % H) * stride_lh + block * stride_li
        t_lo = _listed_tiles_before(list_row, first * TILE, BLOCK_SIZE, TILE, WARPS)
        n = _listed_tiles_before(list_row, gl.maximum(first + n_tiles, first) * TILE, BLOCK_SIZE, TILE, WARPS) - t_lo
    return list_row, t_lo, n


_NO_LISTS: dict = {}


def _list_args(q, lists) -> tuple:
    """(LISTS, stride_lb, stride_lh, stride_li, H) and the constexprs (LISTED, BLOCK_SIZE): ``lists`` = (visible-block
    lists as :func:`flashref.triton.ops.visible_block_lists` gives them, int32 (B, H, n_blocks, n + 1), any
    strides; the mask's block_size), or None (a stand-in, never read)."""
    if lists is None:
        if q.device not in _NO_LISTS:  # made once a device: an allocation (and a fill) at every call would cost
            _NO_LISTS[q.device] = torch.zeros((1, 1, 1), dtype=torch.int32, device=q.device)
        return (_NO_LISTS[q.device], 0, 0, 0, q.shape[1]), dict(LISTED=False, BLOCK_SIZE=1)
    table, block_size = lists
    return (table, *table.stride()[:3], q.shape[1]), dict(LISTED=True, BLOCK_SIZE=int(block_size))


def lists_fit(cfg: dict, part: str, block_size: int) -> bool:
    """Whether a block mask of ``block_size`` maps onto the tiles of ``cfg`` for the ``part`` kernel: a program's
    own rows (keys for dK/dV, queries for dQ and the forward) lie in one mask block, and every streamed tile in one block."""
    own, streamed = (cfg["block_n"], cfg["block_m"]) if part == "dkdv" else (cfg["block_m"], cfg["block_n"])
    return block_size % own == 0 and block_size % streamed == 0


@gluon.jit
def head_origin(bh, H, N, HEAD_D: gl.constexpr, TOKEN_MAJOR: gl.constexpr):
    """(first row, first column) of head bh's N rows in the 2-D view a TMA descriptor has of a (B, H, N, d)
    tensor: (B * H * N, d) rows when it is contiguous; with TOKEN_MAJOR, (B * N, H * d) rows, the layout of a
    model's projections ((B, N, H, d) in memory, seen as (B, H, N, d)), where head h is the column block
    [h * d, +d) of its batch row's N rows. A tile that runs past the head's last row reads the next head's rows,
    or the next batch row's, or TMA's zeros past the tensor's end: the kernels mask those alike."""
    row0 = bh * N
    col0 = bh * 0
    if TOKEN_MAJOR:
        row0 = (bh // H) * N
        col0 = (bh % H) * HEAD_D
    return row0, col0


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kv_base, tile, j, n_tiles,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, col=0):
    """Start the TMA copies of K and V key tile ``tile`` of the head whose rows start at ``kv_base`` (and whose
    columns at ``col``: :func:`head_origin`), for the loop's step j, into slot j % STAGES (nothing when j is past
    the last step). K and V have a barrier each, so Q K^T can start while V is still on its way."""
    slot = j % STAGES
    go = j < n_tiles
    row = kv_base + tile * BLOCK_N
    mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes, pred=go)
    tma.async_copy_global_to_shared(k_desc, [row, col], k_bars.index(slot), k_smem.index(slot), pred=go)
    mbarrier.expect(v_bars.index(slot), v_desc.block_type.nbytes, pred=go)
    tma.async_copy_global_to_shared(v_desc, [row, col], v_bars.index(slot), v_smem.index(slot), pred=go)


@gluon.jit
def _softmax_tile(S, m_i, l_i, j, lo_full, n_full, start_m, N_k, qk_scale, win_left, win_right,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                  s_layout: gl.constexpr, P_SHIFT: gl.constexpr = 0.0):
    """The online-softmax step for (absolute) key tile j: P = exp2(S * scale - m_new + P_SHIFT), the running max
    m and sum l (of P as computed, so l carries the same 2^P_SHIFT), and alpha = exp2(m_old - m_new), the factor
    O must be rescaled by. Tiles outside [lo_full, n_full) hold keys past N_k, right of the diagonal (causal) or
    outside a row's window (WINDOW: query i sees keys i - win_left <= j <= i + win_right): those scores become
    -inf before the max. In a window a row may have seen no key yet (its window starts in a later tile than
    another row's): its max stays -inf and its exponents are taken against 0, not -inf (which would give NaN)."""
    masked = j >= n_full
    if WINDOW:
        masked = masked | (j < lo_full)
    if masked:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(cols < N_k, 0)
        if CAUSAL or WINDOW:
            rows = gl.expand_dims(start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)), 1)
            if CAUSAL:
                keep = keep & (gl.expand_dims(cols, 0) <= rows)
            if WINDOW:
                keep = keep & (gl.expand_dims(cols, 0) >= rows - win_left) & (gl.expand_dims(cols, 0) <= rows + win_right)
        S = gl.where(keep, S, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(S, axis=1) * qk_scale)
    m_sub = m_new
    if WINDOW:
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_sub)
    P = gl.exp2(S * qk_scale - gl.expand_dims(m_sub - P_SHIFT, 1))
    l_i = l_i * alpha + gl.sum(P, axis=1)
    return P, m_new, l_i, alpha


@gluon.jit
def _key_tiles(start_m, N_k, win_left, win_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """(j_lo, n_tiles, lo_full, n_full): the key tiles rows [start_m, +BLOCK_M) visit are j_lo, ..., j_lo +
    n_tiles - 1 (n_tiles <= 0 when a window leaves these rows no key); tiles in [lo_full, n_full) need no mask
    (every row sees every key of them). Without a window j_lo = lo_full = 0 and the visit starts at key 0."""
    j_lo = 0
    lo_full = 0
    hi = N_k
    n_full = N_k // BLOCK_N
    if CAUSAL:
        hi = gl.minimum(N_k, start_m + BLOCK_M)
        n_full = gl.minimum(n_full, (start_m + 1) // BLOCK_N)
    if WINDOW:  # query i sees keys i - win_left <= j <= i + win_right (causal has made win_right 0)
        j_lo = gl.maximum(start_m - win_left, 0) // BLOCK_N
        hi = gl.minimum(hi, gl.maximum(start_m + BLOCK_M + win_right, 0))
        lo_full = gl.cdiv(gl.maximum(start_m + BLOCK_M - 1 - win_left, 0), BLOCK_N)
        n_full = gl.minimum(n_full, gl.maximum(start_m + 1 + win_right, 0) // BLOCK_N)
    return j_lo, gl.cdiv(hi, BLOCK_N) - j_lo, lo_full, n_full


@gluon.jit
def _store_rows(acc, m_i, l_i, O, LSE, M2, L2, bh, start_m, N_q, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr,
                s_layout: gl.constexpr, o_layout: gl.constexpr, WINDOW: gl.constexpr = False, H=1,
                TOKEN_MAJOR: gl.constexpr = False):
    """O = acc / l for rows [start_m, +BLOCK_M) of head bh, the natural-log lse and the backward's (m2, l2). O is
    (B, H, N_q, d) contiguous, or with TOKEN_MAJOR (B, N_q, H, d) in memory (:func:`head_origin`).
    Without a window every real row saw key 0 (top-left causal), so l >= 1; rows past N_q are not stored. In a
    window a row may see no key (l = 0): as the teaching kernel, it stores O = 0, lse = -inf, m2 = 0 and
    l2 = +inf, which make the backward's recomputed P exactly 0."""
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    if WINDOW:
        seen = l_i > 0.0
        l_i = gl.where(seen, l_i, 1.0)
    acc = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    offs_s = start_m + gl.arange(0, BLOCK_M, layout=row_s)
    stat = bh.to(gl.int64) * N_q + offs_s
    log2_l = gl.log2(l_i)
    lse = (m_i + log2_l) * LN2
    if WINDOW:
        lse = gl.where(seen, lse, float("-inf"))
        m_i = gl.where(seen, m_i, 0.0)
        log2_l = gl.where(seen, log2_l, float("inf"))
    gl.store(LSE + stat, lse, mask=offs_s < N_q)
    gl.store(M2 + stat, m_i, mask=offs_s < N_q)
    gl.store(L2 + stat, log2_l, mask=offs_s < N_q)
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    if TOKEN_MAJOR:  # row n of head h of batch row b starts at ((b * N_q + n) * H + h) * d
        rows = ((bh // H).to(gl.int64) * N_q + offs_m) * H + bh % H
    else:
        rows = bh.to(gl.int64) * N_q + offs_m
    ptrs = O + gl.expand_dims(rows * HEAD_D, 1) + gl.expand_dims(offs_d, 0)
    gl.store(ptrs, acc.to(O.dtype.element_ty), mask=gl.expand_dims(offs_m < N_q, 1))


@gluon.jit(do_not_specialize=["seed", "drop_below"])  # 1 and 0 stay runtime values
def hopper_fwd_kernel(q_desc, k_desc, v_desc, O, LSE, M2, L2, N_q, N_k, qk_scale, win_left, win_right, seed,
                      drop_below, keep_scale, LISTS, stride_lb, stride_lh, stride_li, H, HEAD_D: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                      OVERLAP: gl.constexpr, WINDOW: gl.constexpr, DROPOUT: gl.constexpr, KEEP_LAYOUT: gl.constexpr,
                      LISTED: gl.constexpr, BLOCK_SIZE: gl.constexpr, num_warps: gl.constexpr,
                      TOKEN_MAJOR: gl.constexpr = False):
    """Program (pid_m, bh) writes O rows [pid_m * BLOCK_M, +BLOCK_M) of head bh, its lse (natural log) and the
    backward's M2 (base-2 row max) and L2 (log2 of the row sum), as the teaching kernel does. WINDOW: query i
    sees keys i - win_left <= j <= i + win_right only, and the tiles outside every row's window are never
    loaded (the loop counts tiles from the first one visited, so the slots' phases stay its own).

    The descriptors view Q, K, V as 2-D (B * H * N, d) tensors, or with TOKEN_MAJOR as (B * N, H * d) ones, O
    stored in the same layout (:func:`head_origin`). A tile that runs past its head's last row reads the next
    head's (or batch row's) rows, or TMA's zeros past the tensor's end: their scores are masked to -inf (keys),
    or their rows never stored (queries).

    DROPOUT: P is dropped where the teaching kernel's mask for ``seed`` drops it (:func:`_keep`, threshold
    ``drop_below``) after l has summed it, and O is scaled by ``keep_scale`` = 1 / (1 - p) at the end.

    LISTED: a block mask of BLOCK_SIZE (a multiple of both tiles): the loop visits only the key tiles of the
    visible blocks in its query block's list (``LISTS``, as :func:`_list_range` reads it); a row that sees no key
    stores O = 0 and lse = -inf, as in a window. Every visited tile starts at a key each row may see (blocks are
    whole tiles, and a causal diagonal block starts at or before its rows), so no row meets a tile before its
    first key."""
    pid_m = gl.program_id(0)
    if CAUSAL:  # the longest rows first, so the short ones fill the tail of the launch
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    start_m = pid_m * BLOCK_M
    dtype: gl.constexpr = q_desc.dtype

    # wgmma gives each warp 16 rows, stacked down the tile; the tile's columns set the instruction's N.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(s), count=1)
        mbarrier.init(v_bars.index(s), count=1)

    # Key tiles [lo_full, n_full) need no mask; the others hold the ragged end, the causal diagonal or a
    # window's edges. The loop's j counts from tile j_lo (0 without a window).
    j_lo, n_tiles, lo_full, n_full = _key_tiles(start_m, N_k, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    q_base, col = head_origin(bh, H, N_q, HEAD_D, TOKEN_MAJOR)
    kv_base, _ = head_origin(bh, H, N_k, HEAD_D, TOKEN_MAJOR)
    gl.static_assert(not (LISTED and OVERLAP), "the overlapped loop starts with a first key tile a block mask may hide")
    # With a block mask n_tiles becomes the number of listed tiles in [j_lo, j_lo + n_tiles).
    list_row, t_lo, n_tiles = _list_range(LISTED, LISTS, bh, H, stride_lb, stride_lh, stride_li,
                                          start_m // BLOCK_SIZE, j_lo, n_tiles, BLOCK_SIZE, BLOCK_N, num_warps)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_base + start_m, col], q_bar, q_smem)
    # The overlapped loop keeps two tiles in use (K_j, V_{j-1}), so it prefetches one tile fewer.
    for j in gl.static_range(STAGES - 1 if OVERLAP else STAGES):
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kv_base,
                 _tile_of(j, j_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_N), j, n_tiles,
                 BLOCK_N, STAGES, col)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)

    if OVERLAP:
        gl.static_assert(STAGES >= 3, "the overlapped loop holds K_j and V_{j-1}: it needs a third slot to prefetch")
        gl.static_assert(not WINDOW, "the overlapped loop starts with tile 0 alone: a window may visit none")
        # Tile 0's scores and softmax alone; then each step issues S_j = Q K_j^T and O += P_{j-1} V_{j-1},
        # waits for S_j only (the PV product stays in flight), runs softmax j, then waits for O.
        mbarrier.wait(k_bars.index(0), 0)
        S = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        S = warpgroup_mma_wait(0, deps=[S])
        P, m_i, l_i, alpha = _softmax_tile(S, m_i, l_i, 0, lo_full, n_full, start_m, N_k, qk_scale, win_left,
                                           win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, s_layout)
        P = _dropped(P, seed, bh, start_m, 0, drop_below, DROPOUT, BLOCK_M, BLOCK_N, KEEP_LAYOUT, s_layout)
        for j in range(1, n_tiles):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(k_bars.index(slot), (j // STAGES) & 1)
            S = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # O is rescaled for tile j - 1 here, not right after the wait for O below: with those multiplies
            # after the wait, ptxas hoists the wait above the exponentials to interleave them.
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            mbarrier.wait(v_bars.index(prev), ((j - 1) // STAGES) & 1)
            p = gl.convert_layout(P.to(dtype), p_layout)
            acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            # Slot (j - 2) % STAGES was freed by the last step's wait: refill it now, before the softmax.
            # Issued after the wait for O instead, ptxas hoists that wait (with the barrier guarding the
            # slot) above the exponentials, and the overlap is gone.
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kv_base, j - 2 + STAGES, j - 2 + STAGES,
                     n_tiles, BLOCK_N, STAGES, col)
            S = warpgroup_mma_wait(1, deps=[S])
            P, m_i, l_i, alpha = _softmax_tile(S, m_i, l_i, j, lo_full, n_full, start_m, N_k, qk_scale, win_left,
                                               win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, s_layout)
            P = _dropped(P, seed, bh, start_m, j * BLOCK_N, drop_below, DROPOUT, BLOCK_M, BLOCK_N, KEEP_LAYOUT,
                         s_layout)
            acc, p = warpgroup_mma_wait(0, deps=[acc, p])
        last = (n_tiles - 1) % STAGES
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        mbarrier.wait(v_bars.index(last), ((n_tiles - 1) // STAGES) & 1)
        p = gl.convert_layout(P.to(dtype), p_layout)
        acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
        acc, p = warpgroup_mma_wait(0, deps=[acc, p])
    else:
        for j in range(0, n_tiles):
            slot = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_bars.index(slot), phase)
            S = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            tile = _tile_of(j, j_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_N)  # its own index
            # The tile STAGES ahead: with a block mask a load from its list, issued here so that its latency
            # passes under this tile's products and softmax instead of delaying the copy at the loop's end.
            ahead = _tile_of(j + STAGES, j_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_N)
            S = warpgroup_mma_wait(0, deps=[S])
            P, m_i, l_i, alpha = _softmax_tile(S, m_i, l_i, tile, lo_full, n_full, start_m, N_k, qk_scale,
                                               win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, s_layout)
            P = _dropped(P, seed, bh, start_m, tile * BLOCK_N, drop_below, DROPOUT, BLOCK_M, BLOCK_N, KEEP_LAYOUT,
                         s_layout)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            mbarrier.wait(v_bars.index(slot), phase)
            p = gl.convert_layout(P.to(dtype), p_layout)
            acc = warpgroup_mma(p, v_smem.index(slot), acc, is_async=True)
            acc, p = warpgroup_mma_wait(0, deps=[acc, p])
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kv_base, ahead, j + STAGES, n_tiles, BLOCK_N,
                     STAGES, col)

    mbarrier.invalidate(q_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(s))
        mbarrier.invalidate(v_bars.index(s))

    if DROPOUT:  # P~ = P * keep / (1 - p): one scaling of O instead of one per entry of P
        acc = acc * keep_scale
    # A window or a block mask may leave a row no key: stored as O = 0, lse = -inf.
    _store_rows(acc, m_i, l_i, O, LSE, M2, L2, bh, start_m, N_q, BLOCK_M, HEAD_D, s_layout, o_layout, WINDOW | LISTED,
                H, TOKEN_MAJOR)

# ---- Warp specialization: a producer warp feeds two consumer warpgroups ---------------------------------------

@gluon.jit
def _ws_tiles(pid_m, bh, N_k, win_left, win_right, LISTS, stride_lb, stride_lh, stride_li, H, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, LISTED: gl.constexpr,
              BLOCK_SIZE: gl.constexpr, WARPS: gl.constexpr):
    """(j_lo, n_tiles, lo_full, n_full, list_row, t_lo): the key tiles of the program's whole BLOCK_M rows, which
    every partition must agree on (the producer loads these tiles and each consumer takes all of them), as
    :func:`_key_tiles` and, with a block mask, :func:`_list_range` give them. WARPS: the partition's warps."""
    j_lo, n_tiles, lo_full, n_full = _key_tiles(pid_m * BLOCK_M, N_k, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL,
                                                WINDOW)
    list_row, t_lo, n_tiles = _list_range(LISTED, LISTS, bh, H, stride_lb, stride_lh, stride_li,
                                          pid_m * BLOCK_M // BLOCK_SIZE, j_lo, n_tiles, BLOCK_SIZE, BLOCK_N, WARPS)
    return j_lo, n_tiles, lo_full, n_full, list_row, t_lo


@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty,
                 pid_m, bh, N_q, N_k, win_left, win_right, LISTS, stride_lb, stride_lh, stride_li, H,
                 HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, WINDOW: gl.constexpr, FP8: gl.constexpr, LISTED: gl.constexpr,
                 BLOCK_SIZE: gl.constexpr, TOKEN_MAJOR: gl.constexpr):
    """One warp with few registers: it issues every TMA copy. Each consumer warpgroup's Q half has a barrier of
    its own; a K or V slot is refilled once both consumers have arrived on its empty barrier. In FP8, V comes
    transposed, (B * H * d, N_k): the tensor cores take 8-bit operands only with the reduced dimension
    contiguous, and P V reduces over keys. With a block mask it reads each tile's index from the list; the
    load waits here, in the warp that runs ahead, not in the consumers."""
    ROWS: gl.constexpr = BLOCK_M // 2
    q_base, col = head_origin(bh, H, N_q, HEAD_D, TOKEN_MAJOR)
    kv_base, _ = head_origin(bh, H, N_k, HEAD_D, TOKEN_MAJOR)
    for wg in gl.static_range(2):
        mbarrier.expect(q_bars.index(wg), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_base + pid_m * BLOCK_M + wg * ROWS, col], q_bars.index(wg),
                                        q_smem.index(wg))
    j_lo, n_tiles, lo_full, n_full, list_row, t_lo = _ws_tiles(pid_m, bh, N_k, win_left, win_right, LISTS,
                                                               stride_lb, stride_lh, stride_li, H, BLOCK_M, BLOCK_N,
                                                               CAUSAL, WINDOW, LISTED, BLOCK_SIZE, 1)
    for j in range(n_tiles):  # j counts the visited tiles: the slots' phases follow the loop, not the keys
        slot = j % STAGES
        phase = (j // STAGES) & 1
        tile = _tile_of(j, j_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_N)
        row = kv_base + tile * BLOCK_N
        # A fresh mbarrier counts as having completed the phase before its first, so round 0 passes at once.
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        if FP8:
            tma.async_copy_global_to_shared(v_desc, [bh * HEAD_D, tile * BLOCK_N], v_ready.index(slot),
                                            v_smem.index(slot))
        else:
            tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _v_operand(v_smem, slot, FP8: gl.constexpr):
    """V tile `slot` as the (keys x d) operand of P V: a transposed view of the V^T tile in FP8."""
    if FP8:
        v = v_smem.index(slot).permute((1, 0))
    else:
        v = v_smem.index(slot)
    return v


@gluon.jit
def _wait_products(acc, p, S, FP8: gl.constexpr):
    """Wait for every product in flight; (acc, S). The wait holds the register operand P alive until then, but
    Triton's wait takes no 8-bit operands: in FP8, ptxas alone keeps P's registers until the product is done."""
    if FP8:
        acc, S = warpgroup_mma_wait(0, deps=[acc, S])
    else:
        acc, p, S = warpgroup_mma_wait(0, deps=[acc, p, S])
    return acc, S


@gluon.jit
def _take_turn(turns, t, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until the other warpgroup has issued its products of the same round (warpgroup 0 goes
    first: its wait in round 0 is on the phase a fresh barrier counts as done)."""
    if PINGPONG:
        mbarrier.wait(turns.index(WG), (t & 1) ^ (1 - WG))


@gluon.jit
def _give_turn(turns, WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - WG), count=1)


@gluon.jit
def _issue_pv(acc, alpha, P, v_smem, v_ready, turns, t, row_o: gl.constexpr, p_layout: gl.constexpr,
              STAGES: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr, FP8: gl.constexpr):
    """Round t's first product: O rescaled by softmax t-1's alpha, then O += P_{t-1} V_{t-1} issued once V_{t-1}
    is in and it is this warpgroup's turn. Returns (acc, p): p's registers stay in use until the wait."""
    prev = (t - 1) % STAGES
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    p = gl.convert_layout(P.to(v_smem.dtype), p_layout)
    _take_turn(turns, t, WG, PINGPONG)
    mbarrier.wait(v_ready.index(prev), ((t - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, _v_operand(v_smem, prev, FP8), acc, is_async=True)
    return acc, p


@gluon.jit
def _opaque_positive(t):
    """t > 0 for a t >= 1, through an instruction the compilers cannot see into, so that neither can decide it."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [t], dtype=gl.int32, is_pure=True, pack=1) > 0


@gluon.jit
def _ws_rounds(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turns, acc, m_i, l_i, s_zero, q_scale,
               k_scales, j_lo, n_tiles, lo_full, n_full, list_row, t_lo, start_m, N_k, win_left, win_right,
               row_o: gl.constexpr, p_layout: gl.constexpr, s_layout: gl.constexpr, ROWS: gl.constexpr,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr, CAUSAL: gl.constexpr,
               WINDOW: gl.constexpr, PINGPONG: gl.constexpr, FP8: gl.constexpr, P_SHIFT: gl.constexpr,
               LISTED: gl.constexpr, BLOCK_SIZE: gl.constexpr, OVERLAP: gl.constexpr, seed, bh, drop_below,
               DROPOUT: gl.constexpr, KEEP_LAYOUT: gl.constexpr):
    """A consumer's rounds over its n_tiles >= 1 key tiles (in round t tile j_lo + t, or with a block mask the
    list's tile t_lo + t): (acc, m, l) at the end. A tile's index is read while its scores are in flight.

    Round 0 computes S_0 and its softmax alone, and a last round P V of the last tile alone. In between, round t
    issues O += P_{t-1} V_{t-1} and S_t = Q K_t^T back to back and waits for both before softmax t; or, with
    OVERLAP, FlashAttention-3's intra-warpgroup order: it rescales O by alpha_{t-1}, issues S_t, then O +=
    P_{t-1} V_{t-1}, waits for S_t alone (``warpgroup_mma_wait(1)``) and runs softmax t while P_{t-1} V_{t-1} is
    still on the tensor cores; then it waits for O.

    Where that last wait stands decides everything. ptxas (read in the SASS, CUDA 12.8 and 13) schedules a wgmma
    wait at the top of the basic block it is in: written after the exponentials in their own block, it runs
    before them, and the overlap is gone (what :func:`hopper_fwd_kernel`'s ``overlap`` shows). Here the wait
    stands in a block of its own, behind a branch on ``t > 0`` that the compilers cannot decide (t >= 1, so it is
    always taken); the other side of the branch waits too, on other registers, so that LLVM does not merge the
    two sides back into one block.

    DROPOUT: each softmax's P is dropped where :func:`_keep` drops it (after l has summed it), as in
    :func:`hopper_fwd_kernel`; the two consumers' Philox work takes turns with each other's products."""
    _take_turn(turns, 0, WG, PINGPONG)
    mbarrier.wait(k_ready.index(0), 0)
    S = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _give_turn(turns, WG, PINGPONG)
    tile = _tile_of(0, j_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_N)
    S = warpgroup_mma_wait(0, deps=[S])
    mbarrier.arrive(k_empty.index(0), count=1)
    s_scale = q_scale
    if FP8:
        s_scale = q_scale * gl.load(k_scales + tile)
    P, m_i, l_i, alpha = _softmax_tile(S, m_i, l_i, tile, lo_full, n_full, start_m, N_k, s_scale, win_left,
                                       win_right, ROWS, BLOCK_N, CAUSAL, WINDOW, s_layout, P_SHIFT)
    P = _dropped(P, seed, bh, start_m, tile * BLOCK_N, drop_below, DROPOUT, ROWS, BLOCK_N, KEEP_LAYOUT, s_layout)
    for t in range(1, n_tiles):
        slot = t % STAGES
        prev = (t - 1) % STAGES
        if OVERLAP:
            # O is rescaled now, while no product writes it
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p = gl.convert_layout(P.to(v_smem.dtype), p_layout)
            _take_turn(turns, t, WG, PINGPONG)
            mbarrier.wait(k_ready.index(slot), (t // STAGES) & 1)
            S = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((t - 1) // STAGES) & 1)
            acc = warpgroup_mma(p, _v_operand(v_smem, prev, FP8), acc, is_async=True)
            _give_turn(turns, WG, PINGPONG)
            tile = _tile_of(t, j_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_N)
            S = warpgroup_mma_wait(1, deps=[S])  # S_t is done; P_{t-1} V_{t-1} may still run
            mbarrier.arrive(k_empty.index(slot), count=1)
        else:
            acc, p = _issue_pv(acc, alpha, P, v_smem, v_ready, turns, t, row_o, p_layout, STAGES, WG, PINGPONG,
                               FP8)
            mbarrier.wait(k_ready.index(slot), (t // STAGES) & 1)
            S = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            _give_turn(turns, WG, PINGPONG)
            tile = _tile_of(t, j_lo, t_lo, t_lo + n_tiles, list_row, LISTED, BLOCK_SIZE, BLOCK_N)
            acc, S = _wait_products(acc, p, S, FP8)
            mbarrier.arrive(v_empty.index(prev), count=1)
            mbarrier.arrive(k_empty.index(slot), count=1)
        s_scale = q_scale
        if FP8:
            s_scale = q_scale * gl.load(k_scales + tile)
        P, m_i, l_i, alpha = _softmax_tile(S, m_i, l_i, tile, lo_full, n_full, start_m, N_k, s_scale,
                                           win_left, win_right, ROWS, BLOCK_N, CAUSAL, WINDOW, s_layout, P_SHIFT)
        P = _dropped(P, seed, bh, start_m, tile * BLOCK_N, drop_below, DROPOUT, ROWS, BLOCK_N, KEEP_LAYOUT, s_layout)
        if OVERLAP:
            if _opaque_positive(t):  # always: the wait for P_{t-1} V_{t-1}, in a block of its own
                done, S = _wait_products(acc, p, s_zero, FP8)
            else:
                done, S = warpgroup_mma_wait(0, deps=[acc, s_zero])
            acc = done
            mbarrier.arrive(v_empty.index(prev), count=1)
    # The last round: P V of the last tile alone.
    last = (n_tiles - 1) % STAGES
    acc, p = _issue_pv(acc, alpha, P, v_smem, v_ready, turns, n_tiles, row_o, p_layout, STAGES, WG, PINGPONG, FP8)
    _give_turn(turns, WG, PINGPONG)
    acc, S = _wait_products(acc, p, s_zero, FP8)
    mbarrier.arrive(v_empty.index(last), count=1)
    return acc, m_i, l_i


@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turns, O, LSE, M2, L2,
                 QS, KS, VS, pid_m, bh, N_q, N_k, qk_scale, win_left, win_right, seed, drop_below, keep_scale, LISTS,
                 stride_lb, stride_lh, stride_li, H, WG: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                 PINGPONG: gl.constexpr, FP8: gl.constexpr, LISTED: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                 OVERLAP: gl.constexpr, DROPOUT: gl.constexpr, KEEP_LAYOUT: gl.constexpr, TOKEN_MAJOR: gl.constexpr):
    """Consumer warpgroup WG (4 warps) owns rows [WG * BLOCK_M/2, +BLOCK_M/2) of the program's tile. Round t
    issues O += P_{t-1} V_{t-1} and S_t = Q K_t^T back to back, waits for both, frees their slots, then runs
    softmax t. With PINGPONG, the rounds of the two warpgroups take turns on the tensor cores: one issues its
    products while the other computes exponentials.

    FP8: Q, K and V^T are e4m3 with scales QS (one per 64 query rows of a head), KS (one per key tile) and VS
    (one per head). The scores of tile t are scaled by QS * KS[t] with the softmax scale; P goes to e4m3
    times 2^8, so probabilities down to 2^-14 stay in its normal range (down to 2^-17 in its subnormals), and
    O = acc * VS / l."""
    ROWS: gl.constexpr = BLOCK_M // 2
    INSTR_K: gl.constexpr = 32 if FP8 else 16  # a wgmma reduces 32 bytes a step
    P_SHIFT: gl.constexpr = 8.0 if FP8 else 0.0
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, INSTR_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, INSTR_K])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if FP8 else 2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    start_m = pid_m * BLOCK_M + WG * ROWS
    j_lo, n_tiles, lo_full, n_full, list_row, t_lo = _ws_tiles(pid_m, bh, N_k, win_left, win_right, LISTS,
                                                               stride_lb, stride_lh, stride_li, H, BLOCK_M, BLOCK_N,
                                                               CAUSAL, WINDOW, LISTED, BLOCK_SIZE, 4)
    q = q_smem.index(WG)
    q_scale = qk_scale
    k_scales = KS
    if FP8:
        # a consumer whose rows all lie past N_q (N_q <= 64) has no scale of its own: it stores nothing either
        q_scale = qk_scale * gl.load(QS + bh * gl.cdiv(N_q, ROWS) + start_m // ROWS, mask=start_m < N_q, other=1.0)
        k_scales = KS + bh * gl.cdiv(N_k, BLOCK_N)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([ROWS], gl.float32, row_s)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bars.index(WG), 0)

    if WINDOW | LISTED:
        # a window or a block mask may leave every row of the program without a key: then nothing is loaded
        if n_tiles > 0:
            acc, m_i, l_i = _ws_rounds(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turns, acc, m_i, l_i,
                                       s_zero, q_scale, k_scales, j_lo, n_tiles, lo_full, n_full, list_row, t_lo,
                                       start_m, N_k, win_left, win_right, row_o, p_layout, s_layout, ROWS, BLOCK_N,
                                       STAGES, WG, CAUSAL, WINDOW, PINGPONG, FP8, P_SHIFT, LISTED, BLOCK_SIZE,
                                       OVERLAP, seed, bh, drop_below, DROPOUT, KEEP_LAYOUT)
    else:
        acc, m_i, l_i = _ws_rounds(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turns, acc, m_i, l_i,
                                   s_zero, q_scale, k_scales, j_lo, n_tiles, lo_full, n_full, list_row, t_lo,
                                   start_m, N_k, win_left, win_right, row_o, p_layout, s_layout, ROWS, BLOCK_N,
                                   STAGES, WG, CAUSAL, WINDOW, PINGPONG, FP8, P_SHIFT, LISTED, BLOCK_SIZE, OVERLAP,
                                   seed, bh, drop_below, DROPOUT, KEEP_LAYOUT)
    if FP8:  # undo the 2^8 on P (in acc and l alike) and V's scale
        acc = acc * (gl.load(VS + bh) / 256.0)
        l_i = l_i / 256.0
    if DROPOUT:  # P~ = P * keep / (1 - p), as in hopper_fwd_kernel
        acc = acc * keep_scale
    _store_rows(acc, m_i, l_i, O, LSE, M2, L2, bh, start_m, N_q, ROWS, HEAD_D, s_layout, o_layout, WINDOW | LISTED,
                H, TOKEN_MAJOR)


@gluon.jit(do_not_specialize=["seed", "drop_below"])  # 1 and 0 stay runtime values
def hopper_ws_fwd_kernel(q_desc, k_desc, v_desc, O, LSE, M2, L2, QS, KS, VS, N_q, N_k, qk_scale, win_left, win_right,
                         seed, drop_below, keep_scale, LISTS, stride_lb, stride_lh, stride_li, H, HEAD_D: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                         PINGPONG: gl.constexpr, FP8: gl.constexpr, WINDOW: gl.constexpr, LISTED: gl.constexpr,
                         BLOCK_SIZE: gl.constexpr, num_warps: gl.constexpr, OVERLAP: gl.constexpr = False,
                         DROPOUT: gl.constexpr = False, KEEP_LAYOUT: gl.constexpr = None,
                         TOKEN_MAJOR: gl.constexpr = False):
    """The warp-specialized forward: program (pid_m, bh) as in :func:`hopper_fwd_kernel`, its work split among
    three partitions. The kernel's own 4 warps are consumer warpgroup 0; a worker warpgroup of 4 is consumer 1;
    one worker warp is the producer. The launch caps registers so that 12 warps fit an SM, and the partitions'
    requests move them: 24 a thread for the producer, 240 for each consumer. FP8 (e4m3 Q, K, V^T with the scales
    QS, KS, VS; see :func:`_ws_consumer`) is a switch of this kernel: the schedule is the same. LISTED: a block
    mask's lists, as :func:`hopper_fwd_kernel` walks them (BLOCK_SIZE a multiple of BLOCK_M and BLOCK_N).
    DROPOUT (``seed``, ``drop_below``, ``keep_scale`` as :func:`hopper_fwd_kernel` takes them; not with FP8): each
    consumer drops its rows' P by :func:`_keep` with ``KEEP_LAYOUT`` = :func:`keep_layout` of a consumer's tile.
    TOKEN_MAJOR: Q, K, V read and O written in the (B, N, H, d) layout of :func:`head_origin`."""
    gl.static_assert(num_warps == 4, "the kernel's own warps are one consumer warpgroup")
    gl.static_assert(not (DROPOUT and FP8), "dropout runs in fp16 and bf16")
    gl.static_assert(not (TOKEN_MAJOR and FP8), "FP8 reads its own quantized (B, H, N, d) copies")
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    ROWS: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(turns.index(i), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)  # both consumers must be done with a slot
        mbarrier.init(v_empty.index(s), count=2)

    # Tuples built here keep constexprs as constexprs only when written out whole (a sum of tuples does not).
    gl.warp_specialize([
        (_ws_consumer, (q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turns, O, LSE, M2, L2,
                        QS, KS, VS, pid_m, bh, N_q, N_k, qk_scale, win_left, win_right, seed, drop_below, keep_scale,
                        LISTS, stride_lb, stride_lh, stride_li, H, 0, HEAD_D, BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW,
                        PINGPONG, FP8, LISTED, BLOCK_SIZE, OVERLAP, DROPOUT, KEEP_LAYOUT, TOKEN_MAJOR)),
        (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty,
                        pid_m, bh, N_q, N_k, win_left, win_right, LISTS, stride_lb, stride_lh, stride_li, H, HEAD_D,
                        BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW, FP8, LISTED, BLOCK_SIZE, TOKEN_MAJOR)),
        (_ws_consumer, (q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turns, O, LSE, M2, L2,
                        QS, KS, VS, pid_m, bh, N_q, N_k, qk_scale, win_left, win_right, seed, drop_below, keep_scale,
                        LISTS, stride_lb, stride_lh, stride_li, H, 1, HEAD_D, BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW,
                        PINGPONG, FP8, LISTED, BLOCK_SIZE, OVERLAP, DROPOUT, KEEP_LAYOUT, TOKEN_MAJOR)),
    ], [1, 4], [24, 240])


def supported(q, k, v) -> str | None:
    """None when :func:`hopper_forward` can take these (already checked) q, k, v, else the reason it cannot:
    the teaching kernel takes them instead."""
    if not q.is_cuda:
        return f"needs an sm_90 (Hopper) GPU, got device {q.device}"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 9:  # (a T4 is sm_75, an A100 sm_80, a Blackwell sm_100: none has wgmma)
        return f"needs an sm_90 (Hopper) GPU, got {torch.cuda.get_device_name(q.device)} (sm_{major}{minor})"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"needs float16 or bfloat16 q, k, v, got {q.dtype}"
    if k.shape[1] != q.shape[1]:
        return f"has no grouped-query attention: k and v need q's {q.shape[1]} heads, got {k.shape[1]}"
    if q.shape[3] not in HEAD_DIMS:
        return f"needs a head dim in {HEAD_DIMS}, got {q.shape[3]}"
    if max(q.shape[0] * q.shape[1] * max(q.shape[2], k.shape[2]), 1) >= 2**31:
        return "needs B * H * N < 2**31 (TMA coordinates are 32-bit)"
    return None


SWITCHES = ("block_m", "block_n", "num_warps", "stages", "overlap", "warp_specialize", "pingpong")


def default_config(head_dim: int, warp_specialize: bool | None = None) -> dict:
    """The switches :func:`hopper_forward` runs with when given none: the fastest of sweeps on an H100 (fp16,
    B x N = 65536, H x d = 2048, N = 4K and 16K, causal and not; ``python -m flashref.bench hopper``).
    d = 64: one warpgroup over 64 x 128 tiles, four programs an SM, no warp specialization (it measured 0.9-1.1x
    there). d = 128 and 256: warp-specialized, a producer warp and two consumer warpgroups of 64 rows; ping-pong
    measured 0.84-1.13x of that in fp16 across two runs, no steadier than the runs' spread, so it is off (FP8,
    where it measured 0.98-1.10x, gaining at N = 16K, keeps it on). At d = 256 each consumer overlaps its
    softmax with its P V product (``overlap``): the benchmark's step 7 over step 5 (fp16, B 8, H 8, N 4K) is
    1.09x without the causal mask and 1.04x with it in the committed run (0.97-1.07x in the four runs before); at
    d <= 128 0.94-1.01x but for one point (1.09x at d = 128, 4K, causal; 0.97x the run before), no steady gain,
    so it is off there. ``warp_specialize`` picks the best tile
    of either kind."""
    if warp_specialize is None:
        warp_specialize = head_dim > 64
    if warp_specialize:
        return dict(block_m=128, block_n=128 if head_dim <= 128 else 64, num_warps=4, stages=2,
                    overlap=head_dim > 128, warp_specialize=True, pingpong=False)
    if head_dim <= 64:
        return dict(block_m=64, block_n=128, num_warps=4, stages=1, overlap=False, warp_specialize=False,
                    pingpong=False)
    return dict(block_m=128, block_n=64, num_warps=8, stages=2, overlap=False, warp_specialize=False, pingpong=False)


#: Head dims at which :func:`flashref.triton.flash_attention` runs dropout in the Gluon forward (d = 256's overlapped
#: loop does not fit in shared memory; the loop without overlap measured slower than the teaching kernel).
DROPOUT_HEAD_DIMS = (64, 128)


def dropout_config(head_dim: int) -> dict:
    """The switches of the forward with dropout: the warp-specialized kernel at both head dims (below). d = 64, until
    2026-12-01: the overlapped 64 x 128 tile, the fastest of ten one-warpgroup and two-warpgroup tiles
    with and without ``overlap`` on an H100 (fp16, B 8, H 16, N 4K, p = 0.1, causal and not). Philox's integer
    work is what dropout adds (44% more SASS instructions in that tile's kernel, 58% before each of Philox's
    multiplies became one instruction, :func:`_mul_wide`; 72% then in the loop without overlap), and only the
    overlapped loop hides it behind a product in flight: without ``overlap`` every tile measured 0.74-1.03x the
    teaching kernel's speed, with it 1.08-1.10x (64 x 128 tiles). d = 128: the warp-specialized kernel of
    :func:`default_config`, where one consumer's Philox work runs while the other's products are on the tensor
    cores: on an H200 (same shapes) 2.65 ms without the causal mask and 1.47 ms with it, against 2.98 and 1.61
    for the overlapped one-warpgroup 64 x 64 tile that ran before (1.09-1.20x the teaching kernel's speed on the
    H100), and 0.76x / 0.76x the speed of the same kernel without dropout. At d = 64 the warp-specialized kernel
    measured 0.96x (0.72x of its speed without dropout) with the causal mask and 1.04x without it on the H100,
    with eight entries a Philox call; with sixteen (2026-12-01, H200, same shapes, medians of three interleaved
    do_bench rounds) 1.03x non-causal (1.68 ms against 1.73) and 1.00x causal (0.950 against 0.951), and
    another run 1.06x and 1.02x; ping-pong, ``overlap`` and 64-key steps measured 0.69-0.99x of it. So both head
    dims run the warp-specialized kernel with dropout."""
    if head_dim not in DROPOUT_HEAD_DIMS:
        raise ValueError(f"the Gluon forward runs dropout at head dims {DROPOUT_HEAD_DIMS}, got {head_dim}")
    return default_config(head_dim, warp_specialize=True)


def config(head_dim: int, **switches) -> dict:
    """Every switch of :func:`hopper_forward`: those given (``None`` counts as not given) over
    :func:`default_config`'s, checked for combinations the kernels cannot run."""
    unknown = set(switches) - set(SWITCHES)
    if unknown:
        raise TypeError(f"hopper_forward got unknown switches {sorted(unknown)}; it takes {SWITCHES}")
    given = {k: v for k, v in switches.items() if v is not None}
    cfg = dict(default_config(head_dim, given.get("warp_specialize")), **given)
    if cfg["pingpong"] and not cfg["warp_specialize"]:
        raise ValueError("pingpong=True takes turns between the consumer warpgroups of warp_specialize=True")
    if cfg["warp_specialize"] and (cfg["num_warps"] != 4 or cfg["block_m"] % 128):
        raise ValueError(f"warp_specialize=True runs its own schedule: it needs num_warps=4 (one consumer warpgroup) "
                         f"and block_m a multiple of 128 (two consumers of 64 rows or more), got "
                         f"num_warps={cfg['num_warps']}, block_m={cfg['block_m']}")
    if cfg["overlap"] and cfg["stages"] < 3 and not cfg["warp_specialize"]:
        raise ValueError(f"overlap=True needs stages >= 3 (K_j and V_(j-1) are in use while a third tile loads), "
                         f"got stages={cfg['stages']}")
    return cfg


def _descriptor_blocks(cfg: dict, head_dim: int):
    """The TMA boxes: Q rows a copy (a consumer's half of the tile when warp-specialized), K and V rows."""
    q_rows = cfg["block_m"] // 2 if cfg["warp_specialize"] else cfg["block_m"]
    return [q_rows, head_dim], [cfg["block_n"], head_dim]


def kernel_and_constexprs(cfg: dict, head_dim: int, causal: bool, window: bool = False, dropout: bool = False,
                          block_size: int | None = None, token: bool = False):
    """The Gluon kernel a config launches, its compile-time arguments and launch options. ``window``: the kernel
    that bounds each row's keys (``win_left``, ``win_right``); the one-program overlapped loop has none (the
    warp-specialized one has). ``dropout``: the
    kernel that drops P (``seed``, ``drop_below``, ``keep_scale``; both kernels take them).
    ``block_size``: the kernel that walks a block mask's lists of visible blocks (one warpgroup, two, or
    warp-specialized; without overlap, a window or dropout: :func:`block_mask_config`'s tile). ``token``: the
    kernel that reads Q, K, V and writes O in the (B, N, H, d) layout (:func:`token_major`)."""
    if block_size is not None and (cfg["overlap"] or window or dropout or not lists_fit(cfg, "fwd", block_size)):
        raise ValueError(f"a block mask runs a loop without overlap, without a window or dropout, on tiles that its "
                         f"blocks ({block_size}) hold whole; got {cfg}")
    if window and cfg["overlap"] and not cfg["warp_specialize"]:
        raise ValueError("overlap=True takes no window without warp_specialize: its loop starts with a first key "
                         "tile that a window may not have")
    shape = dict(HEAD_D=head_dim, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], STAGES=cfg["stages"],
                 CAUSAL=bool(causal), WINDOW=bool(window), LISTED=block_size is not None,
                 BLOCK_SIZE=int(block_size or 1), TOKEN_MAJOR=bool(token))
    if cfg["warp_specialize"]:
        # 12 warps (3 warpgroups) at WS_MAXNREG each fit the SM's 64K registers; the partitions then move them.
        keep = keep_layout(cfg["block_m"] // 2, cfg["block_n"], 4) if dropout else None  # a consumer's tile
        return (hopper_ws_fwd_kernel, dict(shape, PINGPONG=bool(cfg["pingpong"]), OVERLAP=bool(cfg["overlap"]),
                                           FP8=False, num_warps=4, DROPOUT=bool(dropout), KEEP_LAYOUT=keep),
                dict(maxnreg=WS_MAXNREG))
    keep = keep_layout(cfg["block_m"], cfg["block_n"], cfg["num_warps"]) if dropout else None
    return (hopper_fwd_kernel, dict(shape, OVERLAP=bool(cfg["overlap"]), DROPOUT=bool(dropout), KEEP_LAYOUT=keep,
                                    num_warps=cfg["num_warps"]),
            _occupancy_options(cfg, head_dim) if block_size is not None else {})


#: Shared memory an H100 program may hold, and the registers of its SM.
H100_SMEM_PER_SM, H100_REGISTERS_PER_SM = 227 * 1024, 65536


def _occupancy_options(cfg: dict, head_dim: int) -> dict:
    """Launch options of the loop that walks a block mask's lists: where shared memory holds four programs of
    one warpgroup an SM (d = 64's 64 x 128 tile with one stage, about 41 KB each), ``maxnreg`` caps a thread
    at 128 registers (65536 / (4 x 128)) so that registers do not hold them to three. Left to itself, ptxas
    gives this loop 132-134 registers, which round up to 136; asked for 128 it compiles it in 126 without
    spilling (the compile test checks). On an H100 (kernels alone, fp16, causal, sliding-window and BigBird
    masks, B x N = 16K tokens at N = 1K-16K) the cap measured 1.00-1.12x; at density 1, 1.04x at N = 16K and 0.97x
    at 4K (``python -m flashref.bench sparse-tiles`` times it with and without the cap).
    The dense loop gets no cap: it measured 0.97-1.02x with one. Other tiles get no option."""
    smem = 2 * head_dim * (cfg["block_m"] + 2 * cfg["stages"] * cfg["block_n"])  # Q, then K and V in each stage
    if cfg["num_warps"] != 4 or H100_SMEM_PER_SM // smem < 4:
        return {}
    return dict(maxnreg=H100_REGISTERS_PER_SM // (4 * 32 * cfg["num_warps"]) // 8 * 8)


def block_mask_config(head_dim: int, block_size: int = 128) -> dict:
    """The switches of the forward with a block mask of ``block_size``, the fastest of the tiles that
    ``python -m flashref.bench sparse-tiles`` times on an H100 (fp16, sliding window, BigBird, causal and all-True
    masks of 128-token blocks, B 1 N 16K and B 4 N 4K; ``book/data/sparse_tiles_bench.json``), as the teaching
    forward's time over the tile's, kernels alone.

    d = 64: :func:`default_config`'s tile (64 x 128, one warpgroup, one stage, with :func:`_occupancy_options`' register
    cap): 1.09-1.18x, where the warp-specialized tile gave 0.93-1.13x. d = 128 and 256 with blocks of 128 keys or a
    multiple: the warp-specialized tile of the dense forward (a producer warp reads the lists and loads the listed
    tiles; two consumer warpgroups of 64 rows). At d = 128 it measured 1.22-1.42x, where the best tile without warp
    specialization (64 x 64, one warpgroup, two or three stages) gave 0.96-1.22x; at d = 256 1.54-1.95x, where the
    default's two-warpgroup 128 x 64 tile gave 1.41-1.59x. With ping-pong the same tile measured 1.26-1.39x at d = 128
    and 1.52-1.89x at d = 256: no steady gain, so it stays off as in the dense forward; so does ``overlap``, which
    the dense forward takes at d = 256 but this tile was not measured with. Smaller blocks take 64 x 64 tiles of
    one warpgroup (three stages at d = 128, two at d = 256, where a third does not fit in shared memory); at d = 64
    they keep the teaching kernel."""
    if head_dim >= 128:
        if block_size % 128 == 0:  # the tile measured: without overlap
            return dict(default_config(head_dim, warp_specialize=True), overlap=False)
        return dict(block_m=64, block_n=64, num_warps=4, stages=3 if head_dim <= 128 else 2, overlap=False,
                    warp_specialize=False, pingpong=False)
    return default_config(head_dim, warp_specialize=False)


def hopper_forward(q, k, v, causal=False, sm_scale=None, *, window_size=(-1, -1), block_m=None, block_n=None,
                   num_warps=None, stages=None, overlap=None, warp_specialize=None, pingpong=None, check_finite=True):
    """``(o, lse, (m2, l2))`` for (B, H, N, d) q, k, v on an sm_90 GPU, with the switches of this module's
    docstring (``None`` takes :func:`default_config`'s value). ``window_size=(left, right)``: query i sees keys
    ``i - left <= j <= i + right`` (-1: unbounded), as :func:`flashref.triton.flash_attention`'s; a row that sees
    no key gets O = 0 and lse = -inf. Checks as :func:`flashref.triton.flash_attention`, whose ``check_finite``
    this takes too (False skips the pass over q, k and v for NaN and its host synchronization)."""
    from flashref.triton.ops import Features, _check  # the package's checks: types, shapes, dtypes, devices, ...

    d, scale = _check(q, k, v, causal, sm_scale, check_finite)
    feat = Features(q, k, causal=causal, scale=scale, window_size=window_size, check_finite=False)
    cfg = config(d, block_m=block_m, block_n=block_n, num_warps=num_warps, stages=stages, overlap=overlap,
                 warp_specialize=warp_specialize, pingpong=pingpong)
    why = supported(q, k, v)
    if why is not None:
        raise ValueError(f"hopper_forward {why}")
    window = (feat.win_left, feat.win_right) if feat.window else None
    return launch_forward(q, k, v, feat.causal, scale, cfg, window=window)


def launch_forward(q, k, v, causal: bool, scale: float, cfg: dict, window=None, dropout=None, lists=None,
                   token: bool = False):
    """:func:`hopper_forward` on inputs already checked (and :func:`supported`), with the switches ``cfg`` (what a
    dispatch from :func:`flashref.triton.flash_attention` will call: its checks are done by then). ``window``:
    ``(win_left, win_right)`` as :class:`flashref.triton.ops.Features` holds them, or None. ``dropout``: ``(seed,
    drop_below, keep_scale)`` as :meth:`flashref.triton.ops.Features.scalars` gives them, or None (with dropout,
    :func:`dropout_config`'s ``cfg`` is the measured one). ``lists``: (the visible-block lists of a block mask,
    :func:`flashref.triton.ops.visible_block_lists`'s; its block_size), or None; with :func:`block_mask_config`'s
    ``cfg``. ``token``: q, k, v are all :func:`token_major` and are read in place (o comes in their layout).
    Returns ``(o, lse, (m2, l2))``."""
    return ForwardLaunch(q, k, causal, scale, cfg, window, dropout is not None, lists, token)(q, k, v, dropout)


class ForwardLaunch:
    """The part of :func:`launch_forward` that depends only on the call's signature (shapes, dtype, switches, the
    block mask), worked out once: the TMA boxes and layouts, the kernel, its constexprs, grid and fixed arguments.
    Calling it allocates the outputs, makes the descriptors of this call's q, k, v and launches the kernel; a plan
    of one call signature (:class:`flashref.triton.ops.StepPlan`) keeps it and calls it at every step."""

    def __init__(self, q, k, causal: bool, scale: float, cfg: dict, window=None, dropout: bool = False, lists=None,
                 token: bool = False):
        B, H, N_q, d = q.shape
        N_k = k.shape[2]
        self.d, self.stats_shape, self.token = d, (3, B, H, N_q), bool(token)
        self.q_block, self.kv_block = _descriptor_blocks(cfg, d)
        gdt = gl.float16 if q.dtype == torch.float16 else gl.bfloat16
        self.q_layout, self.kv_layout = shared_layout(self.q_block, gdt), shared_layout(self.kv_block, gdt)
        kernel, constexprs, options = kernel_and_constexprs(cfg, d, causal, window is not None, dropout,
                                                            None if lists is None else lists[1], self.token)
        self.launch = relaunch.Bound(kernel, (host_cdiv(N_q, cfg["block_m"]), B * H), **constexprs, **options)
        self.warp_specialize = cfg["warp_specialize"]
        win_left, win_right = window if window is not None else (0, 0)
        self.fixed = (N_q, N_k, scale * LOG2E, win_left, win_right)
        self.listed = _list_args(q, lists)[0]

    def __call__(self, q, k, v, dropout=None):
        """``(o, lse, (m2, l2))`` of this call's q, k, v (``dropout``: its ``(seed, drop_below, keep_scale)``, or
        None without). With ``token`` (all three :func:`token_major`), o is written in that layout too."""
        q2, k2, v2 = (rows_view(x, self.token) for x in (q, k, v))
        q_desc = descriptor(q2, self.q_block, self.q_layout)
        k_desc = descriptor(k2, self.kv_block, self.kv_layout)
        v_desc = descriptor(v2, self.kv_block, self.kv_layout)
        o = empty_output(q, self.token)
        lse, m2, l2 = torch.empty(self.stats_shape, dtype=torch.float32, device=q.device).unbind(0)
        scales = (lse, lse, lse) if self.warp_specialize else ()  # FP8's scale pointers, unread here
        drop = dropout if dropout is not None else (0, 0, 1.0)
        self.launch(q_desc, k_desc, v_desc, o, lse, m2, l2, *scales, *self.fixed, *drop, *self.listed)
        return o, lse, (m2, l2)


# ---- FP8: the numerics live in flashref.fp8; here, the fused quantizer and the kernel's launch ---------------

_FP8_MAX = tl.constexpr(FP8_MAX)  # for kernels


@triton.jit
def _fp8_blocks_kernel(X, X8, SCALE, N, N_out, out_head, out_row, out_col,
                       ROWS: tl.constexpr, SUB: tl.constexpr, D: tl.constexpr, PER_HEAD: tl.constexpr):
    """One program: ROWS rows of one head of X (contiguous, (B*H, N, D)) divided by their scale and rounded to e4m3
    (round to nearest even). The scale is amax / FP8_MAX of these rows, written to SCALE[head, block], or with
    PER_HEAD the head's, read from SCALE[head]. X8 is addressed through strides, so V^T is written transposed;
    rows from N to N_out are written as zeros (V^T's padding). SUB rows at a time, twice over (amax, then the
    values): a whole 128 x 256 block would not fit in registers."""
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, D)
    X += bh * N * D
    X8 += bh * out_head
    if PER_HEAD:
        scale = tl.load(SCALE + bh)
    else:
        amax = tl.zeros((SUB,), dtype=tl.float32)
        for r0 in range(blk * ROWS, blk * ROWS + ROWS, SUB):
            rows = r0 + tl.arange(0, SUB)
            x = tl.load(X + rows[:, None] * D + cols[None, :], mask=rows[:, None] < N, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        amax = tl.max(amax, axis=0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, _FP8_MAX), 1.0)  # an all-zero block: any scale is exact
        tl.store(SCALE + bh * tl.num_programs(0) + blk, scale)
    for r0 in range(blk * ROWS, blk * ROWS + ROWS, SUB):
        rows = r0 + tl.arange(0, SUB)
        x = tl.load(X + rows[:, None] * D + cols[None, :], mask=rows[:, None] < N, other=0.0)
        # div_rn: the correctly rounded quotient, as torch's, so both quantizers give the same bits
        x8 = tl.math.div_rn(x.to(tl.float32), scale).to(tl.float8e4nv)
        tl.store(X8 + rows[:, None] * out_row + cols[None, :] * out_col, x8, mask=rows[:, None] < N_out)


def _quantize_rows(x: torch.Tensor, rows: int):
    """:func:`flashref.fp8.quantize_blocks`: the fused kernel on a GPU, torch operations elsewhere (the same bits:
    the GPU test compares them)."""
    B, H, N, d = x.shape
    if x.is_cuda:
        x8 = torch.empty((B, H, N, d), dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty((B, H, host_cdiv(N, rows)), dtype=torch.float32, device=x.device)
        _fp8_launch(x, x8, scale, scale.shape[-1], N, N, (N * d, d, 1), rows, per_head=False)
        return x8, scale
    return fp8.quantize_blocks(x, rows)


def _fp8_launch(x, x8, scale, n_blocks, N, N_out, strides, rows, per_head):
    d = x.shape[-1]
    sub = min(rows, 8192 // d)  # 32 values a thread of 8 warps each pass
    _fp8_blocks_kernel[(n_blocks, x.shape[0] * x.shape[1])](x.contiguous(), x8, scale, N, N_out, *strides, ROWS=rows,
                                                            SUB=sub, D=d, PER_HEAD=per_head, num_warps=8)


def _quantize_v(v: torch.Tensor):
    """V (B, H, N_k, d) to (V^T in e4m3, (B, H, d, N_k rounded up to 16), one scale a head)."""
    B, H, N_k, d = v.shape
    v_scale = fp8.head_scale(v)
    if v.is_cuda:
        N_pad = fp8.padded_keys(N_k)
        vt = torch.empty((B, H, d, N_pad), dtype=torch.float8_e4m3fn, device=v.device)
        _fp8_launch(v, vt, v_scale, host_cdiv(N_pad, 64), N_k, N_pad, (d * N_pad, 1, N_pad), 64, per_head=True)
        return vt, v_scale
    return fp8.quantize_v_transposed(v, v_scale), v_scale


def quantize_fp8(q, k, v, *, block_n: int = 128, incoherent: bool = False, seed: int = 0) -> Fp8Inputs:
    """Q, K, V (B, H, N, d) to :class:`Fp8Inputs`, per-block scaled; with ``incoherent``, Q and K are first
    multiplied by the same :func:`random_rotation`, which leaves Q K^T as it was. On a GPU one fused kernel a
    tensor (read twice, for each block's scale and then its values; written once in 8 bits); elsewhere torch
    operations with the same result."""
    if incoherent:
        M = random_rotation(q.shape[-1], seed, q.device)
        q, k = q.float() @ M, k.float() @ M
    q8, q_scale = _quantize_rows(q, FP8_Q_ROWS)
    k8, k_scale = _quantize_rows(k, block_n)
    vt, v_scale = _quantize_v(v)
    return Fp8Inputs(q8, k8, vt, q_scale, k_scale, v_scale, block_n)


def fp8_attention(x: Fp8Inputs, causal=False, sm_scale=None, *, out_dtype=torch.float16, stages=None,
                  pingpong=True):
    """``(o, lse)`` from quantized inputs: the warp-specialized kernel with e4m3 products (P in e4m3 too) and
    fp32 softmax. ``sm_scale`` defaults to 1/sqrt(d)."""
    from flashref import validation

    if not isinstance(x, Fp8Inputs):
        raise TypeError(f"x must be the Fp8Inputs that quantize_fp8 returns, got {type(x).__name__}")
    validation.check_bool("causal", causal)
    B, H, N_q, d = x.q.shape
    N_k = x.k.shape[2]
    scale = validation.check_sm_scale(sm_scale, d)
    if not x.q.is_cuda or torch.cuda.get_device_capability(x.q.device)[0] != 9:
        raise ValueError(f"fp8_attention needs its inputs on an sm_90 (Hopper) GPU, got device {x.q.device}")
    cfg = config(d, warp_specialize=True, block_n=x.block_n, stages=stages, pingpong=pingpong, overlap=False)
    if cfg["block_m"] != 2 * FP8_Q_ROWS:
        raise ValueError(f"fp8_attention's Q scales cover {FP8_Q_ROWS} rows, one consumer's: block_m must be "
                         f"{2 * FP8_Q_ROWS}, got {cfg['block_m']}")
    f8 = gl.float8e4nv
    q_block, kv_block = [FP8_Q_ROWS, d], [x.block_n, d]
    q_desc = TensorDescriptor.from_tensor(x.q.view(-1, d), q_block, shared_layout(q_block, f8))
    k_desc = TensorDescriptor.from_tensor(x.k.view(-1, d), kv_block, shared_layout(kv_block, f8))
    vt_block = [d, x.block_n]
    v_desc = TensorDescriptor.from_tensor(x.vt.view(-1, x.vt.shape[-1]), vt_block,
                                          shared_layout(vt_block, f8))
    o = torch.empty((B, H, N_q, d), dtype=out_dtype, device=x.q.device)
    lse, m2, l2 = torch.empty((3, B, H, N_q), dtype=torch.float32, device=x.q.device).unbind(0)
    _, constexprs, options = kernel_and_constexprs(cfg, d, causal)
    grid = (host_cdiv(N_q, cfg["block_m"]), B * H)
    hopper_ws_fwd_kernel[grid](q_desc, k_desc, v_desc, o, lse, m2, l2, x.q_scale, x.k_scale, x.v_scale, N_q, N_k,
                               scale * LOG2E, 0, 0, 0, 0, 1.0, *_list_args(x.q, None)[0], **dict(constexprs, FP8=True),
                               **options)
    return o, lse


def hopper_fp8_forward(q, k, v, causal=False, sm_scale=None, *, incoherent=False, seed=0, block_n=None,
                       stages=None, pingpong=True, check_finite=True):
    """``(o, lse)`` of fp16 or bf16 q, k, v through e4m3: :func:`quantize_fp8` (per-block scales, and with
    ``incoherent`` the random rotation of Q and K) then :func:`fp8_attention`; o in q's dtype. An sm_90 GPU.
    ``check_finite`` as :func:`hopper_forward`'s."""
    from flashref.triton.ops import _check

    d, scale = _check(q, k, v, causal, sm_scale, check_finite)
    # 8-bit tiles take half the shared memory: 128 keys a tile at every head dim
    cfg = config(d, warp_specialize=True, block_n=128 if block_n is None else block_n, stages=stages,
                 pingpong=pingpong, overlap=False)
    why = supported(q, k, v)
    if why is not None:
        raise ValueError(f"hopper_fp8_forward {why}")
    x = quantize_fp8(q, k, v, block_n=cfg["block_n"], incoherent=incoherent, seed=seed)
    return fp8_attention(x, causal, scale, out_dtype=q.dtype, stages=cfg["stages"], pingpong=cfg["pingpong"])


def dequantize_fp8(x: Fp8Inputs):
    """:func:`flashref.fp8.dequantize`: the float32 Q, K, V that ``x`` stands for."""
    return fp8.dequantize(x)
