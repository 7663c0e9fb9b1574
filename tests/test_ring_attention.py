"""Ring attention (flashref.ring_attention) against the float64 reference: spawned processes joined by a gloo
process group on the CPU (the kernels in Triton's interpreter), world sizes 2 and 3, causal (zigzag) and not,
grouped-query heads, forward and backward; the layout functions and the zigzag rule against a dense causal
mask; and the errors, including the ones every rank must raise together. simulate_ring, the same ring with
threads as ranks in this process, against the same reference, and its failures (no hang). On the GPU machine
the same code runs with NCCL (python -m flashref.bench ring)."""

from __future__ import annotations

import datetime
import math
import os
import tempfile
import threading
import time
import traceback

import flashref.triton  # noqa: F401  (first: Triton's interpreter is switched on before triton is imported)
import numpy as np
import pytest
import torch
import torch.distributed as dist

import flashref.ring_attention as ring_module
from flashref.bench import ring_bench
from flashref import reference
from flashref.ring_attention import (block_visibility, gather_sequence, ring_attention, ring_attention_backward,
                                     ring_attention_forward, sequence_positions, shard_sequence, simulate_ring)
from flashref.tolerance import assert_within_tolerance
from tests._triton_helpers import DEVICE, feature_inputs, np64, plain_with_features

JOIN_TIMEOUT = 120.0  # seconds for one spawned run; a hang fails the test instead of stalling the suite

# (B, H, H_kv, N, d, causal, dtype): N a multiple of 2R, its shards not multiples of the interpreter's tiles
# (32 x 16 forward, 16 x 32 dK/dV), the local sequence crossing a tile for R = 2.
CASES = {
    2: [(1, 2, 2, 76, 16, False, "float32"), (2, 2, 1, 76, 16, True, "float32"), (1, 2, 1, 76, 16, False, "float32"),
        (2, 2, 2, 76, 16, True, "float32"), (1, 2, 1, 44, 16, True, "float16")],
    3: [(2, 2, 2, 66, 16, False, "float32"), (1, 2, 1, 66, 16, True, "float32"), (1, 2, 1, 42, 16, False, "float32"),
        (2, 2, 2, 42, 16, True, "float32")],
}


# ---- the spawned side ---------------------------------------------------------------------------------------

def _inputs(case):
    """q, k, v, dO of a case; a case may end with a scale for q (larger logits)."""
    B, H, H_kv, N, d, causal, dtype, *scale = case
    return feature_inputs(B, H, H_kv, N, N, d, getattr(torch, dtype), seed=N + H_kv + B,
                          scale=scale[0] if scale else 1.0)


def _error_message(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (the message is the result)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _error_cases(rank, world_size):
    """Inputs that are wrong on one rank only: every rank must raise (none may wait in the ring)."""
    q, k, v, _ = feature_inputs(1, 2, 2, 4 * world_size, 4 * world_size, 16, torch.float32)
    q, k, v = (shard_sequence(x, rank, world_size, True) for x in (q, k, v))
    last = rank == world_size - 1
    nan_q = q.clone()
    if last:
        nan_q[0, 1, 2, 3] = float("nan")
    short = (lambda x: x[:, :, :2]) if last else (lambda x: x)
    return {
        "nan on the last rank": _error_message(lambda: ring_attention(nan_q, k, v, causal=True)),
        "N_local differs": _error_message(lambda: ring_attention(short(q), short(k), short(v))),
        "sm_scale differs": _error_message(lambda: ring_attention(q, k, v, sm_scale=0.5 if last else 0.25)),
        "odd N_local, causal": _error_message(lambda: ring_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], True)),
        # after all that, the ring still works (nobody was left behind in a pending transfer)
        "ok afterwards": _error_message(lambda: ring_attention(q, k, v, causal=True)),
    }


