"""flashref.triton's grouped-query attention, block-sparse masks and fused dropout, forward and backward,
against the float64 reference with the same keywords (the tolerance rule's baseline: plain attention in
the inputs' precision with the same masks). In Triton's CPU interpreter on CI; compiled on the GPU machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashref.triton  # noqa: F401  (the interpreter is switched on before triton is imported)
import triton
import triton.language as tl
from flashref import reference
from flashref.tolerance import assert_within_tolerance
from flashref.triton import dropout_mask, flash_attention, flash_attention_backward, flash_attention_forward
from flashref.triton.forward import PHILOX_ROUNDS, _keep, _keep_t, drop_threshold, pair_shift
from tests._triton_helpers import DEVICE, no_autotune  # noqa: F401  (an autouse fixture: applies here)
from tests._triton_helpers import feature_inputs as _inputs
from tests._triton_helpers import np64 as _np64
from tests._triton_helpers import plain_with_features

DTYPES = [torch.float32, torch.float16]


def _check(B, H, H_kv, N_q, N_k, d, dtype, causal, block_shape=None, block_size=128, p=0.0, seed=0, density=0.6,
           scale=1.0):
    q, k, v, do = _inputs(B, H, H_kv, N_q, N_k, d, dtype, seed, scale=scale)
    gen = torch.Generator().manual_seed(seed + 1)
    block_mask = None if block_shape is None else (torch.rand(block_shape, generator=gen) < density).to(DEVICE)
    kw = dict(causal=causal, block_mask=block_mask, block_size=block_size, dropout_p=p, seed=seed if p else None)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = flash_attention(qq, kk, vv, **kw)
    o.backward(do)
    got = [o.detach(), qq.grad, kk.grad, vv.grad]
    _, lse = flash_attention_forward(q, k, v, **kw)

    ref_kw = dict(causal=causal)
    keep = visible = None
    if block_mask is not None:
        ref_kw.update(block_mask=block_mask.cpu().numpy(), block_size=block_size)
        visible = reference.expand_block_mask(ref_kw["block_mask"], block_size, N_q, N_k)
    if p:
        keep = dropout_mask(seed, B, H, N_q, N_k, p, DEVICE)
        ref_kw.update(dropout_mask=keep.cpu().numpy(), dropout_p=p)
    q64, k64, v64, do64 = (_np64(x) for x in (q, k, v, do))
    ref_o, ref_lse = reference.attention(q64, k64, v64, return_lse=True, **ref_kw)
    refs = [ref_o, *reference.attention_backward(q64, k64, v64, do64, **ref_kw)]
    base = plain_with_features(q, k, v, do, causal, visible, keep, p)
    for name, x, r, b in zip(("o", "dq", "dk", "dv"), got, refs, base):
        assert x.shape == b.shape and torch.isfinite(x).all(), f"{name}: shape or non-finite values"
        atol = 1e-5 * max(1.0, float(np.abs(r).max())) if dtype == torch.float32 else None
        assert_within_tolerance(x, r, b, factor=2.0 if name == "o" else 3.0, atol=atol, name=name)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(_np64(lse)), empty), "lse is -inf exactly on the rows that see no key"
    np.testing.assert_allclose(_np64(lse)[~empty], ref_lse[~empty], rtol=0, atol=1e-4 * max(1.0, np.abs(ref_lse[~empty]).max(initial=0)))
    return got, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("H, H_kv", [(4, 2), (3, 1), (8, 1)])
@pytest.mark.parametrize("N_q, N_k", [(1, 1), (33, 47), (47, 33)])
def test_grouped_query_attention(H, H_kv, N_q, N_k, causal, dtype):
    _check(2, H, H_kv, N_q, N_k, 16, dtype, causal)


# block_size 32: a multiple of every interpreter tile side (32, 16) -> tiles skipped whole;
# 8 and 40: tiles span several mask blocks -> the mask applied element by element.
@pytest.mark.parametrize("block_size", [8, 32, 40])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_sparse(block_size, causal, dtype):
    N_q, N_k = 70, 95
    _check(2, 2, 2, N_q, N_k, 16, dtype, causal, block_shape=(2, 1, -(-N_q // block_size), -(-N_k // block_size)),
           block_size=block_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N_q, N_k", [(1, 1), (1, 47), (47, 1)])
def test_block_sparse_on_one_query_or_one_key(N_q, N_k, causal, dtype):
    """A mask of 8-token blocks on a single query or a single key (a row may see nothing: O = 0, lse = -inf)."""
    _check(2, 2, 2, N_q, N_k, 16, dtype, causal, block_shape=(2, 2, -(-N_q // 8), -(-N_k // 8)), block_size=8,
           seed=5)


# block_size 64: each visible block is two tiles of the interpreter's 32 x 16 forward tiles, walked from the
# kernels' lists of visible blocks; with grouped-query heads whose dK/dV programs split the group.
@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_lists_of_multi_tile_blocks(causal):
    _check(1, 8, 2, 150, 200, 16, torch.float32, causal, block_shape=(1, 8, 3, 4), block_size=64, density=0.5)


def test_visible_block_lists():
    from flashref.triton.ops import visible_block_lists

    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(0)) < 0.5
    lists = visible_block_lists(mask.to(DEVICE).expand(2, 3, 5, 7)).cpu()
    assert lists.shape == (2, 3, 5, 8) and lists.dtype == torch.int32
    assert visible_block_lists(mask.to(DEVICE).expand(2, 3, 5, 7)).stride(1) == 0, "no copy along broadcast H"
    for b in range(2):
        for i in range(5):
            want = torch.nonzero(mask[b, 0, i]).flatten().tolist()
            assert lists[b, 2, i, 0].item() == len(want)
            assert lists[b, 2, i, 1:1 + len(want)].tolist() == want, "visible blocks first, in increasing order"


def test_coarse_block_mask_is_visible_where_any_block_under_it_is():
    from flashref.triton.ops import coarse_block_mask

    gen = torch.Generator().manual_seed(3)
    for block_size, size, n_i, n_j in [(8, 32, 9, 13), (12, 32, 7, 11), (40, 32, 3, 5), (64, 128, 5, 3)]:
        mask = torch.rand(2, 1, n_i, n_j, generator=gen) < 0.3
        coarse = coarse_block_mask(mask.expand(2, 3, n_i, n_j), block_size, size)
        assert coarse.dtype == torch.int8 and coarse.stride(1) == 0, "int8, no copy along broadcast H"
        rows = mask.repeat_interleave(block_size, 2).repeat_interleave(block_size, 3)  # element by element
        rows = torch.nn.functional.pad(rows, (0, -(-rows.shape[3] // size) * size - rows.shape[3],
                                              0, -(-rows.shape[2] // size) * size - rows.shape[2]))
        want = rows.unflatten(3, (-1, size)).unflatten(2, (-1, size)).any(5).any(3)
        assert torch.equal(coarse[:, 0].bool(), want[:, 0]), (block_size, size)


def test_the_lists_granule_holds_every_tile_whole():
    from flashref.triton import configs

    for interpreted in (False, True):
        g = configs.list_granule(interpreted)
        tiles = configs.INTERPRETER.values() if interpreted else [
            c for table in configs.KERNELS.values() for pool in table.values() for c in pool]
        assert all(g % c.block_m == 0 and g % c.block_n == 0 for c in tiles)
        assert configs.list_size(4 * g, interpreted) == 4 * g, "a multiple of the granule: the mask's own blocks"
        assert configs.list_size(g // 2, interpreted) == g and configs.list_size(g + 8, interpreted) == g
    assert configs.list_granule() == 128, "ops.flash_attention's docstring names 128 x 128"


# Keys g..2g - 1, one block of the kernels' coarse lists (g = 32 in the interpreter, 128 on a GPU), hidden from
# every query and filled with NaN: a tile that loaded them would turn O and the gradients NaN (P = 0 times NaN), so
# finite results show the tiles of hidden coarse blocks are skipped even where the mask's blocks (8, 12, 48) do not
# hold the tiles whole.
@pytest.mark.parametrize("block_size", [8, 12, 48])
@pytest.mark.parametrize("causal", [False, True])
def test_hidden_tiles_are_never_loaded_whatever_the_block_size(block_size, causal):
    from flashref.triton import configs, ops

    g = configs.list_granule(ops.INTERPRETED)
    N_q, N_k = 2 * g + 6, 3 * g + 4
    q, k, v, do = _inputs(1, 2, 2, N_q, N_k, 16, torch.float32, 7)
    blocks = torch.rand(1, 1, -(-N_q // block_size), -(-N_k // block_size), generator=torch.Generator().manual_seed(2))
    blocks = blocks < 0.7
    j = torch.arange(blocks.shape[3])
    blocks[..., (j * block_size < 2 * g) & ((j + 1) * block_size > g)] = False
    kn, vn = k.clone(), v.clone()
    kn[:, :, g:2 * g] = float("nan")
    vn[:, :, g:2 * g] = float("nan")
    kw = dict(causal=causal, block_mask=blocks.to(DEVICE), block_size=block_size, check_finite=False)
    o, lse = flash_attention_forward(q, kn, vn, **kw)
    want, want_lse = flash_attention_forward(q, k, v, **kw)
    assert torch.equal(o, want) and torch.equal(lse, want_lse)
    grads = flash_attention_backward(q, kn, vn, o, lse, do, **kw)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.all(grads[1][:, :, g:2 * g] == 0) and torch.all(grads[2][:, :, g:2 * g] == 0)
    for got, ref in zip(grads, flash_attention_backward(q, k, v, want, want_lse, do, **kw)):
        assert torch.equal(got, ref)


def test_rows_that_see_no_key_are_zero_with_zero_gradients():
    blocks = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    blocks[..., 1, :] = False  # queries 32..63 see nothing
    q, k, v, do = _inputs(1, 2, 1, 70, 95, 16, torch.float32)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = flash_attention(qq, kk, vv, block_mask=blocks.to(DEVICE), block_size=32)
    o.backward(do)
    assert torch.all(o[:, :, 32:64] == 0) and torch.isfinite(o).all()
    assert torch.all(qq.grad[:, :, 32:64] == 0) and all(torch.isfinite(x.grad).all() for x in (qq, kk, vv))
    o2, lse = flash_attention_forward(q, k, v, block_mask=blocks.to(DEVICE), block_size=32)
    assert torch.isneginf(lse[:, :, 32:64]).all() and torch.isfinite(lse[:, :, :32]).all()
    dq, dk, dv = flash_attention_backward(q, k, v, o2, lse, do, block_mask=blocks.to(DEVICE), block_size=32)
    np.testing.assert_allclose(_np64(dq), _np64(qq.grad), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(_np64(dk), _np64(kk.grad), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# Not (47, 1): with one key exact dQ is 0 and plain attention's softmax backward gives exactly 0, while D reads O
# rounded to fp16 (test_hopper.py's test_flash_attention_runs_dropout_on_the_gluon_kernels says so): three keys.
@pytest.mark.parametrize("N_q, N_k", [(1, 1), (1, 47), (47, 3), (33, 47), (95, 70)])
def test_dropout_matches_the_reference_with_the_kernels_mask(N_q, N_k, causal, dtype):
    _check(2, 2, 2, N_q, N_k, 16, dtype, causal, p=0.25, seed=1234)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_gqa_and_a_block_mask_with_extreme_logits(dtype):
    """Logits of about 30 (q scaled by 30): the exponentials' range, with all three features at once."""
    _check(2, 4, 2, 70, 95, 16, dtype, True, block_shape=(1, 4, 3, 3), block_size=32, p=0.1, seed=11, scale=30.0)


