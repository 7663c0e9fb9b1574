"""Checkers for the exercises of notebook ``12_packing_and_score_mods``.

    from flashref.exercises import score_mods as ex
    ex.check_cu_seqlens(cu_seqlens)          # the reader's function: lengths -> cumulative offsets
    ex.check_padded_work(answer)             # a number
    ex.check_softcap_function(softcap)       # the reader's @triton.jit function, run in a Triton kernel

The softcap function runs inside a small Triton kernel: on the GPU when there is one, otherwise in Triton's
CPU interpreter, so the exercise works anywhere.
"""

from __future__ import annotations

import numpy as np

from flashref.exercises import (NOT_ANSWERED, UNWRITTEN, Verdict, host_array, read_number, right,
                                triton_kernel_unready, wrong)

#: Exercise "offsets": the length lists the reader's function is checked on.
CU_CASES = [[3, 5, 2], [1], [7, 1, 1, 12], [4096, 17, 255, 1000]]

#: Exercise "padded work": a toy packed batch of these documents, causal, against the batch padded to the longest
#: (short, so that counting all pairs instead of the causal ones gives a visibly different answer).
PAD_LENGTHS = [1, 3, 4, 12]

#: Exercise "softcap": the caps and scores the reader's function is checked on.
CAPS = (1.0, 30.0, 50.0)
SCORES = np.concatenate([np.linspace(-1e4, 1e4, 41), np.linspace(-3.0, 3.0, 61), [0.0, 1e-6, -1e-6, 1e-3]])
SOFTCAP_UNWRITTEN = ("Not answered yet: your function still has the line marked 'your code'; return c * tanh(s / c) "
                     "there and run the cell again.")


def check_cu_seqlens(fn) -> Verdict:
    """``fn(lengths)``: the int32 offsets ``[0, n_0, n_0 + n_1, ..., total]`` (a 1-D torch tensor or NumPy array
    of an integer dtype) that ``flash_attention_varlen`` takes."""
    if fn is None:
        return Verdict(False, NOT_ANSWERED)
    if not callable(fn):
        return wrong(f"pass your function itself, not {type(fn).__name__}.")
    for lengths in CU_CASES:
        try:
            got = fn(list(lengths))
        except Exception as exc:  # noqa: BLE001 (the reader's code: say what it raised)
            return wrong(f"for lengths {list(lengths)} your function raised {type(exc).__name__}: {exc}")
        if got is None:
            return Verdict(False, UNWRITTEN)
        try:
            arr = host_array(got)
        except Exception as exc:  # noqa: BLE001 (what came back is not an array of numbers)
            return wrong(f"for lengths {list(lengths)} your function returned {type(got).__name__}, which is not a "
                         f"1-D array of integers ({type(exc).__name__}: {exc}).")
        want = np.concatenate([[0], np.cumsum(lengths)])
        if arr.dtype.kind not in "iu":
            return wrong(f"for lengths {lengths} the offsets have dtype {arr.dtype}: they index rows, so they must "
                         "be integers (int32, as FlashAttention takes them).")
        if arr.shape == (len(lengths),) and np.array_equal(arr, np.cumsum(lengths)):
            return wrong(f"for lengths {lengths} you returned the ends of the documents; the offsets start with 0, so "
                         "there is one more entry than documents (document b is rows cu[b] : cu[b + 1]).")
        if arr.shape != want.shape or not np.array_equal(arr, want):
            return wrong(f"for lengths {lengths} you returned {arr.tolist()}, expected {want.tolist()}.")
    return right("Document b holds rows cu[b] : cu[b + 1] of the packed q, k and v, and cu[-1] is the total.")