def _worker(rank, world_size, init_file, cases, group_bytes, results):
    try:
        torch.set_num_threads(1)
        os.environ["FLASHREF_TRITON_AUTOTUNE"] = "0"
        if group_bytes is not None:  # large shards' head groups (ring_attention.head_groups) at these small ones
            ring_module.HEAD_GROUP_BYTES = group_bytes
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=JOIN_TIMEOUT))
        for i, case in enumerate(cases):
            causal = case[5]
            q, k, v, do = (shard_sequence(x, rank, world_size, causal).contiguous() for x in _inputs(case))
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            o = ring_attention(qq, kk, vv, causal=causal)
            o.backward(do)
            o2, lse = ring_attention_forward(q, k, v, causal=causal)
            grads = ring_attention_backward(q, k, v, o2, lse, do, causal=causal)
            same = bool(torch.equal(o2, o.detach())) and all(torch.equal(a, b.grad) for a, b in zip(grads, (qq, kk, vv)))
            results.put(("result", rank, i, [np64(x) for x in (o, qq.grad, kk.grad, vv.grad, lse)], same))
        results.put(("errors", rank, _error_cases(rank, world_size)))
        dist.destroy_process_group()
        results.put(("done", rank))
    except BaseException:  # noqa: BLE001 (the parent shows the worker's traceback)
        results.put(("error", rank, traceback.format_exc()))


def spawn_ring(world_size, cases, timeout=JOIN_TIMEOUT, group_bytes=None):
    """Run :func:`_worker` on ``world_size`` spawned processes (the ring benchmark's launcher); returns
    ``{(case, rank): arrays}``, ``{rank: errors}``. A worker's exception fails with its traceback; a hang fails
    after ``timeout`` seconds. Skipped where CUDA is visible: gloo carries CPU tensors, which only Triton's
    interpreter runs (CI's machine); on a GPU, tests/test_ring_gpu.py runs the ring over NCCL. ``group_bytes``:
    the workers' ``HEAD_GROUP_BYTES``."""
    if DEVICE != "cpu":
        pytest.skip("the gloo ring runs on CPU tensors under Triton's interpreter; tests/test_ring_gpu.py is the GPU's")
    store = os.path.join(tempfile.mkdtemp(prefix="flashref_ring_"), "store")
    out, errors = {}, {}

    def on_message(msg):
        if msg[0] == "result":
            out[(msg[2], msg[1])] = (msg[3], msg[4])
        elif msg[0] == "errors":
            errors[msg[1]] = msg[2]

    failures = ring_bench._run([(_worker, (r, world_size, store, cases, group_bytes)) for r in range(world_size)],
                               on_message, timeout=timeout)
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    return out, errors


@pytest.fixture(scope="module")
def ring_runs():
    runs = {}

    def get(world_size):
        if world_size not in runs:
            runs[world_size] = spawn_ring(world_size, CASES[world_size])
        return runs[world_size]

    return get


# ---- against the float64 reference ---------------------------------------------------------------------------

@pytest.mark.parametrize("world_size, index", [(R, i) for R in CASES for i in range(len(CASES[R]))],
                         ids=lambda x: str(x))
def test_ring_attention_matches_the_reference(ring_runs, world_size, index):
    out, _ = ring_runs(world_size)
    case = CASES[world_size][index]
    B, H, H_kv, N, d, causal, dtype = case
    q, k, v, do = _inputs(case)
    shards = [out[(index, r)][0] for r in range(world_size)]
    assert all(out[(index, r)][1] for r in range(world_size)), \
        "ring_attention_forward/backward give ring_attention's output and gradients bit for bit"
    got = [gather_sequence([s[j] for s in shards], causal) for j in range(5)]
    q64, k64, v64, do64 = (np64(x) for x in (q, k, v, do))
    ref_o, ref_lse = reference.attention(q64, k64, v64, causal=causal, return_lse=True)
    refs = [ref_o, *reference.attention_backward(q64, k64, v64, do64, causal=causal)]
    base = plain_with_features(q, k, v, do, causal)
    for name, x, r, b in zip(("o", "dq", "dk", "dv"), got, refs, base):
        assert x.shape == r.shape and np.isfinite(x).all(), name
        x = torch.from_numpy(x).to(getattr(torch, dtype))  # the tolerance rule reads the dtype of what is checked
        atol = 1e-5 * max(1.0, float(np.abs(r).max())) if dtype == "float32" else None
        assert_within_tolerance(x, r, b, factor=2.0 if name == "o" else 3.0, atol=atol, name=f"{name} (R={world_size})")
    np.testing.assert_allclose(got[4], ref_lse, rtol=0, atol=1e-4 * max(1.0, np.abs(ref_lse).max()))


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_every_rank_raises_together(ring_runs, world_size):
    _, errors = ring_runs(world_size)
    last = world_size - 1
    for rank in range(world_size):
        e = errors[rank]
        if rank == last:
            assert e["nan on the last rank"].startswith("ValueError: q must be finite"), e
        else:
            assert "rank(s) [" + str(last) + "]" in e["nan on the last rank"], e
        assert "same N_local on every rank" in e["N_local differs"], e
        assert "same sm_scale on every rank" in e["sm_scale differs"], e
        assert "N_local must be even" in e["odd N_local, causal"] and "zigzag" in e["odd N_local, causal"], e
        assert e["ok afterwards"] == "no error", e


