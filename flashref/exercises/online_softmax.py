"""Checkers for the exercises of notebook ``02_online_softmax``.

    from flashref.exercises import online_softmax as ex
    ex.check_merged_state((m, l))

The expected values come from :mod:`flashref.online_softmax`, the module the notebook teaches.
"""

from __future__ import annotations

import math

import numpy as np

from flashref import online_softmax as osm
from flashref.exercises import NOT_ANSWERED, UNWRITTEN, Verdict, as_number, check_number, right, wrong


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
    except (TypeError, ValueError, OverflowError):
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
             ("masked scores, a whole first block of -inf", np.r_[[-np.inf] * 4, rng.standard_normal(6)], 2)]
    for name, x, block in cases:
        expected = float(np.max(x) + np.log(np.sum(np.exp(x - np.max(x)))))
        try:
            with np.errstate(all="ignore"):
                got = float(fn(x.copy(), block))
        except Exception as exc:  # a reader's bug must not stop the notebook
            return wrong(f"on the case {name}: your function raised {type(exc).__name__}: {exc}")
        if not math.isfinite(got):
            return wrong(f"on the case {name}: your function returned {got}. Subtract the running max before "
                         "exp, and treat exp(-inf - (-inf)) as 0.")
        if not math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9):
            hint = ""
            if math.isclose(got, _logsumexp_without_rescale(x, block), rel_tol=1e-9, abs_tol=1e-9):
                hint = (" That is the recurrence without the rescale: when the running max grows from m_old to "
                        "m_new, multiply the running sum by exp(m_old - m_new) before adding the new block.")
            return wrong(f"on the case {name}: your function returned {got:.6g}, expected {expected:.6g}.{hint}")
    return right("Your recurrence matches the one-shot log-sum-exp on every case.")


def _logsumexp_without_rescale(x, block: int) -> float:
    """The blockwise log-sum-exp with the classic mistake: the running sum is never rescaled when the max grows."""
    m, l = -math.inf, 0.0
    for start in range(0, len(x), block):
        m = max(m, float(np.max(x[start:start + block])))
        if m > -math.inf:
            l += float(np.sum(np.exp(x[start:start + block] - m)))
    return m + math.log(l) if l > 0 else -math.inf


def _close(x, y) -> bool:
    value = as_number(x)
    return value is not None and math.isclose(value, y, rel_tol=1e-6)


def check_merge_function(fn) -> Verdict:
    """``fn(m_a, l_a, m_b, l_b)`` must return the merged ``(m, l)`` of two partial softmax states of disjoint
    parts of a row, with m the part's max and l its sum of exp(x - m); an empty part is (-inf, 0)."""
    if fn is None:
        return Verdict(False, NOT_ANSWERED)
    if not callable(fn):
        return wrong(f"pass your function itself (merge), not {type(fn).__name__}.")
    rng = np.random.default_rng(4)
    cases = [("two parts", rng.standard_normal(5), rng.standard_normal(7)),
             ("the second part holds the larger max", rng.standard_normal(5), rng.standard_normal(3) + 40),
             ("scores of size 1e3", rng.standard_normal(4) * 1e3, rng.standard_normal(6) * 1e3),
             ("an empty first part (m = -inf, l = 0)", np.array([]), rng.standard_normal(4)),
             ("two empty parts", np.array([]), np.array([]))]
    for name, a, b in cases:
        state = lambda x: (float(x.max()), float(np.exp(x - x.max()).sum())) if x.size else (-math.inf, 0.0)  # noqa: E731
        (m_a, l_a), (m_b, l_b) = state(a), state(b)
        both = np.r_[a, b]
        m_want, l_want = state(both)
        try:
            with np.errstate(all="ignore"):
                result = fn(m_a, l_a, m_b, l_b)
            if result is None:
                return Verdict(False, UNWRITTEN)
            m, l = (float(x) for x in result)
        except Exception as exc:  # noqa: BLE001
            return wrong(f"on the case {name}: your function raised {type(exc).__name__}: {exc}")
        if math.isnan(m) or math.isnan(l):
            return wrong(f"on the case {name}: your function returned NaN. When a part is empty its m is -inf, "
                         "and exp(-inf - (-inf)) is NaN: rescale an empty part's l (which is 0) to 0 directly.")
        if m != m_want:
            return wrong(f"on the case {name}: m = {m:g}, expected {m_want:g}: the merged max is the larger one.")
        if both.size and math.isclose(l, l_a + l_b, rel_tol=1e-12) and not math.isclose(l, l_want, rel_tol=1e-9):
            return wrong(f"on the case {name}: you added l_a and l_b, which are sums under different maxima. "
                         "Rescale each by exp(its m - the merged m) first.")
        if not math.isclose(l, l_want, rel_tol=1e-9, abs_tol=1e-300):
            return wrong(f"on the case {name}: l = {l:.6g}, expected {l_want:.6g}.")
    return right("Your merge is exact on every case, empty parts included: the same merge FlashAttention's "
                 "tiles, split-K decoding and ring attention all rest on.")
