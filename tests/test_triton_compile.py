"""Compile every config a T4, an A100 and an H100 would keep, for that GPU, on this CPU machine, and check
the compiler's shared-memory figure fits the GPU's per-block limit.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", capability, 32))`` needs kernels defined without
the interpreter, so the compiling runs in a subprocess with ``TRITON_INTERPRET`` unset and
``FLASHREF_TRITON_COMPILE_ONLY=1`` (see flashref/triton/compile_check.py). Head dim 128 in fp16 is the
largest tile of the benchmark grid; d = 256 checks that pruning keeps only what fits at the largest head dim.
"""

from __future__ import annotations

import importlib.util

import pytest

# Only look for triton here: importing it in this process before flashref.triton would keep the other
# test files' kernels from running in the interpreter.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from tests._triton_helpers import compiled_json  # noqa: E402  (imports neither triton nor flashref.triton)


SCRIPT = r"""
import json
from concurrent.futures import ProcessPoolExecutor
from flashref.triton import configs, compile_check

def one(job):
    gpu, kernel, d, cfg = job
    spec = configs.GPUS[gpu]
    k = compile_check.compile_config(kernel, configs.TileConfig(*cfg), spec["capability"], d, "float16")
    block_d = max(16, 1 << (d - 1).bit_length())
    est = configs.shared_bytes_estimate(kernel, configs.TileConfig(*cfg), block_d, 2, spec["capability"])
    return [gpu, kernel, d, list(cfg), int(k.metadata.shared), est, spec["shared_bytes"]]

jobs = []
for gpu, spec in configs.GPUS.items():
    for kernel in ("forward", "dkdv", "dq"):
        for d in (128, 256):
            block_d = max(16, 1 << (d - 1).bit_length())
            kept = configs.candidates(kernel, block_d, 2, spec["shared_bytes"], t4=gpu == "T4",
                                      capability=spec["capability"])
            for c in kept:
                jobs.append((gpu, kernel, d, (c.block_m, c.block_n, c.num_warps, c.num_stages)))
with ProcessPoolExecutor(2) as pool:
    rows = list(pool.map(one, jobs))
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def compiled_rows():
    return compiled_json(SCRIPT, fp_fusion=True)


def test_every_kept_config_fits_its_gpu(compiled_rows):
    gpus = {row[0] for row in compiled_rows}
    assert gpus == {"T4", "A100", "H100"}
    too_big = [row for row in compiled_rows if row[4] > row[6]]
    assert not too_big, f"configs that need more shared memory than the GPU has: {too_big}"


def test_every_kernel_compiled_for_every_gpu(compiled_rows):
    seen = {(row[0], row[1], row[2]) for row in compiled_rows}
    for gpu in ("T4", "A100", "H100"):
        for kernel in ("forward", "dkdv", "dq"):
            for d in (128, 256):
                assert (gpu, kernel, d) in seen
    assert all(row[4] > 0 for row in compiled_rows)  # a real shared-memory figure came back


def test_t4_configs_are_smaller_than_h100_configs(compiled_rows):
    """Why block sizes differ: the largest forward config a T4 keeps needs less shared memory than the
    largest an H100 keeps, and the T4's fits its 64 KB."""
    fwd = lambda gpu: max(row[4] for row in compiled_rows if row[0] == gpu and row[1] == "forward" and row[2] == 128)  # noqa: E731
    assert fwd("T4") <= 64 * 1024
    assert fwd("T4") <= fwd("H100")


def test_estimate_bounds_what_the_compiler_reports(compiled_rows):
    """The pruner trusts the estimate, so it must not undercount: within 4 KB (single-stage configs carry a
    few small buffers it leaves out) of the compiler's figure for a launch on contiguous tensors."""
    under = [row for row in compiled_rows if row[4] > row[5] + 4096]
    assert not under, f"configs the estimate undercounts by more than 4 KB: {under}"


