"""Checkers for the notebooks' exercises, one module per notebook.

    from flashref.exercises import standard_attention as ex
    ex.check_score_bytes(answer)      # shows a short "Correct" or a message saying what is off

Every checker returns a :class:`Verdict`: true or false in tests (``assert ex.check_...(x)``), and in a
notebook it displays its message. A checker never raises on a wrong answer, so a notebook still runs
top to bottom while the reader works on it.
"""

from __future__ import annotations

import numpy as np


class Verdict:
    """The outcome of a check: truthy when right; its repr is the message for the reader."""

    def __init__(self, ok: bool, message: str):
        self.ok = bool(ok)
        self.message = message

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return self.message


NOT_ANSWERED = "Not answered yet: replace None with your answer and run the cell again."
#: What a coding exercise's checker says while the reader's function still returns None.
UNWRITTEN = "Not answered yet: your function returns None; write its body and run the cell again."


def triton_kernel_unready(kernel, name: str, unwritten: str) -> Verdict | None:
    """The verdict for a Triton coding exercise's answer that cannot be run yet, or None when it can: not
    answered (None), not a ``@triton.jit`` kernel (``name`` is the skeleton's), or its source still holds
    the skeleton's line marked "your code" (``unwritten`` says what to write there)."""
    if kernel is None:
        return Verdict(False, NOT_ANSWERED)
    if not hasattr(kernel, "fn") or not callable(getattr(kernel, "__getitem__", None)):
        return wrong(f"pass your @triton.jit kernel itself ({name}), not {type(kernel).__name__}.")
    if "your code" in _kernel_source(kernel):
        return Verdict(False, unwritten)
    return None


def _kernel_source(kernel) -> str:
    """A Triton kernel's Python source: a compiled kernel keeps it as ``src``; under the interpreter, read its
    ``fn``."""
    import inspect

    try:
        return getattr(kernel, "src", None) or inspect.getsource(kernel.fn)
    except (OSError, TypeError):
        return ""


def right(message: str = "") -> Verdict:
    return Verdict(True, "Correct." + (f" {message}" if message else ""))


def wrong(message: str) -> Verdict:
    return Verdict(False, f"Not quite: {message}")


def as_number(x):
    """``float(x)``, or None when the answer is not a number (checkers then say so instead of raising)."""
    try:
        return float(x)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond any float, 10**400
        return None


def host_array(x):
    """A reader's answer as a NumPy array of its own dtype: a torch tensor is detached and copied to the host
    (a sparse or meta tensor raises, as anything that is no array may: checkers catch it and say so)."""
    return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)


def bool_mask(mask, meaning: str):
    """``(array, None)`` or ``(None, what is wrong)`` for a mask a reader's function returned: a torch tensor or
    NumPy array of dtype bool, as a NumPy bool array on the host. ``meaning`` says what True means."""
    if not (hasattr(mask, "detach") or isinstance(mask, np.ndarray)):
        return None, f"your function should return a bool tensor (or NumPy array), got {type(mask).__name__}."
    if "bool" not in str(mask.dtype):
        return None, (f"the mask has dtype {mask.dtype}; return dtype bool (True = {meaning}). A comparison gives "
                      "bool; so does .bool() on a tensor of 0 and 1.")
    try:
        return host_array(mask).astype(bool, copy=False), None
    except Exception as exc:  # noqa: BLE001 (a sparse or meta tensor: no values to read)
        return None, f"the mask's values cannot be read ({type(exc).__name__}: {exc}); return a dense bool tensor."


def read_number(answer, what: str) -> tuple[float | None, Verdict | None]:
    """``(value, None)`` for a numeric answer, or ``(None, verdict)`` with the verdict a checker returns
    instead: not answered yet (None), or not a number (``what`` names the number asked for). Every checker
    of a numeric answer opens with it::

        value, unready = read_number(answer, "the speed-up")
        if unready is not None:
            return unready
    """
    if answer is None:
        return None, Verdict(False, NOT_ANSWERED)
    value = as_number(answer)
    if value is None:
        return None, wrong(f"{what} should be a number, got {type(answer).__name__}: {answer!r}.")
    return value, None


def check_number(answer, expected: float, *, what: str, rel: float = 1e-9, hint: str = "",
                 explain: str = "") -> Verdict:
    """Compare a numeric answer with ``expected`` to a relative tolerance."""
    value, unready = read_number(answer, what)
    if unready is not None:
        return unready
    if np.isclose(value, expected, rtol=rel, atol=0.0):
        return right(explain)
    ratio = f" (off by a factor of {value / expected:.3g})" if expected and value else ""
    return wrong(f"{what} = {value:g} is not right{ratio}. {hint}".rstrip())


def check_array(answer, expected, *, what: str, rtol: float = 1e-6, atol: float = 1e-9, hint: str = "",
                explain: str = "") -> Verdict:
    """Compare an array answer with ``expected``: shape first, then values."""
    if answer is None:
        return Verdict(False, NOT_ANSWERED)
    try:
        answer = np.asarray(answer, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        return wrong(f"{what} should be an array of numbers, got {type(answer).__name__}: {answer!r}.")
    expected = np.asarray(expected, dtype=np.float64)
    if answer.shape != expected.shape:
        return wrong(f"{what} should have shape {expected.shape}, got {answer.shape}.")
    if not np.all(np.isfinite(answer)):
        return wrong(f"{what} contains NaN or inf. {hint}".rstrip())
    if np.allclose(answer, expected, rtol=rtol, atol=atol):
        return right(explain)
    err = float(np.max(np.abs(answer - expected)))
    return wrong(f"{what} differs from the expected values by up to {err:.3g}. {hint}".rstrip())
