"""Exact ring attention (context parallelism): one long sequence cut across the GPUs of a process group.

Taught in notebook ``13_beyond_one_gpu_and_decoding``.

    from flashref.ring_attention import ring_attention, shard_sequence, gather_sequence
    q_r, k_r, v_r = (shard_sequence(x, rank, world_size, zigzag=True) for x in (q, k, v))
    o_r = ring_attention(q_r, k_r, v_r, causal=True)      # this rank's rows of O; differentiable

**The ring.** Each of the R ranks holds a shard of Q, K and V along the sequence (dim 2 of ``(B, H, N_local,
d)``). Its queries need every key, so the K/V shards travel around a ring: at step t rank r holds the block of
rank ``r - t`` (mod R), computes its Q against it with the FlashAttention kernel (:mod:`flashref.triton`),
hands the block on to rank ``r + 1`` and receives the next one from ``r - 1``. The transfer of the next block
is posted (``torch.distributed.batch_isend_irecv``) before the compute on the current one starts, so the
network works while the kernel does: after R steps every query has met every key, and no GPU ever held more
than its own K/V shard and two visiting blocks. With NCCL on GPUs the sends run on NCCL's own stream, beside
the kernels, when that stream has high priority: create the group with
``init_process_group("nccl", pg_options=nccl_group_options())``, as ``python -m flashref.bench ring`` does
(at normal priority a transfer posted just before a kernel can wait for the whole kernel: on two H200s 55% of
NCCL's time overlapped compute so, 93% at high priority; :func:`nccl_group_options` says why). With gloo on
CPUs (the tests) the same code runs, the kernels in Triton's interpreter.

**The merge.** Each step gives a partial attention over one key block: its normalized output O_b and its
log-sum-exp lse_b = m_b + log l_b (the running max m and sum l of notebook ``02_online_softmax``). Two partial
attentions over disjoint key sets combine exactly (:func:`flashref.online_softmax.merge_outputs`):
``lse = logaddexp(lse_a, lse_b)``, ``O = exp(lse_a - lse) O_a + exp(lse_b - lse) O_b``, the merge tiles use
inside one kernel, here between GPUs. O is accumulated in fp32 and rounded once at the end; lse is kept in
float64, from the kernel's own m and l added in float64 (:func:`_block_forward`): rounded to fp32 at scores
near 1e3, an lse would be off by ~1e-4, and the merge's weights would carry that into O.

**Causal, balanced ("zigzag").** Cut a causal sequence into R contiguous shards and rank 0 sees almost
nothing while rank R-1 sees everything: the ring would wait on its slowest rank. Instead the sequence is cut
into 2R chunks of c = N / (2R) tokens and rank r holds chunks r and 2R-1-r, one early and one late
(:func:`shard_sequence` with ``zigzag=True``). Then (:func:`block_visibility`) the rank's own block is plain
top-left causal on its 2c x 2c block; a block from rank s < r is seen by all local queries, but only its first
chunk (s; its chunk 2R-1-s lies in every local query's future), without a mask; a block from s > r is seen
only by the local second chunk (2R-1-r), whole, without a mask. Every step computes c x 2c (query, key) pairs,
the own block's triangle as many: each rank does the same work at each step.

**The backward reuses the forward's global lse.** The FlashAttention backward (notebook
``05_backward_recomputation``) recomputes P = exp(S - lse) tile by tile; with the lse of the *whole* row
(saved by the forward after the last merge), the P it recomputes for one key block is exactly that block's
slice of the global softmax, not a softmax of the block alone, and D = rowsum(dO * O) uses the global O.
So the per-block backward (the kernels of :func:`flashref.triton.flash_attention_backward`, handed the global
lse as an fp32 pair that keeps its float64 precision: :func:`_block_backward`) with the global O and lse gives
each block's exact share of dQ and of dK, dV. The backward's two kernels are separate (one writes dK and dV,
the other dQ), so the backward runs two rings and no partial sum ever travels. First the queries go round (Q,
dO and the row statistics m2, l2, D: all that the dK/dV kernel reads of a query) and each rank sums the dK, dV
shares of its own K/V; then the K/V blocks go round and each rank sums the dQ shares of its own queries. The
sums stay on their owner in float32, rounded once at the end (on two ranks, in the gradients' own dtype: one
addition, rounded once, gives the same bits). Each ring moves two tensors of N/R tokens per step, as the
forward does, and ends with its last block's compute: there is no hop home.

**Large shards go round a head group at a time.** What a rank holds beside its inputs and gradients is
transient: the block in transit, its causal half copied out, a step's partial outputs. With whole shards that
is about three more shard-sized tensors, and the longest sequence two GPUs fit stays near 1.4x one GPU's.
Attention is independent per head, so where a K shard is larger than :data:`HEAD_GROUP_BYTES` the rings run
once per group of heads (:func:`head_groups`), each group's gradients written into the whole ones: the
transient tensors are then a group's, a fraction of a shard, for the same results (O and the gradients bit
for bit).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import queue
import threading
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist

import flashref.triton  # noqa: F401  (first: switches Triton's interpreter on where there is no CUDA device)
from flashref import validation
from flashref.online_softmax import merge_outputs
from flashref.triton import ops
from flashref.triton.ops import _check

__all__ = ["ring_attention", "ring_attention_forward", "ring_attention_backward", "RingAttentionFunction",
           "nccl_group_options", "shard_sequence", "gather_sequence", "sequence_positions", "block_visibility",
           "simulate_ring", "head_groups", "HEAD_GROUP_BYTES"]

# Message tags: K/V blocks and visiting queries are separate streams of messages between two ranks
# (gloo matches messages by tag; NCCL by order, which is the same on every rank anyway).
_TAG_KV, _TAG_Q = 0, 1
_LN2 = math.log(2.0)  # the kernels' row statistics are base 2
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_FACT_NAMES = ("B", "H", "H_kv", "N_local", "d", "dtype", "causal", "sm_scale")  # what every rank must agree on
_N_FACTS = len(_FACT_NAMES)


# --------------------------------------------------------------------------------------------------
# Layout: which tokens a rank holds (pure functions, no process group needed)
# --------------------------------------------------------------------------------------------------

def _check_layout(rank, world_size, zigzag):
    validation.check_positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size) = [0, {world_size}), got {rank!r}")
    validation.check_bool("zigzag", zigzag)
    return int(rank), int(world_size)


def _chunks_of(N: int, world_size: int, zigzag: bool, name: str) -> int:
    """The chunk length: N / (2R) with zigzag, N / R without; ValueError naming ``name`` if N does not divide."""
    parts = 2 * world_size if zigzag else world_size
    if N % parts:
        layout = f"zigzag=True cuts into 2 * world_size = {parts}" if zigzag else f"cuts into world_size = {parts}"
        raise ValueError(f"{name} has N = {N} tokens along dim 2, which {layout} equal chunks: N must be a "
                         f"multiple of {parts}")
    return N // parts


def sequence_positions(rank: int, world_size: int, N: int, zigzag: bool) -> np.ndarray:
    """The global positions (int64, in local order) of the N / world_size tokens rank ``rank`` holds: the
    contiguous slice ``[r n, (r + 1) n)``, or with ``zigzag`` chunk r then chunk 2R-1-r of 2R chunks of
    N / (2R) tokens. Notebook ``13_beyond_one_gpu_and_decoding``."""
    rank, world_size = _check_layout(rank, world_size, zigzag)
    validation.check_positive_int("N", N)
    c = _chunks_of(int(N), world_size, zigzag, "the sequence")
    if not zigzag:
        return np.arange(rank * c, (rank + 1) * c, dtype=np.int64)
    late = 2 * world_size - 1 - rank
    return np.concatenate([np.arange(rank * c, (rank + 1) * c), np.arange(late * c, (late + 1) * c)]).astype(np.int64)


def _seq_tensor(name, x):
    if not isinstance(x, (np.ndarray, torch.Tensor)):
        raise TypeError(f"{name} must be a NumPy array or a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 3:
        raise ValueError(f"{name} must have the sequence along dim 2, as (B, H, N, d) or (B, H, N), got shape "
                         f"{tuple(x.shape)}")


def _cat(parts):
    return torch.cat(parts, dim=2) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts, axis=2)


def shard_sequence(x, rank: int, world_size: int, zigzag: bool):
    """Rank ``rank``'s shard of ``x`` along dim 2 (``(B, H, N, d)``, or ``(B, H, N)`` for an lse; NumPy or
    torch): the contiguous ``N / world_size`` tokens, or with ``zigzag`` (the causal layout) chunks r and
    2R-1-r of 2R, concatenated in that order. N must be a multiple of 2R (zigzag) or R. A copy when zigzag
    (two slices joined), a view otherwise. Notebook ``13_beyond_one_gpu_and_decoding``."""
    _seq_tensor("x", x)
    rank, world_size = _check_layout(rank, world_size, zigzag)
    if x.shape[2] < 1:
        raise ValueError(f"x must hold at least one token along dim 2 (N >= 1, as sequence_positions needs), got "
                         f"shape {tuple(x.shape)}")
    c = _chunks_of(x.shape[2], world_size, zigzag, "x")
    if not zigzag:
        return x[:, :, rank * c:(rank + 1) * c]
    late = 2 * world_size - 1 - rank
    return _cat([x[:, :, rank * c:(rank + 1) * c], x[:, :, late * c:(late + 1) * c]])


def gather_sequence(shards, zigzag: bool):
    """The whole sequence from the list of every rank's shard, in rank order: the inverse of
    :func:`shard_sequence` (``gather_sequence([shard_sequence(x, r, R, z) for r in range(R)], z)`` is x).
    Notebook ``13_beyond_one_gpu_and_decoding``."""
    validation.check_bool("zigzag", zigzag)
    if not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError(f"shards must be a non-empty list of every rank's shard, got {type(shards).__name__}"
                        f"{' (empty)' if isinstance(shards, (list, tuple)) else ''}")
    for r, s in enumerate(shards):
        _seq_tensor(f"shards[{r}]", s)
        if tuple(s.shape) != tuple(shards[0].shape):
            raise ValueError(f"shards must all have one shape, got shards[0] {tuple(shards[0].shape)} and "
                             f"shards[{r}] {tuple(s.shape)}")
        if type(s) is not type(shards[0]):
            raise TypeError("shards must be all NumPy arrays or all torch tensors")
    if not zigzag:
        return _cat(list(shards))
    R, n = len(shards), shards[0].shape[2]
    if n % 2:
        raise ValueError(f"shards of the zigzag layout hold two chunks each: their N_local must be even, got {n}")
    c = n // 2
    chunks = [None] * (2 * R)
    for r, s in enumerate(shards):
        chunks[r], chunks[2 * R - 1 - r] = s[:, :, :c], s[:, :, c:]
    return _cat(chunks)


def block_visibility(rank: int, source: int, n_local: int, causal: bool):
    """What rank ``rank``'s queries compute against the K/V block that rank ``source`` holds: ``(q_rows,
    kv_rows, causal)``, two slices of the local rows and whether the pair is top-left causal. Non-causal:
    everything, no mask. Causal (zigzag layout, ``n_local = 2c``): the own block is causal on all of it;
    from ``source < rank`` all queries see the block's first chunk; from ``source > rank`` the second chunk
    of queries sees the whole block. Each case is c x 2c (query, key) pairs, or the 2c x 2c triangle.
    Notebook ``13_beyond_one_gpu_and_decoding``."""
    for name, value in (("rank", rank), ("source", source)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int (a rank of the ring), got {type(value).__name__}: {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be a non-negative int (a rank of the ring), got {value!r}")
    n_local = validation.check_positive_int("n_local", n_local)
    validation.check_causal(causal)
    everything = slice(0, n_local)
    if not causal:
        return everything, everything, False
    if n_local % 2:
        raise ValueError(f"causal ring attention needs the zigzag layout, two equal chunks per rank: n_local "
                         f"must be even, got {n_local}")
    c = n_local // 2
    if source == rank:
        return everything, everything, True
    if source < rank:   # its chunk `source` lies before both local chunks; its chunk 2R-1-source after both
        return everything, slice(0, c), False
    return slice(c, n_local), everything, False  # both of its chunks lie after chunk `rank`, before 2R-1-rank


# --------------------------------------------------------------------------------------------------
# The process group: peers, one exchange around the ring, and agreement on the inputs
# --------------------------------------------------------------------------------------------------

def nccl_group_options():
    """The options to create the ring's NCCL group with:
    ``torch.distributed.init_process_group("nccl", pg_options=nccl_group_options())``.

    They put NCCL's kernels on a high-priority stream. A transfer is posted just before the kernel it should
    hide behind, and both become ready when the compute stream reaches the same point: at equal priority the GPU
    hands out the kernel's thousands of programs first, and NCCL's kernel gets an SM only once the last of them
    has started and one finishes, at the kernel's end (seen on two H200s: the backward's second ring's first
    transfer ran after the dQ kernel it was posted before, and 55% of NCCL's time overlapped compute). At high
    priority NCCL's programs take the first SMs that free up (93%; notebook 13's timeline). gloo takes no
    options. Raises RuntimeError where torch was built without NCCL."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise RuntimeError("nccl_group_options needs a torch built with NCCL (torch.distributed.ProcessGroupNCCL); "
                           "this one has none. On CPUs use the gloo backend, which takes no pg_options")
    options = nccl.Options()
    options.is_high_priority_stream = True
    return options