def test_the_notebooks_compile_reports():
    """Notebook 07's two reports, computed in a child process whatever this process runs."""
    from flashref.triton.compile_check import report_in_child

    shared = report_in_child("shared").splitlines()
    assert [line.split(":")[0] for line in shared] == ["T4", "H100"]
    assert "of 64 KB" in shared[0] and "of 227 KB" in shared[1]
    wgmma = report_in_child("wgmma")
    assert "wgmma instructions" in wgmma and "waits until no product is in flight" in wgmma
    with pytest.raises(ValueError, match="name must be one of"):
        report_in_child("registers")


MODS_SCRIPT = r"""
import json
from concurrent.futures import ProcessPoolExecutor
from flashref.triton import configs, compile_check

def one(job):
    gpu, kernel, cfg = job
    spec = configs.GPUS[gpu]
    k = compile_check.compile_config(kernel, configs.TileConfig(*cfg), spec["capability"], 128, "float16",
                                     causal=True, window=True, softcap=True, alibi=True, varlen=True)
    return [gpu, kernel, list(cfg), int(k.metadata.shared), spec["shared_bytes"]]

jobs = []
for gpu, spec in configs.GPUS.items():
    for kernel in ("forward", "dkdv", "dq"):
        kept = configs.candidates(kernel, 128, 2, spec["shared_bytes"], t4=gpu == "T4", capability=spec["capability"])
        c = kept[0]
        jobs.append((gpu, kernel, (c.block_m, c.block_n, c.num_warps, c.num_stages)))
with ProcessPoolExecutor(2) as pool:
    print(json.dumps(list(pool.map(one, jobs))))
"""


def test_score_mods_and_packed_batches_compile_for_every_gpu():
    """The kernels with every modification switched on (causal, a window, a softcap, ALiBi, a packed batch)
    compile for a T4, an A100 and an H100 in a config each would keep (tanh from libdevice), and fit its
    shared memory."""
    rows = compiled_json(MODS_SCRIPT, fp_fusion=True)
    assert {(r[0], r[1]) for r in rows} == {(g, k) for g in ("T4", "A100", "H100") for k in ("forward", "dkdv", "dq")}
    for gpu, kernel, cfg, shared, limit in rows:
        assert 0 < shared <= limit, (gpu, kernel, cfg, shared, limit)


SPILLS = r"""
import json
from flashref.triton import configs, compile_check

rows = []
for cfg in [(32, 64, 4, 3), (64, 128, 8, 3)]:
    usage = {one_head: compile_check.ptxas_usage(compile_check.compile_config(
        "dkdv", configs.TileConfig(*cfg), 90, 128, "float16", causal=True, one_head=one_head))
        for one_head in (True, False)}
    rows.append([list(cfg), usage[True], usage[False]])
print(json.dumps(rows))
"""


