"""flashref.triton.decode: flash-decoding (the keys split across programs, then merged) against the float64
reference, per batch row on the valid part of the cache. Bottom-right causal for N_q <= L is the reference's
top-left window ``window_size=(-1, L - N_q)``: query i sees keys j <= i + L - N_q. The tolerance rule's
baseline is plain attention in the inputs' precision. Also: the split partials merged with notebook 02's
``merge_outputs``, the KVCache flow, every bad argument, and both kernels compiled for a T4, an A100 and an
H100 on this CPU machine. In Triton's CPU interpreter on CI; compiled on the GPU machine.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from flashref import reference
from flashref.online_softmax import merge_outputs
from flashref.tolerance import assert_within_tolerance
from flashref.triton import decode
from flashref.triton.decode import KVCache, decode_plan, flash_decode
from tests._triton_helpers import DEVICE, compiled_json
from tests._triton_helpers import feature_inputs as _inputs
from tests._triton_helpers import np64 as _np64


def _lengths(B, N_max, N_q, causal, seed=0):
    """Valid lengths per batch row: the full cache first, then shorter ones (at least N_q when causal)."""
    lowest = N_q if causal else 1
    g = np.random.default_rng(seed)
    lens = [N_max] + [int(g.integers(lowest, N_max + 1)) for _ in range(B - 1)]
    return torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def _window(L, N_q, causal):
    return (-1, L - N_q) if causal else (-1, -1)


def _reference(q, k, v, seqlens, causal, sm_scale=None):
    """float64 o and lse, one batch row at a time on its valid keys."""
    os_, lses = [], []
    for b, L in enumerate(seqlens.tolist()):
        o, lse = reference.attention(_np64(q[b:b + 1]), _np64(k[b:b + 1, :, :L]), _np64(v[b:b + 1, :, :L]),
                                     sm_scale=sm_scale, return_lse=True, window_size=_window(L, q.shape[2], causal))
        os_.append(o)
        lses.append(lse)
    return np.concatenate(os_), np.concatenate(lses)


def _plain(q, k, v, seqlens, causal):
    """Plain attention in q's dtype (matmul, softmax, matmul), per batch row: the tolerance rule's baseline."""
    G = q.shape[1] // k.shape[1]
    N_q = q.shape[2]
    out = []
    for b, L in enumerate(seqlens.tolist()):
        kk, vv = (x[b:b + 1, :, :L].repeat_interleave(G, 1) for x in (k, v))
        s = q[b:b + 1] @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            j = torch.arange(L, device=q.device)[None, :]
            i = torch.arange(N_q, device=q.device)[:, None]
            s = s.masked_fill(j > L - N_q + i, float("-inf"))
        out.append(torch.softmax(s, -1) @ vv)
    return torch.cat(out)


def _check(B, H, H_kv, N_q, N_max, d, dtype, causal, num_splits=None, seqlens=None, seed=0, scale=1.0,
           full_cache=False):
    """flash_decode against the float64 reference. ``seqlens``: None draws a length per batch row.
    ``full_cache``: every row holds all N_max keys and flash_decode gets no cache_seqlens (the kernel then knows
    the length without reading it)."""
    q, k, v, _ = _inputs(B, H, H_kv, N_q, N_max, d, dtype, seed, scale)
    if full_cache:
        seqlens = torch.full((B,), N_max, dtype=torch.int32, device=q.device)
    seqlens = _lengths(B, N_max, N_q, causal, seed) if seqlens is None else seqlens
    o, lse = flash_decode(q, k, v, None if full_cache else seqlens, causal=causal, num_splits=num_splits,
                          return_lse=True)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    ref_o, ref_lse = _reference(q, k, v, seqlens, causal)
    atol = 1e-5 * max(1.0, float(np.abs(ref_o).max())) if dtype == torch.float32 else None
    assert_within_tolerance(o, ref_o, _plain(q, k, v, seqlens, causal), factor=2.0, atol=atol, name="o")
    np.testing.assert_allclose(_np64(lse), ref_lse, rtol=0, atol=1e-4 * max(1.0, np.abs(ref_lse).max()))
    return o, lse


# N_q in {1, 3, 16}, caches of 1, 37 and 200 keys (16-key tiles under the interpreter: none a multiple),
# lengths varying per batch row, causal or not, each with every GQA group size (H = 4, H_kv = 4, 2, 1); the
# splits, head dim and dtype cycle, so every value of any parameter meets every value of any other (the splits
# shift by one every three cases, or they would stay locked to H_kv).
CASES = []
for N_q in (1, 3, 16):
    for N_max in (1, 37, 200):
        for causal in (False, True):
            if causal and N_q > N_max:
                continue
            for H_kv in (4, 2, 1):
                n = len(CASES)
                CASES.append((N_q, N_max, causal, H_kv, (1, 3, None)[(n + n // 3) % 3], (16, 40)[(n // 3) % 2],
                              (torch.float32, torch.float16)[(n // 2) % 2]))


@pytest.mark.parametrize("N_q, N_max, causal, H_kv, num_splits, d, dtype", CASES,
                         ids=[f"nq{c[0]}-n{c[1]}-{'causal' if c[2] else 'full'}-hkv{c[3]}-s{c[4]}-d{c[5]}-"
                              f"{str(c[6])[6:]}" for c in CASES])
def test_matches_reference(N_q, N_max, causal, H_kv, num_splits, d, dtype):
    _check(2, 4, H_kv, N_q, N_max, d, dtype, causal, num_splits)


@pytest.mark.parametrize("N_q, N_max, causal, num_splits, dtype",
                         [(1, 1, False, None, torch.float32), (1, 37, True, 1, torch.float16),
                          (3, 200, True, 3, torch.float32), (16, 200, False, None, torch.float16)],
                         ids=["nq1-n1", "nq1-n37-causal-s1", "nq3-n200-causal-s3", "nq16-n200"])
def test_a_full_cache_without_lengths(N_q, N_max, causal, num_splits, dtype):
    """cache_seqlens=None: every row's length is N_max, passed to the kernel as a number (no length is loaded
    before the first K/V tile), on the one-split kernel that writes its outputs and on the split-and-merge."""
    _check(2, 4, 2, N_q, N_max, 16, dtype, causal, num_splits, full_cache=True)


@pytest.mark.parametrize("H_kv", [4, 2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gqa_groups_with_splits(H_kv, dtype):
    _check(2, 4, H_kv, 3, 100, 16, dtype, True, num_splits=3)


def test_bfloat16():
    _check(2, 4, 2, 3, 70, 16, torch.bfloat16, True, num_splits=3)


def test_a_group_larger_than_one_q_tile():
    """8 query heads on one K/V head with 16 queries each: 128 packed rows, cut into row blocks of 32 (the
    interpreter's largest tile; 64 on a GPU), each rereading the key slice."""
    q = torch.zeros(1, 8, 16, 16, device=DEVICE)
    k = torch.zeros(1, 1, 40, 16, device=DEVICE)
    rows = decode.INTERPRETER_MAX_ROWS if decode.INTERPRETED else decode.GPU_MAX_ROWS
    assert decode_plan(q, k)["row_blocks"] == 128 // rows
    _check(1, 8, 1, 16, 40, 16, torch.float32, True, num_splits=2)


def test_extreme_logits():
    """q scaled by 1e3 in fp32: scores of thousands, the running max keeps every exponent <= 0."""
    for causal in (False, True):
        o, lse = _check(2, 4, 2, 3, 90, 16, torch.float32, causal, num_splits=3, scale=1e3)
        assert torch.isfinite(o).all() and torch.isfinite(lse).all()


def test_splits_agree():
    """One split (the unsplit kernel; the merge is then an exact copy) and several give the same answer up to
    rounding, whether there are fewer splits than tiles or more (empty splits weigh nothing)."""
    q, k, v, _ = _inputs(2, 4, 2, 3, 120, 16, torch.float32, 3)
    seqlens = torch.tensor([120, 9], dtype=torch.int32, device=DEVICE)
    o1, lse1 = flash_decode(q, k, v, seqlens, causal=True, num_splits=1, return_lse=True)
    for s in (3, 5, 12):  # 120 keys are 8 tiles; row 1 has one tile, so most of its splits are empty
        o, lse = flash_decode(q, k, v, seqlens, causal=True, num_splits=s, return_lse=True)
        torch.testing.assert_close(o, o1, rtol=0, atol=2e-6)
        torch.testing.assert_close(lse, lse1, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_one_split_writes_its_outputs_as_the_merge_would(dtype, monkeypatch):
    """With one split the kernel stores O (rounded to q's dtype) and lse itself and no merge runs; bit for bit
    what the split kernel's fp32 partial followed by the merge kernel gives, on the checked call and on the
    launch cache's fast path, for a full cache row and a 5-key one."""
    q, k, v, _ = _inputs(2, 4, 2, 3, 70, 16, dtype, 6)
    seqlens = torch.tensor([70, 5], dtype=torch.int32, device=DEVICE)
    scale = 1 / math.sqrt(16)
    plan = decode_plan(q, k, num_splits=1)
    o_part, lse_part = decode._split_forward(q, k, v, seqlens, True, scale, plan)
    assert o_part.dtype == torch.float32 and o_part.shape[2] == 1
    want_o, want_lse = decode._merge(o_part, lse_part, q.dtype, plan["block_d"])
    merges = []

    class Recorder:  # stands in for the merge kernel: any launch of it is recorded, and launches nothing
        def __getitem__(self, grid):
            return lambda *args, **kw: merges.append(grid)

    monkeypatch.setattr(decode, "flash_decode_merge_kernel", Recorder())
    decode._LAUNCHES.clear()
    for check_finite in (True, False, False):  # the second False call takes the launch cache
        o, lse = flash_decode(q, k, v, seqlens, causal=True, num_splits=1, return_lse=True,
                              check_finite=check_finite)
        assert o.dtype == dtype and o.shape == q.shape and lse.shape == q.shape[:3]
        assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    assert merges == []


def test_partials_merge_as_notebook_02():
    """Kernel 1's partials, merged pairwise by flashref.online_softmax.merge_outputs in float64, give kernel
    2's output; a split that sees no key holds O = 0 and lse = -inf."""
    q, k, v, _ = _inputs(2, 4, 2, 3, 120, 16, torch.float32, 4)
    seqlens = torch.tensor([120, 20], dtype=torch.int32, device=DEVICE)
    scale = 1 / math.sqrt(16)
    plan = decode_plan(q, k, num_splits=5)
    o_part, lse_part = decode._split_forward(q, k, v, seqlens, True, scale, plan)
    o_part, lse_part = _np64(o_part), _np64(lse_part)
    assert np.isneginf(lse_part[1, :, 2:]).all() and (o_part[1, :, 2:] == 0).all()  # 20 keys: two tiles
    o, lse = o_part[:, :, 0], lse_part[:, :, 0]
    for s in range(1, 5):
        o, lse = merge_outputs(o, lse, o_part[:, :, s], lse_part[:, :, s])
    got_o, got_lse = flash_decode(q, k, v, seqlens, causal=True, num_splits=5, return_lse=True)
    np.testing.assert_allclose(_np64(got_o), o, rtol=0, atol=1e-6)
    np.testing.assert_allclose(_np64(got_lse), lse, rtol=0, atol=1e-6)


def test_the_last_query_sees_the_whole_cache_and_the_first_its_prefix():
    """Bottom-right causal: with N_q = L every query sees keys up to itself (top-left = bottom-right); a
    single query sees everything (causal changes nothing)."""
    q, k, v, _ = _inputs(1, 2, 2, 5, 5, 16, torch.float32, 5)
    torch.testing.assert_close(flash_decode(q, k, v, causal=True),
                               torch.from_numpy(reference.attention(_np64(q), _np64(k), _np64(v), causal=True)).float()
                               .to(DEVICE),
                               rtol=0, atol=1e-5)
    q1 = q[:, :, :1]
    assert torch.equal(flash_decode(q1, k, v, causal=True), flash_decode(q1, k, v, causal=False))


def test_cache_strides_and_garbage_past_the_length():
    """A cache stored (B, N, H_kv, d) and passed as a transposed view; NaN after each row's length is never
    read (and not refused by the finite check, which looks at the valid part only)."""
    q, k, v, _ = _inputs(2, 4, 2, 1, 50, 16, torch.float32, 6)
    seqlens = torch.tensor([50, 31], dtype=torch.int32, device=DEVICE)
    kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    kt[1, :, 31:] = float("nan")
    vt[1, :, 31:] = float("nan")
    o = flash_decode(q, kt, vt, seqlens, num_splits=3)
    ref_o, _ = _reference(q, k, v, seqlens, False)
    np.testing.assert_allclose(_np64(o), ref_o, rtol=0, atol=1e-5)
    assert flash_decode(q, kt, vt, seqlens.long(), sm_scale=0.3).shape == q.shape  # int64 lengths


@pytest.mark.skipif(not decode.INTERPRETED, reason="the interpreter's plan; on a GPU the splits follow its SM count")
def test_default_plan_under_the_interpreter():
    q = torch.zeros(2, 4, 1, 16, device=DEVICE)
    for N, splits in ((1, 1), (40, 3), (500, 4)):
        plan = decode_plan(q, torch.zeros(2, 2, N, 16, device=DEVICE))
        assert plan["num_splits"] == splits and plan["block_m"] == 16 and plan["row_blocks"] == 1


def test_gpu_config_fits_each_gpus_shared_memory():
    from flashref.triton import configs

    for gpu, spec in configs.GPUS.items():
        for d in (64, 128, 256):
            for elem in (2, 4):
                for block_m in (16, 64):
                    c = decode.gpu_config(d, spec["capability"], elem, block_m)
                    est = configs.shared_bytes_estimate("forward", configs.TileConfig(
                        c["block_m"], c["block_n"], c["num_warps"], c["num_stages"]), max(16, d), elem,
                        spec["capability"])
                    assert est <= spec["shared_bytes"], (gpu, d, elem, block_m, c)
    assert decode.gpu_config(256, 75, 4, 64)["block_m"] < 64  # a T4 at d = 256: fewer rows a program


# ---- the KV cache -------------------------------------------------------------------------------------------

def _kv(B, H_kv, n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H_kv, n, d, generator=g).to(DEVICE) for _ in range(2)]


def test_split_count_fills_whole_waves():
    """The wave rule on an H100's 132 SMs with 8 K/V heads, one program an SM: B = 1 (8 programs) takes 16
    splits, B = 4 takes 4, B = 16 (128 programs, already a full wave) takes 1; never more splits than key
    tiles. Two programs an SM double each."""
    assert [decode.split_count(8 * B, 1000, 132) for B in (1, 4, 16)] == [16, 4, 1]
    assert decode.split_count(8, 3, 132) == 3 and decode.split_count(1, 1, 132) == 1
    for programs in range(1, 300):
        s = decode.split_count(programs, 10**6, 132)
        waves = -(-s * programs // 132)
        assert s * programs / (waves * 132) >= 0.95 * max(
            t * programs / (-(-t * programs // 132) * 132) for t in range(1, -(-264 // programs) + 1))
    with pytest.raises(ValueError, match="sms must be a positive integer"):
        decode.split_count(8, 10, 0)
    # Two programs an SM (an H100's split kernel at d = 128): waves of 264 slots.
    assert [decode.split_count(8 * B, 1000, 132, resident=2) for B in (1, 4, 16)] == [32, 8, 2]
    assert decode.split_count(8, 16, 132, resident=2) == 16  # a 4K cache: 64 tiles, at least 4 a split
    with pytest.raises(ValueError, match="resident must be a positive integer"):
        decode.split_count(8, 10, 132, resident=0)


def test_launch_cache_reuses_only_what_the_data_cannot_change():
    """check_finite=False: the first call of a signature is checked and planned in full, the next ones go
    straight to the kernels (the launch cache) and give the same answer; another scale, a shifted (not
    16-byte aligned) q, or other lengths' dtype are other signatures; a bad argument is refused even after a
    good call of the same shapes (True and 1 hash alike, the key tells them apart)."""
    q, k, v, _ = _inputs(2, 4, 2, 3, 70, 16, torch.float32, 8)
    seqlens = torch.tensor([70, 40], dtype=torch.int32, device=DEVICE)
    decode._LAUNCHES.clear()
    first = flash_decode(q, k, v, seqlens, causal=True, check_finite=False)
    assert len(decode._LAUNCHES) == 1
    again = flash_decode(q, k, v, seqlens, causal=True, check_finite=False)
    assert torch.equal(first, again) and len(decode._LAUNCHES) == 1
    ref_o, _ = _reference(q, k, v, seqlens, True)
    np.testing.assert_allclose(_np64(again), ref_o, rtol=0, atol=1e-5)
    q2 = torch.randn_like(q)  # new data, same signature: a new answer, not the cached one
    np.testing.assert_allclose(_np64(flash_decode(q2, k, v, seqlens, causal=True, check_finite=False)),
                               _reference(q2, k, v, seqlens, True)[0], rtol=0, atol=1e-5)
    half = flash_decode(q, k, v, seqlens, causal=True, sm_scale=0.5, check_finite=False)
    np.testing.assert_allclose(_np64(half), _reference(q, k, v, seqlens, True, sm_scale=0.5)[0], rtol=0, atol=1e-5)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=DEVICE)[1:].view(q.shape)
    shifted.copy_(q)
    assert torch.equal(flash_decode(shifted, k, v, seqlens, causal=True, check_finite=False), first)
    assert torch.equal(flash_decode(q, k, v, seqlens.long(), causal=True, check_finite=False), first)
    assert len(decode._LAUNCHES) == 4  # + the scale, the shifted q, the int64 lengths
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_decode(q, k, v, seqlens, causal=1, check_finite=False)
    with pytest.raises(ValueError, match="k_cache must have q's batch size"):
        flash_decode(q, k[:1], v[:1], seqlens, causal=True, check_finite=False)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_launch_cache_gives_the_checked_calls_outputs(num_splits):
    """The cached launches write into a fresh output and one workspace (partial O, partial lse and, unless
    returned, lse): with and without return_lse, split or direct, a call taken by the cache returns exactly
    what the checked first call of its signature returned, and new data gets a new answer."""
    q, k, v, _ = _inputs(2, 4, 2, 3, 90, 16, torch.float32, 8)
    seqlens = torch.tensor([90, 33], dtype=torch.int32, device=DEVICE)
    decode._LAUNCHES.clear()
    for return_lse in (True, False):
        kw = dict(causal=True, num_splits=num_splits, return_lse=return_lse, check_finite=False)
        checked = flash_decode(q, k, v, seqlens, **kw)
        cached = [flash_decode(q, k, v, seqlens, **kw) for _ in range(2)]
        as_pair = (lambda out: out) if return_lse else (lambda out: (out,))
        for out in cached:
            assert all(torch.equal(got, want) for got, want in zip(as_pair(out), as_pair(checked)))
        assert as_pair(cached[0])[0].data_ptr() != as_pair(cached[1])[0].data_ptr()  # each call its own o
    assert len(decode._LAUNCHES) == 2
    q2 = torch.randn_like(q)
    o2, lse2 = flash_decode(q2, k, v, seqlens, causal=True, num_splits=num_splits, return_lse=True, check_finite=False)
    ref_o, ref_lse = _reference(q2, k, v, seqlens, True)
    np.testing.assert_allclose(_np64(o2), ref_o, rtol=0, atol=1e-5)
    np.testing.assert_allclose(_np64(lse2), ref_lse, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 4, 1, 16, 3), (3, 6, 5, 24, 7), (2, 8, 16, 80, 2)])
def test_launch_workspace_parts_start_on_256_byte_boundaries(shape):
    """The cached launch's one workspace holds the partial O, the partial lse and lse, each part starting a
    multiple of 256 bytes from the workspace's start (the kernels were compiled for 16-byte aligned pointers)
    and none overlapping the next; under the interpreter the parts are views with the shapes the kernels write,
    on a GPU their addresses. The launch is the one a first unchecked call caches, as a generation loop's."""
    B, H, N_q, d, S = shape
    q = torch.zeros(B, H, N_q, d, device=DEVICE)
    k = torch.zeros(B, 1, 64, d, device=DEVICE)
    decode._LAUNCHES.clear()
    flash_decode(q, k, k, num_splits=S, check_finite=False)
    (launch,) = decode._LAUNCHES.values()
    work = torch.empty(launch.workspace, dtype=torch.float32, device=DEVICE)
    parts = launch.parts(work)
    sizes = [B * H * S * N_q * d, B * H * S * N_q, B * H * N_q]
    if decode.INTERPRETED:
        assert [tuple(x.shape) for x in parts] == [(B, H, S, N_q, d), (B, H, S, N_q), (B, H, N_q)]
        parts = [x.data_ptr() for x in parts]
    starts = [at - work.data_ptr() for at in parts]
    assert all(at % 256 == 0 for at in starts)
    ends = [at + n * 4 for at, n in zip(starts, sizes)]
    assert ends[0] <= starts[1] and ends[1] <= starts[2] and ends[2] <= launch.workspace * 4


def test_kv_cache_prefill_then_decode():
    """Append a prompt, attend with its queries (causal), then decode token by token: each step equals
    flash_decode on the concatenated cache and the float64 reference."""
    B, H, H_kv, d = 2, 4, 2, 16
    cache = KVCache(B, H_kv, 64, d, dtype=torch.float32, device=DEVICE)
    k0, v0 = _kv(B, H_kv, 7, d, 0)
    cache.append(k0, v0)
    assert cache.lengths == [7, 7] and cache.seqlens.tolist() == [7, 7] and cache.k.shape == (B, H_kv, 7, d)
    q0 = torch.randn(B, H, 7, d, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref_o, _ = _reference(q0, k0, v0, cache.seqlens, True)
    np.testing.assert_allclose(_np64(cache.attend(q0)), ref_o, rtol=0, atol=1e-5)
    ks, vs = [k0], [v0]
    for step in range(3):
        k1, v1 = _kv(B, H_kv, 1, d, 10 + step)
        cache.append(k1, v1)
        ks.append(k1)
        vs.append(v1)
        q1 = torch.randn(B, H, 1, d, generator=torch.Generator().manual_seed(20 + step)).to(DEVICE)
        k_all, v_all = torch.cat(ks, 2), torch.cat(vs, 2)
        got = cache.attend(q1, num_splits=2)
        assert torch.equal(got, flash_decode(q1, k_all, v_all, causal=True, num_splits=2))
        np.testing.assert_allclose(_np64(got), _reference(q1, k_all, v_all, cache.seqlens, True)[0], rtol=0, atol=1e-5)
    cache.reset()
    assert cache.lengths == [0, 0] and cache.seqlens.tolist() == [0, 0]


def test_kv_cache_ragged_prompts():
    """Prompts of 5 and 9 tokens padded to 9: each row's next token goes after its own length."""
    B, H, H_kv, d = 2, 4, 1, 16
    cache = KVCache(B, H_kv, 32, d, dtype=torch.float16, device=DEVICE)
    k0, v0 = (x.half() for x in _kv(B, H_kv, 9, d, 2))
    cache.append(k0, v0, lengths=[5, 9])
    k1, v1 = (x.half() for x in _kv(B, H_kv, 1, d, 3))
    cache.append(k1, v1)
    assert cache.lengths == [6, 10]
    assert torch.equal(cache.k_cache[0, :, 5], k1[0, :, 0]) and torch.equal(cache.v_cache[1, :, 9], v1[1, :, 0])
    assert (cache.k_cache[0, :, 6:] == 0).all()
    q = torch.randn(B, H, 1, d, generator=torch.Generator().manual_seed(4)).half().to(DEVICE)
    o = cache.attend(q)
    padded_k = torch.zeros(B, H_kv, 10, d, dtype=torch.float16, device=DEVICE)
    padded_v = torch.zeros_like(padded_k)
    for b, L in enumerate((5, 9)):
        padded_k[b, :, :L], padded_k[b, :, L] = k0[b, :, :L], k1[b, :, 0]
        padded_v[b, :, :L], padded_v[b, :, L] = v0[b, :, :L], v1[b, :, 0]
    lens = torch.tensor([6, 10], dtype=torch.int32, device=DEVICE)
    assert torch.equal(o, flash_decode(q, padded_k, padded_v, lens, causal=True))
    ref_o, _ = _reference(q, padded_k, padded_v, lens, True)
    assert_within_tolerance(o, ref_o, _plain(q, padded_k, padded_v, lens, True), name="o")


def test_kv_cache_errors():
    cache = KVCache(2, 1, 8, 16, dtype=torch.float32, device=DEVICE)
    k, v = _kv(2, 1, 5, 16, 0)
    q = torch.zeros(2, 2, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="append first"):
        cache.attend(q)
    cache.append(k, v)
    with pytest.raises(ValueError, match="k: appending 5 tokens .* overflow max_len = 8"):
        cache.append(k, v)
    with pytest.raises(ValueError, match=r"k must have shape \(B, H_kv, n, d\)"):
        cache.append(k[:1], v[:1])
    with pytest.raises(ValueError, match="v must have the shape of k"):
        cache.append(k[:, :, :2], v[:, :, :3])
    with pytest.raises(TypeError, match="k must have the cache's dtype"):
        cache.append(k.half(), v.half())
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        cache.append(k.cpu().numpy(), v)
    with pytest.raises(ValueError, match="lengths must be"):
        cache.append(k[:, :, :2], v[:, :, :2], lengths=[1, 3])
    bad = k[:, :, :1].clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="k must be finite"):
        cache.append(bad, v[:, :, :1])
    assert cache.lengths == [5, 5]  # nothing was written by the refused calls
    with pytest.raises(ValueError, match="append first"):  # causal: 6 queries, 5 tokens
        cache.attend(torch.zeros(2, 2, 6, 16, device=DEVICE))
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        KVCache(1, 1, 0, 16)
    with pytest.raises(TypeError, match="dtype"):
        KVCache(1, 1, 4, 16, dtype=torch.int32)


# ---- bad arguments ------------------------------------------------------------------------------------------

def _good():
    q = torch.zeros(2, 4, 3, 16, device=DEVICE)
    k = torch.zeros(2, 2, 10, 16, device=DEVICE)
    return q, k, k.clone(), torch.tensor([10, 4], dtype=torch.int32, device=DEVICE)


def _nan(x, index):
    x = x.clone()
    x[index] = float("nan")
    return x


BAD = {
    "q not a tensor": (lambda q, k, v, L: flash_decode(q.cpu().numpy(), k, v), TypeError, "q must be a torch.Tensor"),
    "q rank": (lambda q, k, v, L: flash_decode(q[0], k, v), ValueError, r"q must have shape \(B, H, N_q, d\)"),
    "k_cache rank": (lambda q, k, v, L: flash_decode(q, k[0], v), ValueError, "k_cache must have shape"),
    "v_cache shape": (lambda q, k, v, L: flash_decode(q, k, v[:, :, :5]), ValueError, "v_cache must have the shape"),
    "batch": (lambda q, k, v, L: flash_decode(q[:1], k, v), ValueError, "k_cache must have q's batch size"),
    "head dim": (lambda q, k, v, L: flash_decode(q[..., :8], k, v), ValueError, "k_cache must have q's head dim"),
    "heads": (lambda q, k, v, L: flash_decode(q[:, :3], k, v), ValueError, "k_cache must have a number of heads"),
    "dtype mismatch": (lambda q, k, v, L: flash_decode(q, k.half(), v.half()), TypeError,
                       "k_cache must have q's dtype"),
    "int dtype": (lambda q, k, v, L: flash_decode(q.int(), k.int(), v.int()), TypeError, "q must have dtype"),
    "device": (lambda q, k, v, L: flash_decode(q, k.to("meta"), v.to("meta")), ValueError, "k_cache must be on q's"),
    "q sparse": (lambda q, k, v, L: flash_decode(q.to_sparse(), k, v), TypeError, "q must be a dense"),
    "k_cache sparse": (lambda q, k, v, L: flash_decode(q, k.to_sparse(), v, L), TypeError, "k_cache must be a dense"),
    "seqlens sparse": (lambda q, k, v, L: flash_decode(q, k, v, L.to_sparse()), TypeError,
                       "cache_seqlens must be a dense"),
    "seqlens float": (lambda q, k, v, L: flash_decode(q, k, v, L.float()), TypeError, "cache_seqlens must be None"),
    "seqlens list": (lambda q, k, v, L: flash_decode(q, k, v, [10, 4]), TypeError, "cache_seqlens must be None"),
    "seqlens shape": (lambda q, k, v, L: flash_decode(q, k, v, L[:1]), ValueError, r"cache_seqlens must have shape"),
    "seqlens zero": (lambda q, k, v, L: flash_decode(q, k, v, L * 0), ValueError, r"cache_seqlens\[0\] = 0"),
    "seqlens too long": (lambda q, k, v, L: flash_decode(q, k, v, L + 1), ValueError, r"cache_seqlens\[0\] = 11"),
    "causal short row": (lambda q, k, v, L: flash_decode(q, k, v, L.clamp(max=2), causal=True), ValueError,
                         r"cache_seqlens\[0\] = 2 .*causal: at least N_q = 3"),
    "causal short cache": (lambda q, k, v, L: flash_decode(q, k[:, :, :2], v[:, :, :2], causal=True), ValueError,
                           "causal decoding needs at least N_q = 3 keys"),
    "num_splits zero": (lambda q, k, v, L: flash_decode(q, k, v, num_splits=0), ValueError, "num_splits"),
    "num_splits float": (lambda q, k, v, L: flash_decode(q, k, v, num_splits=2.0), TypeError, "num_splits"),
    "sm_scale": (lambda q, k, v, L: flash_decode(q, k, v, sm_scale=-1.0), ValueError, "sm_scale"),
    "causal": (lambda q, k, v, L: flash_decode(q, k, v, causal=1), TypeError, "causal must be a bool"),
    "return_lse": (lambda q, k, v, L: flash_decode(q, k, v, return_lse="yes"), TypeError, "return_lse must be a bool"),
    "q NaN": (lambda q, k, v, L: flash_decode(_nan(q, (1, 2, 0, 3)), k, v), ValueError, "q must be finite"),
    "k_cache NaN": (lambda q, k, v, L: flash_decode(q, _nan(k, (1, 0, 3, 0)), v, L), ValueError,
                    r"k_cache\[1, :, :4\] must be finite"),
    "v_cache NaN": (lambda q, k, v, L: flash_decode(q, k, _nan(v, (0, 1, 9, 0))), ValueError, "v_cache must be finite"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_name_the_argument(case):
    call, exc, match = BAD[case]
    with pytest.raises(exc, match=match):
        call(*_good())


def test_check_finite_false_trusts_the_lengths():
    """check_finite=False reads nothing on the host: neither the data nor the lengths."""
    q, k, v, L = _good()
    o = flash_decode(q, k, _nan(v, (0, 1, 9, 0)), L, check_finite=False)
    assert torch.isnan(o[0, 2:4, :, 0]).all() and torch.isfinite(o[0, :2]).all()  # K/V head 1: query heads 2, 3
    assert torch.isfinite(o[1]).all()  # batch row 1 holds 4 keys: key 9 is never read


# ---- compiled for the GPUs, on this CPU machine ------------------------------------------------------------

COMPILE_SCRIPT = r"""
import json
from concurrent.futures import ProcessPoolExecutor
from flashref.triton import configs, decode

def one(job):
    gpu, d, dtype, causal, group, n_q = job
    spec = configs.GPUS[gpu]
    ks = decode.compile_kernels(spec["capability"], d, dtype, causal=causal, group=group, n_q=n_q)
    return [gpu, d, dtype, causal, group * n_q, ks["split"].metadata.shared, ks["merge"].metadata.shared,
            spec["shared_bytes"], ks["merge"].metadata.num_warps]

# Llama-style GQA (4 query heads a K/V head) with 16 queries, bottom-right causal: the largest Q tile (64
# rows); and fp32 (input_precision="ieee") decoding of one query on an H100.
jobs = [(gpu, 128, "float16", True, 4, 16) for gpu in configs.GPUS] + [("H100", 128, "float32", False, 1, 1)]
with ProcessPoolExecutor(2) as pool:
    print(json.dumps(list(pool.map(one, jobs))))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_both_kernels_compile_for_every_gpu_and_fit():
    """triton.compile for sm_75, sm_80 and sm_90 in a child process with the interpreter off (kernels defined
    under it cannot be compiled); the split kernel's shared memory fits each GPU's per-block limit, and the merge
    is compiled with the warps it is launched with."""
    rows = compiled_json(COMPILE_SCRIPT, fp_fusion=True)
    assert {r[0] for r in rows} == {"T4", "A100", "H100"} and len(rows) == 4
    for gpu, d, dtype, causal, rows_, split_shared, merge_shared, limit, merge_warps in rows:
        assert 0 < split_shared <= limit, (gpu, d, dtype, causal, rows_, split_shared, limit)
        assert merge_shared <= limit and merge_warps == decode.MERGE_WARPS


def test_the_package_loads_decoding_on_first_use():
    """import flashref.triton reads no decoding code (a notebook that never decodes is not stamped with
    decode.py); flash_decode and KVCache load it when asked for, and an unknown name is still an error."""
    code = ("import sys, flashref.triton as t; before = 'flashref.triton.decode' in sys.modules; "
            "from flashref.triton import flash_decode, KVCache; "
            "print(before, flash_decode is sys.modules['flashref.triton.decode'].flash_decode, "
            "KVCache.__module__, hasattr(t, 'no_such_name'))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "flashref.triton.decode", "False"]
