"""The animated tile walk: its frames are the tiled forward's own states, its counters iomodel's."""

import numpy as np
import pytest

from flashref import iomodel, numpy_flash, reference, tile_walk


def _inputs(N_q, N_k, d=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((N_q, d)), rng.standard_normal((N_k, d)), rng.standard_normal((N_k, d))


@pytest.mark.parametrize("N_q,N_k,block_q,block_k", [(64, 64, 16, 16), (50, 37, 16, 8), (1, 20, 16, 8), (40, 40, 8, 16)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("order", ["fa1", "fa2"])
def test_frames_follow_the_forward_and_end_at_the_reference(N_q, N_k, block_q, block_k, causal, order):
    q, k, v = _inputs(N_q, N_k)
    frames = tile_walk.walk(q, k, v, causal, block_q, block_k, order)
    trace = []
    numpy_flash.flash_attention_forward(q, k, v, causal, block_q=block_q, block_k=block_k, order=order, trace=trace)
    assert [f.tile for f in frames] == trace and frames[-1].visited == trace
    np.testing.assert_allclose(frames[-1].O, reference.attention(q, k, v, causal), atol=1e-12)
    reads = [f.reads for f in frames]
    writes = [f.writes for f in frames]
    assert reads == sorted(reads) and writes == sorted(writes)  # counters only grow
    if order == "fa1":  # Algorithm 1's totals are the paper's accounting, tile for tile
        paper = iomodel.account_tiled(N_q, 8, M=10**6, causal=causal, N_k=N_k, blocks=(block_k, block_q))
        assert (frames[-1].reads, frames[-1].writes) == (paper.reads, paper.writes)
    else:  # FlashAttention-2 reads Q once and K, V once per tile, and writes O and lse once per row
        n_k = [hi - lo for lo, hi in numpy_flash.tile_ranges(N_k, block_k)]
        assert frames[-1].reads == N_q * 8 + sum(2 * n_k[j] * 8 for _, j in trace)
        assert frames[-1].writes == N_q * (8 + 1)


def test_the_running_state_is_the_partial_softmax():
    # After tile (i, j) in the FA2 order, the rows of block i hold softmax attention over keys 0 .. end of block j.
    q, k, v = _inputs(32, 32)
    for f in tile_walk.walk(q, k, v, False, 16, 8, "fa2"):
        i, j = f.tile
        rows, keys = slice(16 * i, 16 * i + 16), slice(0, 8 * j + 8)
        S = q[rows] @ k[keys].T / np.sqrt(8)
        np.testing.assert_allclose(f.m[rows], S.max(1), atol=1e-12)
        np.testing.assert_allclose(f.l[rows], np.exp(S - S.max(1, keepdims=True)).sum(1), atol=1e-12)
        np.testing.assert_allclose(f.O[rows], reference.attention(q[rows], k[keys], v[keys]), atol=1e-12)


def test_observe_must_be_callable():
    q, k, v = _inputs(8, 8)
    with pytest.raises(TypeError, match="observe"):
        numpy_flash.flash_attention_forward(q, k, v, observe=[])


def test_the_animation_plays_as_html():
    q, k, v = _inputs(16, 16)
    html = tile_walk.animate(tile_walk.walk(q, k, v, True, 8, 8, "fa2")).to_jshtml()
    assert '<div class="animation">' in html and html.count("data:image/png;base64") == 3
