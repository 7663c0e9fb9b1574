"""Ring attention under NCCL, one process per GPU, against the float64 reference with the tolerance rule.
Needs two CUDA devices (the two-H200 machine); skipped, visibly, elsewhere. The gloo path of the same code runs
on the CPU in tests/test_ring_attention.py."""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="ring attention over NCCL needs two CUDA devices")]

# (B, H, H_kv, N, d, causal, dtype): N a multiple of 2R but of no tile size; GQA; fp16 and bf16
CASES = [(1, 4, 4, 3000, 64, True, "float16"), (1, 4, 2, 3000, 64, False, "float16"),
         (2, 4, 4, 8188, 128, True, "bfloat16"), (1, 4, 1, 1028, 64, True, "float16")]
WORLD = 2


def _worker(rank, port, queue):
    try:
        import torch.distributed as dist

        import flashref.ring_attention as ring_module
        from flashref.ring_attention import nccl_group_options, ring_attention, shard_sequence
        from tests._triton_helpers import feature_inputs

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=WORLD, pg_options=nccl_group_options())
        assert dist.group.WORLD._get_backend(torch.device("cuda")).options.is_high_priority_stream
        out, default = [], ring_module.HEAD_GROUP_BYTES
        for B, H, H_kv, N, d, causal, dtype in CASES:
            q, k, v, do = feature_inputs(B, H, H_kv, N, N, d, getattr(torch, dtype), seed=N)
            shards = [shard_sequence(x, rank, WORLD, causal).contiguous() for x in (q, k, v, do)]
            for bound in (default, 1):  # the heads in one group, then one K/V head a group
                ring_module.HEAD_GROUP_BYTES = bound
                qs, ks, vs = (x.clone().requires_grad_() for x in shards[:3])
                o = ring_attention(qs, ks, vs, causal=causal)
                o.backward(shards[3])
                # NumPy arrays travel by value: a CPU tensor would travel as a file descriptor that its process
                # shares only while it lives, and a rank may be gone before the parent unpickles it. float32 holds
                # fp16 and bf16 exactly; the parent casts back.
                out.append([x.detach().float().cpu().numpy() for x in (o, qs.grad, ks.grad, vs.grad)])
            ring_module.HEAD_GROUP_BYTES = default
        queue.put((rank, out))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (the parent reports it)
        queue.put((rank, traceback.format_exc()))


def test_ring_over_nccl_matches_the_reference():
    """Every case twice: the heads in one ring, and one ring per K/V head (``HEAD_GROUP_BYTES`` = 1, what a shard
    past the bound does), both within the tolerance rule."""
    import torch.multiprocessing as mp

    from flashref import reference
    from flashref.ring_attention import gather_sequence
    from flashref.tolerance import assert_within_tolerance
    from tests._triton_helpers import feature_inputs, np64, plain_with_features

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, res in got.items():
        assert not isinstance(res, str), f"rank {rank} failed:\n{res}"
    for i, (B, H, H_kv, N, d, causal, dtype) in enumerate(CASES):
        q, k, v, do = feature_inputs(B, H, H_kv, N, N, d, getattr(torch, dtype), seed=N)
        q64, k64, v64, do64 = (np64(x) for x in (q, k, v, do))
        refs = [reference.attention(q64, k64, v64, causal=causal),
                *reference.attention_backward(q64, k64, v64, do64, causal=causal)]
        base = plain_with_features(*(x.cuda() for x in (q, k, v, do)), causal)
        for grouped in (0, 1):
            full = [gather_sequence([torch.from_numpy(got[r][2 * i + grouped][j]).to(getattr(torch, dtype))
                                     for r in range(WORLD)], causal) for j in range(4)]
            for name, x, r, b in zip(("o", "dq", "dk", "dv"), full, refs, base):
                assert_within_tolerance(x, r, b.cpu(), factor=2.0 if name == "o" else 3.0,
                                        name=f"{name} {CASES[i]}{' a head a group' if grouped else ''}")