def _group_of(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ring_attention needs an initialized torch.distributed process group: call "
                           "torch.distributed.init_process_group('nccl', pg_options=nccl_group_options()) on GPUs "
                           "(one process per GPU, after torch.cuda.set_device) or ('gloo') on CPUs first")
    return dist.group.WORLD if group is None else group


class _Ring:
    """Rank, size and neighbours (global ranks, as point-to-point ops take them) of one group."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, tensors, tag):
        """Post: send ``tensors`` to the next rank, receive as many like them from the previous one. Returns
        the pending transfer; its ``wait()`` gives the received tensors. Nothing waits here, so the caller
        computes while the transfer runs."""
        return _Exchange(self, tensors, tag)


class _Exchange:
    def __init__(self, ring, tensors, tag):
        if ring.size == 1:  # the ring is one rank: what it sends is what it receives
            self.received, self.requests = list(tensors), []
            return
        self.received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, ring.next, ring.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, ring.prev, ring.group, tag) for t in self.received]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self):
        # On NCCL this makes the current stream wait for the transfer (the CPU goes on); on gloo it blocks.
        for request in self.requests:
            request.wait()
        return self.received


def _local_facts(q, k, v, causal, sm_scale, ring, check_finite, extra=None):
    """This rank's checks (and ``extra(check_finite)``, the backward's own). Returns ``(error or None, facts)``:
    facts are what must agree between ranks (shapes, dtype, causal, scale), as floats; -1 where the checks
    failed before they were known."""
    facts = [-1.0] * _N_FACTS
    try:
        d, scale = _check(q, k, v, causal, sm_scale, check_finite=False)
        B, H, n, _ = q.shape
        facts = [float(B), float(H), float(k.shape[1]), float(n), float(d), float(_DTYPE_CODES[q.dtype]),
                 float(causal), scale]
        if causal and n % 2:
            raise ValueError(f"causal ring attention takes the zigzag layout (shard_sequence(..., zigzag=True)): "
                             f"each rank's N_local must be even (two chunks), got q with N_local = {n}")
        if k.shape[2] != n:
            raise ValueError(f"ring attention needs q, k and v sharded alike: N_local of k ({k.shape[2]}) must "
                             f"equal N_local of q ({n})")
        backend = dist.get_backend(ring.group)
        if backend == "gloo" and q.device.type != "cpu":
            raise ValueError(f"the gloo backend sends CPU tensors: q, k and v are on {q.device}; use the nccl "
                             f"backend for GPU tensors")
        if backend == "nccl" and q.device.type != "cuda":
            raise ValueError(f"the nccl backend sends CUDA tensors: q, k and v are on {q.device}; use gloo on CPUs")
        if extra is not None:
            extra(check_finite)
        if check_finite:
            validation.check_finite({"q": q, "k": k, "v": v})
        return None, facts
    except (TypeError, ValueError) as exc:
        return exc, facts


def _agree(error, facts, ring, device):
    """Every rank raises, or none: one all_gather of each rank's check status and facts (a rank that raised
    alone would leave the others waiting in the ring forever). Raises this rank's own error first, then
    another rank's failure, then a disagreement between ranks."""
    row = torch.tensor([0.0 if error is None else 1.0, *facts], dtype=torch.float64, device=device)
    rows = [torch.empty_like(row) for _ in range(ring.size)]
    dist.all_gather(rows, row, group=ring.group)
    rows = [r.tolist() for r in rows]
    if error is not None:
        raise error
    failed = [r for r, x in enumerate(rows) if x[0]]
    if failed:
        raise ValueError(f"ring_attention: rank(s) {failed} of the group refused their inputs (see their error); "
                         f"every rank stops")
    for i, name in enumerate(_FACT_NAMES, start=1):
        values = [x[i] for x in rows]
        if any(val != values[0] for val in values):
            shown = values
            if name == "dtype":
                codes = {c: str(t).replace("torch.", "") for t, c in _DTYPE_CODES.items()}
                shown = [codes.get(int(val), "?") for val in values]
            elif name == "causal":
                shown = [bool(val) for val in values]
            elif name != "sm_scale":
                shown = [int(val) for val in values]
            raise ValueError(f"ring_attention needs the same {name} on every rank of the group, got {shown} "
                             f"(rank 0, 1, ...)")


