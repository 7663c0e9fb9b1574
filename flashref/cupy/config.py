"""Tile shapes, shared-memory sizes and compile options of the CUDA kernels (no GPU needed).

Taught in notebook ``06_cupy_kernel`` ("How much shared memory a tile takes"). Everything here is
plain Python, so the compile test (tests/test_cupy_compile.py), the exercises and the notebook can
use it on a machine without CuPy or a GPU; :mod:`flashref.cupy` uses it to pick and build a kernel.
The helpers that show the sources piece by piece live in :mod:`flashref.cupy.teaching`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

#: the kernels, in the order notebook 06 teaches them: CUDA cores, tensor cores through wmma, through mma.sync
KERNELS = ("tiled", "wmma", "mma")
SOURCES = {"tiled": "flash_tiled.cu", "wmma": "flash_wmma.cu", "mma": "flash_mma.cu"}
ENTRY_POINTS = {"tiled": "flash_tiled_forward", "wmma": "flash_wmma_forward", "mma": "flash_mma_forward"}
#: input dtypes each kernel accepts (arithmetic and accumulation are always fp32)
DTYPES = {"tiled": ("float32", "float16"), "wmma": ("float16",), "mma": ("float16",)}
#: kernels that move 16-byte chunks of fp16 rows: the wrapper pads d to a multiple of 8 for them
PADS_TO_8 = ("wmma", "mma")
MAX_HEAD_DIM = 128
#: what one thread block may use on a T4 (sm_75): 48 KB static, 64 KB with the dynamic opt-in
T4_STATIC_SMEM = 48 * 1024
T4_BLOCK_SMEM = 64 * 1024
#: the dynamic shared memory a block may opt in to, by compute capability (CUDA programming guide)
BLOCK_SMEM_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
#: the compute capabilities the compile test builds for: T4, A100, H100
COMPILE_ARCHS = (75, 80, 90)
_C_TYPES = {"float32": "float", "float16": "__half"}


def check_kernel(kernel) -> str:
    """``kernel`` names one of :data:`KERNELS` (a ValueError naming the argument otherwise, whatever its type)."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")
    return kernel


def padded_head_dim(d: int) -> int:
    """The compile-time head dimension: ``d`` rounded up to a multiple of 16 (extra columns are zeros)."""
    return 16 * math.ceil(d / 16)


def tiled_smem_bytes(head_dim: int, block_m: int, block_n: int) -> int:
    """Shared memory of the tiled kernel, in bytes: fp32 tiles Q_i (block_m rows), one buffer that holds
    K_j and then V_j (block_n rows), both with rows padded by one float, and P_ij (block_m x (block_n + 1))."""
    return 4 * ((block_m + block_n) * (head_dim + 1) + block_m * (block_n + 1))


def wmma_smem_bytes(head_dim: int, block_m: int, block_n: int) -> int:
    """Shared memory of the wmma kernel, in bytes: O_i in fp32 (rows of head_dim + 4 floats; Q_i passes
    through the same space first), S_ij in fp32 (block_n + 4 floats a row), P_ij in fp16 (block_n + 8
    halves a row) and one fp16 buffer for K_j, then V_j (head_dim + 8 halves a row)."""
    return (4 * block_m * (head_dim + 4) + 4 * block_m * (block_n + 4) + 2 * block_m * (block_n + 8)
            + 2 * block_n * (head_dim + 8))


def mma_smem_bytes(head_dim: int, block_m: int, block_n: int) -> int:
    """Shared memory of the tensor-core kernel, in bytes: fp16 rows padded by 8 halves (16 bytes); Q_i
    passes through first, then the same space holds K_j and V_j."""
    return 2 * max(block_m, 2 * block_n) * (head_dim + 8)


