"""Shared by the float64 reference's tests: a backward checked against central finite differences."""

from __future__ import annotations

from flashref import reference as ref


def assert_reference_gradients_match(q, k, v, do, rng, **kw):
    """``reference.attention_backward`` with keywords ``kw`` against the central difference of
    ``sum(attention(...) * do)`` along one random direction per input (step 1e-6, float64)."""
    grads = ref.attention_backward(q, k, v, do, **kw)
    for i, x in enumerate((q, k, v)):
        dx = rng.standard_normal(x.shape)
        args = [q, k, v]
        args[i] = x + 1e-6 * dx
        up = (ref.attention(*args, **kw) * do).sum()
        args[i] = x - 1e-6 * dx
        down = (ref.attention(*args, **kw) * do).sum()
        want = (grads[i] * dx).sum()
        assert abs((up - down) / 2e-6 - want) < 1e-6 * max(1.0, abs(want)), f"gradient {'qkv'[i]}"