def _agreement_device(ring):
    """Where the agreement's small tensor lives: the current GPU under NCCL, else the CPU (gloo)."""
    if dist.get_backend(ring.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _prepare(q, k, v, causal, sm_scale, group, check_finite, extra=None):
    """The ring of ``group`` and the softmax scale, once every rank's inputs passed their checks."""
    ring = _Ring(_group_of(group))
    validation.check_bool("check_finite", check_finite)
    error, facts = _local_facts(q, k, v, causal, sm_scale, ring, check_finite, extra)
    if check_finite:
        _agree(error, facts, ring, _agreement_device(ring))
    elif error is not None:
        raise error
    return ring, facts[_FACT_NAMES.index("sm_scale")]


# --------------------------------------------------------------------------------------------------
# Forward and backward around the ring
# --------------------------------------------------------------------------------------------------

def _block_forward(q, k, v, causal: bool, scale: float, **features):
    """One step's partial attention, ``(O_b, lse_b)``: the FlashAttention forward kernel's normalized output, and
    its log-sum-exp in float64, added from the kernel's own base-2 row max m2 and log2 row sum l2. The kernel's
    fp32 lse rounds m + log l once more: with scores near 1e3 that is ~1e-4, which the merge's weights would carry
    into O, and D = rowsum(dO O) into the gradients, where a single kernel (which keeps m and l apart) has none.
    ``features``: keywords of :func:`flashref.triton.flash_attention` (the ring bench's probe takes a window)."""
    feat = ops.Features(q, k, causal=causal, scale=scale, check_finite=False, **features)
    O_b, _, (m2, l2) = ops._forward(q, k, v, scale, feat, "auto")
    seen = torch.isfinite(l2)  # a row that saw no key has m2 = 0, l2 = +inf
    return O_b, torch.where(seen, (m2.double() + l2.double()) * _LN2, float("-inf"))


def _block_backward(q, k, v, stats, delta, dO, causal: bool, scale: float, parts, **features):
    """One step's share of the gradients the ``parts`` name (``("dq",)`` or ``("dkdv",)``), as
    ``(dQ_b, dK_b, dV_b)`` with the others ``None``: the backward kernels given the whole row's statistics
    ``stats`` (``flashref.triton.ops._stats_from_lse`` of the global float64 lse: an fp32 pair that keeps its
    precision) and ``delta`` = rowsum(dO * O) of the global O, so the recomputed P and dS are this block's slices
    of the whole row's."""
    feat = ops.Features(q, k, causal=causal, scale=scale, check_finite=False, **features)
    return ops._backward(q, k, v, None, stats, dO, scale, True, feat, "auto", parts=parts, delta=delta)


def _rows(x, rows: slice):
    """``x[:, :, rows]`` as a contiguous tensor. A causal step sees half of a block (:func:`block_visibility`),
    a strided slice that the Hopper kernels' TMA copies cannot read (``flashref.triton.forward_kernel`` would
    say so and run the teaching kernel). The copy moves N_local / 2 rows; the step then computes on
    (N_local / 2) x N_local pairs. A whole block is returned as it is."""
    return x[:, :, rows].contiguous()


#: The most bytes one K/V head group of a rank's shard may hold before the ring takes the heads group by group
#: (:func:`head_groups`): above it, the blocks in transit, their copies and the partial outputs would be whole
#: shards again beside the inputs and gradients, and those transient shards are what keeps the longest sequence
#: on R GPUs short of R times one GPU's.
HEAD_GROUP_BYTES = 1 << 30


def head_groups(k) -> int:
    """How many groups of K/V heads (each with its query heads) the ring takes one after another: the fewest,
    dividing H_kv, whose share of this rank's K shard is at most :data:`HEAD_GROUP_BYTES` (H_kv when even
    one head is larger). Attention is independent per head, so the groups give the same result; what changes
    is that only one group's blocks travel and wait at a time. Every rank has the same shapes, so the same G."""
    validation.check_tensor("k", k)
    if k.ndim != 4:
        raise ValueError(f"k must have shape (B, H_kv, N_local, d), got {k.ndim}-d")
    H_kv = k.shape[1]
    per_head = k[:, :1].numel() * k.element_size()
    return next((g for g in range(1, H_kv + 1) if H_kv % g == 0 and per_head * H_kv // g <= HEAD_GROUP_BYTES), H_kv)


def _head_slices(q, k, G: int):
    """(query heads, K/V heads) of each of the G groups: whole K/V heads and the query heads that share them."""
    per_kv, per_q = k.shape[1] // G, q.shape[1] // G
    return [(slice(g * per_q, (g + 1) * per_q), slice(g * per_kv, (g + 1) * per_kv)) for g in range(G)]


def _forward(q, k, v, causal: bool, scale: float, ring: _Ring):
    """(O in q's dtype, lse in float64) of this rank's queries against every rank's keys, a head group at a time
    where the shard is large (:func:`head_groups`; one group of every head where it is small): each group's
    written into its heads of the whole O and lse, which are allocated when the first group's ring is done (its
    blocks in transit and partial outputs freed by then, so the whole O is not held beside them)."""
    O = lse = None
    for hq, hkv in _head_slices(q, k, head_groups(k)):
        O_g, lse_g = _forward_heads(q[:, hq], k[:, hkv], v[:, hkv], causal, scale, ring)
        if O is None:
            O = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], dtype=torch.float64, device=q.device)
        O[:, hq] = O_g  # the fp32 sum of the merges rounded once, into q's dtype
        lse[:, hq] = lse_g
        del O_g, lse_g
    return O, lse


def _forward_heads(q, k, v, causal: bool, scale: float, ring: _Ring):
    """These heads' (O in float32, lse in float64) in one ring: the merges run on an fp32 O (each merge in
    fp16 would round once more), which :func:`_forward` rounds into q's dtype."""
    n = q.shape[2]
    k_cur, v_cur = k.contiguous(), v.contiguous()  # what is sent must be contiguous
    O = lse = None
    for step in range(ring.size):
        source = (ring.rank - step) % ring.size
        # The next block's transfer first, so it runs while this block is computed.
        incoming = ring.exchange([k_cur, v_cur], _TAG_KV) if step < ring.size - 1 else None
        rows, cols, blk_causal = block_visibility(ring.rank, source, n, causal)
        O_b, lse_b = _block_forward(_rows(q, rows), _rows(k_cur, cols), _rows(v_cur, cols), blk_causal, scale)
        if O is None:  # step 0 is the own block, which every local query sees
            O, lse = O_b.float(), lse_b
        else:  # exact: notebook 02's merge of two partial softmaxes over disjoint key sets (O in fp32), in place
            merge_outputs(O[:, :, rows], lse[:, :, rows], O_b, lse_b, inplace=True, check_finite=False)
        del O_b, lse_b  # before the next step allocates its own
        if incoming is not None:
            k_cur, v_cur = incoming.wait()
    del k_cur, v_cur  # the last visiting block
    return O, lse


def _backward(q, k, v, O, lse, dO, causal: bool, scale: float, ring: _Ring):
    """(dQ, dK, dV) of this rank's shards: the whole gradients allocated once, and each head group's
    (:func:`head_groups`; one group of every head where the shard is small) summed straight into its heads of
    them by :func:`_backward_heads`."""
    dQ, dK, dV = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    G = head_groups(k)
    for hq, hkv in _head_slices(q, k, G):
        _backward_heads(q[:, hq], k[:, hkv], v[:, hkv], O[:, hq], lse[:, hq], dO[:, hq],
                        (dQ[:, hq], dK[:, hkv], dV[:, hkv]), causal, scale, ring, hide_first=G == 1)
    return dQ, dK, dV


def _backward_heads(q, k, v, O, lse, dO, out, causal: bool, scale: float, ring: _Ring, hide_first: bool):
    """The gradients of these heads written into ``out`` = (dQ, dK, dV) (views of the whole gradients), in two
    rings that each run one of the two backward kernels. First this rank's queries go round (Q, dO and the row
    statistics m2, l2, D: what the dK/dV kernel reads of a query) and dK, dV sum their shares locally; then the
    K/V blocks go round and dQ sums its own (in this order the second ring's step outputs are one tensor, dQ's,
    beside the finished dK and dV). No partial sum travels and no float32 buffer is sent or received: what a
    step adds is the block in transit and its share of the gradients, computed in pieces of at most
    :data:`_CHUNK` tokens where the block is a whole rectangle. ``hide_first``: see :class:`_Transfers`."""
    stats = ops._stats_from_lse(lse)
    delta = ops._delta(O, dO)
    dQ, dK, dV = out
    _dkdv_ring(q, k, v, stats, delta, dO, (dK, dV), causal, scale, ring, hide_first)
    _dq_ring(q, k, v, stats, delta, dO, dQ, causal, scale, ring, hide_first)


class _Transfers:
    """When a backward ring posts each step's transfer of the block it holds to the next rank. From step 1 on,
    before the step's kernels, so the transfer runs while they compute. The first transfer the same way where
    every head goes round in one ring (``hide_first``); where the shard is taken in head groups, after step 0's
    shares are summed into the gradients. Then the buffers that receive the next block do not exist beside
    step 0's shares (the own block's, whole: the largest of the ring), and on two ranks, where the sum is the
    gradient itself (:class:`_GradientSum`), a rank holds two of the group's tensors beside its eight, not
    four; a group of several heads also copies half a block in a causal step (a strided slice of its heads),
    three in all (measured: 8 + 3/G shard tensors at G groups, 8 + 2/G with one head a group). The price is
    each group's first transfer waiting unhidden: one group's block, milliseconds, beside the seconds that a
    step of such a shard computes."""

    def __init__(self, ring, tag, hide_first: bool):
        self.ring, self.tag, self.hide_first = ring, tag, hide_first
        self.pending = None

    def before_step(self, step: int, block):
        if step < self.ring.size - 1 and (step > 0 or self.hide_first):
            self.pending = self.ring.exchange(block, self.tag)

    def after_step(self, step: int, block):
        """The next block (the received one), or ``block`` after the last step."""
        if step < self.ring.size - 1 and self.pending is None:
            self.pending = self.ring.exchange(block, self.tag)
        if self.pending is None:
            return block
        received, self.pending = self.pending.wait(), None
        return received


class _GradientSum:
    """A gradient's running sum over the ring's steps, ending in ``out`` (a view of the whole gradient). On more
    than two ranks the sum is float32 (each addition in fp16 or bf16 would round once more) and copied into
    ``out`` at the end. On one or two it is ``out`` itself: one addition of two fp16 (or bf16) numbers is exact
    in float32 and rounded once, the very bits a float32 sum rounded at the end gives, and no second buffer
    of the group's size exists beside the gradient (what the longest sequence that fits is made of)."""

    def __init__(self, out, ring):
        self.out, self.total = out, None
        self.wide = ring.size > 2

    def add(self, share, index: slice):
        """``sum[:, :, index] += share``. The first share starts the sum: copied when it covers every token,
        added to zeros otherwise (adding to 0 is exact, so the bits are the same)."""
        if self.total is None:
            self.total = torch.empty(self.out.shape, dtype=torch.float32, device=self.out.device) if self.wide \
                else self.out
            if tuple(share.shape) == tuple(self.out.shape):
                self.total.copy_(share)
                return
            self.total.zero_()
        self.total[:, :, index] += share

    def finish(self):
        """Writes the sum into ``out`` (zeros if no share came) and frees a float32 sum."""
        if self.total is None:
            self.out.zero_()
        elif self.total is not self.out:
            self.out.copy_(self.total)
        self.total = None


#: A step of the backward computes the shares of at most this many keys (dK/dV ring) or queries (dQ ring) at a
#: time where its block is a whole rectangle (not a causal diagonal block): each piece's output is then at most
#: this long, not the shard's length, which is what the longest sequence that fits is made of.
_CHUNK = 1 << 17


def _chunks(index: slice, n: int, causal: bool) -> list:
    """``index`` (a slice of a shard of n tokens) cut into pieces of at most :data:`_CHUNK` tokens; a causal
    (diagonal) block stays whole, since its mask is aligned to the block's corner."""
    start, stop, _ = index.indices(n)
    if causal or stop - start <= _CHUNK:
        return [index]
    return [slice(a, min(a + _CHUNK, stop)) for a in range(start, stop, _CHUNK)]


def _dq_ring(q, k, v, stats, delta, dO, dQ, causal, scale, ring, hide_first: bool):
    """dQ, written into ``dQ``: this rank's queries against every rank's K/V block, its shares summed
    (:class:`_GradientSum`), a whole block's rows in pieces (:func:`_chunks`)."""
    n = q.shape[2]
    k_cur, v_cur = k.contiguous(), v.contiguous()
    total = _GradientSum(dQ, ring)
    transfers = _Transfers(ring, _TAG_KV, hide_first)
    for step in range(ring.size):
        source = (ring.rank - step) % ring.size
        transfers.before_step(step, [k_cur, v_cur])
        rows, cols, blk_causal = block_visibility(ring.rank, source, n, causal)
        k_s, v_s = _rows(k_cur, cols), _rows(v_cur, cols)
        for sub in _chunks(rows, n, blk_causal):
            dQ_b = _block_backward(_rows(q, sub), k_s, v_s, [_rows(s, sub) for s in stats], _rows(delta, sub),
                                   _rows(dO, sub), blk_causal, scale, ("dq",))[0]
            total.add(dQ_b, sub)
            del dQ_b  # before the next piece allocates its own
        del k_s, v_s
        k_cur, v_cur = transfers.after_step(step, [k_cur, v_cur])
    del k_cur, v_cur
    total.finish()


def _dkdv_ring(q, k, v, stats, delta, dO, out, causal, scale, ring, hide_first: bool):
    """(dK, dV), written into ``out``: every rank's queries (Q, dO, m2, l2, D) against this rank's K/V, the
    shares summed as dQ's are, a whole block's columns in pieces. At step t this rank holds the queries of rank
    ``rank - t``, so the visible part is ``block_visibility(source, rank)``: rows of the visiting queries,
    columns of the own keys."""
    n = q.shape[2]
    visiting = [x.contiguous() for x in (q, dO, *stats, delta)]
    dK, dV = (_GradientSum(x, ring) for x in out)
    transfers = _Transfers(ring, _TAG_Q, hide_first)
    for step in range(ring.size):
        source = (ring.rank - step) % ring.size
        transfers.before_step(step, visiting)
        rows, cols, blk_causal = block_visibility(source, ring.rank, n, causal)
        q_s, dO_s, m2_s, l2_s, delta_s = (_rows(x, rows) for x in visiting)
        for sub in _chunks(cols, n, blk_causal):
            _, dK_b, dV_b = _block_backward(q_s, _rows(k, sub), _rows(v, sub), (m2_s, l2_s), delta_s, dO_s,
                                            blk_causal, scale, ("dkdv",))
            dK.add(dK_b, sub)
            dV.add(dV_b, sub)
            del dK_b, dV_b
        del q_s, dO_s, m2_s, l2_s, delta_s
        visiting = transfers.after_step(step, visiting)
    del visiting
    dK.finish()  # one float32 sum (R > 2) freed before the other is copied
    dV.finish()


def ring_attention_forward(q, k, v, causal=False, sm_scale=None, group=None, *, check_finite=True):
    """Ring attention forward without autograd: ``(o, lse)`` of this rank's queries, ``o`` like ``q``, ``lse``
    ``(B, H, N_local)`` in float64 (natural log), the whole row's: the kernels' row max and sum added in float64,
    so that :func:`ring_attention_backward` given it recomputes P as exactly as the autograd path does.
    Arguments as :func:`ring_attention`. Notebook ``13_beyond_one_gpu_and_decoding``."""
    ring, scale = _prepare(q, k, v, causal, sm_scale, group, check_finite)
    with torch.no_grad():
        return _forward(q, k, v, causal, scale, ring)


def ring_attention_backward(q, k, v, o, lse, do, causal=False, sm_scale=None, group=None, *, check_finite=True):
    """Gradients ``(dq, dk, dv)`` of this rank's shards from the forward's ``o`` and global ``lse`` (those of
    :func:`ring_attention_forward`) and ``do``. Notebook ``13_beyond_one_gpu_and_decoding``."""
    def extra(check_finite):
        for name, x in (("o", o), ("lse", lse), ("do", do)):
            validation.check_tensor(name, x, q.device)
        if not lse.dtype.is_floating_point:
            raise TypeError(f"lse must be a floating tensor (the forward's float64 lse), got dtype {lse.dtype}")
        validation.check_same_shape("o", o, "q", q)
        validation.check_same_shape("do", do, "q", q)
        if o.dtype != q.dtype or do.dtype != q.dtype:  # as flash_attention_backward: no silent cast
            raise TypeError(f"o and do must have the dtype of q ({q.dtype}), got {o.dtype} and {do.dtype}")
        if tuple(lse.shape) != tuple(q.shape[:3]):
            raise ValueError(f"lse must have shape (B, H, N_local) = {tuple(q.shape[:3])}, got {tuple(lse.shape)}")
        if check_finite:
            validation.check_finite({"o": o, "do": do})
            validation.check_finite({"lse": lse}, allow_neg_inf=True)

    ring, scale = _prepare(q, k, v, causal, sm_scale, group, check_finite, extra)
    with torch.no_grad():
        return _backward(q, k, v, o.to(q.dtype), lse.double(), do.to(q.dtype), causal, scale, ring)


class RingAttentionFunction(torch.autograd.Function):
    """:func:`ring_attention` as an autograd Function: saves this rank's Q, K, V, its O and the global lse;
    the backward runs two rings (the queries around for dK and dV, then K/V around for dQ)."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, sm_scale=None, group=None, check_finite=True):
        ring, scale = _prepare(q, k, v, causal, sm_scale, group, check_finite)
        O, lse = _forward(q, k, v, causal, scale, ring)
        ctx.save_for_backward(q, k, v, O, lse)
        ctx.causal, ctx.scale, ctx.ring, ctx.check_finite = causal, scale, ring, check_finite
        return O

    @staticmethod
    def backward(ctx, dO):
        q, k, v, O, lse = ctx.saved_tensors
        ring = ctx.ring
        if ctx.check_finite:  # all ranks agree first: one rank raising alone would hang the others
            error = None
            try:
                validation.check_finite({"do (the gradient of o)": dO})
            except ValueError as exc:
                error = exc
            _agree(error, [0.0] * _N_FACTS, ring, _agreement_device(ring))
        dQ, dK, dV = _backward(q, k, v, O, lse, dO.to(q.dtype), ctx.causal, ctx.scale, ring)
        return dQ, dK, dV, None, None, None, None


def ring_attention(q, k, v, causal=False, sm_scale=None, group=None, *, check_finite=True):
    """Exact attention over a sequence sharded across the ranks of ``group`` (default: the world group),
    differentiable: ``o = ring_attention(q, k, v, causal)`` gives this rank's rows of
    ``softmax(sm_scale Q K^T) V`` over the *whole* sequence.

    ``q``: ``(B, H, N_local, d)``, ``k`` and ``v``: ``(B, H_kv, N_local, d)`` (grouped-query attention when
    ``H_kv < H``), this rank's shards along dim 2 (:func:`shard_sequence`): contiguous for ``causal=False``
    (any layout works there, everything being visible), the zigzag layout for ``causal=True`` (chunks r and
    2R-1-r of 2R; causal is top-left over the global positions). dtypes and devices as
    :func:`flashref.triton.flash_attention`: CUDA tensors with the ``nccl`` backend (one process per GPU,
    ``torch.cuda.set_device`` first, the group created with ``pg_options=nccl_group_options()``: a high-priority
    NCCL stream keeps the transfers beside the kernels), CPU tensors with ``gloo`` (Triton's interpreter). Every
    rank must call it, with the same shapes. ``check_finite`` (default True): refuse NaN or inf (also in dO) and
    compare the shapes, dtype, ``causal`` and ``sm_scale`` of all ranks, with one small all_gather per pass, so
    that every rank raises together rather than one raising and the others waiting in the ring; False skips
    both, as the benchmarks do. Notebook ``13_beyond_one_gpu_and_decoding``; the module docstring explains the ring.
    """
    return RingAttentionFunction.apply(q, k, v, causal, sm_scale, group, check_finite)


# --------------------------------------------------------------------------------------------------
# One process, R simulated ranks: the same ring with threads as ranks and mailboxes as the network
# --------------------------------------------------------------------------------------------------

_SIMULATION_TIMEOUT = 600.0  # seconds for a whole simulate_ring call: a bug fails it instead of hanging forever
_POLL = 0.2  # seconds a waiting rank sleeps between looks at the failure flag


class _RingAborted(RuntimeError):
    """A rank bailing out of a wait because another rank failed: never the error simulate_ring reports."""


class _SimulatedWorld:
    """What the simulated ranks share: one mailbox per (receiving rank, tag), the lock that makes them take
    turns, and the first real error."""

    def __init__(self, size):
        self.size = size
        self.turn = threading.Lock()
        self.mailboxes = defaultdict(queue.Queue)  # only touched under `turn`, so the dict needs no lock of its own
        self.failed = threading.Event()
        self.error = None

    def fail(self, exc):
        if self.error is None and not isinstance(exc, _RingAborted):
            self.error = exc
        self.failed.set()

    def receive(self, rank, tag):
        """The oldest message for ``rank`` under ``tag``. Called holding ``turn``; gives it up while blocked, so
        the sender can run (Triton's interpreter allows one kernel at a time)."""
        box = self.mailboxes[(rank, tag)]
        self.turn.release()
        try:
            while True:
                if self.failed.is_set():
                    raise _RingAborted(f"rank {rank} stops: another rank failed")
                try:
                    return box.get(timeout=_POLL)
                except queue.Empty:
                    pass
        finally:
            self.turn.acquire()


class _SimulatedRing:
    """A rank of the simulated world, with the interface _forward and _backward use from _Ring."""

    def __init__(self, world, rank):
        self.world, self.size, self.rank = world, world.size, rank

    def exchange(self, tensors, tag):
        return _SimulatedExchange(self, tensors, tag)


class _SimulatedExchange:
    def __init__(self, ring, tensors, tag):
        self.ring, self.tag = ring, tag
        if ring.size == 1:  # as _Exchange: what a ring of one sends is what it receives
            self.received = list(tensors)
            return
        self.received = None
        # Clones: a sent message is a snapshot, whatever the sender does with its tensors afterwards.
        ring.world.mailboxes[((ring.rank + 1) % ring.size, tag)].put([t.clone() for t in tensors])

    def wait(self):
        if self.received is None:
            return self.ring.world.receive(self.ring.rank, self.tag)
        return self.received


@contextlib.contextmanager
def _rank_scope(device, stream):
    """Grad mode and the current CUDA device and stream belong to a thread: each rank takes the caller's."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        if stream is not None:
            stack.enter_context(torch.cuda.device(device))
            stack.enter_context(torch.cuda.stream(stream))
        yield


def _run_rank(world, rank, work, results, device, stream):
    with world.turn:  # released only inside receive(): the ranks take turns
        try:
            if world.failed.is_set():
                raise _RingAborted(f"rank {rank} stops before it starts: another rank failed")
            with _rank_scope(device, stream):
                results[rank] = work(_SimulatedRing(world, rank))
        except BaseException as exc:  # noqa: BLE001 (recorded for the caller; the others must not wait forever)
            world.fail(exc)


def _run_world(world_size, work, device):
    """``work(ring)`` on each rank of a simulated world, one thread each; their results in rank order."""
    world = _SimulatedWorld(world_size)
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    results = [None] * world_size
    threads = [threading.Thread(target=_run_rank, args=(world, r, work, results, device, stream),
                                name=f"flashref-simulated-rank-{r}", daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + _SIMULATION_TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        world.failed.set()  # the waiting ranks bail out; a rank stuck inside a kernel cannot be stopped
        raise TimeoutError(f"simulate_ring: the {world_size} simulated ranks did not finish within "
                           f"{_SIMULATION_TIMEOUT} s")
    if world.error is not None:
        raise world.error
    return results


def simulate_ring(q, k, v, world_size, causal=False, sm_scale=None, do=None):
    """The ring of :func:`ring_attention` with ``world_size`` ranks in one process: threads as ranks, a FIFO
    mailbox per (rank, tag) as the network, each rank running the module's own forward (and, given ``do``,
    backward) on its shard. For reading and checking the algorithm on one device (notebook
    ``13_beyond_one_gpu_and_decoding``). The threads take turns (Triton's interpreter runs one kernel at a
    time), so it shows the ring's arithmetic and message order, not its speed. ``q``: ``(B, H, N, d)``, ``k``,
    ``v``: ``(B, H_kv, N, d)``, the whole sequence, sharded as :func:`shard_sequence` (zigzag when causal).
    Returns ``(o, lse)``, or ``(o, lse, dq, dk, dv)`` given ``do``, gathered back in sequence order."""
    world_size = validation.check_positive_int("world_size", world_size)
    _, scale = _check(q, k, v, causal, sm_scale, check_finite=True)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"simulate_ring shards one sequence: N of k ({k.shape[2]}) must equal N of q "
                         f"({q.shape[2]})")
    if do is not None:
        if not isinstance(do, torch.Tensor):
            raise TypeError(f"do must be None or a torch.Tensor, got {type(do).__name__}")
        validation.check_tensor("do", do, q.device)
        validation.check_same_shape("do", do, "q", q)
        if do.dtype != q.dtype:
            raise TypeError(f"do must have the dtype of q ({q.dtype}), got {do.dtype}")
        validation.check_finite({"do": do})
    # Each rank holds its own copy of its shard, as on separate GPUs.
    shards = [[shard_sequence(x, r, world_size, zigzag=causal).contiguous() for r in range(world_size)]
              for x in (q, k, v)]
    do_shards = None if do is None else [shard_sequence(do.to(q.dtype), r, world_size, zigzag=causal).contiguous()
                                         for r in range(world_size)]

    def work(ring):
        q_r, k_r, v_r = (s[ring.rank] for s in shards)
        O, lse = _forward(q_r, k_r, v_r, causal, scale, ring)
        if do_shards is None:
            return O, lse
        return (O, lse, *_backward(q_r, k_r, v_r, O, lse, do_shards[ring.rank], causal, scale, ring))

    results = _run_world(world_size, work, q.device)
    return tuple(gather_sequence([res[i] for res in results], zigzag=causal) for i in range(len(results[0])))
