"""flashref.cupy on the GPU: every kernel against the float64 reference, with the tolerance rule.

Marked `gpu`: skipped, visibly, without CUDA. Plain attention in the input's precision (NumPy) is the
baseline of the rule; every case checks that this baseline is finite, so the rule cannot pass vacuously.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from flashref import reference
from flashref.tolerance import check_tolerance

pytestmark = pytest.mark.gpu

# (B, H, N_q, N_k, d): uneven N, N_q != N_k both ways, N = 1, d from 16 to 128 (20 is not a multiple of 8)
SHAPES = [
    (1, 2, 1, 1, 64),
    (2, 3, 100, 100, 64),
    (1, 2, 257, 129, 32),
    (1, 1, 129, 300, 16),
    (1, 2, 1, 77, 64),
    (2, 2, 200, 200, 80),
    (1, 2, 300, 257, 128),
    (1, 1, 65, 190, 20),
    (1, 4, 256, 256, 64),
]
CASES = [("tiled", "float32"), ("tiled", "float16"), ("wmma", "float16"), ("mma", "float16")]


@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


def _inputs(shape, dtype, scale=1.0, seed=0):
    B, H, N_q, N_k, d = shape
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((B, H, N_q, d)) * scale).astype(dtype)
    k = rng.standard_normal((B, H, N_k, d)).astype(dtype)
    v = rng.standard_normal((B, H, N_k, d)).astype(dtype)
    return q, k, v


def _check(cp, kernel, q, k, v, causal, sm_scale=None):
    from flashref.cupy import flash_attention_forward
    o, lse = flash_attention_forward(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=causal,
                                     sm_scale=sm_scale, kernel=kernel, return_lse=True)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == np.float32
    ref_o, ref_lse = reference.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                         causal=causal, sm_scale=sm_scale, return_lse=True)
    base_o, base_lse = reference.attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)
    assert np.all(np.isfinite(base_o)) and np.all(np.isfinite(base_lse)), "baseline must be finite"
    result_o = check_tolerance(o, ref_o, base_o)
    assert result_o.ok, f"O: {result_o}"
    if q.dtype == np.float32:
        result_lse = check_tolerance(lse, ref_lse, base_lse)
        assert result_lse.ok, f"lse: {result_lse}"
    else:  # the kernels keep lse in fp32 for fp16 inputs too: the fp16 reference's lse would be no baseline
        np.testing.assert_allclose(cp.asnumpy(lse), ref_lse, rtol=0, atol=1e-4 * max(1.0, float(np.abs(ref_lse).max())))


@pytest.mark.parametrize("kernel,dtype", CASES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(cp, kernel, dtype, causal, shape):
    q, k, v = _inputs(shape, dtype, seed=sum(shape))
    _check(cp, kernel, q, k, v, causal)


@pytest.mark.parametrize("kernel,dtype", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_large_logits(cp, kernel, dtype, causal):
    """Extreme logits (q scaled by 1e3 in fp32, by 64 in fp16 so that q and the baseline's fp16 scores
    stay representable): exp would overflow without the running max."""
    scale = 1e3 if dtype == "float32" else 64.0
    q, k, v = _inputs((1, 2, 150, 170, 64), dtype, scale=scale, seed=7)
    _check(cp, kernel, q, k, v, causal)


@pytest.mark.parametrize("kernel,dtype", CASES)
def test_sm_scale(cp, kernel, dtype):
    q, k, v = _inputs((1, 2, 70, 90, 32), dtype, seed=3)
    _check(cp, kernel, q, k, v, False, sm_scale=0.5)


def test_many_heads_split_over_launches(cp):
    """More (batch, head) pairs than gridDim.y can hold (65535): the wrapper launches in chunks."""
    q, k, v = _inputs((2, 33000, 3, 5, 16), "float32", seed=11)
    _check(cp, "tiled", q, k, v, False)


@pytest.mark.parametrize("kernel", ["wmma", "mma"])
def test_non_contiguous_input(cp, kernel):
    from flashref.cupy import flash_attention_forward
    q, k, v = _inputs((1, 3, 40, 50, 32), "float16", seed=5)
    qt = cp.asarray(q.transpose(0, 2, 1, 3).copy()).transpose(0, 2, 1, 3)   # (B, H, N, d) view, strided
    o = flash_attention_forward(qt, cp.asarray(k), cp.asarray(v), kernel=kernel)
    ref = reference.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    assert check_tolerance(o, ref, reference.attention(q, k, v)).ok


def test_numpy_input_is_refused(cp):
    from flashref.cupy import flash_attention_forward
    q, k, v = _inputs((1, 1, 4, 4, 16), "float32")
    with pytest.raises(TypeError, match="q must be a CuPy array"):
        flash_attention_forward(q, k, v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 1, 77, 64), (2, 2, 200, 170, 80), (1, 2, 300, 257, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_turing_variant_on_this_gpu(cp, monkeypatch, causal, shape):
    """The sm_75 (T4) variant of the mma kernel (m16n8k8, plain loads instead of cp.async, 64-row
    blocks) also runs on newer GPUs: build it here by pretending to be compute capability 7.5."""
    import flashref.cupy as fc
    monkeypatch.setattr(fc, "_compute_capability", lambda cupy: 75)
    q, k, v = _inputs(shape, "float16", seed=sum(shape) + 1)
    _check(cp, "mma", q, k, v, causal)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_finite_inputs_are_refused(cp, which):
    """validation's rule for bad values holds on the GPU too; check_finite=False skips the check."""
    from flashref.cupy import flash_attention_forward

    data = {n: cp.asarray(np.random.default_rng(1).standard_normal((1, 2, 9, 16)), dtype=cp.float32) for n in "qkv"}
    data[which][0, 1, 4, 3] = cp.nan
    with pytest.raises(ValueError, match=rf"^{which} must be finite \(no NaN or inf\), got NaN at index \(0, 1, 4, 3\)$"):
        flash_attention_forward(data["q"], data["k"], data["v"])
    o = flash_attention_forward(data["q"], data["k"], data["v"], check_finite=False)
    assert not bool(cp.isfinite(o).all())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 129, 300, 96), (1, 2, 300, 129, 112)], ids=lambda s: "x".join(map(str, s)))
def test_wmma_at_the_edge_of_a_t4_block(cp, causal, shape):
    """d = 96 is the largest head dimension for which the wmma kernel takes 64 query rows: its shared
    memory is then exactly a T4 block's 64 KB (dynamic, opted in); d = 112 is the first with 32 rows."""
    from flashref.cupy import config
    assert config.kernel_config("wmma", "float16", shape[-1], 75).smem_bytes <= config.T4_BLOCK_SMEM
    q, k, v = _inputs(shape, "float16", seed=sum(shape) + 2)
    _check(cp, "wmma", q, k, v, causal)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_kernels_pass_compute_sanitizer(cp, tool):
    """tests/cupy_sanitize.py under compute-sanitizer: no out-of-bounds access or shared-memory race in any of the
    three kernels, on edge tiles, N_q != N_k, N = 1 and causal (and every result within the tolerance rule)."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("compute-sanitizer is not on PATH")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([exe, "--tool", tool, "--error-exitcode", "1", sys.executable, "tests/cupy_sanitize.py"],
                          cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILURES: 0" in proc.stdout
