"""Checkers for the exercises of notebook ``09_measured_io``.

    from flashref.exercises import measured_io as ex
    ex.check_predicted_dram_read(answer)

The expected values come from :mod:`flashref.hbm` (the model) and from the committed measurements,
``book/data/hbm_bench.json`` (:func:`flashref.bench.hbm_bench.load_results`), so the exercises, the
package and the data cannot disagree. A checker that cannot read the measurements still grades the
answer against the model and says that the measured value is unavailable.
"""

from __future__ import annotations

import math

from flashref import hbm
from flashref.exercises import NOT_ANSWERED, UNWRITTEN, Verdict, as_number, read_number, right, wrong

#: Exercise 1: the Triton forward on one sequence of 16 heads, N = 16K, d = 128, fp16, not causal.
PREDICT = {"B": 1, "H": 16, "N": 16384, "d": 128}
#: Exercise 2: plain attention's forward at N = 16K, d = 64.
PASSES = {"B": 1, "H": 16, "N": 16384, "d": 64}


def _measured():
    """The committed measurements, or None where they cannot be read (no checkout and no network)."""
    try:
        from flashref.bench.hbm_bench import load_results

        return load_results()
    except Exception:  # noqa: BLE001 (checkers never raise: the model still grades the answer)
        return None


def _totals(impl, mode, shape):
    from flashref.bench.hbm_bench import find, totals

    data = _measured()
    return None if data is None else totals(find(data, impl, mode, shape["N"], shape["d"], False))


def check_predicted_dram_read(answer) -> Verdict:
    """The bytes the Triton forward reads from DRAM at ``PREDICT``, predicted from the compulsory count."""
    value, unready = read_number(answer, "the prediction (a number of bytes)")
    if unready is not None:
        return unready
    B, H, N, d = PREDICT["B"], PREDICT["H"], PREDICT["N"], PREDICT["d"]
    model = hbm.flash_forward(B, H, N, N, d, 128, 64, causal=False, elem=2).compulsory_read
    measured = _totals("flashref-triton", "fwd", PREDICT)
    seen = ("the measurement is not available here" if measured is None else
            f"ncu measured {measured['dram_read']:,} bytes read, {measured['dram_read'] / model:.3f}x the model")
    if math.isclose(value, model, rel_tol=0.01):
        return right(f"Every byte of Q, K and V read once: {model:,} bytes; {seen}. The L2 serves every re-read of "
                     "K and V; what the hardware reads beyond the model at d = 128 is the registers the forward "
                     "spills to local memory (\"Model against hardware\").")
    if math.isclose(value, model / 2, rel_tol=0.01) or math.isclose(value, model * 2, rel_tol=0.01):
        return wrong(f"{value:,.0f} is off by a factor of 2: fp16 is 2 bytes an element, and count Q, K and V "
                     f"once each ({seen} once you have it).")
    if math.isclose(value, model / 3, rel_tol=0.01):
        return wrong("that is one of the three tensors: Q, K and V are each read once.")
    if math.isclose(value, model * 4 / 3, rel_tol=0.01):
        return wrong("that counts O too, but O is written, not read.")
    if math.isclose(value, model / (B * H), rel_tol=0.01):
        return wrong(f"that is one head: there are {B * H} of them.")
    return wrong(f"{value:,.0f} bytes is not the compulsory count. Every element of Q, K and V is read once: "
                 "B H (N_q + 2 N_k) d elements of 2 bytes.")


def nn_passes(measured_dram_bytes: float, shape=PASSES, elem: int = 2) -> float:
    """How many N x N matrices of ``elem`` bytes the bytes amount to."""
    return measured_dram_bytes / (shape["B"] * shape["H"] * shape["N"] ** 2 * elem)


