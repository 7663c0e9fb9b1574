"""Checkers for the exercises of notebook ``13_beyond_one_gpu_and_decoding``.

    from flashref.exercises import beyond as ex
    ex.check_merge_splits(merge_splits)      # the reader's function: S partial (O, lse) -> the whole attention
    ex.check_decode_time(answer)             # a number: microseconds
    ex.check_causal_imbalance(answer)        # a number: a ratio

The merge is checked in NumPy against the float64 reference (:mod:`flashref.reference`) on keys cut into
slices, one of them empty, and on scores of thousands, so it works without a GPU.
"""

from __future__ import annotations

import numpy as np

from flashref import reference
from flashref.bench.decode_bench import bytes_moved  # the benchmark's count: one home for it
from flashref.exercises import NOT_ANSWERED, UNWRITTEN, Verdict, check_number, read_number, right, wrong
from flashref.tolerance import to_numpy

#: Exercise "merge": (N_q, N_k, d, slice boundaries of the keys, score scale) of the cases checked; an empty
#: slice (two equal boundaries) holds no key: O = 0 and lse = -inf, as flash-decoding stores it.
MERGE_CASES = [(1, 40, 8, (0, 10, 25, 40), 1.0), (3, 64, 16, (0, 16, 16, 48, 64), 1.0),
               (2, 33, 8, (0, 1, 33), 1e3)]

#: Exercise "decode time": one decoding step of a Llama-style layer on an H100 SXM.
DECODE = dict(B=1, H=32, H_kv=8, N_k=65536, d=128, elem_bytes=2, bandwidth=3.35e12)

#: Exercise "imbalance": causal attention over N tokens cut into R contiguous shards.
IMBALANCE = dict(N=4096, R=4)


def _partials(N_q, N_k, d, bounds, scale, seed):
    """float64 q, k, v and each key slice's (O_s, lse_s), the empty slices as O = 0, lse = -inf."""
    g = np.random.default_rng(seed)
    q = g.standard_normal((N_q, d)) * scale
    k, v = g.standard_normal((N_k, d)), g.standard_normal((N_k, d))
    o_parts, lse_parts = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            o_parts.append(np.zeros((N_q, d)))
            lse_parts.append(np.full(N_q, -np.inf))
            continue
        o, lse = reference.attention(q, k[lo:hi], v[lo:hi], return_lse=True)
        o_parts.append(o)
        lse_parts.append(lse)
    return q, k, v, np.stack(o_parts), np.stack(lse_parts)


def check_merge_splits(fn) -> Verdict:
    """``fn(o_parts, lse_parts) -> (o, lse)``: ``o_parts`` ``(S, N_q, d)`` and ``lse_parts`` ``(S, N_q)`` are the
    normalized outputs and log-sum-exps of attention over S disjoint slices of the keys; the answer is attention
    over all the keys, as flash-decoding's second kernel computes it."""
    if fn is None:
        return Verdict(False, NOT_ANSWERED)
    if not callable(fn):
        return wrong(f"pass your function itself, not {type(fn).__name__}.")
    for seed, (N_q, N_k, d, bounds, scale) in enumerate(MERGE_CASES):
        q, k, v, o_parts, lse_parts = _partials(N_q, N_k, d, bounds, scale, seed)
        try:
            with np.errstate(all="ignore"):
                got = fn(o_parts.copy(), lse_parts.copy())
        except Exception as exc:  # noqa: BLE001 (the reader's code: say what it raised)
            return wrong(f"your function raised {type(exc).__name__}: {exc}")
        if got is None:
            return Verdict(False, UNWRITTEN)
        if not isinstance(got, tuple) or len(got) != 2:
            return wrong("return a pair (o, lse).")
        try:
            o, lse = (to_numpy(x) for x in got)
        except Exception as exc:  # noqa: BLE001 (what came back is not two arrays of numbers)
            return wrong(f"o and lse must be arrays of numbers ({type(exc).__name__}: {exc}).")
        want_o, want_lse = reference.attention(q, k, v, return_lse=True)
        case = f"{len(bounds) - 1} slices of {N_k} keys{' (one empty)' if len(set(bounds)) < len(bounds) else ''}"
        if o.shape != want_o.shape or lse.shape != want_lse.shape:
            return wrong(f"for {case}: o should have shape {want_o.shape} and lse {want_lse.shape}, got {o.shape} "
                         f"and {lse.shape}.")
        if not (np.isfinite(o).all() and np.isfinite(lse).all()):
            return wrong(f"for {case} your o or lse holds NaN or inf. An empty slice has lse = -inf: subtract the "
                         "largest lse (finite), never -inf from -inf; and with scores of thousands exp(lse) "
                         "overflows, so take exponentials of differences only.")
        if not np.allclose(lse, want_lse, rtol=0, atol=1e-9):
            return wrong(f"for {case} lse is off by up to {np.abs(lse - want_lse).max():.3g}: the whole row's lse "
                         "is log sum_s exp(lse_s).")
        if not np.allclose(o, want_o, rtol=0, atol=1e-9):
            return wrong(f"for {case} o is off by up to {np.abs(o - want_o).max():.3g}: each O_s is already "
                         "normalized over its own slice, so it weighs exp(lse_s - lse), the slice's share of the "
                         "row's softmax.")
    return right("The same merge joins two tiles in a kernel, two GPUs in a ring, and S key slices in "
                 "flash-decoding: exact, in any order.")


