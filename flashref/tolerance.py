"""The one tolerance rule for low precision, shared by every test and notebook.

FlashAttention reorders floating-point work (tiles, rescaling), so its low-precision output is not
bit-identical to plain attention. The rule serious FlashAttention test suites use: against a
high-precision reference (float64, or float32 for fp16/bf16 kernels), the implementation's error may be
at most ``factor`` times the error of *plain attention computed in the same low precision*, plus a
small absolute slack. The slack is the dtype's rounding step at the reference's magnitude, so the rule
still means something when plain attention happens to be exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def to_numpy(x) -> np.ndarray:
    """A float64 NumPy copy of a NumPy array, torch tensor or CuPy array."""
    if hasattr(x, "detach"):  # torch
        x = x.detach().to("cpu").double().numpy()
    elif hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        x = x.get()
    return np.asarray(x, dtype=np.float64)


def dtype_eps(x) -> float:
    """Machine epsilon of the dtype of ``x`` (NumPy, torch or CuPy)."""
    name = str(x.dtype).replace("torch.", "")
    return _EPS.get(name, _EPS["float64"])


@dataclass
class ToleranceResult:
    """The outcome of the rule; ``ok`` says whether ``error <= bound``."""
    error: float
    baseline_error: float
    bound: float
    ok: bool

    def __str__(self) -> str:
        verdict = "within" if self.ok else "OUTSIDE"
        return (f"max error {self.error:.3g} {verdict} bound {self.bound:.3g} "
                f"(plain attention in the same precision: {self.baseline_error:.3g})")


def check_tolerance(actual, reference, baseline, *, factor: float = 2.0, atol: float | None = None) -> ToleranceResult:
    """Apply the rule: ``max|actual - reference| <= factor * max|baseline - reference| + atol``.

    ``baseline`` is plain attention computed in the precision of ``actual``. ``atol`` defaults to two
    rounding steps of ``actual``'s dtype at the reference's magnitude.
    """
    a, r, b = to_numpy(actual), to_numpy(reference), to_numpy(baseline)
    if a.shape != r.shape or b.shape != r.shape:
        raise ValueError(f"shapes differ: actual {a.shape}, reference {r.shape}, baseline {b.shape}")
    if not np.all(np.isfinite(a)):
        return ToleranceResult(float("inf"), float(np.max(np.abs(b - r), initial=0.0)), 0.0, False)
    if atol is None:
        atol = 2.0 * dtype_eps(actual) * max(1.0, float(np.max(np.abs(r), initial=0.0)))
    error = float(np.max(np.abs(a - r), initial=0.0))
    baseline_error = float(np.max(np.abs(b - r), initial=0.0))
    bound = factor * baseline_error + atol
    return ToleranceResult(error, baseline_error, bound, error <= bound)


def assert_within_tolerance(actual, reference, baseline, *, factor: float = 2.0, atol: float | None = None,
                            name: str = "output") -> ToleranceResult:
    """:func:`check_tolerance`, raising ``AssertionError`` with the numbers when the rule fails."""
    result = check_tolerance(actual, reference, baseline, factor=factor, atol=atol)
    if not result.ok:
        raise AssertionError(f"{name}: {result}")
    return result