def test_dropout_is_reproducible_from_its_seed_and_keeps_one_minus_p():
    q, k, v, do = _inputs(1, 2, 2, 32, 48, 16, torch.float32)
    runs = []
    for seed in (5, 5, 6):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        o = flash_attention(qq, kk, vv, dropout_p=0.3, seed=seed)
        o.backward(do)
        runs.append([o.detach(), qq.grad, kk.grad, vv.grad])
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1])), "same seed: bitwise-identical results"
    assert not torch.equal(runs[0][0], runs[2][0]), "another seed, another mask"
    keep = dropout_mask(5, 2, 2, 100, 164, 0.3, DEVICE)
    assert keep.dtype == torch.bool and keep.shape == (2, 2, 100, 164)
    assert abs(keep.float().mean().item() - 0.7) < 0.01  # 65,600 draws: the standard error is 0.0018
    assert torch.equal(keep, dropout_mask(5, 2, 2, 100, 164, 0.3, DEVICE))
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])  # a stream per head


def test_philox_rounds_change_the_mask_and_every_kernel_draws_the_same_one():
    """FLASHREF_PHILOX_ROUNDS (read once at import: the dropout-rounds benchmark's knob) in a process of its own:
    3 rounds draw another mask than 7, still about 1 - p of it kept, and the forward and backward kernels use
    the very mask dropout_mask returns (against the float64 reference given it). A bad count is refused."""
    import json
    import os
    import subprocess
    import sys

    from flashref.triton.forward import philox_rounds

    child = """
import json
import numpy as np, torch
import flashref.triton
from flashref import reference
from flashref.triton import dropout_mask, flash_attention
from flashref.triton.forward import PHILOX_ROUNDS
from tests._triton_helpers import DEVICE, feature_inputs, np64
q, k, v, do = feature_inputs(1, 2, 2, 33, 47, 16, torch.float32, 0)
q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
o = flash_attention(q, k, v, dropout_p=0.25, seed=7)
o.backward(do)
keep = dropout_mask(7, 1, 2, 33, 47, 0.25, DEVICE)
kw = dict(dropout_mask=keep.cpu().numpy(), dropout_p=0.25)
q64, k64, v64, do64 = (np64(x) for x in (q, k, v, do))
refs = [reference.attention(q64, k64, v64, **kw), *reference.attention_backward(q64, k64, v64, do64, **kw)]
got = (o, q.grad, k.grad, v.grad)
err = max(float(np.abs(np64(x) - r).max() / max(1.0, np.abs(r).max())) for x, r in zip(got, refs))
print(json.dumps({"rounds": PHILOX_ROUNDS.value, "keep": keep.flatten().tolist(), "err": err}))
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", child], env={**os.environ, "FLASHREF_PHILOX_ROUNDS": "3"},
                         capture_output=True, text=True, cwd=root, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["rounds"] == 3 and PHILOX_ROUNDS.value == 7
    keep3 = torch.tensor(got["keep"])
    keep7 = dropout_mask(7, 1, 2, 33, 47, 0.25, DEVICE).flatten().cpu()
    assert not torch.equal(keep3, keep7)
    assert abs(keep3.float().mean().item() - 0.75) < 0.04  # 3102 entries: the standard error is 0.008
    assert got["err"] < 1e-5, got["err"]
    assert philox_rounds({}) == 7 and philox_rounds({"FLASHREF_PHILOX_ROUNDS": "0"}) == 0
    for bad in ("-1", "17", "seven", ""):
        with pytest.raises(ValueError, match="FLASHREF_PHILOX_ROUNDS"):
            philox_rounds({"FLASHREF_PHILOX_ROUNDS": bad})


@triton.jit
def _keep_tiles(KEEP, KEEP_T, seed, start_m, start_n, drop_below, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tile of the mask from each orientation's function: _keep (queries in rows), _keep_t (keys)."""
    bh = tl.program_id(0) + 1
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    tl.store(KEEP + rows[:, None] * BLOCK_N + cols[None, :],
             _keep(seed, bh, start_m, start_n, BLOCK_M, BLOCK_N, drop_below).to(tl.int8))
    tl.store(KEEP_T + cols[:, None] * BLOCK_M + rows[None, :],
             _keep_t(seed, bh, start_m, start_n, BLOCK_M, BLOCK_N, drop_below).to(tl.int8))


