"""The features benchmark's masks, on the CPU: FlexAttention's are exactly ours (the blocks Flex visits, full or
partial, are the visible blocks of our block mask, with and without causality, on an uneven length), and the
block-sparse cases measure the windows and count the FLOPs they always did. (The timings themselves run on the
GPU: python -m flashref.bench features.)"""

from __future__ import annotations

import pytest
import torch

from flashref import block_masks
from flashref.bench.features_bench import flex_block_mask


@pytest.mark.parametrize("pattern, causal", [("bigbird", False), ("window", True), ("causal", True)])
def test_flex_visits_exactly_our_blocks(pattern, causal):
    N, bs = 77, 16
    n = block_masks.n_blocks(N, bs)
    mask = {"bigbird": block_masks.bigbird(n, window=2, n_global=1, n_random=1, seed=3),
            "window": block_masks.sliding_window(n, window=2, causal=True),
            "causal": block_masks.causal_blocks(n)}[pattern]
    fbm = flex_block_mask(mask, N, bs, causal, compile_mask=False)
    visited = fbm.to_dense()[0, 0].bool()
    want = mask[0, 0] & (block_masks.causal_blocks(n)[0, 0] if causal else True)
    assert torch.equal(visited, want)


def test_the_block_sparse_cases_are_the_causal_windows_they_always_were():
    """The sparse part's masks, visible pairs, densities and FLOPs, against the benchmark's own copy of the
    window and its closed-form pair count from before it used flashref.block_masks (N = 16K, 128-key blocks:
    the committed run's points), bit for bit."""
    from flashref.bench.features_bench import sparse_cases, windows
    from flashref.bench.results import flops, pair_flops

    def old_window_mask(N, block, w):
        n = -(-N // block)
        i = torch.arange(n)
        return ((i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < w))[None, None]

    N, block, B, H, d = 16384, 128, 1, 16, 64
    assert sparse_cases.__defaults__ == (N, d, B, H, block)
    n = -(-N // block)
    seen = []
    for w, mask, pairs, density in windows(N, block):
        seen.append(w)
        assert torch.equal(mask, old_window_mask(N, block, w))
        assert pairs == sum((min(i + 1, w) - 1) * block * block + block * (block + 1) // 2 for i in range(n))
        assert density == old_window_mask(N, block, w).float().mean().item()
        for mode in ("fwd", "fwd+bwd"):
            assert pair_flops(B, H, pairs, d, mode) == (1.0 if mode == "fwd" else 3.5) * 4.0 * B * H * pairs * d
    assert seen == [n, 32, 8, 2]
    for mode in ("fwd", "fwd+bwd"):  # the dense rows: causal, and the all-True mask's
        assert flops(B, H, N, N, d, True, mode) == (1.0 if mode == "fwd" else 3.5) * 2.0 * B * H * N * N * d
        assert flops(B, H, N, N, d, False, mode) == (1.0 if mode == "fwd" else 3.5) * 4.0 * B * H * N * N * d


def test_the_window_masks_hold_on_an_uneven_length():
    from flashref.bench.features_bench import windows

    N, block = 1000, 128  # 8 blocks, the last one 104 keys
    for w, mask, pairs, density in windows(N, block):
        i = torch.arange(N)
        visible = (i[:, None] >= i[None, :]) & (i[:, None] // block - i[None, :] // block < w)
        assert pairs == int(visible.sum())
        assert torch.equal(mask[0, 0], block_masks.sliding_window(8, window=w, causal=True)[0, 0])


def test_the_flex_table_gives_both_ratios_and_says_what_is_missing():
    """flex_table: Flex's time over flashref's from do_bench's ms and from the kernels alone (graph_ms), a dash
    where a row lacks graph_ms (runs before it was measured) or a side is missing, a failed call's status."""
    from flashref.bench.features_bench import flex_table

    def row(impl, mode, ms, graph_ms=None, **kw):
        r = {"case": f"sparse vs flex {mode}", "impl": impl, "pattern": "bigbird", "N": 4096, "d": 64,
             "density": 0.25, "dtype": "float16", **kw}
        if ms is not None:
            r.update(ms=ms, graph_ms=graph_ms)
        return r

    rows = [row("flashref-triton", "fwd", 0.5, 0.2), row("flex", "fwd", 1.0, 0.3),
            row("flashref-triton", "fwd+bwd", 2.0), row("flex", "fwd+bwd", 1.0, 0.9),
            dict(row("flex", "fwd", None, N=16384), status="RuntimeError: out of memory"),
            row("flashref-triton", "fwd", 0.25, 0.1, N=16384)]
    lines = flex_table(rows).splitlines()
    assert len(lines) == 2 + 3 and "kernels" in lines[0]
    fwd4k, big16k, fwdbwd = lines[2], lines[3], lines[4]
    assert fwd4k.startswith("fwd ") and fwd4k.split()[-4:] == ["1.000", "2.00", "|", "1.50"], fwd4k
    assert big16k.split()[-4:] == ["RuntimeErr", "-", "|", "-"], big16k  # Flex failed: no ratio either way
    assert fwdbwd.startswith("fwd+bwd") and fwdbwd.split()[-3:] == ["0.50", "|", "-"], fwdbwd
    assert flex_table([row("flashref-triton", "fwd", 0.5, 0.2)]) == "this run has no FlexAttention rows"
