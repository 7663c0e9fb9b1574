"""flashref.cupy without a GPU: import, clear errors, input validation, tile arithmetic."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from flashref.cupy import config


def _arrays(shape_q=(1, 2, 8, 16), shape_kv=None, dtype="float32"):
    shape_kv = shape_kv or shape_q
    return np.zeros(shape_q, dtype), np.zeros(shape_kv, dtype), np.zeros(shape_kv, dtype)


@pytest.fixture
def no_cupy(monkeypatch):
    """Make `import cupy` fail, as on a machine without CuPy (CI), even where CuPy is installed."""
    monkeypatch.setitem(sys.modules, "cupy", None)


def test_import_does_not_import_cupy():
    code = "import sys, flashref.cupy, flashref.cupy.resources; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("kernel,dtype", [(k, dt) for k in config.KERNELS for dt in config.DTYPES[k]])
def test_launch_without_cupy_raises_runtime_error(no_cupy, kernel, dtype):
    from flashref.cupy import flash_attention_forward
    with pytest.raises(RuntimeError, match="CuPy is not installed"):
        flash_attention_forward(*_arrays(dtype=dtype), kernel=kernel)


@pytest.mark.parametrize("kwargs,arrays,error,match", [
    ({}, _arrays((2, 8, 16), (2, 8, 16)), ValueError, "q must have shape \\(B, H, N, d\\)"),
    ({}, _arrays(dtype="float64"), TypeError, "float32 or float16, got float64"),
    ({"kernel": "mma"}, _arrays(), TypeError, "dtype float16, got float32"),
    ({"kernel": "wmma"}, _arrays(), TypeError, "dtype float16, got float32"),
    ({}, _arrays((1, 1, 4, 160)), ValueError, "d = 160 is larger"),
    ({}, _arrays((1, 1, 4, 16), (1, 1, 5, 8)), ValueError, "head dimension"),
    ({}, _arrays((1, 1, 0, 16), (1, 1, 5, 16)), ValueError, "empty sequence"),
    ({"kernel": "naive"}, _arrays(), ValueError, "kernel must be one of 'tiled', 'wmma', 'mma', got 'naive'"),
    ({"kernel": np.array(["tiled", "mma"])}, _arrays(), ValueError, "kernel must be one of 'tiled', 'wmma', 'mma'"),
    ({"causal": 1}, _arrays(), TypeError, "causal must be a bool"),
    ({"sm_scale": float("nan")}, _arrays(), ValueError, "sm_scale must be a finite number"),
    ({"return_lse": "yes"}, _arrays(), TypeError, "return_lse must be a bool"),
])
def test_bad_input_raises_before_anything(no_cupy, kwargs, arrays, error, match):
    from flashref.cupy import flash_attention_forward
    with pytest.raises(error, match=match):
        flash_attention_forward(*arrays, **kwargs)


def test_padded_head_dim():
    assert [config.padded_head_dim(d) for d in (1, 16, 17, 64, 80, 100, 128)] == [16, 16, 32, 64, 80, 112, 128]


def test_shared_memory_formulas():
    # tiled, d = 64, 64 x 64 tiles: Q_i and K_j/V_j with 65-float rows, P_ij with 65-float rows
    assert config.tiled_smem_bytes(64, 64, 64) == 4 * (128 * 65 + 64 * 65) == 49920
    # mma, d = 128, 128 query rows, 64 keys: max(Q_i, K_j + V_j) rows of 136 halves
    assert config.mma_smem_bytes(128, 128, 64) == 2 * 128 * 136 == 34816
    # wmma, d = 64, 64 x 64 tiles: O_i (68 floats a row), S_ij (68 floats), P_ij (72 halves), K_j/V_j (72 halves)
    assert config.wmma_smem_bytes(64, 64, 64) == 4 * 64 * 68 + 4 * 64 * 68 + 2 * 64 * 72 + 2 * 64 * 72 == 53248
    # d = 96 is the largest that takes 64 query rows: exactly a T4 block
    assert config.wmma_smem_bytes(96, 64, 64) == config.T4_BLOCK_SMEM


@pytest.mark.parametrize("cc", [75, 80, 90])
def test_every_variant_fits_a_t4_block(cc):
    for c in config.package_configurations(cc):
        assert c.smem_bytes <= config.T4_BLOCK_SMEM, c
        assert c.dynamic_smem_bytes == 0 or c.kernel in ("tiled", "wmma")
        assert c.threads % 32 == 0 and c.threads <= 1024


def test_kernel_config_choices():
    t = config.kernel_config("tiled", "float32", 64, 90)
    assert (t.head_dim, t.block_m, t.block_n, t.threads) == (64, 64, 64, 256)
    assert config.kernel_config("tiled", "float32", 128, 90).block_m == 32       # 64 rows would not fit a T4
    assert config.kernel_config("mma", "float16", 64, 90).block_m == 128
    assert config.kernel_config("mma", "float16", 64, 75).block_m == 64
    assert config.kernel_config("mma", "float16", 128, 90).block_m == 64
    assert "-DUSE_CP_ASYNC=0" in config.kernel_config("mma", "float16", 64, 75).defines
    assert "-DMMA_K8=0" in config.kernel_config("mma", "float16", 64, 80).defines
    assert "-DELEM_T=__half" in config.kernel_config("tiled", "float16", 64, 80).defines
    w = config.kernel_config("wmma", "float16", 64, 75)
    assert (w.head_dim, w.block_m, w.block_n, w.threads, w.dynamic_smem_bytes) == (64, 64, 64, 128, 53248)
    assert [config.kernel_config("wmma", "float16", d, 90).block_m for d in (16, 96, 97, 128)] == [64, 64, 32, 32]
    assert "-D__CUDA_NO_HALF_CONVERSIONS__" in w.defines
    with pytest.raises(ValueError, match="kernel must be one of"):
        config.kernel_config("naive", "float32", 64, 90)


def test_sources_are_package_data():
    for kernel in config.KERNELS:
        text = config.source(kernel)
        assert config.ENTRY_POINTS[kernel] in text and "__syncthreads" in text