@pytest.mark.parametrize("block_m, block_n, start_m, start_n", [(16, 32, 0, 0), (64, 16, 48, 80), (32, 64, 96, 32)])
def test_each_kernels_tile_draws_the_same_bits_as_dropout_mask(block_m, block_n, start_m, start_n):
    """The forward and dQ kernels draw the mask with _keep, the dK/dV kernel with _keep_t (its tiles hold
    keys in rows), each grouping Philox calls as its own threads hold P. Any tile of either is the same slice
    of dropout_mask, whatever the tile's shape and position."""
    p, seed = 0.3, 77
    keep, keep_t = (torch.empty(shape, dtype=torch.int8, device=DEVICE)
                    for shape in ((block_m, block_n), (block_n, block_m)))
    _keep_tiles[(1,)](keep, keep_t, seed, start_m, start_n, drop_threshold(p), BLOCK_M=block_m, BLOCK_N=block_n)
    whole = dropout_mask(seed, 1, 2, 160, 160, p, DEVICE)[0, 1]  # head bh = 1, as the kernel above
    want = whole[start_m:start_m + block_m, start_n:start_n + block_n]
    assert torch.equal(keep.bool(), want)
    assert torch.equal(keep_t.bool().T, want)


def _philox_numpy(seed, c0, c1, c2, c3, rounds):
    """Philox-4x32 (Salmon et al., 2011) in NumPy, from its definition: the four words of counter (c0 .. c3),
    uint32 arrays, under the 64-bit key ``seed``."""
    c = [np.asarray(x, dtype=np.uint64) for x in (c0, c1, c2, c3)]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    low = np.uint64(0xFFFFFFFF)
    for _ in range(rounds):
        p0, p1 = c[2] * np.uint64(0xCD9E8D57), c[0] * np.uint64(0xD2511F53)
        c = [(p0 >> np.uint64(32)) ^ c[1] ^ k0, p0 & low, (p1 >> np.uint64(32)) ^ c[3] ^ k1, p1 & low]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & low, (k1 + np.uint64(0xBB67AE85)) & low
    return [x.astype(np.uint32) for x in c]