@dataclass(frozen=True)
class KernelConfig:
    """One compiled variant of a kernel: what the loader caches and the compile test builds."""
    kernel: str
    dtype: str
    head_dim: int      # compile-time head dimension (a multiple of 16)
    block_m: int       # query rows per thread block
    block_n: int       # key rows per step
    cc: int            # compute capability, e.g. 90

    @property
    def threads(self) -> int:
        # tiled: (BLOCK_M / 4) x 16 threads; wmma and mma: one warp per 16 query rows
        return (self.block_m // 4) * 16 if self.kernel == "tiled" else (self.block_m // 16) * 32

    @property
    def smem_bytes(self) -> int:
        if self.kernel == "tiled":
            return tiled_smem_bytes(self.head_dim, self.block_m, self.block_n)
        if self.kernel == "wmma":
            return wmma_smem_bytes(self.head_dim, self.block_m, self.block_n)
        return mma_smem_bytes(self.head_dim, self.block_m, self.block_n)

    @property
    def dynamic_smem_bytes(self) -> int:
        """The tiled and wmma kernels take their shared memory dynamically (they need more than 48 KB)."""
        return self.smem_bytes if self.kernel in ("tiled", "wmma") else 0

    @property
    def defines(self) -> tuple[str, ...]:
        d = (f"-DHEAD_DIM={self.head_dim}", f"-DBLOCK_M={self.block_m}", f"-DBLOCK_N={self.block_n}")
        if self.kernel == "tiled":
            return d + (f"-DELEM_T={_C_TYPES[self.dtype]}",)
        if self.kernel == "wmma":
            # mma.h pulls in cuda_bf16.h, whose implicit half conversions can clash with the fp16 header
            # NVRTC finds (an older one bundled with CuPy): the kernel converts explicitly, so turn them off.
            return d + ("-D__CUDA_NO_HALF_CONVERSIONS__",)
        # cp.async exists from sm_80; mma.sync m16n8k16 too (sm_75 has m16n8k8).
        return d + (f"-DUSE_CP_ASYNC={int(self.cc >= 80)}", f"-DMMA_K8={int(self.cc < 80)}")


def kernel_config(kernel: str, dtype: str, d: int, cc: int) -> KernelConfig:
    """The variant the package launches for head dimension ``d`` on a GPU of compute capability ``cc``."""
    D = padded_head_dim(d)
    if kernel == "tiled":
        # 64 query rows while the tiles fit a T4 block (64 KB), else 32: d <= 80 gets 64.
        block_m = 64 if tiled_smem_bytes(D, 64, 64) <= T4_BLOCK_SMEM else 32
        return KernelConfig("tiled", dtype, D, block_m, 64, cc)
    if kernel == "wmma":
        # Same rule: 64 query rows (4 warps) while O_i, S_ij, P_ij and K_j/V_j fit a T4 block, else 32.
        block_m = 64 if wmma_smem_bytes(D, 64, 64) <= T4_BLOCK_SMEM else 32
        return KernelConfig("wmma", dtype, D, block_m, 64, cc)
    if kernel == "mma":
        # 8 warps (128 rows) for d <= 64 on sm_80+; 4 warps (64 rows) for larger d, whose registers
        # then leave room for two blocks per SM (measured faster on an H100), and on Turing, which
        # would spill registers with 8.
        return KernelConfig("mma", dtype, D, 128 if cc >= 80 and D <= 64 else 64, 64, cc)
    raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def package_configurations(cc: int) -> list[KernelConfig]:
    """Every variant the package can launch on compute capability ``cc``: all padded head dims up to 128."""
    dims = range(16, MAX_HEAD_DIM + 1, 16)
    return [kernel_config(kernel, dtype, D, cc) for kernel in KERNELS for dtype in DTYPES[kernel] for D in dims]


def source(kernel: str) -> str:
    """The CUDA C source of ``kernel`` (shipped as package data in flashref/cuda/)."""
    return resources.files("flashref").joinpath("cuda", SOURCES[kernel]).read_text()


def source_path(kernel: str) -> str:
    return str(resources.files("flashref").joinpath("cuda", SOURCES[kernel]))


def nvcc_command(config: KernelConfig, output: str, nvcc: str = "nvcc") -> list[str]:
    """Compile one variant to a cubin with ptxas' resource report (what tests/test_cupy_compile.py runs)."""
    return [nvcc, f"-arch=sm_{config.cc}", "-cubin", "--resource-usage", *config.defines,
            "-o", output, source_path(config.kernel)]