def test_dkdv_kernel_without_the_head_loop_keeps_its_registers():
    """The dK/dV kernel with one query head a program (ONE_HEAD, multi-head attention) has no loop around its
    tile loops, and for the H100 spills at most half of what the same kernel with the loop over a group's heads
    spills (read from ptxas -v). How much less depends on the compiler: with Triton 3.7, 32-36 bytes a thread
    against 320-424; with Triton 3.6 (the GPU machine's), 296 against 840 in the (64, 128, 8, 3) config."""
    for cfg, one, loop in compiled_json(SPILLS):
        assert one["registers"] <= 255 and loop["registers"] <= 255
        assert one["spill_stores"] <= max(64, loop["spill_stores"] // 2), (cfg, one, loop)



WIDE = r"""
import json
from flashref.triton import configs, compile_check

limit = configs.GPUS["H100"]["shared_bytes"]
rows = []
for kernel in ("dkdv", "dq"):
    for pool in ("wide", "large"):
        for cfg in configs.KERNELS[kernel][pool]:
            fits = configs.shared_bytes_estimate(kernel, cfg, 256, 2, 90) <= limit
            if pool == "wide" or (kernel == "dkdv" and fits and cfg.block_n >= 64):
                # the wide configs as launched (dK/dV columns split in two); the large ones as they were
                split = None if pool == "wide" else 1
                usage = compile_check.ptxas_usage(compile_check.compile_config(kernel, cfg, 90, 256, "float16",
                                                                               d_split=split))
                rows.append([kernel, pool, list(cfg.__dict__.values()), usage["spill_stores"]])
print(json.dumps(rows))
"""


def test_wide_heads_have_configs_that_keep_their_accumulators_in_registers():
    """At d = 256 (BLOCK_D 256) the backward kernels take the "wide" configs, and the dK/dV kernel splits its
    columns between two programs, so the fp32 accumulators fit a thread's registers: for the H100 no wide
    config spills more than 512 bytes a thread, where the large dK/dV configs with 64 or 128 resident keys that
    fit, unsplit, spill several KB (ptxas -v; Triton 3.7: 0-164 bytes against 3.3 and 11 KB). The head dim picks
    the list."""
    from flashref.triton import configs

    assert configs.pool_name(256) == "wide" and configs.pool_name(128) == "large"
    assert configs.pool_name(256, t4=True) == configs.pool_name(64, t4=True) == "t4"
    rows = compiled_json(WIDE)
    wide = [r for r in rows if r[1] == "wide"]
    large = [r for r in rows if r[1] == "large"]
    assert len(wide) == len(configs.KERNELS["dkdv"]["wide"]) + len(configs.KERNELS["dq"]["wide"]) and large
    assert max(r[3] for r in wide) <= 512, wide
    assert min(r[3] for r in large) >= 2048, large


COARSE = r"""
import json
from concurrent.futures import ProcessPoolExecutor
from flashref.triton import configs, compile_check

def one(job):
    kernel, block_size = job
    cfg = configs.candidates(kernel, 128, 2, configs.GPUS["H100"]["shared_bytes"], capability=90)[0]
    k = compile_check.compile_config(kernel, cfg, 90, 128, "float16", causal=True, block_size=block_size)
    return [kernel, block_size, int(k.metadata.shared)]

jobs = [(kernel, size) for kernel in ("forward", "dkdv", "dq") for size in (128, 64)]
with ProcessPoolExecutor(2) as pool:
    print(json.dumps(list(pool.map(one, jobs))))
"""


def test_block_masks_of_any_block_size_need_the_shared_memory_of_exact_lists():
    """A block mask of 64-key blocks (which the H100's first config's tiles do not fit, so the kernels walk coarse
    lists and mask listed tiles element by element) compiles, for each kernel at d = 128, to the shared memory of
    128-key blocks (exact lists): one pipelined loop over listed tiles, not a second one beside the plain loop
    (which took 1.4-1.9x the shared memory, and put some d = 128 configs of each kernel past an H100's limit)."""
    shared = {(kernel, size): b for kernel, size, b in compiled_json(COARSE)}
    for kernel in ("forward", "dkdv", "dq"):
        # the coarse kernel keeps a few bytes more for its mask bits' reductions, no more K/V buffers
        assert shared[(kernel, 128)] <= shared[(kernel, 64)] <= shared[(kernel, 128)] + 1024, (kernel, shared)


TURING = r"""
import json
from flashref.triton import configs, compile_check

cfg = configs.FORWARD["t4"][0]
rows = {}
for capability in (75, 80):
    ptx = compile_check.compile_config("forward", cfg, capability, 64, "float16").asm["ptx"]
    rows[capability] = [ptx.count("mma.sync"), ptx.count("fma.rn.f32")]
print(json.dumps(rows))
"""


def test_below_sm80_triton_compiles_tl_dot_to_fma_not_tensor_cores():
    """Notebook 07's warning: Triton 3.3 and newer lower ``tl.dot`` to fused multiply-adds below compute
    capability 8.0 (triton-lang/triton pull request 5066). The fp16 forward in the T4's first config, compiled
    for sm_75, holds no ``mma.sync`` and thousands of fp32 FMAs; compiled for sm_80, its products are
    ``mma.sync``."""
    rows = compiled_json(TURING)
    (mma75, fma75), (mma80, fma80) = rows["75"], rows["80"]
    assert mma75 == 0 and fma75 > 1000, rows
    assert mma80 > 0 and fma80 < fma75 // 10, rows
