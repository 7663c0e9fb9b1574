"""Autotuning configurations that know the hardware (notebook ``07_triton_forward``, "SRAM per GPU").

Each kernel has a short list of candidate tile shapes. Before the autotuner times them, the list is pruned
to what the running GPU can hold: the shared memory a config needs is estimated from its tiles and
compared with the device's per-block limit (64 KB on a T4, 163 KB on an A100, 227 KB on an H100). Setting
``FLASHREF_T4_CONFIGS=1`` restricts any GPU to the configs a T4 would use (our stand-in for Colab).
``tests/test_triton_compile.py`` compiles every config each GPU would keep, for that GPU, on a CPU
machine, and checks the compiler's own shared-memory figure against the limit.

Under Triton's CPU interpreter there is no autotuner (it needs a GPU to time configs): one fixed small
config per kernel is launched, :data:`INTERPRETER`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Shared memory per block (opt-in maximum, bytes) and compute capability of the GPUs we target.
GPUS = {
    "T4": {"capability": 75, "shared_bytes": 64 * 1024},
    "A100": {"capability": 80, "shared_bytes": 163 * 1024},
    "H100": {"capability": 90, "shared_bytes": 227 * 1024},
}


@dataclass(frozen=True)
class TileConfig:
    """One candidate: the tile shape (block_m query rows by block_n key rows), warps and pipeline depth."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Forward and dQ kernels: BLOCK_M % BLOCK_N == 0. dK/dV kernel: BLOCK_N % BLOCK_M == 0 (BLOCK_N keys
# stay resident, BLOCK_M queries stream past), so the diagonal is always whole tiles.
#
# Three lists per kernel: "large" for A100- and H100-class GPUs up to d = 128, "wide" for them beyond
# (BLOCK_D = 256), "t4" for a T4 at any d. Wide heads need their own: a thread holds its share of the fp32
# accumulators, (BLOCK_N x 256) for each of dK and dV, and 4 warps with 128 resident keys would need 512
# registers a thread for those alone, where 255 is the most. ptxas -v (compile_check.ptxas_usage, sm_90)
# counts 11-14 KB of spills a thread for that dK/dV config, 3-4 KB for (32, 64) on 4 warps. At d = 256 the
# dK/dV kernel also splits the columns between two programs (column_split), so 8 warps hold 128 keys
# without a spill. Timed on an H100 at d = 256 (B 8, H 8, N 4K, not causal): dK/dV took 25.1 ms a pass in the
# best large config, 10.2 ms in (32, 32) on 4 warps unsplit, 9.0 ms in (32, 128) on 8 warps split. Swept
# again there (same shape, whole backward, do_bench): no unsplit dK/dV config beat the split (32, 128) one
# ((64, 64) on 8 warps came closest, 0.97x non-causal, 0.85x causal), and the dQ kernel's (128, 32) tile with
# three stages of K and V (224 KB of shared memory: an H100's, pruned on smaller GPUs) took 1.06-1.07x less
# time than the autotuner's earlier pick, where (64, 32) on 8 warps took 1.3x more (dropped from the list).
FORWARD = {
    "large": [TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 3), TileConfig(128, 64, 8, 3),
              TileConfig(128, 64, 8, 4), TileConfig(128, 128, 8, 2), TileConfig(64, 64, 4, 3),
              TileConfig(64, 32, 4, 2)],
    "wide": [TileConfig(128, 64, 8, 2), TileConfig(128, 32, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(64, 32, 4, 2)],
    "t4": [TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 2), TileConfig(32, 32, 4, 2), TileConfig(16, 16, 4, 1)],
}
BACKWARD_DKDV = {
    "large": [TileConfig(32, 128, 4, 3), TileConfig(64, 128, 8, 3), TileConfig(64, 128, 4, 3),
              TileConfig(32, 64, 4, 3), TileConfig(16, 32, 4, 1)],
    "wide": [TileConfig(32, 128, 8, 2), TileConfig(16, 128, 8, 3), TileConfig(32, 32, 4, 3), TileConfig(16, 32, 4, 1)],
    "t4": [TileConfig(32, 64, 4, 2), TileConfig(16, 64, 4, 2), TileConfig(16, 32, 4, 1), TileConfig(16, 16, 4, 1)],
}
BACKWARD_DQ = {
    "large": [TileConfig(128, 32, 4, 3), TileConfig(128, 64, 8, 3), TileConfig(128, 64, 4, 3),
              TileConfig(64, 32, 4, 3), TileConfig(32, 16, 4, 1)],
    "wide": [TileConfig(128, 32, 8, 2), TileConfig(128, 32, 8, 3), TileConfig(64, 32, 4, 3), TileConfig(32, 16, 4, 1)],
    "t4": [TileConfig(64, 32, 4, 2), TileConfig(64, 16, 4, 2), TileConfig(32, 16, 4, 1), TileConfig(16, 16, 4, 1)],
}
KERNELS = {"forward": FORWARD, "dkdv": BACKWARD_DKDV, "dq": BACKWARD_DQ}