def padded_work(lengths=PAD_LENGTHS) -> float:
    """(query, key) pairs causal attention computes on the batch padded to the longest document, over those
    of the packed batch."""
    n = np.asarray(lengths, dtype=np.int64)
    longest = int(n.max())
    return len(n) * longest * (longest + 1) / 2 / float((n * (n + 1) // 2).sum())


def check_padded_work(answer) -> Verdict:
    """How many times more (query, key) pairs the padded batch computes than the packed one, causal."""
    x, unready = read_number(answer, "the ratio")
    if unready is not None:
        return unready
    want = padded_work()
    n = np.asarray(PAD_LENGTHS)
    not_causal = len(n) * n.max() ** 2 / float((n ** 2).sum())
    tokens = len(n) * n.max() / n.sum()
    if abs(x - want) <= 1e-3 * want:
        return right(f"{want:.2f}x: the padded batch spends most of its work on padding, and the kernel cannot "
                     "skip it unless it knows where each document ends, which is what cu_seqlens tells it.")
    if abs(x - not_causal) <= 1e-3 * not_causal:
        return wrong("that counts every (query, key) pair; with causal attention query i sees i + 1 keys, "
                     "n (n + 1) / 2 pairs for a document of n tokens.")
    if abs(x - tokens) <= 1e-3 * tokens:
        return wrong("that is the ratio of tokens; attention's work grows with the pairs, about n^2 / 2 each.")
    return wrong(f"count the pairs: the padded batch has {len(n)} documents of {n.max()} tokens, the packed one "
                 "the real lengths; a causal document of n tokens has n (n + 1) / 2 pairs.")


def _apply(fn, scores, c):
    """Run the reader's ``fn(s, c)`` on a tile of scores in a Triton kernel; return the result as NumPy."""
    import torch

    import flashref.triton as flashref_triton  # sets the interpreter up when there is no GPU
    import triton
    import triton.language as tl

    @triton.jit
    def apply_kernel(S, OUT, c, N: tl.constexpr, FN: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(OUT + offs, FN(tl.load(S + offs), c))

    device = "cpu" if flashref_triton.INTERPRETED else "cuda"
    n = triton.next_power_of_2(len(scores))
    s = torch.zeros(n, dtype=torch.float32, device=device)
    s[:len(scores)] = torch.tensor(scores, dtype=torch.float32)
    out = torch.empty_like(s)
    apply_kernel[(1,)](s, out, c, N=n, FN=fn)
    return out[:len(scores)].cpu().double().numpy()


def check_softcap_function(fn) -> Verdict:
    """``fn``: the reader's ``@triton.jit`` function ``softcap(s, c)`` returning ``c * tanh(s / c)`` in fp32,
    built from ``tl.exp2`` (Triton's core language has no tanh). Right when it is within fp32 rounding of the
    float64 value for every cap and score, from tiny to 1e4 in size."""
    unready = triton_kernel_unready(fn, "softcap", SOFTCAP_UNWRITTEN)
    if unready is not None:
        return unready
    for c in CAPS:
        try:
            got = _apply(fn, SCORES, c)
        except Exception as exc:  # noqa: BLE001 (the reader's code: say what it raised)
            return wrong(f"with c = {c} the kernel calling your function raised {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]}")
        want = c * np.tanh(SCORES / c)
        if not np.isfinite(got).all():
            bad = SCORES[~np.isfinite(got)][0]
            return wrong(f"with c = {c}, s = {bad:g} gives {got[~np.isfinite(got)][0]}: exp of a large positive number "
                         "overflows to inf, and inf / inf is NaN. Write tanh with exp(-2|x|), which stays in [0, 1], and "
                         "put the sign back afterwards.")
        if np.allclose(got, SCORES, rtol=1e-6, atol=1e-6):
            return wrong("your function returns the scores unchanged: nothing is capped.")
        if np.allclose(got, np.tanh(SCORES / c), rtol=1e-5, atol=1e-6) and c != 1.0:
            return wrong(f"with c = {c} your values stay within 1: multiply tanh(s / c) by c, so the cap is c.")
        if np.allclose(got, c * np.tanh(SCORES), rtol=1e-5, atol=1e-5) and c != 1.0:
            return wrong(f"with c = {c} the values saturate too early: the argument of tanh is s / c, not s.")
        err = np.abs(got - want)
        bound = 8 * 2.0**-24 * np.maximum(np.abs(want), c)  # a few fp32 roundings at the scale of the cap
        if (err > bound).any():
            i = int(np.argmax(err - bound))
            return wrong(f"with c = {c}, s = {SCORES[i]:g} gives {got[i]:.9g}; c tanh(s / c) = {want[i]:.9g} (error "
                         f"{err[i]:.2g}).")
    return right("Inside the kernel this costs one exp2 and a division per score, on a tile that is already in "
                 "registers; outside it, capping needs the whole N x N matrix of scores in memory.")
