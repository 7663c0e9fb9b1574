"""The CUDA sources compile with nvcc for sm_75 (T4), sm_80 (A100) and sm_90 (H100), in every variant
the package launches and on their own with their default constants, without register spills and within
what a T4 block can have (48 KB static, 64 KB in all). Skipped, visibly, where nvcc is absent."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

from flashref.cupy import config, resources

NVCC = resources.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA sources were not compile-checked")

SAMPLE_REPORT = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'flash_mma_forward' for 'sm_90'
ptxas info    : Function properties for flash_mma_forward
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 121 registers, used 1 barriers, 18432 bytes smem
"""


def test_parse_ptxas():
    assert resources.parse_ptxas(SAMPLE_REPORT) == {"registers": 121, "spill_stores": 4, "spill_loads": 12,
                                                     "stack_bytes": 8, "static_smem": 18432}
    assert resources.parse_ptxas(SAMPLE_REPORT.replace(", 18432 bytes smem", ""))["static_smem"] == 0
    with pytest.raises(ValueError, match="registers"):
        resources.parse_ptxas("nothing here")


@pytest.fixture(scope="module")
def table():
    if NVCC is None:
        pytest.skip("nvcc not found: the CUDA sources were not compile-checked")
    return resources.resource_table(nvcc=NVCC, jobs=2)


@needs_nvcc
def test_every_variant_compiled(table):
    built = {(r["kernel"], r["dtype"], r["head_dim"], r["cc"]) for r in table}
    expected = {(c.kernel, c.dtype, c.head_dim, c.cc) for cc in config.COMPILE_ARCHS
                for c in config.package_configurations(cc)}
    # 3 architectures x (tiled fp32, tiled fp16, wmma fp16, mma fp16) x 8 padded head dims
    assert built == expected and len(expected) == 3 * 4 * 8
    assert {r["kernel"] for r in table} == set(config.KERNELS)


@needs_nvcc
def test_no_spills(table):
    spilled = [r for r in table if r["spill_stores"] or r["spill_loads"] or r["stack_bytes"]]
    assert not spilled, spilled


@needs_nvcc
def test_shared_memory_fits_a_t4_block(table):
    for r in table:
        assert r["static_smem"] <= config.T4_STATIC_SMEM, r
        assert r["smem"] <= config.T4_BLOCK_SMEM, r


@needs_nvcc
def test_static_shared_memory_matches_the_formula(table):
    """The mma kernel's shared memory is static: ptxas' figure must equal what config computes. The tiled
    and wmma kernels have none: theirs is dynamic, what config computes, passed at launch."""
    for r in table:
        if r["kernel"] == "mma":
            assert r["static_smem"] == config.mma_smem_bytes(r["head_dim"], r["block_m"], r["block_n"]), r
        else:
            assert r["static_smem"] == 0 and r["dynamic_smem"] == r["smem"], r


@needs_nvcc
def test_registers_allow_one_block_per_sm(table):
    for r in table:
        assert r["registers"] * r["threads"] <= 65536, r


@needs_nvcc
def test_committed_table_is_current(table):
    """book/data/cupy_resources.json (the notebook's table) is what these sources and this nvcc give."""
    committed = resources.load_resource_table()
    if committed["nvcc"] != resources.nvcc_version(NVCC):
        pytest.skip(f"table made with nvcc {committed['nvcc']}, this is {resources.nvcc_version(NVCC)}")
    key = lambda r: (r["kernel"], r["dtype"], r["head_dim"], r["cc"])
    assert sorted(committed["rows"], key=key) == sorted(table, key=key), \
        "run `python -m flashref.cupy.resources` to refresh book/data/cupy_resources.json"


@needs_nvcc
@pytest.mark.parametrize("cc", config.COMPILE_ARCHS)
@pytest.mark.parametrize("kernel", config.KERNELS)
def test_standalone_defaults(kernel, cc):
    """Each .cu file compiles on its own with nvcc, with the defaults of its compile-time constants."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([NVCC, f"-arch=sm_{cc}", "-cubin", "--resource-usage", "-o",
                               os.path.join(tmp, "k.cubin"), config.source_path(kernel)],
                              capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    usage = resources.parse_ptxas(done.stdout + done.stderr)
    assert usage["spill_stores"] == usage["spill_loads"] == 0, usage