def _mask_numpy(seed, B, H, N_q, N_k, p):
    """dropout_mask as its docstring defines it, written out in NumPy: entry (i, j) of head bh takes half i % 2 of
    word 2 (bit3(i) ^ bit3(j)) + j % 2 of the call (j and i without bits 0 and 3, bh, 0), turned by pair_shift
    when bit 3 of i is set."""
    D = drop_threshold(p)
    i = np.arange(N_q)[:, None].astype(np.uint32)
    j = np.arange(N_k)[None, :].astype(np.uint32)
    bit = lambda x, n: (x >> n) & 1  # noqa: E731
    drop_bits = lambda x: (x >> 4) * 4 + ((x >> 1) & 3)  # noqa: E731  (x without bits 0 and 3)
    keep = np.empty((B * H, N_q, N_k), dtype=bool)
    for bh in range(B * H):
        words = _philox_numpy(seed, drop_bits(j) + 0 * i, drop_bits(i) + 0 * j, np.full((N_q, N_k), bh),
                              np.zeros((N_q, N_k)), PHILOX_ROUNDS.value)
        which = 2 * (bit(i, 3) ^ bit(j, 3)) + bit(j, 0)
        word = np.choose(which, words)
        u = (word >> (16 * bit(i, 0))) & 0xFFFF
        u = np.where(bit(i, 3) == 1, (u + pair_shift(D)) % 2**16, u)
        keep[bh] = u >= D
    return keep.reshape(B, H, N_q, N_k)