def check_decode_time(answer) -> Verdict:
    """The least time, in microseconds, one decoding step of :data:`DECODE` can take at the HBM's bandwidth."""
    x, unready = read_number(answer, "the time (in microseconds)")
    if unready is not None:
        return unready
    p = {key: DECODE[key] for key in ("B", "H", "H_kv", "N_k", "d", "elem_bytes")}
    want = bytes_moved(**p, N_q=1) / DECODE["bandwidth"] * 1e6
    per_head = bytes_moved(**{**p, "H_kv": p["H"]}, N_q=1) / DECODE["bandwidth"] * 1e6
    if abs(x - per_head) <= 0.01 * per_head:
        return wrong("that reads K and V once per query head; with grouped-query attention the 32 query heads "
                     "share 8 K/V heads, and each K/V head is read once for its whole group.")
    if abs(x - want / 2) <= 0.01 * want:
        return wrong("that counts K or V, not both: every key's value is read too.")
    return check_number(x, want, what="the time in microseconds", rel=0.01,
                        hint="Count the bytes of K and V (fp16: 2 bytes a number), plus q and o, over 3.35e12 "
                             "bytes a second, in microseconds.",
                        explain=f"{want:.1f} us: no kernel decodes this step faster; FLOPs barely matter (4 per "
                                "byte read: a multiply-add per fp16 number for each of the 4 query heads that share "
                                "it), so decoding is judged by the bandwidth it reaches.")


def causal_pairs_contiguous(N: int, R: int) -> list[int]:
    """(query, key) pairs each of R ranks computes in causal attention when rank r holds tokens r c .. (r+1) c - 1."""
    c = N // R
    return [r * c * c + c * (c + 1) // 2 for r in range(R)]


def check_causal_imbalance(answer) -> Verdict:
    """How many times more pairs the busiest rank computes than the least busy one, contiguous shards, causal."""
    if answer is None:
        return Verdict(False, NOT_ANSWERED)
    pairs = causal_pairs_contiguous(**IMBALANCE)
    want = max(pairs) / min(pairs)
    return check_number(answer, want, what="the ratio", rel=1e-3,
                        hint="Rank r's c queries see the r c keys of the ranks before it whole, and a triangle "
                             "of c (c + 1) / 2 pairs of its own.",
                        explain=f"{want:.2f}x: every ring step waits for the slowest rank, so the contiguous "
                                "layout runs at the speed of its last rank. The zigzag layout gives each rank one "
                                "early and one late chunk, and the same work at every step.")