# The interpreter's fixed config: small tiles, so tests on short sequences still cross several tiles.
INTERPRETER = {"forward": TileConfig(32, 16, 4, 1), "dkdv": TileConfig(16, 32, 4, 1), "dq": TileConfig(32, 16, 4, 1)}


def list_granule(interpreted: bool = False) -> int:
    """The side of the coarse blocks whose visible-block lists the kernels walk when a block mask's own blocks do
    not hold their tiles whole (``flashref.triton.ops.coarse_block_mask``): the longest tile side of any config
    they may launch (under the interpreter, of its fixed configs), so every tile lies inside one coarse block."""
    cfgs = INTERPRETER.values() if interpreted else [c for table in KERNELS.values() for pool in table.values()
                                                     for c in pool]
    return max(max(c.block_m, c.block_n) for c in cfgs)


def list_size(block_size: int, interpreted: bool = False) -> int:
    """The side of the blocks whose visible-block lists the kernels walk for a block mask of ``block_size``: its
    own blocks when they hold every tile whole (``block_size`` a multiple of :func:`list_granule`), else the
    granule's coarser blocks, so the tiles of hidden blocks are skipped whatever the block size."""
    granule = list_granule(interpreted)
    return block_size if block_size % granule == 0 else granule


def autotune_enabled() -> bool:
    """False when ``FLASHREF_TRITON_AUTOTUNE=0``: launch the first config that fits instead of timing them
    all (the GPU tests use it to keep compile time short; a separate test runs every config)."""
    return os.environ.get("FLASHREF_TRITON_AUTOTUNE", "1") != "0"


def t4_mode() -> bool:
    """True when ``FLASHREF_T4_CONFIGS=1``: use only the configs a T4 would use, on any GPU."""
    return os.environ.get("FLASHREF_T4_CONFIGS", "") == "1"


def column_split(block_d: int, deterministic: bool = True, interpreted: bool = False) -> int:
    """How many dK/dV programs share one K/V tile, each keeping a slice of the columns (the kernel's
    D_SPLIT): 2 for wide heads (BLOCK_D 256), whose whole fp32 dK and dV tiles would not fit a thread's
    registers, and 1 otherwise. Atomic dQ (not ``deterministic``) needs every column of K in one program, so
    it never splits. Under the interpreter 2 from BLOCK_D 64 on, so CI runs both paths."""
    if not deterministic:
        return 1
    return 2 if block_d >= (64 if interpreted else 256) else 1


def shared_bytes_estimate(kernel: str, cfg: TileConfig, block_d: int, elem_bytes: int, capability: int = 90) -> int:
    """Shared memory a config is expected to need, in bytes (checked against the compiler's own figure by
    ``tests/test_triton_compile.py``).

    forward keeps a resident Q tile (block_m x d) and streams K and V (block_n x d each); dq keeps Q and dO
    and streams K and V; dkdv keeps K and V (block_n x d) and streams Q and dO (block_m x d). From sm_80 on,
    Triton pipelines the streamed tiles through shared memory with asynchronous copies: num_stages - 1 copies
    in flight on an A100, num_stages on an H100. Before sm_80 (a T4) there are
    no asynchronous copies: shared memory holds the dot operands while they change register layout, about
    two tiles per row of the resident side and one per streamed row in the forward, twice that backward.
    """
    if kernel == "dkdv":
        resident, streamed = cfg.block_n, cfg.block_m
        if column_split(block_d) > 1:  # each program also streams its half of Q and dO
            streamed = streamed * 3 // 2
    else:
        resident, streamed = cfg.block_m, cfg.block_n
    if capability < 80:
        rows = 2 * resident + 2 * streamed if kernel == "forward" else 4 * resident + 2 * streamed
        return rows * block_d * elem_bytes
    n_resident = 1 if kernel == "forward" else 2  # Q; K and V; Q and dO
    # Unpipelined (one stage), dkdv stages one more streamed tile for a layout change.
    relayout = streamed if kernel == "dkdv" and cfg.num_stages == 1 else 0
    if capability >= 90:
        # Hopper: the tensor cores read both operands from shared memory, and Triton keeps num_stages copies
        # of the streamed pair there (no staged score tile); dkdv also stages three fp32 numbers per query row.
        row_stats = 3 * cfg.num_stages * cfg.block_m * 4 if kernel == "dkdv" else 0
        return (n_resident * resident + (cfg.num_stages * 2) * streamed + relayout) * block_d * elem_bytes + row_stats
    # sm_80: num_stages - 1 copies of the streamed pair are in flight; the score tile may be staged once more.
    in_flight = max(cfg.num_stages - 1, 1)
    tiles = (n_resident * resident + in_flight * 2 * streamed + relayout) * block_d + cfg.block_m * cfg.block_n
    return tiles * elem_bytes


