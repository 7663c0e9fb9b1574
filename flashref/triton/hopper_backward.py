"""The backward pass on Hopper, in Gluon: a dK/dV kernel built from the forward's parts (first step).

The teaching backward (:mod:`flashref.triton.backward`) leaves its schedule to Triton's compiler. This kernel
does for dK and dV what :mod:`flashref.triton.hopper` does for the forward: TMA copies of the Q and dO tiles into
a ring of shared-memory slots guarded by mbarriers, and the four products of a tile pair as asynchronous
warpgroup products (wgmma). A program owns ``BLOCK_N`` keys of one head; with K_j and V_j resident in shared
memory it walks the query tiles i that see them, in the transposed orientation (keys are the rows, so each
product's accumulator rows are this program's keys):

    S^T = K_j Q_i^T,  P^T = exp2(S^T * scale * log2 e - m2_i - l2_i),  dV_j += P^T dO_i,
    dP^T = V_j dO_i^T,  dS^T = P^T * (dP^T - D_i),  dK_j += dS^T Q_i

with the forward's row statistics (m2, l2) and D = rowsum(dO * O) from the teaching preprocess kernel; dQ stays
with the teaching dQ kernel. fp16 and bf16, head dims 64 and 128, top-left causal or not, no other feature.
:func:`hopper_dkdv` launches it. Not yet part of :func:`flashref.triton.flash_attention`'s backward.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashref.triton import hopper
from flashref.triton.forward import LOG2E

HEAD_DIMS = (64, 128)


@gluon.jit
def _load_q_do(q_desc, do_desc, q_smem, do_smem, bars, q_row, n, n_tiles, BLOCK_M: gl.constexpr,
               STAGES: gl.constexpr):
    """Start the TMA copies of the program's n-th Q and dO tile (rows q_row + n * BLOCK_M on) into slot
    n % STAGES, one barrier for both (nothing from n_tiles on). n counts from the program's first tile, as the
    loop's waits do."""
    slot = n % STAGES
    go = n < n_tiles
    row = q_row + n * BLOCK_M
    mbarrier.expect(bars.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=go)
    tma.async_copy_global_to_shared(q_desc, [row, 0], bars.index(slot), q_smem.index(slot), pred=go)
    tma.async_copy_global_to_shared(do_desc, [row, 0], bars.index(slot), do_smem.index(slot), pred=go)


@gluon.jit
def hopper_bwd_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, DK, DV, M2, L2, Delta, N_q, N_k, sm_scale, qk_scale,
                           HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           STAGES: gl.constexpr, CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """Program (pid_n, bh) writes dK and dV of keys [pid_n * BLOCK_N, +BLOCK_N) of head bh. The descriptors view
    Q, dO (B * H * N_q, d) and K, V (B * H * N_k, d); query columns past N_q (the next head's rows, or TMA's
    zeros) get P = 0, so they add nothing; key rows past N_k are never stored."""
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    start_n = pid_n * BLOCK_N
    dtype: gl.constexpr = q_desc.dtype

    # Scores tile: (keys x queries); accumulators: (keys x d). wgmma gives each warp 16 rows (keys).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)

    # Query tiles [i_lo, i_end) see this key tile: causal (query i sees key j <= i) starts at the diagonal.
    i_lo = 0
    if CAUSAL:
        i_lo = start_n // BLOCK_M
    n_tiles = gl.cdiv(N_q, BLOCK_M) - i_lo  # may be <= 0: no query sees these keys, dK = dV = 0
    q_row = bh * N_q + i_lo * BLOCK_M

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [bh * N_k + start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [bh * N_k + start_n, 0], kv_bar, v_smem)
    for s in gl.static_range(STAGES):
        _load_q_do(q_desc, do_desc, q_smem, do_smem, bars, q_row, s, n_tiles, BLOCK_M, STAGES)

    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, a_layout)
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, a_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    keys = start_n + gl.arange(0, BLOCK_N, layout=row_s)
    mbarrier.wait(kv_bar, 0)

    for n in range(0, n_tiles):
        i = i_lo + n
        slot = n % STAGES
        mbarrier.wait(bars.index(slot), (n // STAGES) & 1)
        q_t = q_smem.index(slot)
        do_t = do_smem.index(slot)
        # S^T and dP^T issued back to back: the second runs while the first's exponentials wait.
        St = warpgroup_mma(k_smem, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dPt = warpgroup_mma(v_smem, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        queries = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s)
        live = queries < N_q
        stat = bh.to(gl.int64) * N_q + queries
        lse2 = gl.load(M2 + stat, mask=live, other=0.0) + gl.load(L2 + stat, mask=live, other=0.0)
        D = gl.load(Delta + stat, mask=live, other=0.0)
        St = warpgroup_mma_wait(1, deps=[St])
        keep = gl.expand_dims(live, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(queries, 0) >= gl.expand_dims(keys, 1))
        Pt = gl.exp2(gl.where(keep, St * qk_scale - gl.expand_dims(lse2, 0), float("-inf")))
        p = gl.convert_layout(Pt.to(dtype), p_layout)
        dv = warpgroup_mma(p, do_t, dv, is_async=True)
        dPt = warpgroup_mma_wait(1, deps=[dPt])
        dSt = Pt * (dPt - gl.expand_dims(D, 0))
        ds = gl.convert_layout(dSt.to(dtype), p_layout)
        dk = warpgroup_mma(ds, q_t, dk, is_async=True)
        dv, dk, p, ds = warpgroup_mma_wait(0, deps=[dv, dk, p, ds])
        # Slot free: start the copies of the tile STAGES ahead.
        _load_q_do(q_desc, do_desc, q_smem, do_smem, bars, q_row, n + STAGES, n_tiles, BLOCK_M, STAGES)

    mbarrier.invalidate(kv_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, a_layout))
    offs = gl.expand_dims((bh.to(gl.int64) * N_k + rows) * HEAD_D, 1) + gl.expand_dims(cols, 0)
    in_range = gl.expand_dims(rows < N_k, 1)
    gl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=in_range)
    gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=in_range)


