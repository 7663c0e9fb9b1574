"""The IO model: the simulated memory enforces M, both algorithms compute exact attention through it,
the tile-by-tile counts equal the closed forms, and the counts scale as the paper says."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from flashref import iomodel as io
from flashref.exercises import io_complexity as ex
from flashref.reference import attention

# (N_q, N_k, d, M): N = 1, N_q != N_k, N not a multiple of any block, d not a power of two, M not a
# multiple of 4d, and M below N_k so that the standard softmax needs two passes over a row of S.
EXEC_CASES = [
    (1, 1, 1, 40),
    (7, 7, 1, 64),
    (64, 64, 16, 1024),
    (100, 100, 16, 1000),
    (100, 257, 16, 1500),
    (257, 100, 80, 4000),
    (64, 300, 4, 120),
    (257, 257, 64, 2049),
]


def _inputs(N_q, N_k, d, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return (scale * rng.standard_normal((N_q, d)), rng.standard_normal((N_k, d)), rng.standard_normal((N_k, d)))


# ---------------------------------------------------------------------------------------------------
# Exactness: the simulated algorithms compute attention
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N_q,N_k,d,M", EXEC_CASES)
def test_executed_outputs_equal_the_reference(N_q, N_k, d, M, causal):
    q, k, v = _inputs(N_q, N_k, d)
    o, lse = attention(q, k, v, causal=causal, return_lse=True)
    standard = io.simulate_standard(q, k, v, M, causal=causal)
    tiled = io.simulate_tiled(q, k, v, M, causal=causal)
    assert np.abs(standard.o - o).max() < 1e-12
    assert np.abs(tiled.o - o).max() < 1e-12
    assert np.abs(tiled.lse - lse).max() < 1e-12
    assert standard.lse is None


@pytest.mark.parametrize("causal", [False, True])
def test_extreme_logits_and_custom_scale(causal):
    """Logits scaled by 1e3 would overflow a naive exp; the running max keeps both exact."""
    q, k, v = _inputs(100, 257, 16, seed=1, scale=1e3)
    for sm_scale in (None, 0.3):
        o, lse = attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)
        for result in (io.simulate_standard(q, k, v, 600, causal, sm_scale),
                       io.simulate_tiled(q, k, v, 1500, causal, sm_scale)):
            assert np.all(np.isfinite(result.o))
            assert np.abs(result.o - o).max() < 1e-9 * max(1.0, np.abs(o).max())
        assert np.abs(result.lse - lse).max() < 1e-9 * np.abs(lse).max()


def test_float32_inputs_are_computed_in_float64():
    q, k, v = (x.astype(np.float32) for x in _inputs(33, 47, 8, seed=2))
    o = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    assert io.simulate_tiled(q, k, v, 500).o.dtype == np.float64
    assert np.abs(io.simulate_tiled(q, k, v, 500).o - o).max() < 1e-12


def test_custom_block_sizes_give_the_same_output_and_their_own_counts():
    q, k, v = _inputs(100, 100, 8, seed=3)
    o = attention(q, k, v, causal=True)
    for blocks in [(1, 1), (7, 3), (13, 64), (100, 100)]:
        result = io.simulate_tiled(q, k, v, 20000, causal=True, blocks=blocks)
        assert np.abs(result.o - o).max() < 1e-12
        assert result.io == io.tiled_io(100, 8, 20000, causal=True, blocks=blocks)


# ---------------------------------------------------------------------------------------------------
# Capacity: SRAM holds at most M elements
# ---------------------------------------------------------------------------------------------------

def test_loading_more_than_fits_raises():
    mem = io.TwoLevelMemory(100)
    mem.place("Q", np.zeros((20, 10)))
    a = mem.load("Q", (0, 5))  # 50 elements
    b = mem.load("Q", (5, 10))  # 100 in use: full
    with pytest.raises(io.SRAMOverflowError, match="M = 100"):
        mem.load("Q", (10, 11))
    with pytest.raises(io.SRAMOverflowError):
        mem.scratch((1, 1), "one more")
    mem.free(a)
    c = mem.load("Q", (10, 15))  # room again after a free
    assert (mem.reads, mem.writes, mem.used, mem.peak) == (150, 0, 100, 100)
    mem.allocate("O", (20, 10))
    mem.store(c, "O", (0, 5))
    assert mem.writes == 50 and mem.used == 100  # a store moves data out but keeps the tile on chip
    mem.free(b, c)
    assert mem.used == 0


def test_accounting_memory_enforces_the_same_capacity():
    mem = io.TwoLevelMemory(30, execute=False)
    mem.place("K", (10, 4))
    tile = mem.load("K", (0, 7))
    assert tile.data is None and mem.reads == 28
    with pytest.raises(io.SRAMOverflowError):
        mem.load("K", (7, 8))


def test_out_of_range_tiles_are_refused():
    mem = io.TwoLevelMemory(100)
    mem.place("Q", np.zeros((4, 3)))
    with pytest.raises(IndexError):
        mem.load("Q", (2, 5))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N_q,N_k,d,M", EXEC_CASES + [(1000, 1000, 64, 25600), (4096, 300, 128, 70000)])
def test_peak_sram_never_exceeds_M(N_q, N_k, d, M, causal):
    for count in (io.account_standard, io.account_tiled):
        assert 0 < count(N_q, d, M, causal=causal, N_k=N_k).peak_sram <= M


def test_tiled_working_set_is_K_V_and_a_group_of_rows():
    """With large N the peak is exactly K_j, V_j plus rows_on_chip rows of Q, O, S and 6 statistics."""
    N, d, M = 2048, 64, 25600
    plan = io.tiled_plan(N, N, d, M)
    assert (plan.B_c, plan.B_r) == (100, 64)
    assert plan.rows_on_chip == (M - 2 * 100 * 64) // (2 * 64 + 100 + 6) == 54
    assert io.account_tiled(N, d, M).peak_sram == 2 * 100 * 64 + 54 * (2 * 64 + 100 + 6)


# ---------------------------------------------------------------------------------------------------
# Counts: execution = accounting = closed form
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N_q,N_k,d,M", EXEC_CASES)
def test_execution_and_accounting_count_the_same_moves(N_q, N_k, d, M, causal):
    q, k, v = _inputs(N_q, N_k, d)
    for simulate, account in ((io.simulate_standard, io.account_standard), (io.simulate_tiled, io.account_tiled)):
        executed = simulate(q, k, v, M, causal=causal).io
        accounted = account(N_q, d, M, causal=causal, N_k=N_k)
        assert executed == accounted
        assert executed.peak_sram == accounted.peak_sram


GRID = [
    (N_q, N_k, d, M)
    for (N_q, N_k), d, M in itertools.product(
        [(1, 1), (7, 7), (64, 64), (100, 100), (257, 257), (100, 257), (257, 100)],
        [1, 16, 64, 80],
        [40, 130, 500, 1023, 4096, 70001],
    )
] + [(1000, 1000, 64, 25600), (3000, 3000, 80, 25601), (1000, 1000, 1, 500), (2000, 700, 16, 1000)]


@pytest.mark.parametrize("causal", [False, True])
def test_accounting_equals_the_closed_forms_on_a_grid(causal):
    checked = 0
    for N_q, N_k, d, M in GRID:
        for account, closed in ((io.account_standard, io.standard_io), (io.account_tiled, io.tiled_io)):
            try:
                expected = closed(N_q, d, M, causal=causal, N_k=N_k)
            except ValueError:  # M too small for this d: the simulator must refuse too
                with pytest.raises(ValueError, match="M = "):
                    account(N_q, d, M, causal=causal, N_k=N_k)
                continue
            assert account(N_q, d, M, causal=causal, N_k=N_k) == expected, (N_q, N_k, d, M, causal)
            checked += 1
    assert checked > 250  # most of the grid is valid; the refusals are the small M at large d


def test_closed_forms_by_hand():
    """N = 1024, d = 64, M = 25600: B_c = 100, T_c = ceil(1024 / 100) = 11."""
    tiled = io.tiled_io(1024, 64, 25600)
    assert tiled.reads == 2 * 1024 * 64 + 11 * 1024 * (2 * 64 + 2) == 1_595_392
    assert tiled.writes == 12 * 1024 * (64 + 2) == 811_008
    assert tiled.total == 2_406_400
    # Standard: R = 25600 // 130 = 196 rows a block, T_R = 6 blocks; a row of S (1024 + 2) fits.
    standard = io.standard_io(1024, 64, 25600)
    assert standard.reads == 1024 * 64 + 2 * 6 * 1024 * 64 + 2 * 1024 ** 2
    assert standard.writes == 2 * 1024 ** 2 + 1024 * 64
    # Rows of S longer than SRAM are read twice by the softmax.
    assert io.standard_io(1024, 8, 1000).reads - io.standard_io(1024, 8, 1026).reads >= 1024 ** 2


def test_causal_changes_only_the_tiled_count():
    for N, d, M in [(1000, 64, 25600), (257, 16, 1000), (4096, 128, 50000)]:
        assert io.standard_io(N, d, M, causal=True) == io.standard_io(N, d, M)
        full, causal = io.tiled_io(N, d, M), io.tiled_io(N, d, M, causal=True)
        assert causal.total < full.total and causal.flops < full.flops
    # Many blocks: the causal tiled algorithm does about half the work.
    full, causal = io.tiled_io(8192, 64, 4096), io.tiled_io(8192, 64, 4096, causal=True)
    assert 0.45 < causal.flops / full.flops < 0.55
    assert 0.45 < causal.total / full.total < 0.6


def test_flops_are_those_of_attention():
    for N_q, N_k, d, M in EXEC_CASES:
        assert io.standard_io(N_q, d, M, N_k=N_k).flops == 4 * N_q * N_k * d
        assert io.tiled_io(N_q, d, M, N_k=N_k).flops == 4 * N_q * N_k * d


def test_paper_block_sizes():
    assert io.block_sizes(25600, 64) == (100, 64)  # (B_c, B_r)
    assert io.block_sizes(25601, 64) == (101, 64)  # rounded up
    assert io.block_sizes(1000, 64) == (4, 4)  # B_r = B_c when B_c < d
    assert io.block_sizes(49152, 80) == io.BlockSizes(B_c=154, B_r=80)
    assert io.tiled_plan(1000, 1000, 64, 1000).B_c == 4


# ---------------------------------------------------------------------------------------------------
# Scaling: the exponents the paper predicts
# ---------------------------------------------------------------------------------------------------

def test_slopes_in_N_are_two_for_both():
    d, M = 64, 16384
    Ns = [1024, 2048, 4096, 8192, 16384]
    assert io.loglog_slope(Ns, [io.tiled_io(N, d, M).total for N in Ns]) == pytest.approx(2.0, abs=0.05)
    assert io.loglog_slope(Ns, [io.standard_io(N, d, M).total for N in Ns]) == pytest.approx(2.0, abs=0.05)
    # the accounting simulator gives the same slopes (its own counts, not the formulas)
    small = [256, 512, 1024, 2048]
    assert io.loglog_slope(small, [io.account_tiled(N, d, M).total for N in small]) == pytest.approx(2.0, abs=0.1)


def test_slopes_in_M_are_minus_one_for_tiled_and_zero_for_standard():
    N, d = 8192, 64
    Ms = [4 * d * d * 2 ** k for k in range(6)]  # 16K ... 512K elements, up to N d
    tiled = [io.tiled_io(N, d, M).total for M in Ms]
    standard = [io.standard_io(N, d, M).total for M in Ms]
    assert io.loglog_slope(Ms, tiled) == pytest.approx(-1.0, abs=0.1)
    assert abs(io.loglog_slope(Ms, standard)) < 0.1
    # the ratio standard / tiled grows like M / d^2, and is about M / 3d^2 when M >> d^2
    ratio = np.array(standard) / np.array(tiled)
    assert io.loglog_slope(Ms, ratio) == pytest.approx(1.0, abs=0.15)
    for M, r in zip(Ms, ratio):
        assert r == pytest.approx(M / (3 * d * d), rel=0.35)


def test_theta_orders_track_the_exact_counts():
    """Exact count / order stays within constant bounds over a wide range (Theorem 2)."""
    d = 64
    for N, M in itertools.product([1024, 4096, 16384], [8192, 32768, 65536]):  # d^2 < M <= N d
        assert 3 < io.standard_io(N, d, M).total / io.standard_io_theta(N, d) < 8
        assert 11 < io.tiled_io(N, d, M).total / io.tiled_io_theta(N, d, M) < 16
    assert io.tiled_io_theta(1024, 64, 4096) == 1024 ** 2 * 64 ** 2 / 4096
    assert io.standard_io_theta(1024, 64) == 1024 * 64 + 1024 ** 2


def test_lower_bound_range_end_M_equals_N_d():
    """At M = N d the lower bound N^2 d^2 / M = N d is the size of the input, which must be read."""
    N, d = 4096, 64
    assert io.tiled_io_theta(N, d, N * d) == N * d
    assert io.tiled_io(N, d, N * d).reads >= 3 * N * d  # Q, K, V each read at least once


def test_loglog_slope_recovers_a_power():
    x = np.array([1.0, 2.0, 4.0, 8.0])
    assert io.loglog_slope(x, 3 * x ** -1.5) == pytest.approx(-1.5)


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [io.standard_io, io.tiled_io, io.account_standard, io.account_tiled])
@pytest.mark.parametrize("kwargs,name", [
    (dict(N=0, d=16, M=1000), "N"), (dict(N=10, d=-1, M=1000), "d"), (dict(N=10, d=16, M=0), "M"),
    (dict(N=10, d=16, M=1000, N_k=0), "N_k"),
])
def test_non_positive_sizes_are_named(fn, kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be a positive integer, got"):
        fn(**kwargs)


@pytest.mark.parametrize("fn", [io.standard_io, io.tiled_io, io.block_sizes])
def test_non_integer_sizes_are_type_errors(fn):
    with pytest.raises(TypeError, match="d must be a positive integer, got float"):
        fn(*(((10, 2.5, 1000)) if fn is not io.block_sizes else (1000, 2.5)))
    with pytest.raises(TypeError, match="M must be a positive integer, got bool"):
        fn(*(((10, 4, True)) if fn is not io.block_sizes else (True, 4)))


def test_M_too_small_for_a_tile():
    with pytest.raises(ValueError, match=r"M = 129 is too small for the standard algorithm with d = 64"):
        io.standard_io(100, 64, 129)
    assert io.standard_io(100, 64, 130).total > 0  # one row of Q and its score, one row of K
    # B_c = ceil(300 / 256) = 2: K_j, V_j take 256 elements, one row of Q, O, S and statistics 136.
    with pytest.raises(ValueError, match=r"M = 300 is too small for the tiled algorithm with d = 64.* 392 in all"):
        io.account_tiled(100, 64, 300)
    assert io.account_tiled(100, 64, 392).peak_sram == 392
    q, k, v = _inputs(10, 10, 64)
    with pytest.raises(ValueError, match="too small for the tiled algorithm"):
        io.simulate_tiled(q, k, v, 300)
    with pytest.raises(ValueError, match="too small for the tiled algorithm"):
        io.tiled_io(100, 8, 1000, blocks=(100, 10))  # K_j and V_j alone are 1600 elements


def test_bad_arrays_and_arguments_are_named():
    q, k, v = _inputs(10, 12, 8)
    with pytest.raises(ValueError, match="q must have shape"):
        io.simulate_tiled(q[None, None], k[None, None], v[None, None], 1000)
    with pytest.raises(ValueError, match="v must have as many rows as k"):
        io.simulate_standard(q, k, v[:5], 1000)
    with pytest.raises(TypeError, match="causal must be a bool"):
        io.simulate_tiled(q, k, v, 1000, causal="yes")
    with pytest.raises(TypeError, match="causal must be a bool"):
        io.tiled_io(10, 8, 1000, causal=1)
    with pytest.raises(ValueError, match="sm_scale must be a finite number"):
        io.simulate_standard(q, k, v, 1000, sm_scale=math.inf)
    with pytest.raises(TypeError, match="M must be a positive integer"):
        io.simulate_standard(q, k, v, 1000.0)
    with pytest.raises(TypeError, match="blocks must be a pair"):
        io.tiled_io(10, 8, 1000, blocks=[4, 4])
    with pytest.raises(ValueError, match="blocks B_r must be a positive integer"):
        io.tiled_io(10, 8, 1000, blocks=(4, 0))


# ---------------------------------------------------------------------------------------------------
# The notebook's exercise checkers
# ---------------------------------------------------------------------------------------------------

def test_exercise_block_sizes():
    assert ex.check_block_sizes((154, 80))  # ceil(49152 / 320) = ceil(153.6), min(154, 80)
    assert ex.check_block_sizes([154, 80])
    for bad in [(80, 154), (153, 80), (154, 154), (1, 2), "154, 80", 154, None]:
        verdict = ex.check_block_sizes(bad)
        assert not verdict and repr(verdict)
    assert "order" in repr(ex.check_block_sizes((80, 154)))
    assert "rounded up" in repr(ex.check_block_sizes((153, 80)))


def test_exercise_tiled_accesses():
    assert ex.check_tiled_accesses(2_406_400)  # worked out in test_closed_forms_by_hand
    assert not ex.check_tiled_accesses(2_406_401)
    assert "writes only" in repr(ex.check_tiled_accesses(811_008))
    assert "initializing" in repr(ex.check_tiled_accesses(2_406_400 - 1024 * 66))
    assert not ex.check_tiled_accesses(None) and not ex.check_tiled_accesses("many")


def test_exercise_ratio():
    # R = 98304 // 130 = 756 query rows a block, T_R = 6; a row of S fits, so S is read once.
    standard = 4096 * 64 + 2 * 6 * 4096 * 64 + 2 * 4096 ** 2 + 2 * 4096 ** 2 + 4096 * 64
    tiled = 2 * 4096 * 64 + 11 * 4096 * 130 + 12 * 4096 * 66  # B_c = 384, T_c = ceil(4096 / 384) = 11
    assert ex.check_ratio(standard / tiled)
    assert ex.check_ratio(round(standard / tiled, 2))
    assert not ex.check_ratio(98304 / (3 * 64 ** 2))  # the rough estimate is not the answer
    assert not ex.check_ratio(None) and not ex.check_ratio([1, 2])


def test_block_sparse_order_is_the_dense_order_scaled_by_density_plus_the_inputs():
    """Proposition 4: Theta(N d + N^2 d^2 s / M). At s = 1 it is the dense order plus reading the inputs once;
    at s = 0 only the N d term is left; in between it is linear in s."""
    N, d, M = 4096, 64, 32768
    assert io.block_sparse_io_theta(N, d, M, 1.0) == N * d + io.tiled_io_theta(N, d, M)
    assert io.block_sparse_io_theta(N, d, M, 0.0) == N * d
    s = [0.0, 0.125, 0.5, 1.0]
    values = [io.block_sparse_io_theta(N, d, M, x) for x in s]
    assert np.allclose(np.diff(values) / np.diff(s), io.tiled_io_theta(N, d, M))
    for bad in (-0.1, 1.5, "half", True, float("nan")):
        with pytest.raises(ValueError, match="fraction of nonzero blocks"):
            io.block_sparse_io_theta(N, d, M, bad)
    with pytest.raises(ValueError, match="N must be a positive integer"):
        io.block_sparse_io_theta(0, d, M, 0.5)