def check_tile(kernel: str, cfg: TileConfig) -> None:
    """Raise ValueError if ``cfg`` breaks the tile rule of ``kernel``: forward and dq need BLOCK_M a multiple
    of BLOCK_N, dkdv BLOCK_N a multiple of BLOCK_M (so causal diagonals are whole tiles). A config that
    breaks it would compute garbage on the diagonal, so pinned configs are checked before launch."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}")
    big, small, names = ((cfg.block_n, cfg.block_m, ("block_n", "block_m")) if kernel == "dkdv"
                         else (cfg.block_m, cfg.block_n, ("block_m", "block_n")))
    if big % small:
        raise ValueError(f"{kernel} config {cfg}: {names[0]} must be a multiple of {names[1]}, got {big} and {small}")


def pool_name(block_d: int, t4: bool = False) -> str:
    """Which list of a kernel's configs applies: "t4" (a T4, or FLASHREF_T4_CONFIGS=1), else "wide" for
    head dims above 128, else "large"."""
    return "t4" if t4 else "wide" if block_d > 128 else "large"


def candidates(kernel: str, block_d: int, elem_bytes: int, shared_limit: int, t4: bool = False,
               capability: int = 90) -> list[TileConfig]:
    """The configs of ``kernel`` ("forward", "dkdv", "dq") that fit ``shared_limit`` bytes per block.
    Never empty: the smallest config is kept even if the estimate says it will not fit (the compiler has
    the last word and the autotuner skips configs that run out of resources)."""
    pool = KERNELS[kernel][pool_name(block_d, t4)]
    fits = [c for c in pool if shared_bytes_estimate(kernel, c, block_d, elem_bytes, capability) <= shared_limit]
    return fits or [pool[-1]]


def device_shared_limit(device=None) -> int:
    """Opt-in shared memory per block of the running CUDA device, in bytes (asks torch, then Triton)."""
    import torch

    index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    limit = getattr(props, "shared_memory_per_block_optin", None)
    if not limit:
        import triton

        limit = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return int(limit)


def device_capability(device=None) -> int:
    """Compute capability of the running CUDA device as one number (75, 80, 90)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _to_triton(cfg: TileConfig, names: tuple[str, str]):
    import triton

    return triton.Config({names[0]: cfg.block_m, names[1]: cfg.block_n}, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages)


def autotune_configs(kernel: str):
    """Every candidate of ``kernel``, all lists, as ``triton.Config``: the autotuner is built once, at
    import, and :func:`make_pruner` picks the list (head dim, ``FLASHREF_T4_CONFIGS``) when it tunes, as the
    first-fit path does on every call, so the variable is read at one time for both."""
    pool = []
    for name in ("large", "wide", "t4"):
        pool += [c for c in KERNELS[kernel][name] if c not in pool]
    return [_to_triton(c, ("BLOCK_M", "BLOCK_N")) for c in pool]


def device_candidates(kernel: str, block_d: int, elem_bytes: int, device=None) -> list[TileConfig]:
    """:func:`candidates` for the running GPU (and the T4 list and limit under ``FLASHREF_T4_CONFIGS=1``)."""
    limit = device_shared_limit(device)
    if t4_mode():
        limit = min(limit, GPUS["T4"]["shared_bytes"])
    return candidates(kernel, block_d, elem_bytes, limit, t4=t4_mode(), capability=device_capability(device))


def make_pruner(kernel: str):
    """An ``early_config_prune`` hook: keep the configs of the list in use (the T4 list under
    ``FLASHREF_T4_CONFIGS=1``) whose estimate fits the running GPU."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        block_d = int(args["BLOCK_D"])
        elem = args["Q"].element_size()
        limit = device_shared_limit(args["Q"].device)
        capability = device_capability(args["Q"].device)
        if t4_mode():
            limit = min(limit, GPUS["T4"]["shared_bytes"])
        pool = KERNELS[kernel][pool_name(block_d, t4_mode())]
        listed = [c for c in configs
                  if TileConfig(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in pool]
        keep = []
        for c in listed:
            tc = TileConfig(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
            if shared_bytes_estimate(kernel, tc, block_d, elem, capability) <= limit:
                keep.append(c)
        return keep or [listed[-1]]

    return prune