# ---- the layout and the zigzag rule, in-process ---------------------------------------------------------------

@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_and_gather_round_trip(world_size, zigzag):
    N = 2 * world_size * 3
    x = np.arange(2 * 3 * N * 5, dtype=np.float64).reshape(2, 3, N, 5)
    shards = [shard_sequence(x, r, world_size, zigzag) for r in range(world_size)]
    np.testing.assert_array_equal(gather_sequence(shards, zigzag), x)
    t = torch.from_numpy(x)
    assert torch.equal(gather_sequence([shard_sequence(t, r, world_size, zigzag) for r in range(world_size)], zigzag), t)
    lse = x[..., 0]  # (B, H, N): sharded the same way
    np.testing.assert_array_equal(gather_sequence([shard_sequence(lse, r, world_size, zigzag)
                                                   for r in range(world_size)], zigzag), lse)
    for r, s in enumerate(shards):
        np.testing.assert_array_equal(s[0, 0, :, 0] / 5, sequence_positions(r, world_size, N, zigzag))


def test_zigzag_holds_an_early_and_a_late_chunk():
    assert sequence_positions(0, 2, 8, True).tolist() == [0, 1, 6, 7]
    assert sequence_positions(1, 2, 8, True).tolist() == [2, 3, 4, 5]
    assert sequence_positions(1, 3, 12, True).tolist() == [2, 3, 8, 9]
    assert sequence_positions(1, 3, 12, False).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("c", [1, 2, 3])
def test_zigzag_visibility_is_the_dense_causal_mask(world_size, c):
    """What each rank computes against each visiting block is exactly the global causal mask's part, and each
    step's work is the same: c x 2c pairs (the own block: its causal triangle, c more)."""
    N, n = 2 * world_size * c, 2 * c
    dense = np.tril(np.ones((N, N), dtype=bool))
    tri = np.tril(np.ones((n, n), dtype=bool))
    for r in range(world_size):
        rows_r = sequence_positions(r, world_size, N, True)
        for s in range(world_size):
            rows, cols, causal = block_visibility(r, s, n, True)
            computed = np.zeros((n, n), dtype=bool)
            computed[rows, cols] = tri[rows, cols] if causal else True
            want = dense[np.ix_(rows_r, sequence_positions(s, world_size, N, True))]
            np.testing.assert_array_equal(computed, want, err_msg=f"rank {r}, block of rank {s}")
            assert computed.sum() == (2 * c * c + c if s == r else 2 * c * c)
            assert (s == r) == causal, "only the own block needs a mask"
        assert block_visibility(r, (r + 1) % world_size, n, False) == (slice(0, n), slice(0, n), False)


def test_layout_errors():
    x = np.zeros((1, 2, 10, 4))
    with pytest.raises(ValueError, match=r"x has N = 10 .* multiple of 6"):
        shard_sequence(x, 0, 3, True)
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_sequence(x, 0, 4, False)
    with pytest.raises(ValueError, match="rank must be an int in"):
        shard_sequence(x, 2, 2, False)
    with pytest.raises(TypeError, match="zigzag must be a bool"):
        shard_sequence(x, 0, 2, 1)
    with pytest.raises(ValueError, match="world_size"):
        shard_sequence(x, 0, 0, False)
    with pytest.raises(ValueError, match="sequence along dim 2"):
        shard_sequence(np.zeros((10, 4)), 0, 2, False)
    with pytest.raises(TypeError, match="NumPy array or a torch.Tensor"):
        shard_sequence([[1.0]], 0, 1, False)
    with pytest.raises(ValueError, match="one shape"):
        gather_sequence([np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 6, 2))], False)
    with pytest.raises(TypeError, match="non-empty list"):
        gather_sequence([], True)
    with pytest.raises(ValueError, match="must be even"):
        gather_sequence([np.zeros((1, 1, 3, 2))] * 2, True)
    with pytest.raises(ValueError, match="n_local must be even"):
        block_visibility(0, 1, 5, True)