def default_config(head_dim: int) -> dict:
    """The tiles :func:`hopper_dkdv` launches with, the best of three on an H100 (fp16, B x N = 65536, H x d = 2048,
    N = 4K and 16K, causal and not): 64 keys a program in one warpgroup; 64 queries a step at d = 64, 32 at d = 128
    (64 spill there: dK and dV's fp32 accumulators alone take 128 registers a thread), Q and dO in a ring of 2 or 3
    slots. Measured 1.13-1.33x the teaching dK/dV kernel's time at d = 64 and 1.07-1.16x at d = 128."""
    if head_dim <= 64:
        return dict(block_m=64, block_n=64, num_warps=4, stages=2)
    return dict(block_m=32, block_n=64, num_warps=4, stages=3)


def supported(q, k, v) -> str | None:
    """None when :func:`hopper_dkdv` can take these (checked) q, k, v, else why not: the forward's conditions
    (:func:`flashref.triton.hopper.supported`) with head dims 64 and 128 only."""
    why = hopper.supported(q, k, v)
    if why is None and q.shape[3] not in HEAD_DIMS:
        why = f"needs a head dim in {HEAD_DIMS}, got {q.shape[3]}"
    return why


def hopper_dkdv(q, k, v, do, m2, l2, delta, causal: bool, scale: float, cfg: dict | None = None):
    """(dk, dv) from the Gluon kernel, for checked, :func:`supported` inputs; m2, l2, delta: (B, H, N_q) fp32."""
    B, H, N_q, d = q.shape
    N_k = k.shape[2]
    cfg = cfg or default_config(d)
    gdt = gl.float16 if q.dtype == torch.float16 else gl.bfloat16
    q_block, kv_block = [cfg["block_m"], d], [cfg["block_n"], d]
    q_lay = gl.NVMMASharedLayout.get_default_for(q_block, gdt)
    kv_lay = gl.NVMMASharedLayout.get_default_for(kv_block, gdt)
    q2, k2, v2, do2 = (x.contiguous().view(-1, d) for x in (q, k, v, do))
    q_desc = TensorDescriptor.from_tensor(q2, q_block, q_lay)
    do_desc = TensorDescriptor.from_tensor(do2, q_block, q_lay)
    k_desc = TensorDescriptor.from_tensor(k2, kv_block, kv_lay)
    v_desc = TensorDescriptor.from_tensor(v2, kv_block, kv_lay)
    dk = torch.empty((B, H, N_k, d), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    grid = (triton.cdiv(N_k, cfg["block_n"]), B * H)
    hopper_bwd_dkdv_kernel[grid](q_desc, k_desc, v_desc, do_desc, dk, dv, m2.contiguous(), l2.contiguous(),
                                 delta, N_q, N_k, scale, scale * LOG2E, HEAD_D=d, BLOCK_M=cfg["block_m"],
                                 BLOCK_N=cfg["block_n"], STAGES=cfg["stages"], CAUSAL=bool(causal),
                                 num_warps=cfg["num_warps"])
    return dk, dv
