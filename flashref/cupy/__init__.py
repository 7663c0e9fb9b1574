"""FlashAttention forward in CUDA C, launched from Python with CuPy.

Taught in notebook ``06_cupy_kernel``. Three kernels, all in ``flashref/cuda/``:

- ``kernel="tiled"`` (flash_tiled.cu): the readable one, fp32 or fp16 inputs, CUDA cores;
- ``kernel="wmma"`` (flash_wmma.cu): the middle step, tensor cores through the CUDA C++ ``nvcuda::wmma``
  API (sm_70 and newer), fp16 inputs; the scores and O_i pass through shared memory;
- ``kernel="mma"`` (flash_mma.cu): tensor cores through ``mma.sync``, fp16 inputs; everything but the
  K_j and V_j tiles stays in registers.

CuPy is imported only when a kernel is launched, so ``import flashref.cupy`` works everywhere; on a
machine without CuPy or without a CUDA GPU, launching raises a ``RuntimeError`` that says which is
missing. Sources are compiled with NVRTC by ``cupy.RawModule`` (CuPy adds ``-arch`` for the running
GPU) with the head dimension and tile shape as ``-D`` defines, once per (kernel, dtype, head dim,
compute capability), and cached.
"""

from __future__ import annotations

import math
import os

from flashref import validation
from flashref.cupy.config import (DTYPES, ENTRY_POINTS, KERNELS, MAX_HEAD_DIM, PADS_TO_8, KernelConfig,
                                  check_kernel, kernel_config, source)

__all__ = ["flash_attention_forward", "KERNELS", "require_cupy", "compiled_kernel"]

_MAX_GRID_Y = 65535          # CUDA's limit on gridDim.y, where the (batch, head) index goes
_CACHE: dict[tuple, object] = {}


def require_cupy():
    """Import CuPy and check that it sees a CUDA GPU; raise ``RuntimeError`` naming what is missing."""
    try:
        import cupy
    except ImportError as err:
        raise RuntimeError(
            "flashref.cupy needs CuPy and a CUDA GPU, but CuPy is not installed "
            "(pip install cupy-cuda12x or cupy-cuda13x, matching the CUDA of your driver)") from err
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # CUDARuntimeError when there is no driver
        raise RuntimeError(f"flashref.cupy needs a CUDA GPU, but CuPy finds none ({err})") from err
    if count < 1:
        raise RuntimeError("flashref.cupy needs a CUDA GPU, but CuPy finds none")
    return cupy


def _wmma_include(cupy, kernel: str) -> tuple[str, ...]:
    """``-I`` for the header ``mma.h`` pulls in (``crt/mma.h``). NVRTC finds ``mma.h`` among the headers of the
    pip package ``nvidia-cuda-nvrtc``, which lacks ``crt/mma.h`` (seen with CUDA 13); a CUDA toolkit
    (``cupy.cuda.get_cuda_path()``, /usr/local/cuda on Colab) or Triton's copy of the headers has it."""
    if kernel != "wmma":
        return ()
    candidates = [os.path.join(cupy.cuda.get_cuda_path() or "", "include")]
    try:
        import triton

        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include"))
    except ImportError:
        pass
    for folder in candidates:
        if os.path.exists(os.path.join(folder, "crt", "mma.h")):
            return (f"-I{folder}",)
    raise RuntimeError("kernel='wmma' needs the CUDA header crt/mma.h, found in no CUDA toolkit or Triton "
                       f"install here (looked in {', '.join(candidates)}); install the CUDA toolkit or use "
                       "kernel='tiled' or 'mma'")


def compiled_kernel(config: KernelConfig):
    """The ``cupy.RawKernel`` of ``config``, compiled on first use and cached (CuPy also keeps the cubin
    on disk, in ~/.cupy/kernel_cache)."""
    key = (config.kernel, config.dtype, config.head_dim, config.block_m, config.block_n, config.cc)
    if key not in _CACHE:
        cupy = require_cupy()
        options = ("-std=c++17", *config.defines, *_wmma_include(cupy, config.kernel))
        module = cupy.RawModule(code=source(config.kernel), options=options)
        fn = module.get_function(ENTRY_POINTS[config.kernel])
        if config.dynamic_smem_bytes > 48 * 1024:   # beyond 48 KB a kernel must opt in
            fn.max_dynamic_shared_size_bytes = config.dynamic_smem_bytes
        _CACHE[key] = fn
    return _CACHE[key]