# ---- one rank, in-process: the errors, and the ring of one is flash attention ------------------------------------

def test_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    q = torch.zeros(1, 1, 4, 16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)


def test_nccl_group_options_ask_for_a_high_priority_stream(monkeypatch):
    """The options the docstrings tell users to create the NCCL group with put NCCL on a high-priority stream
    (notebook 13: at normal priority a transfer posted before a kernel waited for the whole kernel).
    ``ProcessGroupNCCL`` exists only in CUDA builds of torch, so a stand-in records what is set; where it is
    missing the error names NCCL and says what to use instead. tests/test_ring_gpu.py creates its groups with
    the real options."""
    class Options:
        is_high_priority_stream = False

    monkeypatch.setattr(dist, "ProcessGroupNCCL", type("ProcessGroupNCCL", (), {"Options": Options}), raising=False)
    options = ring_module.nccl_group_options()
    assert isinstance(options, Options) and options.is_high_priority_stream is True
    monkeypatch.delattr(dist, "ProcessGroupNCCL")
    with pytest.raises(RuntimeError, match="ProcessGroupNCCL.*gloo"):
        ring_module.nccl_group_options()


@pytest.fixture
def one_rank_group():
    """A gloo group of one rank in this process; gloo carries CPU tensors, which a machine with CUDA refuses."""
    if DEVICE != "cpu":
        pytest.skip("the gloo ring runs on CPU tensors under Triton's interpreter; tests/test_ring_gpu.py is the GPU's")
    store = os.path.join(tempfile.mkdtemp(prefix="flashref_ring_"), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_ring_of_one_is_flash_attention(one_rank_group):
    from flashref.triton import flash_attention

    q, k, v, do = feature_inputs(2, 4, 2, 33, 33, 16, torch.float32)
    for causal in (False, True):
        if causal:
            q, k, v, do = (x[:, :, :32] for x in (q, k, v, do))
        got = [x.clone().requires_grad_() for x in (q, k, v)]
        want = [x.clone().requires_grad_() for x in (q, k, v)]
        o = ring_attention(*got, causal=causal, sm_scale=0.3)
        o.backward(do)
        o_ref = flash_attention(*want, causal=causal, sm_scale=0.3)
        o_ref.backward(do)
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_bad_inputs_name_the_argument(one_rank_group):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(TypeError, match="causal must be a bool"):
        ring_attention(q, q, q, causal="yes")
    with pytest.raises(ValueError, match="sm_scale must be a finite number > 0"):
        ring_attention(q, q, q, sm_scale=-1.0)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        ring_attention(q.numpy(), q, q)
    with pytest.raises(ValueError, match="zigzag"):
        ring_attention(q[:, :, :7], q[:, :, :7], q[:, :, :7], causal=True)
    with pytest.raises(ValueError, match="N_local of k"):
        ring_attention(q, q[:, :, :4], q[:, :, :4])
    bad = q.clone()
    bad[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="k must be finite"):
        ring_attention(q, bad, q)
    with pytest.raises(TypeError, match="check_finite must be a bool"):
        ring_attention(q, q, q, check_finite=None)
    o, lse = ring_attention_forward(q, q, q)
    with pytest.raises(ValueError, match="lse must have shape"):
        ring_attention_backward(q, q, q, o, lse[:, :, :4], o)
    with pytest.raises(ValueError, match="do must be finite"):
        ring_attention_backward(q, q, q, o, lse, torch.full_like(o, math.nan))
    with pytest.raises(TypeError, match="lse must be a floating tensor"):
        ring_attention_backward(q, q, q, o, lse.long(), o)
    with pytest.raises(TypeError, match="lse must be a torch.Tensor"):
        ring_attention_backward(q, q, q, o, lse.numpy(), o)
    qq = q.clone().requires_grad_()
    out = ring_attention(qq, q, q)
    with pytest.raises(ValueError, match="gradient of o"):
        out.backward(torch.full_like(out, math.inf))


def test_the_gloo_ring_takes_a_head_group_at_a_time(ring_runs):
    """Over gloo (processes as ranks, the real point-to-point transfers) with HEAD_GROUP_BYTES of one byte: every
    K/V head its own group, B = 2 making each group's slices strided. O and the gradients are bit for bit the
    one-group ring's, the float64 lse within 1e-15 (as the simulated ring's test explains)."""
    indices = (1, 3)  # (B 2, H 2, H_kv 1 and 2, N 76, causal, float32)
    grouped, _ = spawn_ring(2, [CASES[2][i] for i in indices], group_bytes=1)
    whole, _ = ring_runs(2)
    for i, index in enumerate(indices):
        for rank in range(2):
            (got, same), (want, _) = grouped[(i, rank)], whole[(index, rank)]
            assert same, "autograd and the functions agree"
            for a, b in zip(got[:4], want[:4]):
                np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(got[4], want[4], rtol=1e-15, atol=0)


# ---- simulate_ring: the ring with threads as ranks, in this process --------------------------------------------

# (world_size, B, H, H_kv, N): N a multiple of 2R (causal's zigzag), grouped-query heads for every R
SIMULATED = [(1, 2, 2, 1, 8), (2, 1, 2, 2, 16), (2, 2, 2, 1, 8), (3, 1, 2, 1, 12), (3, 2, 2, 2, 12), (4, 1, 2, 1, 16)]


def _simulated_reference(q, k, v, do, causal, sm_scale=None):
    q64, k64, v64, do64 = (np64(x) for x in (q, k, v, do))
    o, lse = reference.attention(q64, k64, v64, causal=causal, sm_scale=sm_scale, return_lse=True)
    return (o, lse, *reference.attention_backward(q64, k64, v64, do64, causal=causal, sm_scale=sm_scale))


def _assert_matches(got, want, like):
    for name, x, r, t in zip(("o", "lse", "dq", "dk", "dv"), got, want, like):
        assert x.shape == r.shape and x.dtype == t.dtype, (name, tuple(x.shape), x.dtype)
        np.testing.assert_allclose(np64(x), r, rtol=0, atol=1e-5 * max(1.0, float(np.abs(r).max())), err_msg=name)


def _simulated_threads_alive():
    return [t for t in threading.enumerate() if t.name.startswith("flashref-simulated-rank-")]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world_size, B, H, H_kv, N", SIMULATED, ids=lambda x: str(x))
def test_simulate_ring_matches_the_reference(world_size, B, H, H_kv, N, causal):
    q, k, v, do = feature_inputs(B, H, H_kv, N, N, 16, torch.float32, seed=7 * world_size + N)
    got = simulate_ring(q, k, v, world_size, causal=causal, do=do)
    lse_like = torch.empty(B, H, N, dtype=torch.float64)  # the ring keeps lse in float64
    _assert_matches(got, _simulated_reference(q, k, v, do, causal), (q, lse_like, q, k, v))
    forward = simulate_ring(q, k, v, world_size, causal=causal)
    assert len(forward) == 2 and all(torch.equal(a, b) for a, b in zip(forward, got[:2])), \
        "without do: (o, lse), the same numbers"
    assert not _simulated_threads_alive()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world_size, B, H, H_kv", [(2, 2, 4, 2), (3, 1, 4, 4), (2, 1, 4, 1)])
def test_the_ring_takes_large_shards_a_head_group_at_a_time(monkeypatch, world_size, B, H, H_kv, causal):
    """head_groups: the fewest groups of K/V heads (dividing H_kv) whose share of a rank's K shard fits
    HEAD_GROUP_BYTES. With the bound at one head's bytes (or two heads'), the ring runs group by group, B > 1
    giving strided head slices: O and the gradients are bit for bit the ring's in one group (the kernels run each
    head on its own), the float64 lse within a few units in its last place (torch's logaddexp may round a
    strided slice's last bit otherwise than a contiguous one's), and so all within the reference's tolerance."""
    from flashref import ring_attention as ra

    N = 4 * world_size
    q, k, v, do = feature_inputs(B, H, H_kv, N, N, 16, torch.float32, seed=11 * world_size + H_kv)
    whole = simulate_ring(q, k, v, world_size, causal=causal, do=do)
    one_head = B * (N // world_size) * 16 * 4  # bytes of one head of a rank's K shard
    assert ra.head_groups(torch.empty(B, H_kv, N // world_size, 16)) == 1
    for bound, groups in ((one_head, H_kv), (2 * one_head, max(1, H_kv // 2))):
        monkeypatch.setattr(ra, "HEAD_GROUP_BYTES", bound)
        assert ra.head_groups(torch.empty(B, H_kv, N // world_size, 16)) == groups
        grouped = simulate_ring(q, k, v, world_size, causal=causal, do=do)
        assert all(torch.equal(grouped[i], whole[i]) for i in (0, 2, 3, 4)), (bound, groups)
        torch.testing.assert_close(grouped[1], whole[1], rtol=1e-15, atol=0)
    monkeypatch.setattr(ra, "HEAD_GROUP_BYTES", 1)  # smaller than a head: one head a group
    assert ra.head_groups(torch.empty(B, H_kv, N // world_size, 16)) == H_kv
    lse_like = torch.empty(B, H, N, dtype=torch.float64)
    _assert_matches(simulate_ring(q, k, v, world_size, causal=causal, do=do),
                    _simulated_reference(q, k, v, do, causal), (q, lse_like, q, k, v))


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_a_gradient_sum_on_two_ranks_is_the_gradient_itself(ranks):
    """_GradientSum: on one or two ranks the running sum is the output view itself (no buffer of its size
    beside it); on more, a float32 sum copied into it at the end. Either way a first share of some tokens
    starts from zeros, and the result is the sum of the shares."""
    from types import SimpleNamespace

    out_whole = torch.full((1, 3, 6, 4), float("nan"), dtype=torch.float16)
    out = out_whole[:, 1:]  # a view, as a head group's slice of the whole gradient
    total = ring_module._GradientSum(out, SimpleNamespace(size=ranks))
    a, b = torch.randn(1, 2, 4, 4).half(), torch.randn(1, 2, 6, 4).half()
    total.add(a, slice(2, 6))
    assert (total.total is out) == (ranks <= 2)
    assert total.total.dtype == (torch.float16 if ranks <= 2 else torch.float32)
    total.add(b, slice(0, 6))
    total.finish()
    expected = b.clone()
    expected[:, :, 2:] += a
    assert torch.equal(out, expected if ranks <= 2 else (b.float() + torch.nn.functional.pad(
        a.float(), (0, 0, 2, 0))).half())
    assert torch.isnan(out_whole[:, 0]).all()  # the other heads untouched
    empty = ring_module._GradientSum(out, SimpleNamespace(size=ranks))
    empty.finish()
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("hide_first", [True, False])
def test_a_grouped_backward_posts_its_first_transfer_after_the_own_block(monkeypatch, hide_first):
    """Both backward rings, on a recording ring of two ranks: from step 1 on (and at step 0 where every head goes
    round at once, ``hide_first``) the transfer is posted before the step's kernel, so it runs beside it; where
    the shard is taken in head groups, step 0's kernel runs and its shares are summed before the first transfer
    is posted, so the receiving buffers never exist beside step 0's shares."""
    from types import SimpleNamespace

    events = []

    class Pending:
        def __init__(self, tensors):
            self.tensors = tensors

        def wait(self):
            events.append("wait")
            return [t.clone() for t in self.tensors]

    def exchange(tensors, tag):
        events.append("post")
        return Pending(tensors)

    def block_backward(q, k, v, stats, delta, dO, causal, scale, parts, **features):
        events.append("kernel")
        if parts == ("dq",):
            return torch.zeros_like(q), None, None
        return None, torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(ring_module, "_block_backward", block_backward)
    ring = SimpleNamespace(size=2, rank=0, exchange=exchange)
    q, k, v, do = (torch.randn(1, 1, 8, 4) for _ in range(4))
    stats, delta = (torch.zeros(1, 1, 8), torch.ones(1, 1, 8)), torch.zeros(1, 1, 8)
    dQ, dK, dV = (torch.full_like(x, float("nan")) for x in (q, k, v))
    ring_module._dkdv_ring(q, k, v, stats, delta, do, (dK, dV), False, 0.5, ring, hide_first)
    ring_module._dq_ring(q, k, v, stats, delta, do, dQ, False, 0.5, ring, hide_first)
    one_ring = ["post", "kernel", "wait", "kernel"] if hide_first else ["kernel", "post", "wait", "kernel"]
    assert events == one_ring + one_ring
    assert all(torch.equal(x, torch.zeros_like(x)) for x in (dQ, dK, dV)), "every share summed into the gradients"


def test_simulate_ring_takes_sm_scale_and_gradients_that_require_grad():
    q, k, v, do = feature_inputs(1, 2, 1, 12, 12, 16, torch.float32, seed=3)
    qq = q.clone().requires_grad_()  # the threads run without autograd, whatever the inputs ask for
    got = simulate_ring(qq, k, v, 3, causal=True, sm_scale=0.3, do=do)
    assert not any(x.requires_grad for x in got)
    _assert_matches(got, _simulated_reference(q, k, v, do, True, sm_scale=0.3),
                    (q, torch.empty(1, 2, 12, dtype=torch.float64), q, k, v))


def test_simulate_ring_bad_arguments_name_the_argument():
    q, k, v, do = feature_inputs(1, 2, 1, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        simulate_ring(q, k, v, 0)
    with pytest.raises(TypeError, match="world_size must be a positive integer"):
        simulate_ring(q, k, v, 2.0)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        simulate_ring(q.cpu().numpy(), k, v, 2)
    with pytest.raises(TypeError, match="causal must be a bool"):
        simulate_ring(q, k, v, 2, causal=1)
    with pytest.raises(ValueError, match="sm_scale must be a finite number > 0"):
        simulate_ring(q, k, v, 2, sm_scale=0.0)
    with pytest.raises(ValueError, match="N of k"):
        simulate_ring(q, k[:, :, :4], v[:, :, :4], 2)
    with pytest.raises(ValueError, match="multiple of 3"):
        simulate_ring(q, k, v, 3)
    with pytest.raises(ValueError, match="multiple of 4"):  # causal: the zigzag's 2R chunks
        simulate_ring(q[:, :, :6], k[:, :, :6], v[:, :, :6], 2, causal=True)
    with pytest.raises(ValueError, match=r"do must have the shape of q \(1, 2, 8, 16\)"):
        simulate_ring(q, k, v, 2, do=do[:, :, :4])
    with pytest.raises(TypeError, match="do must be None or a torch.Tensor"):
        simulate_ring(q, k, v, 2, do=do.cpu().numpy())
    with pytest.raises(ValueError, match="do must be finite"):
        simulate_ring(q, k, v, 2, do=torch.full_like(do, math.nan))
    nan_v = v.clone()
    nan_v[0, 0, 1, 2] = math.nan
    with pytest.raises(ValueError, match="v must be finite"):
        simulate_ring(q, k, nan_v, 2)


class _Boom(RuntimeError):
    pass


def _failing_on_rank(monkeypatch, rank, before=None):
    """The ring's block forward, raising _Boom on simulated rank ``rank`` (after ``before()``, if given)."""
    real = ring_module._block_forward

    def forward(*args, **kwargs):
        if threading.current_thread().name == f"flashref-simulated-rank-{rank}":
            if before is not None:
                before()
            raise _Boom(f"rank {rank} fails")
        return real(*args, **kwargs)

    monkeypatch.setattr(ring_module, "_block_forward", forward)


@pytest.mark.parametrize("with_backward", [False, True])
def test_simulate_ring_a_failing_rank_raises_its_error_and_nobody_hangs(monkeypatch, with_backward):
    q, k, v, do = feature_inputs(1, 2, 1, 12, 12, 16, torch.float32)
    _failing_on_rank(monkeypatch, 1)
    start = time.monotonic()
    with pytest.raises(_Boom, match="rank 1 fails"):  # the rank's own error, not another rank's bail-out
        simulate_ring(q, k, v, 3, causal=True, do=do if with_backward else None)
    assert time.monotonic() - start < 60
    assert not _simulated_threads_alive()
    monkeypatch.undo()  # and the next simulated world is a fresh one: nothing left in its mailboxes
    _assert_matches(simulate_ring(q, k, v, 3, causal=True, do=do), _simulated_reference(q, k, v, do, True),
                    (q, torch.empty(1, 2, 12, dtype=torch.float64), q, k, v))


def test_simulate_ring_times_out_instead_of_hanging(monkeypatch):
    q, k, v, _ = feature_inputs(1, 2, 1, 8, 8, 16, torch.float32)
    monkeypatch.setattr(ring_module, "_SIMULATION_TIMEOUT", 0.5)
    _failing_on_rank(monkeypatch, 0, before=lambda: time.sleep(1.5))  # stuck past the timeout, then gone
    with pytest.raises(TimeoutError, match="did not finish within 0.5 s"):
        simulate_ring(q, k, v, 2)
    deadline = time.monotonic() + 30
    while _simulated_threads_alive() and time.monotonic() < deadline:  # no thread may outlive this test
        time.sleep(0.1)
    assert not _simulated_threads_alive()


# ---- the backward's two kernels, one at a time (what the ring's two backward rings run) -------------------------

@pytest.mark.parametrize("H_kv,causal,d,dtype", [(2, False, 16, "float32"), (1, True, 64, "float16")])
def test_backward_parts_are_the_whole_backwards_parts(H_kv, causal, d, dtype):
    """``ops._backward`` with ``parts=("dq",)`` or ``("dkdv",)`` and a given D gives bitwise the gradients the
    whole deterministic backward gives, and ``None`` for the others (on an H100, the fp16 case runs the Gluon
    kernels; on the CPU, the teaching kernels in the interpreter)."""
    from flashref.triton import ops

    q, k, v, do = feature_inputs(1, 2, H_kv, 37 * 5, 29 * 5, d, getattr(torch, dtype), seed=5)
    feat = ops.Features(q, k, causal=causal, scale=0.25, check_finite=False)
    o, _, stats = ops._forward(q, k, v, 0.25, feat, "auto")
    whole = ops._backward(q, k, v, o, stats, do, 0.25, True, feat, "auto")
    delta = ops._delta(o, do)
    dq_only = ops._backward(q, k, v, None, stats, do, 0.25, True, feat, "auto", parts=("dq",), delta=delta)
    dkdv_only = ops._backward(q, k, v, None, stats, do, 0.25, True, feat, "auto", parts=("dkdv",), delta=delta)
    assert dq_only[1] is None and dq_only[2] is None and dkdv_only[0] is None
    assert torch.equal(dq_only[0], whole[0])
    assert torch.equal(dkdv_only[1], whole[1]) and torch.equal(dkdv_only[2], whole[2])
    with pytest.raises(ValueError, match="parts"):
        ops._backward(q, k, v, o, stats, do, 0.25, False, feat, parts=("dq",))
    with pytest.raises(ValueError, match="parts"):
        ops._backward(q, k, v, o, stats, do, 0.25, True, feat, parts=("dk",))


@pytest.mark.parametrize("world_size,causal,dtype", [(2, False, "float32"), (2, True, "float16"),
                                                     (3, True, "float32"), (3, False, "float16")])
def test_the_backward_in_pieces_gives_the_same_gradients(monkeypatch, world_size, causal, dtype):
    """A whole block's shares computed a few keys (dK/dV ring) or queries (dQ ring) at a time: the gradients as
    in one piece, bitwise in the interpreter (each token's share is the same tile arithmetic, and the sums add
    the same numbers in the same order; on a GPU the autotuner may pick other tiles for a piece), including
    pieces that do not divide the shard and a first share in pieces."""
    q, k, v, do = feature_inputs(1, 2, 1, 24 * world_size, 24 * world_size, 16, getattr(torch, dtype), seed=11)
    whole = simulate_ring(q, k, v, world_size, causal=causal, do=do)
    monkeypatch.setattr(ring_module, "_CHUNK", 5)
    assert len(ring_module._chunks(slice(0, 24), 24, False)) == 5 and ring_module._chunks(slice(0, 24), 24, True) \
        == [slice(0, 24)]
    pieces = simulate_ring(q, k, v, world_size, causal=causal, do=do)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), whole, pieces):
        if q.is_cuda:
            torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=name)
        else:
            assert torch.equal(a, b), name


def test_the_layout_helpers_and_the_backward_name_bad_arguments():
    from flashref import ring_attention as ra

    for kwargs, exc, words in ((dict(rank=-1), ValueError, "rank must be a non-negative int"),
                               (dict(source=0.5), TypeError, "source must be an int .*got float"),
                               (dict(n_local=0), ValueError, "n_local must be a positive integer"),
                               (dict(n_local=4.0), TypeError, "n_local must be a positive integer"),
                               (dict(causal=1), TypeError, "causal must be a bool")):
        args = dict(rank=0, source=1, n_local=4, causal=True) | kwargs
        with pytest.raises(exc, match=words):
            ra.block_visibility(**args)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got ndarray"):
        ra.head_groups(np.zeros((1, 2, 4, 8)))
    with pytest.raises(ValueError, match="k must have shape"):
        ra.head_groups(torch.zeros(2, 4, 8))
