"""Checkers for the exercises of notebook ``11_attention_in_a_model``.

    from flashref.exercises import model as ex
    ex.check_end_to_end_speedup(answer)   # Amdahl's law with the measured share and kernel speed-up
    ex.check_window_mask(window_mask)     # a token-level sliding-window mask the reader writes

They need neither torch nor triton: a mask may be a torch tensor or a NumPy array.
"""

from __future__ import annotations

import numpy as np

from flashref.exercises import NOT_ANSWERED, UNWRITTEN, Verdict, bool_mask, read_number, right, wrong


#: Exercise "end to end": rounded from the committed run at N = 4096 (book/data/model_bench.json): the plain
#: model spends SHARE of its GPU time in attention, flashref's kernels do that work KERNEL_SPEEDUP times faster,
#: and the step's GPU time fell MEASURED times.
SHARE, KERNEL_SPEEDUP, MEASURED = 0.92, 22.0, 8.83

#: Exercise "window mask": (N, window) cases the reader's function is checked on.
WINDOW_CASES = [(8, 3), (1, 1), (5, 8), (12, 1), (33, 7)]


def end_to_end_speedup(share: float = SHARE, kernel_speedup: float = KERNEL_SPEEDUP) -> float:
    """Amdahl's law: the part of the time that does not get faster stays."""
    return 1.0 / ((1.0 - share) + share / kernel_speedup)


def check_end_to_end_speedup(answer) -> Verdict:
    """The whole step's speed-up when SHARE of it runs KERNEL_SPEEDUP times faster."""
    value, unready = read_number(answer, "the speed-up")
    if unready is not None:
        return unready
    want = end_to_end_speedup()
    if abs(value - want) <= 0.02 * want:
        return right(f"1 / ((1 - {SHARE}) + {SHARE} / {KERNEL_SPEEDUP:g}) = {want:.2f}: the {1 - SHARE:.0%} of the "
                     f"step outside attention now takes over half of it. The committed run measured {MEASURED}x in "
                     "GPU time.")
    if abs(value - KERNEL_SPEEDUP) <= 0.02 * KERNEL_SPEEDUP:
        return wrong("that is the kernels' own speed-up; only the attention part of the step gets faster, the "
                     "rest (the linear layers, the MLP, the optimizer) takes as long as before.")
    if abs(value - 1 / (1 - SHARE)) <= 0.02 / (1 - SHARE):
        return wrong(f"{value:.3g} is the limit for infinitely fast attention (1 / (1 - share)); the kernels still "
                     f"take 1 / {KERNEL_SPEEDUP:g} of the time attention took.")
    mixed = SHARE * KERNEL_SPEEDUP + (1 - SHARE)
    if abs(value - mixed) <= 0.02 * mixed:
        return wrong("that averages the speed-ups, weighted by the share; times add, speed-ups do not. Write the "
                     "new step time as a fraction of the old one, then invert it.")
    return wrong(f"{value:.3g} is not it. Let the old step take 1: attention {SHARE}, the rest {1 - SHARE:.2f}. "
                 "How long does each part take now?")


def window_mask(N: int, window: int) -> np.ndarray:
    """Query i sees the ``window`` keys i - window < j <= i (local attention's rule in flashref.torch_attention)."""
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    return (j <= i) & (j > i - window)


def check_window_mask(fn) -> Verdict:
    """``fn(N, window)`` must return the (N, N) bool mask in which query i sees keys i - window < j <= i."""
    if fn is None:
        return Verdict(False, NOT_ANSWERED)
    if not callable(fn):
        return wrong(f"pass your function itself (window_mask), not {type(fn).__name__}.")
    for N, w in WINDOW_CASES:
        case = f"N = {N}, window = {w}"
        try:
            got = fn(N, w)
        except Exception as exc:  # noqa: BLE001 (the reader's code: say what it raised)
            return wrong(f"for {case} your function raised {type(exc).__name__}: {exc}")
        if got is None:
            return Verdict(False, UNWRITTEN)
        got, problem = bool_mask(got, "the key is visible")
        if problem:
            return wrong(problem)
        if got.shape != (N, N):
            return wrong(f"for {case} the mask should have shape ({N}, {N}) (queries by keys), got {got.shape}.")
        want = window_mask(N, w)
        if np.array_equal(got, want):
            continue
        i, j = np.nonzero(got & ~want)
        if len(i) and np.all(j > i):
            return wrong(f"for {case} query {i[0]} sees key {j[0]}, a later token: the window must be causal (j <= i).")
        if np.array_equal(got, want.T):
            return wrong(f"for {case} the mask is transposed: rows are queries, columns keys.")
        if np.array_equal(got, window_mask(N, w + 1)):
            return wrong(f"for {case} each query sees {w + 1} keys, one too many: keys i - window < j <= i, "
                         "its own included.")
        if np.array_equal(got, window_mask(N, w - 1)):
            return wrong(f"for {case} each query sees {w - 1} keys, one too few: count the query's own key.")
        bad = np.argwhere(got != want)[0]
        return wrong(f"for {case} entry (query {bad[0]}, key {bad[1]}) is {bool(got[tuple(bad)])}, expected "
                     f"{bool(want[tuple(bad)])}.")
    return right("That is the mask flashref.torch_attention.local_attention applies, chunk by chunk.")
