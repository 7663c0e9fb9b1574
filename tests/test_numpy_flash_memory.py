"""The tiled forward and backward never allocate an N_q x N_k array: proof by tracemalloc.

NumPy reports its array buffers to tracemalloc, so the peak traced memory of a call (above what was
allocated before it) bounds every array the call created. At N = 4096, d = 64, float32, one N x N
matrix is 64 MiB; the tiled code must stay far below it while the reference, which materializes S and
P on purpose, must exceed it (so the measurement can see such a buffer when there is one).
"""

from __future__ import annotations

import numpy as np
import pytest

from flashref import reference
from flashref.bench.numpy_bench import peak_bytes
from flashref.numpy_flash import flash_attention_backward, flash_attention_forward

N, D = 4096, 64
ONE_MATRIX = N * N * 4  # bytes of one float32 N x N buffer: 64 MiB


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((N, D), dtype=np.float32) for _ in range(4))
    o, lse = flash_attention_forward(q, k, v)
    return q, k, v, do, o, lse


def test_measurement_sees_the_references_matrices(inputs):
    q, k, v, do, _, _ = inputs
    assert ONE_MATRIX == 64 * 2**20
    assert peak_bytes(reference.attention, q, k, v) > ONE_MATRIX
    assert peak_bytes(reference.attention_backward, q, k, v, do) > ONE_MATRIX


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("order", ["fa1", "fa2"])
def test_forward_peak_far_below_one_score_matrix(inputs, order, causal):
    q, k, v = inputs[:3]
    peak = peak_bytes(flash_attention_forward, q, k, v, causal=causal, order=order)
    assert peak < ONE_MATRIX / 4, f"forward ({order}) peak {peak / 2**20:.1f} MiB"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_peak_far_below_one_score_matrix(inputs, causal):
    q, k, v, do, o, lse = inputs
    peak = peak_bytes(flash_attention_backward, q, k, v, o, lse, do, causal=causal)
    assert peak < ONE_MATRIX / 4, f"backward peak {peak / 2**20:.1f} MiB"
