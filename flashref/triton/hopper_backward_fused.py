"""The backward pass on Hopper in one Gluon kernel, FlashAttention-3's way: dQ from the dK/dV kernel's own dS.

:mod:`flashref.triton.hopper_backward` runs two kernels: dK/dV (four products a tile pair: S^T, dP^T, dV, dK) and
dQ (three: S and dP again, then dQ). The dQ kernel recomputes two products to stay deterministic, and it takes
38-44% of the backward's time. Here the dK/dV kernel's program (128 keys of one head: a producer warp and two
consumer warpgroups of 64 keys, as :func:`flashref.triton.hopper_backward.hopper_ws_bwd_dkdv_kernel`) also
computes each query tile's share of dQ from what it already has:

    each consumer w:  S^T, P^T, dV_w += P^T dO_i, dP^T, dS^T_w = P^T * (dP^T - D_i), dK_w += dS^T_w Q_i
                      dS^T_w into shared memory (both warpgroups read both)
    dQ_i's share:     dS_i,0 K_0 + dS_i,1 K_1   (all 128 keys; K_0, K_1 already in shared memory)

Five products a tile pair instead of seven. The share is added into an fp32 buffer by a TMA reduce-add
(``cp.reduce.async.bulk.tensor ... .add``: the adds happen in the L2 cache, and nothing waits for them but the
shared-memory tile's reuse), then cast to q's dtype. The programs' adds into one dQ row come in no fixed order, so
the result's last bits vary from run to run: this is the backward for ``deterministic=False`` (notebook
``14_flashattention3_on_hopper``, "The backward in one kernel").

Who computes the dQ product, measured on an H100 (fp16, B x N = 65536, H x d = 2048, N = 4K and 16K, causal and
not; time against the two kernels, :func:`flashref.triton.hopper_backward.hopper_backward`, medians of three
do_bench windows):

- d = 128: each warpgroup half of dQ's columns, every step (FlashAttention-3's split: a 64 x 64 fp32 share a
  warpgroup, 32 registers a thread): 1.13-1.18x. Each warpgroup the whole of dQ on alternate steps measured
  1.02-1.13x (its 64 x 128 share takes 64 registers: ptxas spills 176-256 bytes a thread, the split 40-76).
- d = 64: the warpgroups alternate, whole 64 x 64 shares: 1.05-1.13x; halves of 32 columns 0.98-1.03x.
- One warpgroup of 64 keys computing its own share (the dK/dV kernel's d = 64 tile) measured 0.94-0.97x at
  d = 64 and 0.77-0.79x at d = 128, though the reduce itself cost only 4-8% of its time.

The ordered variant (``ordered=True``; ``deterministic=True`` with dropout runs it). FlashAttention-2's
deterministic idea was tried first: each program adds into a dQ copy of its own, so every element takes its adds
in a fixed order, built as one launch a key block of every head. It was reproducible but slow: on an H200 (B 8,
H 16, N 4K, d 64 and 128, causal and not, fp16, the backward alone) 1.14-1.32x the two kernels' time without
dropout. Nsight Compute read why (d = 64, not causal, caches not flushed): its 32 launches read 8.8 GB from DRAM
and wrote 4.4 GB, where the one launch reads 0.41 and writes 0.27; the L2 hit rate fell from 94% to 19%. A launch's
128 programs belong to 128 heads, and each streams its own Q, dO and fp32 dQ through the 50 MB L2 cache; in one
launch of every key block a head's 32 programs run side by side and share them.

So the order is kept inside the one launch, with FlashAttention-3's semaphores: one a (head, query tile, column
half). A program's adds into tile i wait until its semaphore reads the program's rank among the tile's adders
(:func:`_rank`); once the add has landed, the program sets rank + 1. Three choices make the waits rare and cheap:

- The rank is the order in which programs of equal speed reach the tile. Causal, key block n starts at its
  diagonal, tile 2n, so tile i is reached first by block i // 2 and then by the blocks below it, each two steps
  behind the one before. Without causal masking each block starts at a tile of its own (tile n * m_q // m_k) and
  wraps around: the same staircase. (If every block visited the tiles in the same order, block n would wait for
  block n - 1 at every tile, and the head's last block would start 31 hand-overs late.)
- A program takes its (head, key block) from a ticket counter, heads in order and a head's key blocks from the
  last to the first: whoever holds a ticket has an SM, and a causal program waits only for blocks that drew theirs
  first, so no dispatch order can deadlock it. Without causal masking the last block waits for the first, which
  draws last: :func:`ordered_supported` asks that a head's blocks fit on the GPU's multiprocessors together.
- The consumers hand each dQ share to a writer warp through shared memory and go on; only the writer waits for a
  turn and issues the TMA reduce. It checks that a reduce has landed (``cp.async.bulk.wait_group 0``) and
  releases that tile when the next share has been handed over, before it waits for that one's turn.

Measured on an H200 (B 8, H 16, N 4K, fp16, the backward alone, medians of five do_bench windows taken in turns:
``python -m flashref.bench features --parts dropout-backward``, ``book/data/dropout_backward.json``; ms, and the
ordered kernel's speed against the two kernels and the atomic one):

| d | causal | p | two kernels | atomic | ordered | vs two kernels | vs atomic |
|---|---|---|---|---|---|---|---|
| 64 | no | 0 | 3.70 | 3.26 | 3.43 | 1.08x | 0.95x |
| 64 | no | 0.1 | 4.79 | 3.76 | 4.09 | 1.17x | 0.92x |
| 64 | yes | 0 | 1.99 | 1.92 | 2.00 | 1.00x | 0.96x |
| 64 | yes | 0.1 | 2.52 | 2.41 | 2.35 | 1.07x | 1.03x |
| 128 | no | 0 | 6.40 | 5.42 | 6.03 | 1.06x | 0.90x |
| 128 | no | 0.1 | 7.72 | 6.17 | 6.49 | 1.19x | 0.95x |
| 128 | yes | 0 | 3.59 | 3.19 | 3.44 | 1.04x | 0.93x |
| 128 | yes | 0.1 | 4.26 | 3.69 | 3.83 | 1.11x | 0.96x |

An earlier run (the second of two interleaved rounds) had 0.89-0.98x against the atomic kernel and 1.11-1.18x
against the two kernels with dropout: 0.98x, not 1.03x, at d = 64 causal with dropout.

A writer that released a tile only after issuing the next reduce (one always in flight) measured within 4% of
these either way (in another run), and deadlocked without causal masking wherever ceil(N_q / 64) ==
ceil(N_k / 128).

Built without the writer warp (each consumer waited for its turn and for its reduce to land itself) it ran at
0.65-0.90x the atomic kernel; of that, rotating the visits and drawing tickets alone cost 0.95x, and the consumers'
waits for the reduces to land 0.92x more. With dropout the kernel draws the mask once where the two kernels draw it
twice; without dropout the two kernels keep the deterministic calls (:func:`flashref.triton.ops._ordered_takes`
says why).

Scope: what :func:`flashref.triton.hopper_backward.supported` takes at head dims 64 and 128, top-left causal or not,
and dropout (the forward's mask, drawn once a tile for all three gradients where the two kernels draw it
twice); no window, ALiBi or block mask (those keep the two kernels). Triton's Gluon has no public TMA reduce yet:
:func:`_tma_reduce_add` reaches the builder's, and :func:`supported` says so where a Triton lacks it.
"""