@pytest.mark.parametrize("p", [0.3, 0.1, 3e-6])
def test_dropout_mask_is_the_documented_function_of_philox(p):
    """dropout_mask, bit for bit, is Philox-4x32-7 of each entry's counter with the word, half and turn its
    docstring names (a NumPy Philox from the paper's definition draws it here); p = 3e-6 rounds to a threshold
    of 0: nothing dropped."""
    got = dropout_mask(12345678901, 2, 3, 37, 70, p, DEVICE).cpu().numpy()
    want = _mask_numpy(12345678901, 2, 3, 37, 70, p)
    assert (got != want).sum() == 0, f"{(got != want).sum()} of {got.size} entries differ"
    assert want.all() == (p < 2**-17)


def test_all_sixteen_entries_of_a_philox_call_are_kept_with_the_same_odds():
    """The sixteen entries that share a call take different halves and words, the eight with bit 3 of i set
    turned by pair_shift; a wrong shift, word or turn would show as one of the sixteen positions kept far from
    1 - p (each has 4,096 draws here)."""
    p = 0.3
    keep = dropout_mask(9, 1, 4, 128, 128, p, DEVICE)[0].float()
    i, j = torch.arange(128, device=DEVICE), torch.arange(128, device=DEVICE)
    for bits_i in ((0, 0), (0, 1), (1, 0), (1, 1)):
        for bits_j in ((0, 0), (0, 1), (1, 0), (1, 1)):
            rows = ((i // 8) % 2 == bits_i[0]) & (i % 2 == bits_i[1])
            cols = ((j // 8) % 2 == bits_j[0]) & (j % 2 == bits_j[1])
            kept = keep[:, rows][:, :, cols].mean().item()
            assert abs(kept - (1 - p)) < 0.035, (bits_i, bits_j, kept)  # 5 standard errors


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_two_entries_of_a_number_are_nearly_independent(p):
    """Each 16-bit number serves (i, j) and (i + 8, j ^ 8), bit 3 of i clear: the second reads it turned by
    pair_shift, so that both are kept with odds round(K**2 / 2**16) / 2**16 for K = 2**16 - drop_threshold(p),
    within 2**-17 of (1 - p)**2. Counted exactly over every number, and seen in a drawn mask: the pairs are kept
    together as often as independent entries are (within 5 standard errors)."""
    D = drop_threshold(p)
    u = np.arange(2**16)
    both = np.count_nonzero((u >= D) & ((u + pair_shift(D)) % 2**16 >= D))
    K = 2**16 - D
    assert np.count_nonzero((u + pair_shift(D)) % 2**16 >= D) == K
    assert abs(both / 2**16 - (K / 2**16) ** 2) <= 2**-17
    keep = dropout_mask(3, 2, 4, 256, 256, p, DEVICE).cpu().numpy()
    j = np.arange(256)
    i = j[(j // 8) % 2 == 0]  # rows with bit 3 clear; their partners are i + 8, at keys j ^ 8
    pairs = keep[:, :, i, :] & keep[:, :, i + 8, :][..., j ^ 8]
    q = 1 - p
    assert abs(pairs.mean() - q * q) < 5 * np.sqrt(q * q * (1 - q * q) / pairs.size), (pairs.mean(), q * q)


def test_dropout_seed_none_draws_from_torchs_generator():
    """seed=None draws the seed from torch's generator (torch.manual_seed rules it: the same state, the same
    mask; another state, another), and autograd's backward replays the mask the forward drew. O = P~ V is linear
    in V, so V = I (N_k = d) reads P~ out of the forward, and the backward's dV must be P~^T dO."""
    q, k, v, do = _inputs(1, 1, 1, 16, 16, 16, torch.float32)
    torch.manual_seed(3)
    P_dropped = flash_attention(q, k, torch.eye(16, device=q.device).expand_as(v).contiguous(), dropout_p=0.5)
    torch.manual_seed(3)
    vv = v.clone().requires_grad_()
    o = flash_attention(q, k, vv, dropout_p=0.5)
    o.backward(do)
    torch.testing.assert_close(o, P_dropped @ v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vv.grad, P_dropped.transpose(-1, -2) @ do, rtol=1e-5, atol=1e-5)
    assert (P_dropped == 0).float().mean().item() > 0.25  # the mask dropped entries (about half of them)
    torch.manual_seed(4)
    assert not torch.equal(flash_attention(q, k, v, dropout_p=0.5), o.detach())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_all_three_together(dtype):
    _check(2, 4, 2, 70, 95, 16, dtype, True, block_shape=(1, 4, 3, 3), block_size=32, p=0.1, seed=11)


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(dropout_p=1.0), ValueError, "dropout_p must be in [0, 1)"),
    (dict(dropout_p=0.1, seed=-1), TypeError, "seed must be None or an int"),
    (dict(block_mask=torch.ones(1, 1, 2, 2, dtype=torch.bool)), ValueError, "block_mask must have shape (B or 1, H or 1, 1, 1)"),
    (dict(block_mask=torch.ones(1, 1, 1, 1)), TypeError, "block_mask must be boolean"),
    (dict(block_mask=np.ones((1, 1, 1, 1), bool)), TypeError, "block_mask must be a torch.Tensor"),
    (dict(block_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool), block_size=0), ValueError, "block_size must be a positive int"),
])
def test_bad_feature_arguments(kwargs, exc, words):
    q, k, v, _ = _inputs(1, 2, 1, 33, 47, 16, torch.float32)
    if isinstance(kwargs.get("block_mask"), torch.Tensor):
        kwargs = {**kwargs, "block_mask": kwargs["block_mask"].to(DEVICE)}
    with pytest.raises(exc, match=__import__("re").escape(words)):
        flash_attention(q, k, v, **kwargs)


def test_bad_kv_heads_and_backward_without_seed():
    q, k, v, do = _inputs(1, 4, 3, 16, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="H_kv that divides q's H = 4"):
        flash_attention(q, k, v)
    q, k, v, do = _inputs(1, 2, 2, 16, 16, 16, torch.float32)
    o, lse = flash_attention_forward(q, k, v, dropout_p=0.2, seed=1)
    with pytest.raises(ValueError, match="needs the seed the forward used"):
        flash_attention_backward(q, k, v, o, lse, do, dropout_p=0.2)


def test_dropout_mask_arguments():
    with pytest.raises(ValueError, match="N_q must be a positive int"):
        dropout_mask(1, 1, 1, 0, 4, 0.1, DEVICE)
    with pytest.raises(TypeError, match="seed must be an int"):
        dropout_mask(None, 1, 1, 4, 4, 0.1, DEVICE)


def test_visible_lists_reused_for_the_same_mask_and_rebuilt_after_an_in_place_change():
    from flashref.triton import ops

    q, k, v, do = _inputs(1, 2, 2, 70, 64, 16, torch.float32)
    mask = torch.ones(1, 1, 3, 2, dtype=torch.bool, device=DEVICE)
    built = []
    real = ops.visible_block_lists
    ops.visible_block_lists = lambda bm: built.append(bm.shape) or real(bm)
    try:
        o1 = flash_attention(q, k, v, block_mask=mask, block_size=32)
        o2 = flash_attention(q, k, v, block_mask=mask, block_size=32)
        assert len(built) == 1, "the second call with the same mask tensor reuses its lists"
        assert torch.equal(o1, o2)
        mask[0, 0, 1, 0] = False  # queries 32..63 no longer see keys 0..31
        o3 = flash_attention(q, k, v, block_mask=mask, block_size=32)
        assert len(built) == 2, "an in-place change of the mask rebuilds the lists"
        want = reference.attention(_np64(q), _np64(k), _np64(v), block_mask=mask.cpu().numpy(), block_size=32)
        assert not torch.equal(o3, o1)
        np.testing.assert_allclose(_np64(o3), want, atol=1e-4)
        o4 = flash_attention(q, k, v, block_mask=mask.clone(), block_size=32)
        assert len(built) == 3 and torch.equal(o3, o4), "another tensor with the same values: its own lists"
    finally:
        ops.visible_block_lists = real


def test_visible_lists_freed_with_their_mask():
    import gc

    from flashref.triton import ops

    q, k, v, _ = _inputs(1, 1, 1, 40, 40, 16, torch.float32)
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool, device=DEVICE)
    flash_attention(q, k, v, block_mask=mask, block_size=32)
    key = [key for key in ops._LISTS_KEPT if key[0] == id(mask)]
    assert key, "the lists of a live mask are kept"
    del mask
    gc.collect()
    assert not any(k_ in ops._LISTS_KEPT for k_ in key), "and dropped when the mask is freed"


def test_autotuner_consulted_once_per_key_then_its_choice_launched_directly(monkeypatch):
    """On a GPU the autotuner's own dispatch costs about 100 us a call: after it has chosen a config for a key,
    _launch launches that config itself. Checked with stand-ins for the tuner and the kernel."""
    import types

    from flashref.triton import configs, ops

    calls = []

    class Tuner:
        best_config = types.SimpleNamespace(kwargs={"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2)

        def __getitem__(self, grid):
            return lambda *a, **meta: calls.append(("tuner", grid({"BLOCK_M": 64})))

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **meta: calls.append(("kernel", grid, meta["BLOCK_M"], meta["BLOCK_N"],
                                                    meta.get("num_warps"), meta.get("num_stages")))

    monkeypatch.setattr(ops, "INTERPRETED", False)
    monkeypatch.setattr(ops, "_TUNED", {"forward": Tuner()}, raising=False)
    monkeypatch.setattr(ops, "_CHOSEN", {})
    monkeypatch.setenv("FLASHREF_TRITON_AUTOTUNE", "1")
    q = torch.zeros(1, 2, 1000, 16, dtype=torch.float16)
    meta = dict(TUNE_N=1024, HEAD_DIM=16, CAUSAL=True, HAS_BM=False, BLOCK_SIZE=1, LIST_SIZE=1, DROPOUT=False,
                WINDOW=False, SOFTCAP=False, ALIBI=False, VARLEN=False)
    for _ in range(3):
        ops._launch(Kernel(), "forward", 1000, 2, q, q, **meta)
    assert calls == [("tuner", (16, 2)), ("kernel", (16, 2), 64, 32, 4, 2), ("kernel", (16, 2), 64, 32, 4, 2)]
    ops._launch(Kernel(), "forward", 1000, 2, q, q, **{**meta, "CAUSAL": False})
    assert calls[-1][0] == "tuner", "another key is tuned afresh"
    assert configs.TileConfig(64, 32, 4, 2) in ops._CHOSEN.values()


def test_apply_takes_flash_attentions_arguments_and_checks_them():
    from flashref.triton import FlashAttentionFunction, flash_attention

    q, k, v, _ = _inputs(1, 2, 2, 19, 23, 16, torch.float32, seed=3)
    expected = flash_attention(q, k, v, check_finite=False)
    assert torch.equal(FlashAttentionFunction.apply(q, k, v), expected)  # sm_scale=None: 1/sqrt(d)
    assert torch.equal(FlashAttentionFunction.apply(q, k, v, False, None), expected)
    with pytest.raises(ValueError, match="sm_scale"):
        FlashAttentionFunction.apply(q, k, v, False, float("nan"))
    with pytest.raises(TypeError, match="deterministic"):
        FlashAttentionFunction.apply(q, k, v, False, None, "yes")
