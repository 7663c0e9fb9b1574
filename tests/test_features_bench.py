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


def test_kept_fraction_counts_the_entries_a_dropout_keeps_whatever_their_scale():
    """kept_fraction on an attention that keeps each entry of P with probability 230/256 (8-bit numbers, as a
    kernel that rounds 1 - p to 8 bits would) and scales by a rounded 1 / (1 - p): P is uniform (every key the
    same), so it counts exactly the entries kept, and at 16.8M entries 230/256 is many standard errors from 0.9."""
    from flashref.bench.features_bench import kept_fraction

    counted = []

    def eight_bit(q, k, v, seed):
        assert torch.equal(k, k[..., :1, :].expand_as(k)), "every key the same: P uniform"
        g = torch.Generator().manual_seed(seed)
        keep = torch.randint(0, 256, (*q.shape[:3], k.shape[2]), generator=g) < 230
        counted.append(int(keep.sum()))
        return (keep.float() / k.shape[2] * 1.1113) @ v.float()

    got = kept_fraction(eight_bit, 0.1, device="cpu")
    assert got["entries"] == 4 * 16 * 4096 * 64
    assert got["kept"] == sum(counted) / got["entries"]
    assert abs(got["kept"] - 230 / 256) < 4 * got["std_error"]
    assert (0.9 - got["kept"]) / got["std_error"] > 20
    assert got["scale"] == pytest.approx(1.1113 * 0.9, rel=1e-6)


def test_flashrefs_kept_fraction_is_its_masks_and_one_minus_p():
    """Counted through flashref's own dropout (the kernels on the GPU where there is one, else in Triton's
    interpreter), the kept fraction is that of ``dropout_mask`` for the same seed, entry count for entry count, and
    1 - p within four standard errors over 64K entries."""
    from flashref.bench.features_bench import _seeded, kept_fraction
    from flashref.triton import dropout_mask
    from tests._triton_helpers import DEVICE

    got = kept_fraction(_seeded("flashref-triton", 0.1), 0.1, N_q=512, H=2, draws=1, device=DEVICE)
    assert got["entries"] == 2 * 512 * 64
    assert got["kept"] * got["entries"] == int(dropout_mask(0, 1, 2, 512, 64, 0.1, DEVICE).sum())
    assert abs(got["kept"] - 0.9) < 4 * got["std_error"], got
    assert got["scale"] == pytest.approx(1, abs=2**-11)  # 1 / (1 - p), as fp16 rounds O


def test_the_dropout_cost_table_gives_the_added_time_the_ratio_and_the_kept_fraction_in_standard_errors():
    from flashref.bench.features_bench import dropout_cost_table

    rows = [{"case": "dropout cost fwd+bwd", "impl": "sdpa-flash", "d": 64, "causal": False, "ms": 5.0,
             "ms_no_dropout": 4.0, "ratio": 0.8},
            {"case": "dropout cost fwd+bwd", "impl": "flashref-triton", "d": 64, "causal": False, "ms": 3.0,
             "ms_no_dropout": 2.25, "ratio": 0.75},
            {"case": "dropout cost fwd+bwd", "impl": "sdpa-cudnn", "d": 64, "causal": False,
             "status": "RuntimeError: no kernel"},
            {"case": "dropout kept fraction", "impl": "sdpa-flash", "dropout_p": 0.1, "kept": 0.8984,
             "entries": 1000, "std_error": 0.0008, "scale": 1.0}]
    lines = dropout_cost_table(rows).splitlines()
    assert lines[1].split() == ["sdpa-flash", "64", "False", "4.00", "5.00", "1.00", "0.80"], lines[1]
    assert lines[2].startswith("sdpa-cudnn") and "no kernel" in lines[2], lines[2]  # in DROPOUT_COST_IMPLS order
    assert lines[3].split() == ["flashref-triton", "64", "False", "2.25", "3.00", "0.75", "0.75"], lines[3]
    assert lines[-1].split() == ["sdpa-flash", "0.89840", "0.9000", "-2.0", "1000", "1.0000", "0.9982"], lines[-1]
    assert dropout_cost_table([]) == "this run has no dropout-cost rows"


def test_the_dropout_backward_table_gives_each_kernels_time_and_the_ordered_kernels_speed_over_the_others():
    from flashref.bench.features_bench import dropout_backward_table, measures

    rows = [{"case": "dropout backward", "impl": impl, "d": 64, "causal": True, "dropout_p": p, "ms": ms}
            for impl, p, ms in [("gluon pair", 0.1, 2.4), ("gluon fused", 0.1, 1.8), ("gluon fused ordered", 0.1, 2.0),
                                ("gluon pair", 0.0, 2.0), ("gluon fused ordered", 0.0, 2.5)]]
    lines = dropout_backward_table(rows).splitlines()
    assert lines[0].split()[:6] == ["d", "causal", "p", "gluon", "pair", "gluon"], lines[0]
    assert lines[1].split() == ["64", "True", "0.00", "2.000", "-", "2.500", "0.80x", "-"], lines[1]
    assert lines[2].split() == ["64", "True", "0.10", "2.400", "1.800", "2.000", "1.20x", "0.90x"], lines[2]
    assert dropout_backward_table([]) == "this run has no dropout-backward rows"
    assert measures(rows[0]) == ("dropout-backward", None)  # --append replaces the part's rows


def test_the_dropout_rounds_part_runs_each_count_in_a_process_of_its_own_and_reports_a_failed_one():
    """Each count of Philox's rounds reaches its child through FLASHREF_PHILOX_ROUNDS (the child reports what
    its kernels were built with); a child that fails, or a count the kernels refuse, gives a row that says why."""
    from flashref.bench.features_bench import dropout_rounds_cases, dropout_rounds_table

    child = ("import json\nfrom flashref.triton.forward import PHILOX_ROUNDS\nn = PHILOX_ROUNDS.value\n"
             "assert n != 5, 'five rounds'\n"
             "print(json.dumps({'impl': 'flashref-triton', 'd': 64, 'causal': False, 'ms': 3.0 + n / 10,"
             " 'ms_no_dropout': 3.0, 'ratio': 3.0 / (3.0 + n / 10), 'philox_rounds': n}))\n")
    rows = list(dropout_rounds_cases((0, 5, 10, 17), child=child))
    assert [(r["philox_rounds"], "ms" in r) for r in rows] == [(0, True), (5, False), (10, True), (17, False)]
    assert all(r["case"] == "dropout rounds fwd+bwd" for r in rows)
    assert rows[1]["status"] == "child failed: AssertionError: five rounds", rows[1]
    assert rows[3]["status"].startswith("child failed: ValueError: FLASHREF_PHILOX_ROUNDS must be"), rows[3]
    lines = dropout_rounds_table(rows).splitlines()
    assert lines[0].split()[-4:] == ["0", "rounds", "10", "rounds"], lines[0]
    assert lines[1].split() == ["flashref-triton", "64", "False", "3.00", "+0.00", "(1.00)", "+1.00", "(0.75)"], lines
    assert dropout_rounds_table(rows[1:2]) == "this run has no dropout-rounds rows"
