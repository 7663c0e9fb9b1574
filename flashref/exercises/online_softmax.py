"""Checkers for the exercises of notebook ``02_online_softmax``.

    from flashref.exercises import online_softmax as ex
    ex.check_merged_state((m, l))

The expected values come from :mod:`flashref.online_softmax`, the module the notebook teaches.
"""

from __future__ import annotations

import math

import numpy as np

from flashref import online_softmax as osm
from flashref.exercises import NOT_ANSWERED, Verdict, check_number, right, wrong

#: The two partial states of the merge exercise, as (m, l).
STATE_A = (2.0, 1.5)
STATE_B = (5.0, 2.0)

#: The running max before and after a new block, for the rescale-factor exercise.
M_OLD, M_NEW = 3.0, 7.0


def check_merged_state(answer) -> Verdict:
    """The merged (m, l) of STATE_A and STATE_B."""
    if answer is None:
        return Verdict(False, NOT_ANSWERED)
    try:
        m, l = (float(x) for x in answer)
    except (TypeError, ValueError):
        return wrong(f"give a pair (m, l) of two numbers, got {answer!r}.")
    merged = osm.merge(osm.SoftmaxState(np.float64(STATE_A[0]), np.float64(STATE_A[1])),
                       osm.SoftmaxState(np.float64(STATE_B[0]), np.float64(STATE_B[1])))
    if not math.isclose(m, float(merged.m), rel_tol=1e-9):
        return wrong(f"m = {m:g} is not right: the merged max is the larger of the two maxima.")
    if math.isclose(l, STATE_A[1] + STATE_B[1], rel_tol=1e-9):
        return wrong("adding l_a and l_b mixes two scales: rescale each to the merged max first.")
    return check_number(l, float(merged.l), what="l", rel=1e-6,
                        hint="each l must be multiplied by exp(its m - the merged m).",
                        explain="l = 1.5 exp(2 - 5) + 2.0 exp(5 - 5) = 1.5 e^-3 + 2 = 2.0747.")


def check_rescale_factor(answer) -> Verdict:
    """The factor that multiplies the old l (and o) when the running max goes from M_OLD to M_NEW."""
    expected = math.exp(M_OLD - M_NEW)
    if answer is not None and _close(answer, 1 / expected):
        return wrong("that is the inverse: the old terms shrink when the max grows, so the factor is below 1.")
    return check_number(answer, expected, what="the rescale factor", rel=1e-6,
                        hint="each old term exp(x - m_old) must become exp(x - m_new).",
                        explain="exp(m_old - m_new) = exp(-4) = 0.0183.")


def check_online_logsumexp(fn) -> Verdict:
    """``fn(x, block_size)`` must return the log-sum-exp of the 1-d array x, computed block by block."""
    if fn is None:
        return Verdict(False, NOT_ANSWERED)
    if not callable(fn):
        return wrong(f"pass your function itself, got {type(fn).__name__}.")
    rng = np.random.default_rng(2)
    cases = [("small scores", rng.standard_normal(10), 3),
             ("scores of size 1e3 (a naive exp overflows)", rng.standard_normal(50) * 1e3, 7),
             ("one block", rng.standard_normal(5), 8),
             ("masked scores (-inf), a whole block of them first", np.r_[[-np.inf] * 4, rng.standard_normal(6)], 2)]
    for name, x, block in cases:
        expected = float(np.max(x) + np.log(np.sum(np.exp(x - np.max(x)))))
        try:
            with np.errstate(all="ignore"):
                got = float(fn(x.copy(), block))
        except Exception as exc:  # a reader's bug must not stop the notebook
            return wrong(f"on {name} your function raised {type(exc).__name__}: {exc}")
        if not math.isfinite(got):
            return wrong(f"on {name} your function returned {got}. Subtract the running max before exp, and "
                         "treat exp(-inf - (-inf)) as 0.")
        if not math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9):
            return wrong(f"on {name} your function returned {got:.6g}, expected {expected:.6g}.")
    return right("Your recurrence matches the one-shot log-sum-exp on every case.")


def _close(x, y) -> bool:
    try:
        return math.isclose(float(x), y, rel_tol=1e-6)
    except (TypeError, ValueError):
        return False