def check_nn_passes(answer) -> Verdict:
    """How many N x N fp16 matrices' worth of bytes plain attention's forward moves through DRAM at ``PASSES``
    (reads plus writes, measured), to 5%."""
    value, unready = read_number(answer, "the answer")
    if unready is not None:
        return unready
    B, H, N, d = PASSES["B"], PASSES["H"], PASSES["N"], PASSES["d"]
    model = nn_passes(hbm.total(hbm.standard_forward(B, H, N, N, d)))
    measured = _totals("plain", "fwd", PASSES)
    expected = model if measured is None else nn_passes(measured["dram"])
    basis = "the model (the measurement is not available here)" if measured is None else "the measurement"
    if math.isclose(value, expected, rel_tol=0.05):
        return right(f"{expected:.2f} N x N matrices by {basis}; the model counts {model:.2f}: Q K^T writes S, the "
                     "scaling reads it and writes sm_scale S, the softmax reads that and writes P, and P V reads P.")
    if math.isclose(value, expected / 2, rel_tol=0.05):
        return wrong("that is half: each N x N matrix passes through DRAM twice, written by one kernel and read "
                     "by the next.")
    return wrong(f"{value:g} is not what {basis} gives. Sum dram_read and dram_write over the kernels of the "
                 "case and divide by B H N^2 x 2 bytes.")


#: Exercise 3: (flops, bytes, peak FLOP/s, bytes/s) cases the reader's roofline is checked on.
ROOFLINE_CASES = [(4.4e12, 1.3e8, 989e12, 3.35e12), (2.7e11, 8.6e9, 989e12, 3.35e12),
                  (1.0e9, 1.0e9, 1.0e12, 1.0e9), (0.0, 2.0e9, 989e12, 3.35e12), (3.0e12, 0.0, 989e12, 3.35e12)]


def roofline_time(flops, nbytes, peak_flops, bandwidth):
    """The roofline's lower bound on a kernel's time: the longer of its arithmetic and its memory traffic."""
    return max(flops / peak_flops, nbytes / bandwidth)


def check_roofline_time(fn) -> Verdict:
    """The reader's ``fn(flops, nbytes, peak_flops, bandwidth) -> seconds`` against :func:`roofline_time`."""
    if fn is None:
        return Verdict(False, NOT_ANSWERED)
    if not callable(fn):
        return wrong(f"pass your function itself (roofline_time), not {type(fn).__name__}.")
    for flops, nbytes, peak, bw in ROOFLINE_CASES:
        try:
            returned = fn(flops, nbytes, peak, bw)
        except Exception as exc:  # noqa: BLE001 (report the reader's error, never raise)
            return wrong(f"your function raised {type(exc).__name__}: {exc} on flops={flops:g}, bytes={nbytes:g}.")
        if returned is None:  # the skeleton's body, not yet written
            return Verdict(False, UNWRITTEN)
        got = as_number(returned)
        want = roofline_time(flops, nbytes, peak, bw)
        if got is None:
            return wrong(f"your function should return a number of seconds; on flops={flops:g} it returned a non-number.")
        if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-18):
            continue
        t_compute, t_memory = flops / peak, nbytes / bw
        if math.isclose(got, t_compute + t_memory, rel_tol=1e-9):
            return wrong("you added the two times: a kernel that overlaps its loads with its arithmetic takes the "
                         "longer of the two, not their sum (the roofline is a bound, max).")
        if math.isclose(got, min(t_compute, t_memory), rel_tol=1e-9):
            return wrong("you took the shorter time: the slower of arithmetic and memory sets the bound.")
        if math.isclose(got, max(flops * peak, nbytes * bw), rel_tol=1e-9) or \
                math.isclose(got, max(peak / flops if flops else 0, bw / nbytes if nbytes else 0), rel_tol=1e-9):
            return wrong("check the units: time is work divided by rate (FLOPs / (FLOP/s), bytes / (bytes/s)).")
        return wrong(f"for flops={flops:g}, bytes={nbytes:g}, peak={peak:g}, bandwidth={bw:g} your function gave "
                     f"{got:g} s; the roofline gives {want:g} s.")
    return right("The slower of the two resources bounds the kernel: max(FLOPs / peak, bytes / bandwidth).")