from __future__ import annotations

import torch
import triton
from triton._C.libtriton import gluon_ir, ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from flashref.triton import hopper, hopper_backward, ops, relaunch
from flashref.triton.forward import LOG2E
from flashref.triton.hopper_backward import (_descriptors, _dropped_dp, _mask_args, _p_operand,
                                             _query_tiles, _row_view, _stat_descriptors, _store_dkdv, _wgmma_layout,
                                             _ws_dkdv_producer, _ws_smem)

HEAD_DIMS = (64, 128)
#: Head dims at which the kernel takes dropout (at d = 128 with the mask drawn late: :func:`_fused_step`).
DROPOUT_HEAD_DIMS = (64, 128)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` into global memory at ``tensor_desc``'s tile ``coord`` (TMA, issued by
    one thread; ``tma.store_wait`` in that thread before ``src`` is written again)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@builtin
def _warpgroup_barrier(_semantic=None):
    """The threads of this partition (one warpgroup) wait for one another: a named barrier of its 128 threads in a
    warp-specialized kernel (Triton 3.7's ``gl.barrier``, 3.6's ``gl.thread_barrier``)."""
    return _semantic.debug_barrier()


@gluon.jit
def _add_dq_share(dq, dq_t, dq_desc, row, col, sm_scale, WAIT: gl.constexpr):
    """dq * sm_scale into the shared tile dq_t, then reduced into dQ's (row, col) tile. WAIT: how many of this
    warpgroup's reduces may still be reading their tiles (the one that last read dq_t must be done)."""
    tma.store_wait(WAIT)  # in the thread that issued them, so the others wait for it at the barrier
    _warpgroup_barrier()
    dq_t.store(dq * sm_scale)
    fence_async_shared()  # the TMA unit reads what the threads wrote
    _warpgroup_barrier()  # every thread's part is written before the one thread issues the reduce
    _tma_reduce_add(dq_desc, [row, col], dq_t)


@gluon.jit
def _rank(i, nb, m_k, m_q, CAUSAL: gl.constexpr, PER_KEY_BLOCK: gl.constexpr):
    """Key block nb's place among the adders into dQ tile i in the ordered backward: the order in which programs
    of equal speed reach the tile. Causal, block nb visits tiles PER_KEY_BLOCK * nb onwards, so tile i is first
    reached by the last block whose diagonal it holds, then by the blocks below it. Otherwise block nb starts at
    tile nb * m_q // m_k and wraps around, so the same order runs on cyclically past block 0 to m_k - 1."""
    if CAUSAL:
        return gl.minimum(i // PER_KEY_BLOCK, m_k - 1) - nb
    else:
        return (((i + 1) * m_k - 1) // m_q - nb + m_k) % m_k


@gluon.jit
def _wait_turn(sem, rank):
    """Spin until the semaphore at ``sem`` reads ``rank`` (every thread of the warpgroup, acquiring at GPU scope):
    the adders before this one into the tile have landed. The proxy fence orders the TMA reduce after it."""
    gl.inline_asm_elementwise("{ .reg .pred p; .reg .b32 v; spin: ld.acquire.gpu.global.b32 v, [$1]; "
                              "setp.ne.b32 p, v, $2; @p bra spin; fence.proxy.async.global; mov.b32 $0, v; }",
                              "=r,l,r", [sem, rank], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _signal_done(sem, value):
    """This warp's TMA reduces complete (``cp.async.bulk.wait_group 0``: their writes done, where
    ``tma.store_wait`` waits only for their reads of shared memory), then the semaphore at ``sem`` set to ``value``
    with release semantics: the next adder into that tile may go."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.b32 $0, $1;", "=r,r",
                              [value], dtype=gl.int32, is_pure=False, pack=1)
    _warpgroup_barrier()  # the one thread that issued them has waited
    gl.inline_asm_elementwise("st.release.gpu.global.b32 [$1], $2; mov.b32 $0, 0;", "=r,l,r", [sem, value],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _share_slot(n, h, SPLIT_COLS: gl.constexpr):
    """The shared-memory slot of step n's dQ share (its column half h with SPLIT_COLS): by step parity, and then
    by half (at d = 64 the parity is also the warpgroup whose turn it is)."""
    if SPLIT_COLS:
        return (n % 2) * 2 + h
    else:
        return n % 2


@gluon.jit
def _hand_dq_share(dq, n, h, dq_smem, dq_full, dq_empty, sm_scale, SPLIT_COLS: gl.constexpr):
    """The ordered backward's consumer side: dq * sm_scale into its slot once the writer has freed it, then the
    writer told (:func:`_dq_writer` adds it in its turn)."""
    slot = _share_slot(n, h, SPLIT_COLS)
    mbarrier.wait(dq_empty.index(slot), ((n // 2) & 1) ^ 1)  # (a fresh barrier passes round 0 at once)
    dq_smem.index(slot).store(dq * sm_scale)
    fence_async_shared()  # the TMA unit reads what the threads wrote
    mbarrier.arrive(dq_full.index(slot), count=1)


@gluon.jit
def _signal_share(n, h, i_lo, sems, nb, m_k, m_q, dq_empty, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr,
                  SPLIT_COLS: gl.constexpr):
    """The share of step n (half h) has landed: its tile's next adder may go, and its slot is free."""
    i = _tile_at(n, i_lo, m_q, CAUSAL, True)
    _signal_done(sems + i * 2 + h, _rank(i, nb, m_k, m_q, CAUSAL, 128 // BLOCK_M) + 1)
    mbarrier.arrive(dq_empty.index(_share_slot(n, h, SPLIT_COLS)), count=1)


@gluon.jit
def _dq_writer(dq_smem, dq_full, dq_empty, dq_desc, sems, q_base, i_lo, n_tiles, nb, m_k, m_q,
               BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, SPLIT_COLS: gl.constexpr):
    """One warp of the ordered backward: every dQ share the consumers hand over, in step order, waited for its turn
    (:func:`_wait_turn`) and reduced into dQ by TMA. The share before it is signalled to its tile's next adder once
    it has landed, checked when this one has been handed over and before this one waits for its turn: a signal that
    waited for the next turn could close a ring of waits (without causal masking, with as many key blocks as query
    tiles every program would wait for the next one's signal). The consumers never wait on another program; only
    this warp does."""
    HALVES: gl.constexpr = 2 if SPLIT_COLS else 1
    COLS: gl.constexpr = dq_desc.block_type.shape[1]
    for n in range(0, n_tiles):
        i = _tile_at(n, i_lo, m_q, CAUSAL, True)
        rank = _rank(i, nb, m_k, m_q, CAUSAL, 128 // BLOCK_M)
        for h in gl.static_range(HALVES):
            slot = _share_slot(n, h, SPLIT_COLS)
            mbarrier.wait(dq_full.index(slot), (n // 2) & 1)
            if h == 1:
                _signal_share(n, 0, i_lo, sems, nb, m_k, m_q, dq_empty, BLOCK_M, CAUSAL, SPLIT_COLS)
            elif n > 0:
                _signal_share(n - 1, HALVES - 1, i_lo, sems, nb, m_k, m_q, dq_empty, BLOCK_M, CAUSAL, SPLIT_COLS)
            _wait_turn(sems + i * 2 + h, rank)
            _tma_reduce_add(dq_desc, [q_base + i * BLOCK_M, h * COLS], dq_smem.index(slot))
    if n_tiles > 0:
        _signal_share(n_tiles - 1, HALVES - 1, i_lo, sems, nb, m_k, m_q, dq_empty, BLOCK_M, CAUSAL, SPLIT_COLS)


@gluon.jit
def _fused_step(n, q_smem, do_smem, k_smem, lse_smem, delta_smem, ds_smem, dq_smem, k_t, v_t, ready, empty, ds_full,
                ds_empty, dq_desc, dk, dv, keys, key_live, i_lo, q_base, bh, first_key, N_q, sm_scale, qk_scale, seed,
                drop_below, dq_full, dq_empty, m_q, WG: gl.constexpr, HEAD_D: gl.constexpr,
                BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, SPLIT_COLS: gl.constexpr,
                DROPOUT: gl.constexpr, KEEP_LAYOUT: gl.constexpr, ORDERED: gl.constexpr):
    """Step n of consumer WG: query tile i_lo + n against its 64 keys, then dQ's share of all 128 keys: half its
    columns (SPLIT_COLS), or all of them on the steps n % 2 == WG. DROPOUT: the forward's mask of these keys and
    queries, drawn once for dV, dK and dQ alike (:func:`flashref.triton.hopper._keep_t`; the row statistics carry
    keep_scale: :func:`flashref.triton.hopper_backward._dropped_dp`), as
    :func:`flashref.triton.hopper_backward._dkdv_tile` applies it. It is drawn after
    both products, and lse2 and D are read after it (``_dkdv_tile``'s ``LATE_MASK``). At d = 128, drawn while the
    products run, ptxas spilled 512-592 bytes a thread; drawn late with the statistics read early, 316-320; so,
    132-204 (Triton 3.7, with eight 16-bit numbers a Philox call; 44-88 with sixteen entries a call). On an H200
    (B 8, H 16, N 4K, fp16, p = 0.1, the kernel alone, medians of five do_bench rounds) dropout so added 1.06 ms
    non-causal and 0.80 causal to the kernel's 5.64 and 3.23 ms, where with the statistics read early it added 1.96
    and 2.13 (the causal kernel then slower than the two kernels). At d = 64, drawn early, sixteen entries a call
    spill 36-52 bytes, and late none; the H200's forward + backward step with p = 0.1 took 5.72 and 3.35 ms early
    (non-causal, causal), 5.56 and 3.40 late: so late here too."""
    dtype: gl.constexpr = q_smem.dtype
    ROWS: gl.constexpr = 64
    s_layout: gl.constexpr = _wgmma_layout(4, BLOCK_M)
    a_layout: gl.constexpr = _wgmma_layout(4, HEAD_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    slot = n % STAGES
    buf = n % 2
    mbarrier.wait(ready.index(slot), (n // STAGES) & 1)
    i = _tile_at(n, i_lo, m_q, CAUSAL, ORDERED)
    q_t = q_smem.index(slot)
    do_t = do_smem.index(slot)
    s_zero = gl.zeros([ROWS, BLOCK_M], gl.float32, s_layout)
    St = warpgroup_mma(k_t, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dPt = warpgroup_mma(v_t, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    LATE: gl.constexpr = DROPOUT  # at both head dims (the docstring says why)
    kept = None
    if DROPOUT and not LATE:  # Philox's integer work while both products run
        kept = hopper._keep_t(seed, bh, i * BLOCK_M, first_key, drop_below, BLOCK_M, ROWS, KEEP_LAYOUT, s_layout)
    queries = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s)
    if LATE:
        St, dPt = warpgroup_mma_wait(0, deps=[St, dPt])
        kept = hopper._keep_t(seed, bh, i * BLOCK_M, first_key, drop_below, BLOCK_M, ROWS, KEEP_LAYOUT, s_layout)
        dPt = _dropped_dp(dPt, kept, DROPOUT)  # (the statistics carry keep_scale)
        lse2 = _row_view(lse_smem, slot, BLOCK_M, STAGES).load(col_s)
    else:
        lse2 = _row_view(lse_smem, slot, BLOCK_M, STAGES).load(col_s)
        D = _row_view(delta_smem, slot, BLOCK_M, STAGES).load(col_s)
        St = warpgroup_mma_wait(1, deps=[St])
    # Keys past N_k (the next head's rows) are masked here, unlike in the dK/dV kernel: their dK and dV are never
    # stored, but their dS would reach dQ.
    keep = gl.expand_dims(queries < N_q, 0) & key_live
    if CAUSAL:
        keep = keep & (gl.expand_dims(queries, 0) >= gl.expand_dims(keys, 1))
    Pt = gl.exp2(gl.where(keep, St * qk_scale - gl.expand_dims(lse2, 0), float("-inf")))
    p = _p_operand(Pt, kept, dtype, p_layout, DROPOUT)
    dv = warpgroup_mma(p, do_t, dv, is_async=True)
    if LATE:
        D = _row_view(delta_smem, slot, BLOCK_M, STAGES).load(col_s)
    else:
        dPt = _dropped_dp(warpgroup_mma_wait(1, deps=[dPt]), kept, DROPOUT)
    dSt = Pt * (dPt - gl.expand_dims(D, 0))
    ds_t = ds_smem.index(buf * 2 + WG)
    mbarrier.wait(ds_empty.index(buf), ((n // 2) & 1) ^ 1)  # the dQ product two steps back has read this buffer
    ds_t.store(dSt.to(dtype))
    fence_async_shared()  # the tensor cores of both warpgroups read what the threads wrote
    mbarrier.arrive(ds_full.index(buf), count=1)
    dk = warpgroup_mma(ds_t, q_t, dk, is_async=True)
    if SPLIT_COLS:
        HALF: gl.constexpr = HEAD_D // 2
        mbarrier.wait(ds_full.index(buf), (n // 2) & 1)  # the other warpgroup's dS^T too
        dq = warpgroup_mma(ds_smem.index(buf * 2).permute((1, 0)), k_smem.index(0).slice(WG * HALF, HALF, dim=1),
                           gl.zeros([BLOCK_M, HALF], gl.float32, _wgmma_layout(4, HALF)), use_acc=False,
                           is_async=True)
        dq = warpgroup_mma(ds_smem.index(buf * 2 + 1).permute((1, 0)), k_smem.index(1).slice(WG * HALF, HALF, dim=1),
                           dq, is_async=True)
        dv, dk, dq, p = warpgroup_mma_wait(0, deps=[dv, dk, dq, p])
        mbarrier.arrive(ds_empty.index(buf), count=1)
        mbarrier.arrive(empty.index(slot), count=1)  # Q_i and dO_i are done with
        if ORDERED:
            _hand_dq_share(dq, n, WG, dq_smem, dq_full, dq_empty, sm_scale, SPLIT_COLS)
        else:
            _add_dq_share(dq, dq_smem.index(buf * 2 + WG), dq_desc, q_base + i * BLOCK_M, WG * HALF, sm_scale, 1)
    else:
        # The products are waited for before the branch (a product in flight cannot cross it); the other warpgroup's
        # work keeps the tensor cores busy meanwhile.
        dv, dk, p = warpgroup_mma_wait(0, deps=[dv, dk, p])
        mbarrier.arrive(empty.index(slot), count=1)
        if n % 2 == WG:
            mbarrier.wait(ds_full.index(buf), (n // 2) & 1)
            dq = warpgroup_mma(ds_smem.index(buf * 2).permute((1, 0)), k_smem.index(0),
                               gl.zeros([BLOCK_M, HEAD_D], gl.float32, a_layout), use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_smem.index(buf * 2 + 1).permute((1, 0)), k_smem.index(1), dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=[dq])
            mbarrier.arrive(ds_empty.index(buf), count=1)
            if ORDERED:
                _hand_dq_share(dq, n, 0, dq_smem, dq_full, dq_empty, sm_scale, SPLIT_COLS)
            else:
                _add_dq_share(dq, dq_smem.index(WG), dq_desc, q_base + i * BLOCK_M, 0, sm_scale, 0)
    return dk, dv


@gluon.jit
def _tile_at(n, i_lo, m_q, CAUSAL: gl.constexpr, ORDERED: gl.constexpr):
    """The query tile of step n: i_lo + n, wrapped around the m_q tiles in the ordered non-causal backward (whose
    programs start at different tiles: :func:`_rank`)."""
    if ORDERED and not CAUSAL:
        return (i_lo + n) % m_q
    else:
        return i_lo + n



@gluon.jit
def _fused_consumer(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, ready, empty,
                    ds_full, ds_empty, dq_desc, DK, DV, bh, start_n, i_lo, n_tiles, N_q, N_k, sm_scale, qk_scale,
                    seed, drop_below, dq_full, dq_empty, m_q, WG: gl.constexpr, HEAD_D: gl.constexpr,
                    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, SPLIT_COLS: gl.constexpr,
                    DROPOUT: gl.constexpr, KEEP_LAYOUT: gl.constexpr, ORDERED: gl.constexpr):
    """Consumer warpgroup WG: keys [start_n + 64 WG, +64) over every query tile of the ring; their dK and dV at the
    end, dQ's shares as it goes (ORDERED: handed to the writer warp, :func:`_dq_writer`)."""
    ROWS: gl.constexpr = 64
    a_layout: gl.constexpr = _wgmma_layout(4, HEAD_D)
    row_s: gl.constexpr = gl.SliceLayout(1, _wgmma_layout(4, BLOCK_M))
    first_key = start_n + WG * ROWS
    keys = first_key + gl.arange(0, ROWS, layout=row_s)
    key_live = gl.expand_dims(keys < N_k, 1)
    dk = gl.zeros([ROWS, HEAD_D], gl.float32, a_layout)
    dv = gl.zeros([ROWS, HEAD_D], gl.float32, a_layout)
    q_base = bh * N_q
    mbarrier.wait(kv_bar, 0)
    for n in range(0, n_tiles):
        dk, dv = _fused_step(n, q_smem, do_smem, k_smem, lse_smem, delta_smem, ds_smem, dq_smem, k_smem.index(WG),
                             v_smem.index(WG), ready, empty, ds_full, ds_empty, dq_desc, dk, dv, keys, key_live, i_lo,
                             q_base, bh, first_key, N_q, sm_scale, qk_scale, seed, drop_below, dq_full, dq_empty,
                             m_q, WG, HEAD_D, BLOCK_M, STAGES, CAUSAL, SPLIT_COLS, DROPOUT, KEEP_LAYOUT, ORDERED)
    tma.store_wait(0)
    _store_dkdv(DK, DV, dk, dv, first_key, bh, N_k, sm_scale, ROWS, HEAD_D, a_layout)


@gluon.jit(do_not_specialize=["seed", "drop_below"])  # 1 and 0 stay runtime values
def hopper_fused_bwd_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, DK, DV, N_q, N_k, sm_scale,
                            qk_scale, seed, drop_below, SEMS, HEAD_D: gl.constexpr,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                            SPLIT_COLS: gl.constexpr, DROPOUT: gl.constexpr, KEEP_LAYOUT: gl.constexpr,
                            ORDERED: gl.constexpr, num_warps: gl.constexpr):
    """Program (pid_n, bh): keys [pid_n * BLOCK_N, +BLOCK_N) of head bh, their dK and dV, and their share of every
    query tile's dQ (into dq_desc's fp32 rows). Two consumer warpgroups of 64 keys (the kernel's own 4 warps and a
    worker warpgroup) and one producer warp, as the warp-specialized dK/dV kernel's (registers moved 24 / 240).
    Each consumer's dS^T tile goes to shared memory in two buffers (by step parity): ``ds_full`` (both have written
    it) and ``ds_empty`` (its dQ products have read it) guard each.

    ORDERED (``deterministic=True``): every dQ tile takes its adds in one fixed order, so the result is the same bits
    run after run. SEMS holds a semaphore a (head, query tile, column half) and, last, a ticket counter. A program
    takes its (head, key block) from the counter, heads in order and each head's key blocks from the last to the
    first, so whoever holds a ticket has an SM, and the blocks a program waits for drew theirs before it. The
    consumers hand their dQ shares to a writer warp (:func:`_dq_writer`), which waits before each reduce until the
    tile's semaphore reads the program's rank (:func:`_rank`) and sets rank + 1 once the reduce has landed."""
    gl.static_assert(num_warps == 4, "the kernel's own warps are one consumer warpgroup")
    gl.static_assert(BLOCK_N == 128 and BLOCK_M == 64, "two consumers of 64 keys; 64 query rows, wgmma's M")
    m_k = gl.num_programs(0)
    m_q = gl.cdiv(N_q, BLOCK_M)
    if ORDERED:
        ticket = gl.atomic_add(SEMS + gl.num_programs(1) * m_q * 2, 1, sem="relaxed", scope="gpu")
        bh = ticket // m_k
        nb = m_k - 1 - ticket % m_k
    else:
        nb = gl.program_id(0)
        bh = gl.program_id(1)
    start_n = nb * BLOCK_N
    sems = SEMS + bh * m_q * 2
    dtype: gl.constexpr = q_desc.dtype
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, ready, empty = _ws_smem(
        k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, STAGES, STAGES)
    ds_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_N // 2, BLOCK_M],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N // 2, BLOCK_M], dtype))
    # fp32 dQ shares: split, two per warpgroup (by step parity); whole, one (its turn comes every other step)
    dq_smem = gl.allocate_shared_memory(gl.float32, [4 if SPLIT_COLS else 2] + dq_desc.block_type.shape,
                                        dq_desc.layout)
    ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(ds_full.index(s), count=2)
        mbarrier.init(ds_empty.index(s), count=2 if SPLIT_COLS else 1)  # who read both dS^T tiles
    # ORDERED: a dQ share's slot is written (dq_full) and, once its reduce has landed, free again (dq_empty)
    dq_full = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    if ORDERED:
        for s in gl.static_range(4 if SPLIT_COLS else 2):
            mbarrier.init(dq_full.index(s), count=1)
            mbarrier.init(dq_empty.index(s), count=1)
    i_lo, n_tiles = _query_tiles(start_n, N_q, 0, 0, BLOCK_M, BLOCK_N, CAUSAL, False)
    if ORDERED and not CAUSAL:
        i_lo = nb * m_q // m_k  # (rotated: see _rank)
    zero = start_n * 0  # (runtime zeros: a partition's arguments are values)
    i_lo = i_lo + zero
    if ORDERED:  # (a partition's arguments must be written out: a tuple of them loses what is constexpr)
        gl.warp_specialize([
            (_fused_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, ready,
                               empty, ds_full, ds_empty, dq_desc, DK, DV, bh, start_n, i_lo, n_tiles, N_q, N_k,
                               sm_scale, qk_scale, seed, drop_below, dq_full, dq_empty, m_q, 0, HEAD_D,
                               BLOCK_M, STAGES, CAUSAL, SPLIT_COLS, DROPOUT, KEEP_LAYOUT, ORDERED)),
            (_ws_dkdv_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem,
                                 v_smem, lse_smem, delta_smem, kv_bar, ready, empty, bh, start_n, i_lo, n_tiles, zero,
                                 zero, N_q, N_k, BLOCK_M, BLOCK_N, STAGES, False, BLOCK_N, True, 1, 0, False, m_q,
                                 not CAUSAL)),
            (_fused_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, ready,
                               empty, ds_full, ds_empty, dq_desc, DK, DV, bh, start_n, i_lo, n_tiles, N_q, N_k,
                               sm_scale, qk_scale, seed, drop_below, dq_full, dq_empty, m_q, 1, HEAD_D,
                               BLOCK_M, STAGES, CAUSAL, SPLIT_COLS, DROPOUT, KEEP_LAYOUT, ORDERED)),
            (_dq_writer, (dq_smem, dq_full, dq_empty, dq_desc, sems, bh * N_q, i_lo, n_tiles, nb, m_k, m_q, BLOCK_M,
                          CAUSAL, SPLIT_COLS)),
        ], [1, 4, 1], [24, 240, 24])
    else:
        gl.warp_specialize([
            (_fused_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, ready,
                               empty, ds_full, ds_empty, dq_desc, DK, DV, bh, start_n, i_lo, n_tiles, N_q, N_k,
                               sm_scale, qk_scale, seed, drop_below, dq_full, dq_empty, m_q, 0, HEAD_D,
                               BLOCK_M, STAGES, CAUSAL, SPLIT_COLS, DROPOUT, KEEP_LAYOUT, ORDERED)),
            (_ws_dkdv_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem,
                                 v_smem, lse_smem, delta_smem, kv_bar, ready, empty, bh, start_n, i_lo, n_tiles, zero,
                                 zero, N_q, N_k, BLOCK_M, BLOCK_N, STAGES, False, BLOCK_N, True)),
            (_fused_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, ready,
                               empty, ds_full, ds_empty, dq_desc, DK, DV, bh, start_n, i_lo, n_tiles, N_q, N_k,
                               sm_scale, qk_scale, seed, drop_below, dq_full, dq_empty, m_q, 1, HEAD_D,
                               BLOCK_M, STAGES, CAUSAL, SPLIT_COLS, DROPOUT, KEEP_LAYOUT, ORDERED)),
        ], [1, 4], [24, 240])


def default_config(head_dim: int) -> dict:
    """64 queries a step, 128 keys a program, a ring of 2; dQ's columns split between the warpgroups at d = 128,
    whole shares on alternate steps at d = 64 (the module's docstring has the measurements). Shared memory: 129 KB
    at d = 64, 225 KB at d = 128 (the H100 holds 227)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the fused backward needs a head dim in {HEAD_DIMS}, got {head_dim}")
    return dict(block_m=64, block_n=128, stages=2, split_cols=head_dim > 64)


def supported(q, k, v) -> str | None:
    """None when :func:`hopper_fused_backward` can take these (checked) q, k, v, else why not: the Gluon backward's
    conditions (:func:`flashref.triton.hopper_backward.supported`) at head dims 64 and 128, and a Triton whose
    builder has the TMA reduce."""
    why = hopper_backward.supported(q, k, v)
    if why is None and q.shape[3] not in HEAD_DIMS:
        why = f"needs a head dim in {HEAD_DIMS}, got {q.shape[3]}"
    has_reduce = hasattr(ir, "DESCRIPTOR_REDUCE_KIND") and hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce")
    if why is None and not has_reduce:
        why = f"needs a Triton with the TMA reduce in its builder (this is {triton.__version__})"
    return why


def ordered_supported(N_q: int, N_k: int, causal: bool, sms: int, cfg: dict | None = None) -> str | None:
    """None when the ordered (bitwise reproducible) kernel can take these lengths on a GPU of ``sms``
    multiprocessors, else why not. Causal, a program waits only for key blocks that drew their tickets before it,
    so any length will do. Without causality the visits wrap around, and the last key block waits for the first,
    which drew its ticket last: all of a head's key blocks must be resident at once (at most one program a
    multiprocessor is counted), and every block must start on a tile of its own (no more key blocks than query
    tiles)."""
    cfg = cfg or default_config(64)
    m_q, m_k = hopper.host_cdiv(N_q, cfg["block_m"]), hopper.host_cdiv(N_k, cfg["block_n"])
    if causal:
        return None
    if m_k > sms:
        return f"without causal masking needs at most one key block a multiprocessor ({m_k} blocks, {sms} SMs)"
    if m_k > m_q:
        return f"without causal masking needs no more key blocks than query tiles ({m_k} > {m_q})"
    return None


def hopper_fused_backward(q, k, v, do, m2, l2, delta, causal: bool, scale: float, cfg: dict | None = None, *,
                          dropout=None, ordered: bool = False):
    """(dq, dk, dv) from :func:`hopper_fused_bwd_kernel` for checked q, k, v that :func:`supported` takes; m2, l2,
    delta: (B, H, N_q) fp32, as :func:`flashref.triton.hopper_backward.hopper_backward` takes them; ``dropout``:
    ``(seed, drop_below, keep_scale)`` with the forward's mask (at :data:`DROPOUT_HEAD_DIMS`), or None. dQ
    accumulates in an fp32 buffer of q's shape: in whatever order the adds come (not bitwise reproducible), or
    with ``ordered`` in a fixed one (where :func:`ordered_supported` allows it; a ValueError elsewhere)."""
    B, H, N_q, d = q.shape
    if dropout is not None and d not in DROPOUT_HEAD_DIMS:
        raise ValueError(f"the fused backward takes dropout at head dims {DROPOUT_HEAD_DIMS}, got {d}")
    N_k = k.shape[2]
    cfg = cfg or default_config(d)
    block_m = cfg["block_m"]
    if ordered:
        why = ordered_supported(N_q, N_k, causal, ops._sm_count(q.device), cfg)
        if why is not None:
            raise ValueError(f"ordered=True: the ordered one-kernel backward {why}")
    dk = torch.empty((B, H, N_k, d), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    # dQ's fp32 sums and, after them, the semaphores and the ticket counter: zeroed in one launch
    n_sems = B * H * hopper.host_cdiv(N_q, block_m) * 2 + 1 if ordered else 1
    zeroed = torch.zeros(B * H * N_q * d + n_sems, dtype=torch.float32, device=q.device)
    dq32 = zeroed[:B * H * N_q * d].view(B * H * N_q, d)
    sems = zeroed[B * H * N_q * d:].view(torch.int32)
    cols = d // 2 if cfg["split_cols"] else d
    dq_desc = hopper.descriptor(dq32, (block_m, cols), hopper.shared_layout((block_m, cols), gl.float32))
    halves = dict(cfg, block_n=cfg["block_n"] // 2)  # each TMA copy of K or V is one consumer's rows
    grid = (hopper.host_cdiv(N_k, cfg["block_n"]), B * H)
    relaunch.launch(hopper_fused_bwd_kernel, grid, *_descriptors(q, k, v, do, halves),
                    *_stat_descriptors(m2, l2, delta, block_m, dropout=dropout), dq_desc, dk, dv, N_q, N_k, scale,
                    scale * LOG2E,
                    *_mask_args(dropout), sems, HEAD_D=d, BLOCK_M=block_m, BLOCK_N=cfg["block_n"],
                    STAGES=cfg["stages"], CAUSAL=bool(causal), SPLIT_COLS=bool(cfg["split_cols"]),
                    DROPOUT=dropout is not None,
                    KEEP_LAYOUT=hopper.keep_t_layout(64, block_m, 4) if dropout is not None else None,
                    ORDERED=bool(ordered), num_warps=4, maxnreg=hopper.WS_MAXNREG)
    return dq32.view(B, H, N_q, d).to(q.dtype), dk, dv