def _check(q, k, v, causal, sm_scale, kernel, return_lse, check_finite):
    check_kernel(kernel)
    _, _, d = validation.check_attention_inputs(q, k, v, allowed_ndims=(4,), allowed_dtypes=DTYPES[kernel],
                                                max_head_dim=MAX_HEAD_DIM, finite=False)
    validation.check_causal(causal)
    validation.check_bool("check_finite", check_finite)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}: {return_lse!r}")
    return validation.check_sm_scale(sm_scale, d)


def flash_attention_forward(q, k, v, causal=False, sm_scale=None, kernel="tiled", return_lse=False, *,
                            check_finite=True):
    """FlashAttention forward on CuPy arrays of shape (B, H, N, d); returns O (and lse when asked).

    ``q``: (B, H, N_q, d); ``k``, ``v``: (B, H, N_k, d); float32 or float16 for ``kernel="tiled"``,
    float16 for ``kernel="wmma"`` and ``kernel="mma"``; d <= 128. O has q's shape and dtype; lse (natural
    log, float32) has shape (B, H, N_q). ``causal=True`` is top-left aligned (query i sees keys j <= i).
    ``check_finite`` (default True): NaN or inf in q, k or v is a ``ValueError``
    (:mod:`flashref.validation`'s rule; one read of the inputs and one synchronization); False skips the
    check.
    """
    scale = _check(q, k, v, causal, sm_scale, kernel, return_lse, check_finite)
    cupy = require_cupy()
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a CuPy array on the GPU, got {type(x).__module__}.{type(x).__name__}")
    if check_finite:
        validation.check_finite({"q": q, "k": k, "v": v})
    B, H, N_q, d = q.shape
    N_k = k.shape[2]
    with q.device:
        config = kernel_config(kernel, str(q.dtype), d, _compute_capability(cupy))
        # The tensor-core kernels move 16-byte chunks of rows: pad d to a multiple of 8 with zero columns,
        # which change neither Q K^T nor the first d columns of P V.
        d_run = 8 * math.ceil(d / 8) if kernel in PADS_TO_8 else d
        q3, k3, v3 = (_rows(cupy, x, d_run) for x in (q, k, v))
        o = cupy.empty((B * H, N_q, d_run), dtype=q.dtype)
        lse = cupy.empty((B * H, N_q), dtype=cupy.float32)
        fn = compiled_kernel(config)
        for s in range(0, B * H, _MAX_GRID_Y):
            e = min(B * H, s + _MAX_GRID_Y)
            grid = (math.ceil(N_q / config.block_m), e - s)
            args = (q3[s:e], k3[s:e], v3[s:e], o[s:e], lse[s:e], _i32(N_q), _i32(N_k), _i32(d_run),
                    _f32(scale), _i32(int(causal)))
            fn(grid, (config.threads,), args, shared_mem=config.dynamic_smem_bytes)
        if d_run != d:
            o = o[:, :, :d]
        o = cupy.ascontiguousarray(o).reshape(B, H, N_q, d)
    return (o, lse.reshape(B, H, N_q)) if return_lse else o


def _rows(cupy, x, d_run):
    """(B, H, N, d) -> contiguous (B*H, N, d_run), zero-padding columns d..d_run-1."""
    B, H, N, d = x.shape
    x = cupy.ascontiguousarray(x).reshape(B * H, N, d)
    if d_run != d:
        x = cupy.pad(x, ((0, 0), (0, 0), (0, d_run - d)))
    return x


def _compute_capability(cupy) -> int:
    return int(cupy.cuda.Device().compute_capability)


def _i32(x):
    import numpy as np
    return np.int32(x)


def _f32(x):
    import numpy as np
    return np.float32(x)
