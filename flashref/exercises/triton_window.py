"""The coding exercise of notebook ``07_triton_forward``: complete a small Triton attention kernel so that
it computes causal sliding-window attention, and check it against the float64 reference.

    from flashref.exercises import triton_window as ex
    ex.check_window_kernel(window_attention_kernel)   # the reader's @triton.jit kernel

The kernel is launched here on small, uneven shapes, on the GPU when there is one and otherwise in
Triton's CPU interpreter (so the exercise works without a GPU, and on Colab's T4). Its signature is the
skeleton's: ``(Q, K, V, O, N, sm_scale, WINDOW, D, BLOCK_M, BLOCK_N)`` over contiguous fp32 tensors of
shape ``(B * H, N, D)``, one program per (query block, batch x head).
"""

from __future__ import annotations

import numpy as np

from flashref.exercises import Verdict, right, triton_kernel_unready, wrong

#: (N, window) cases: uneven lengths, a window of one key, one longer than the sequence.
CASES = [(37, 5), (1, 3), (50, 16), (40, 1), (29, 64)]
BH, D, BLOCK = 2, 16, 16
UNWRITTEN = ("Not answered yet: your kernel still has the line marked 'your code'; write the mask there and "
             "run the cell again.")


def window_mask(N: int, window: int, kind: str = "right") -> np.ndarray:
    """Query i sees keys i - window < j <= i ("right"), or one of the mistakes the checker names."""
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    return {"right": (j <= i) & (j > i - window),
            "no window": j <= i,
            "one more": (j <= i) & (j >= i - window),
            "one fewer": (j <= i) & (j > i - window + 1),
            "both sides": np.abs(i - j) < window,
            "none": np.ones((N, N), dtype=bool)}[kind]


def reference(q, k, v, visible, sm_scale):
    """Softmax attention in float64 with the boolean mask ``visible`` (N_q, N_k)."""
    S = sm_scale * q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2)
    S = np.where(visible, S, -np.inf)
    P = np.exp(S - S.max(-1, keepdims=True))
    return (P / P.sum(-1, keepdims=True)) @ v.astype(np.float64)


def run_kernel(kernel, q, k, v, window: int, sm_scale: float):
    """Launch ``kernel`` as the skeleton does; ``q, k, v`` are NumPy (B * H, N, D). Returns O as NumPy."""
    import torch

    import flashref.triton as flashref_triton  # sets the interpreter up when there is no GPU

    device = "cpu" if flashref_triton.INTERPRETED else "cuda"
    Q, K, V = (torch.tensor(x, dtype=torch.float32, device=device) for x in (q, k, v))
    O = torch.empty_like(Q)
    N = Q.shape[1]
    grid = (-(-N // BLOCK), Q.shape[0])
    kernel[grid](Q, K, V, O, N, sm_scale, WINDOW=window, D=Q.shape[2], BLOCK_M=BLOCK, BLOCK_N=BLOCK)
    return O.cpu().numpy()


def check_window_kernel(kernel) -> Verdict:
    """``kernel``: the reader's completed skeleton. Right when O matches causal sliding-window attention (query
    i sees keys i - WINDOW < j <= i) within fp32 rounding on every case; otherwise the message names the
    mask the kernel did compute when it is a common mistake."""
    unready = triton_kernel_unready(kernel, "window_attention_kernel", UNWRITTEN)
    if unready is not None:
        return unready
    rng = np.random.default_rng(0)
    for N, w in CASES:
        q, k, v = (rng.standard_normal((BH, N, D)) for _ in range(3))
        scale = 1 / np.sqrt(D)
        case = f"N = {N}, WINDOW = {w}"
        try:
            got = run_kernel(kernel, q, k, v, w, scale)
        except Exception as exc:  # noqa: BLE001 (the reader's code: say what it raised)
            return wrong(f"for {case} the kernel raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        if not np.isfinite(got).all():
            return wrong(f"for {case} the output has NaN or inf: a row whose keys of a tile are all masked has a "
                         "max of -inf there; subtract the safe max (m_safe in the skeleton), not m_new.")
        if np.allclose(got, reference(q, k, v, window_mask(N, w), scale), rtol=1e-4, atol=1e-5):
            continue
        for kind, message in (("none", "every query sees every key: the kernel applies no mask but the sequence's end"),
                              ("no window", "every earlier key is visible: the window is missing (j > i - WINDOW)"),
                              ("one more", "each query sees WINDOW + 1 keys, one too many: keys i - WINDOW < j <= i"),
                              ("one fewer", "each query sees WINDOW - 1 keys, one too few: its own key counts"),
                              ("both sides", "queries see later keys too: the window must be causal (j <= i)")):
            if np.allclose(got, reference(q, k, v, window_mask(N, w, kind), scale), rtol=1e-4, atol=1e-5):
                return wrong(f"for {case} {message}.")
        diff = np.abs(got - reference(q, k, v, window_mask(N, w), scale)).max(axis=(0, 2))
        return wrong(f"for {case} the output differs from sliding-window attention, first at query row "
                     f"{int(np.argmax(diff > 1e-4))}. Is every key the mask keeps inside 0 <= j < N?")
    return right("Your kernel computes causal sliding-window attention. Skipping the key blocks outside the window "
                 "(the solution's loop bounds) makes its time grow as N x WINDOW instead of N^2 / 2.")
