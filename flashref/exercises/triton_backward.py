"""The coding exercise of notebook ``08_triton_backward``: complete a small Triton kernel that computes dV
by recomputing P from Q, K and the forward's log-sum-exp, and check it against the float64 reference.

    from flashref.exercises import triton_backward as ex
    ex.check_dv_kernel(dv_kernel)   # the reader's @triton.jit kernel

The kernel is launched here on small, uneven shapes (N_q != N_k, lengths that are no multiple of the
block), on the GPU when there is one and otherwise in Triton's CPU interpreter (so the exercise works
without a GPU, and on Colab's T4). Its signature is the skeleton's: ``(Q, K, DO, LSE, DV, N_q, N_k,
sm_scale, D, BLOCK_M, BLOCK_N)`` over contiguous fp32 tensors: Q and dO ``(B * H, N_q, D)``, K and dV
``(B * H, N_k, D)``, LSE ``(B * H, N_q)``; one program per (key block, batch x head).
"""

from __future__ import annotations

import numpy as np

from flashref.exercises import Verdict, right, triton_kernel_unready, wrong

#: (N_q, N_k) cases: uneven lengths, one query, one key, more keys than queries.
CASES = [(37, 29), (1, 20), (45, 1), (16, 50)]
BH, D, BLOCK = 2, 16, 16
UNWRITTEN = ("Not answered yet: your kernel still has the line marked 'your code'; recompute P there and run the "
             "cell again.")


def _scores(q, k, sm_scale):
    return sm_scale * q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2)


def dv_of(q, k, do, sm_scale, kind: str = "right"):
    """dV = P^T dO in float64 with P = softmax(sm_scale q k^T), or the dV of one of the mistakes the checker
    names ("no scale": the scores were not scaled; "no lse": exp(S), unnormalized)."""
    S = _scores(q, k, sm_scale)
    lse = np.log(np.exp(S - S.max(-1, keepdims=True)).sum(-1, keepdims=True)) + S.max(-1, keepdims=True)
    P = {"right": lambda: np.exp(S - lse),
         "no scale": lambda: np.exp(S / sm_scale - lse),
         "no lse": lambda: np.exp(S)}[kind]()
    return np.swapaxes(P, -1, -2) @ do.astype(np.float64)


def run_kernel(kernel, q, k, do, sm_scale: float):
    """Launch ``kernel`` as the skeleton does; NumPy in, dV as NumPy out. LSE is computed here in float64, as
    the forward would have saved it."""
    import torch

    import flashref.triton as flashref_triton  # sets the interpreter up when there is no GPU

    device = "cpu" if flashref_triton.INTERPRETED else "cuda"
    S = _scores(q, k, sm_scale)
    m = S.max(-1, keepdims=True)
    lse = (np.log(np.exp(S - m).sum(-1, keepdims=True)) + m)[..., 0]
    Q, K, DO, LSE = (torch.tensor(np.ascontiguousarray(x), dtype=torch.float32, device=device) for x in (q, k, do, lse))
    DV = torch.empty_like(K)
    N_q, N_k = Q.shape[1], K.shape[1]
    grid = (-(-N_k // BLOCK), Q.shape[0])
    kernel[grid](Q, K, DO, LSE, DV, N_q, N_k, sm_scale, D=Q.shape[2], BLOCK_M=BLOCK, BLOCK_N=BLOCK)
    return DV.cpu().numpy()


def check_dv_kernel(kernel) -> Verdict:
    """``kernel``: the reader's completed skeleton. Right when dV matches ``P^T dO`` (P recomputed from q, k and
    lse) within fp32 rounding on every case; otherwise the message names the mistake when it is a common one."""
    unready = triton_kernel_unready(kernel, "dv_kernel", UNWRITTEN)
    if unready is not None:
        return unready
    rng = np.random.default_rng(0)
    for N_q, N_k in CASES:
        q, do = (rng.standard_normal((BH, N_q, D)) for _ in range(2))
        k = rng.standard_normal((BH, N_k, D))
        scale = 1 / np.sqrt(D)
        case = f"N_q = {N_q}, N_k = {N_k}"
        try:
            got = run_kernel(kernel, q, k, do, scale)
        except Exception as exc:  # noqa: BLE001 (the reader's code: say what it raised)
            # a compile error on a GPU spells the source out first and the error itself last
            last = ([line for line in str(exc).splitlines() if line.strip()] or [""])[-1]
            return wrong(f"for {case} the kernel raised {type(exc).__name__}: {last.strip()[:200]}")
        if not np.isfinite(got).all():
            return wrong(f"for {case} dV has NaN or inf: is P computed from the scaled scores minus lse, so that "
                         "every entry is at most 1?")
        if np.allclose(got, dv_of(q, k, do, scale), rtol=1e-4, atol=1e-5):
            continue
        for kind, message in (("no scale", "P was computed from q k^T without sm_scale: scale the scores first"),
                              ("no lse", "P is exp(S) without the normalization: subtract lse (P = exp(S - lse))")):
            alt = dv_of(q, k, do, scale, kind)
            # these mistakes make P large (exp of unnormalized scores): compare against the largest entry,
            # as fp32 rounding of a score is amplified by exp (seen 7e-4 elementwise with OpenBLAS's Katmai)
            if np.abs(got - alt).max() <= 1e-3 * np.abs(alt).max():
                return wrong(f"for {case} {message}.")
        diff = np.abs(got - dv_of(q, k, do, scale)).max(axis=(0, 2))
        return wrong(f"for {case} dV differs from P^T dO, first at key row {int(np.argmax(diff > 1e-4))}. Do the "
                     "padded query rows (past N_q) contribute? Their dO must load as 0.")
    return right("Your kernel recomputes P from q, k and lse and never stores it: the backward's memory stays "
                 "O(N), as the forward's. The real dK/dV kernel does the same, plus dP, dS and dK.")
