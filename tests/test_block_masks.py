"""flashref.block_masks: each pattern's rule checked block by block, and visible_pairs against a count of
the expanded element mask (uneven N, N_q != N_k, N = 1, causal and not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashref import block_masks as bmk
from flashref.reference import expand_block_mask


def test_n_blocks_and_bad_arguments():
    assert bmk.n_blocks(1, 128) == 1 and bmk.n_blocks(128, 128) == 1 and bmk.n_blocks(129, 128) == 2
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        bmk.n_blocks(10, 0)
    with pytest.raises(ValueError, match="window must be a positive int"):
        bmk.sliding_window(4, window=0)
    with pytest.raises(ValueError, match="n_random must be a non-negative int"):
        bmk.bigbird(4, n_random=-1)


@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window_rule(causal):
    m = bmk.sliding_window(7, 9, window=3, causal=causal)
    assert m.shape == (1, 1, 7, 9) and m.dtype == torch.bool
    for i in range(7):
        for j in range(9):
            want = (i - 3 < j <= i) if causal else abs(i - j) < 3
            assert bool(m[0, 0, i, j]) == want, (i, j)


def test_causal_blocks_and_density():
    m = bmk.causal_blocks(4)
    assert torch.equal(m[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert bmk.density(m) == 10 / 16


def test_bigbird_globals_window_random_and_seed():
    m = bmk.bigbird(12, window=2, n_global=2, n_random=3, seed=5)[0, 0]
    assert m[:2].all() and m[:, :2].all(), "global blocks see and are seen by every block"
    for i in range(12):
        assert all(m[i, j] for j in range(12) if abs(i - j) < 2), "the window"
        extra = sum(1 for j in range(2, 12) if abs(i - j) >= 2 and m[i, j])
        assert i < 2 or extra <= 3, "at most n_random random blocks a row beyond the window and globals"
    assert torch.equal(m, bmk.bigbird(12, window=2, n_global=2, n_random=3, seed=5)[0, 0]), "a seed, a mask"
    assert not torch.equal(m, bmk.bigbird(12, window=2, n_global=2, n_random=3, seed=6)[0, 0])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N_q, N_k, bs", [(1, 1, 16), (70, 95, 32), (95, 70, 32), (33, 33, 8)])
def test_visible_pairs_matches_the_element_mask(N_q, N_k, bs, causal):
    g = torch.Generator().manual_seed(N_q + N_k)
    m = torch.rand(2, 3, bmk.n_blocks(N_q, bs), bmk.n_blocks(N_k, bs), generator=g) < 0.6
    got = bmk.visible_pairs(m, N_q, N_k, bs, causal=causal)
    assert got.shape == (2, 3) and got.dtype == torch.int64
    elem = expand_block_mask(m.numpy(), bs, N_q, N_k)
    if causal:
        elem = elem & np.tril(np.ones((N_q, N_k), dtype=bool))
    assert got.tolist() == elem.sum(axis=(-1, -2)).tolist()


def test_visible_pairs_shape_check():
    with pytest.raises(ValueError, match="block_mask must have shape"):
        bmk.visible_pairs(bmk.causal_blocks(3, 4), 70, 95, 32)


@pytest.mark.parametrize("make", [lambda d: bmk.causal_blocks(4, device=d), lambda d: bmk.sliding_window(4, device=d),
                                  lambda d: bmk.bigbird(4, device=d)], ids=["causal", "window", "bigbird"])
def test_a_device_this_machine_lacks_is_named(make):
    assert make("cpu").device.type == "cpu" and make(None).device.type == "cpu"
    with pytest.raises(ValueError, match="device must be a torch.device or a device string"):
        make("gpu")
    with pytest.raises(ValueError, match="device must be a device of this machine"):
        make(f"cuda:{torch.cuda.device_count()}")


def test_density_of_an_empty_mask_is_an_error():
    assert bmk.density(torch.ones(1, 1, 2, 2, dtype=torch.bool)) == 1.0
    with pytest.raises(ValueError, match="block_mask is empty"):
        bmk.density(torch.ones(0, dtype=torch.bool))
