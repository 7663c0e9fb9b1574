"""dK and dV at head dim 256 on Hopper, in Gluon: two consumer warpgroups that split the head dim, not the keys.

At d = 128 the warp-specialized dK/dV kernel (:mod:`flashref.triton.hopper_backward`) gives each of two consumer
warpgroups 64 keys and the whole head dim: its fp32 dK_j and dV_j take 128 registers a thread. At d = 256 they
would take 256, more than a thread has. So here both warpgroups own the same 64 keys and each one half of the head
dim, columns [w * d/2, +d/2) of dK_j and dV_j (128 registers). Every tile is held in shared memory as two column
halves of d/2, so that each product reads whole tiles:

    warpgroup 0:  S^T  = K_j Q_i^T  (the two halves' products summed),  P^T = exp2(S^T * scale log2 e - lse2_i)
    warpgroup 1:  dP^T = V_j dO_i^T (the same)
    each hands its 64 x 64 fp32 tile to the other through shared memory, then both compute
    dS^T = P^T * (dP^T - D_i),  dV_j[:, w] += P^T dO_i[:, w],  dK_j[:, w] += dS^T Q_i[:, w]

The four products of a tile pair are split evenly, none is computed twice, and only the 64 x 64 score tiles cross
between the warpgroups (two fp32 buffers, each guarded by a "full" and an "empty" mbarrier). A producer warp copies
K_j and V_j once and each query tile's Q_i, dO_i, lse2 and D into a ring, as the d = 128 kernel's does.

Scope: fp16 or bf16, head dim 256, top-left causal or not, uneven N_q and N_k; no window, ALiBi, dropout or block
mask. :func:`flashref.triton.hopper_backward.hopper_dkdv` runs it at d = 256, so :func:`flashref.triton.
flash_attention`'s backward does on an H100: measured 1.66x the teaching dK/dV kernel's speed (416 TFLOP/s against
250, B 8, H 8, N 4K, fp16), 1.60x causal (398 against 249).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from flashref.triton import hopper, relaunch
from flashref.triton.forward import LOG2E
from flashref.triton.hopper_backward import (_descriptors, _query_tiles, _row_view, _stat_descriptors, _store_dkdv,
                                             _wgmma_layout, _ws_smem)

HEAD_DIMS = (256,)


@gluon.jit
def _wide_producer(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
                   delta_smem, kv_bar, ready, empty, bh, start_n, i_lo, n_tiles, N_q, N_k, BLOCK_M: gl.constexpr,
                   STAGES: gl.constexpr):
    """One warp: the two column halves of K_j and V_j once, then each query tile's halves of Q_i and dO_i and its
    lse2 and D into ring slot n % STAGES (halves 2 * slot and 2 * slot + 1), once both consumers have freed it."""
    HALF: gl.constexpr = k_desc.block_type.shape[1]
    mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for h in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [bh * N_k + start_n, h * HALF], kv_bar, k_smem.index(h))
        tma.async_copy_global_to_shared(v_desc, [bh * N_k + start_n, h * HALF], kv_bar, v_smem.index(h))
    nbytes: gl.constexpr = (2 * (q_desc.block_type.nbytes + do_desc.block_type.nbytes) + lse_desc.block_type.nbytes
                            + delta_desc.block_type.nbytes)
    for n in range(0, n_tiles):
        slot = n % STAGES
        # A fresh mbarrier counts as having completed the phase before its first, so round 0 passes at once.
        mbarrier.wait(empty.index(slot), ((n // STAGES) & 1) ^ 1)
        tile = i_lo + n
        bar = ready.index(slot)
        mbarrier.expect(bar, nbytes)
        for h in gl.static_range(2):
            tma.async_copy_global_to_shared(q_desc, [bh * N_q + tile * BLOCK_M, h * HALF], bar,
                                            q_smem.index(2 * slot + h))
            tma.async_copy_global_to_shared(do_desc, [bh * N_q + tile * BLOCK_M, h * HALF], bar,
                                            do_smem.index(2 * slot + h))
        tma.async_copy_global_to_shared(lse_desc, [bh, tile * BLOCK_M], bar, lse_smem.index(slot))
        tma.async_copy_global_to_shared(delta_desc, [bh, tile * BLOCK_M], bar, delta_smem.index(slot))


@gluon.jit
def _half_product(a_smem, b_smem, slot, s_zero):
    """A (keys x queries) tile from the two column halves: a_0 b_0^T + a_1 b_1^T (K and Q, or V and dO), issued."""
    X = warpgroup_mma(a_smem.index(0), b_smem.index(2 * slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma(a_smem.index(1), b_smem.index(2 * slot + 1).permute((1, 0)), X, is_async=True)


@gluon.jit
def _exchange(mine, x_smem, x_full, x_empty, n, WG: gl.constexpr, layout: gl.constexpr):
    """Hand this warpgroup's tile of step n to the other and take the other's: write into buffer WG once the other
    has read the last one (x_empty[WG]), say so (x_full[WG]), wait for the other's (x_full[1 - WG]), read it, and
    free it (x_empty[1 - WG])."""
    mbarrier.wait(x_empty.index(WG), (n & 1) ^ 1)
    x_smem.index(WG).store(mine)
    mbarrier.arrive(x_full.index(WG), count=1)
    mbarrier.wait(x_full.index(1 - WG), n & 1)
    theirs = x_smem.index(1 - WG).load(layout)
    mbarrier.arrive(x_empty.index(1 - WG), count=1)
    return theirs


@gluon.jit
def _wide_consumer(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x_smem, kv_bar, ready, empty, x_full,
                   x_empty, DK, DV, bh, start_n, i_lo, n_tiles, N_q, N_k, sm_scale, qk_scale, WG: gl.constexpr,
                   HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr):
    """Consumer warpgroup WG: columns [WG * HEAD_D/2, +HEAD_D/2) of dK and dV for keys [start_n, +BLOCK_N). WG 0
    computes S^T and P^T (with the masks: the ragged end and the causal diagonal), WG 1 dP^T; they swap tiles
    (:func:`_exchange`) and each adds its half of dV and dK."""
    HALF: gl.constexpr = HEAD_D // 2
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _wgmma_layout(4, BLOCK_M)
    a_layout: gl.constexpr = _wgmma_layout(4, HALF)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    keys = start_n + gl.arange(0, BLOCK_N, layout=row_s)
    dk = gl.zeros([BLOCK_N, HALF], gl.float32, a_layout)
    dv = gl.zeros([BLOCK_N, HALF], gl.float32, a_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    mbarrier.wait(kv_bar, 0)
    for n in range(0, n_tiles):
        slot = n % STAGES
        mbarrier.wait(ready.index(slot), (n // STAGES) & 1)
        queries = (i_lo + n) * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s)
        if WG == 0:
            X = _half_product(k_smem, q_smem, slot, s_zero)
        else:
            X = _half_product(v_smem, do_smem, slot, s_zero)
        D = _row_view(delta_smem, slot, BLOCK_M, STAGES).load(col_s)
        X = warpgroup_mma_wait(0, deps=[X])
        if WG == 0:  # P^T, zero where a query is past N_q or (causal) before the key
            lse2 = _row_view(lse_smem, slot, BLOCK_M, STAGES).load(col_s)
            keep = gl.expand_dims(queries < N_q, 0)
            if CAUSAL:
                keep = keep & (gl.expand_dims(queries, 0) >= gl.expand_dims(keys, 1))
            Pt = gl.exp2(gl.where(keep, X * qk_scale - gl.expand_dims(lse2, 0), float("-inf")))
            dPt = _exchange(Pt, x_smem, x_full, x_empty, n, WG, s_layout)
        else:
            dPt = X
            Pt = _exchange(dPt, x_smem, x_full, x_empty, n, WG, s_layout)
        dSt = Pt * (dPt - gl.expand_dims(D, 0))
        p = gl.convert_layout(Pt.to(dtype), p_layout)
        ds = gl.convert_layout(dSt.to(dtype), p_layout)
        dv = warpgroup_mma(p, do_smem.index(2 * slot + WG), dv, is_async=True)
        dk = warpgroup_mma(ds, q_smem.index(2 * slot + WG), dk, is_async=True)
        dv, dk, p, ds = warpgroup_mma_wait(0, deps=[dv, dk, p, ds])
        mbarrier.arrive(empty.index(slot), count=1)
    _store_dkdv(DK, DV, dk, dv, start_n, bh, N_k, sm_scale, BLOCK_N, HEAD_D, a_layout, WG * HALF, HALF)


@gluon.jit
def hopper_wide_bwd_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV, N_q, N_k, sm_scale,
                                qk_scale, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                STAGES: gl.constexpr, CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """Program (pid_n, bh) writes dK and dV of keys [pid_n * BLOCK_N, +BLOCK_N) of head bh (rows past N_k are not
    stored; query columns past N_q get P = 0). The descriptors view Q, dO (B * H * N_q, d) and K, V (B * H * N_k,
    d) in column halves; lse_desc and delta_desc as :func:`flashref.triton.hopper_backward._stat_descriptors`
    gives them. As the forward's warp-specialized kernel, the launch caps registers at 168 a thread so that 12
    warps fit an SM, and the partitions move them: 24 for the producer, 240 for each consumer."""
    gl.static_assert(num_warps == 4, "the kernel's own warps are one consumer warpgroup")
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    start_n = pid_n * BLOCK_N
    # K, V and each ring slot's Q and dO in two column halves (a slot's halves at 2 * slot and 2 * slot + 1)
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, ready, empty = _ws_smem(
        k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, 2 * STAGES, STAGES)
    x_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[1, 0])
    x_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, BLOCK_M], x_layout)
    x_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(x_full.index(w), count=1)
        mbarrier.init(x_empty.index(w), count=1)
    i_lo, n_tiles = _query_tiles(start_n, N_q, 0, 0, BLOCK_M, BLOCK_N, CAUSAL, False)
    gl.warp_specialize([
        (_wide_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x_smem, kv_bar, ready, empty, x_full,
                          x_empty, DK, DV, bh, start_n, i_lo, n_tiles, N_q, N_k, sm_scale, qk_scale, 0, HEAD_D,
                          BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
        (_wide_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                          lse_smem, delta_smem, kv_bar, ready, empty, bh, start_n, i_lo, n_tiles, N_q, N_k, BLOCK_M,
                          STAGES)),
        (_wide_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, x_smem, kv_bar, ready, empty, x_full,
                          x_empty, DK, DV, bh, start_n, i_lo, n_tiles, N_q, N_k, sm_scale, qk_scale, 1, HEAD_D,
                          BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
    ], [1, 4], [24, 240])


def default_config() -> dict:
    """64 queries a step, 64 keys a program, a ring of 2 (225 KB of shared memory: the H100 holds 227)."""
    return dict(block_m=64, block_n=64, num_warps=4, stages=2)


def hopper_wide_dkdv(q, k, v, do, m2, l2, delta, causal: bool, scale: float, cfg: dict | None = None):
    """(dk, dv) from :func:`hopper_wide_bwd_dkdv_kernel` for checked q, k, v of head dim 256 that
    :func:`flashref.triton.hopper.supported` takes; m2, l2, delta: (B, H, N_q) fp32, as
    :func:`flashref.triton.hopper_backward.hopper_dkdv` takes them."""
    B, H, N_q, d = q.shape
    N_k = k.shape[2]
    if d not in HEAD_DIMS:
        raise ValueError(f"hopper_wide_dkdv needs a head dim in {HEAD_DIMS}, got {d}")
    cfg = cfg or default_config()
    dk = torch.empty((B, H, N_k, d), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    grid = (hopper.host_cdiv(N_k, cfg["block_n"]), B * H)
    relaunch.launch(hopper_wide_bwd_dkdv_kernel, grid, *_descriptors(q, k, v, do, cfg, d // 2),
                    *_stat_descriptors(m2, l2, delta, cfg["block_m"]), dk, dv, N_q, N_k, scale, scale * LOG2E,
                    HEAD_D=d, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], STAGES=cfg["stages"],
                    CAUSAL=bool(causal), num_warps=cfg["num_warps"], maxnreg=hopper.WS_MAXNREG)
    return dk, dv
