"""Registers and shared memory of each kernel variant, from ptxas' report (``nvcc --resource-usage``).

Taught in notebook ``06_cupy_kernel`` ("How much shared memory a tile takes"). :func:`resource_table` compiles every
variant the package launches for sm_75 (T4), sm_80 (A100) and sm_90 (H100) and parses the report;
tests/test_cupy_compile.py fails on register spills or on shared memory a T4 block cannot have, and
checks that book/data/cupy_resources.json (the table the notebook shows) is what the sources give.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from flashref.cupy.config import COMPILE_ARCHS, KernelConfig, nvcc_command, package_configurations

TABLE_PATH = os.path.join("book", "data", "cupy_resources.json")
#: the repository's root when flashref is used from a checkout (book/ lies beside flashref/)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")
_SMEM = re.compile(r"(\d+) bytes smem")


def find_nvcc() -> str | None:
    """The nvcc on PATH (or under $CUDA_HOME/bin), or None."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = os.path.join(home, "bin", "nvcc")
    return candidate if os.access(candidate, os.X_OK) else None


def parse_ptxas(report: str) -> dict:
    """Registers, spills, stack and static shared memory (bytes) from ptxas' report of one kernel."""
    def grab(pattern, group=1):
        match = pattern.search(report)
        if match is None:
            raise ValueError(f"no {pattern.pattern!r} in the ptxas report:\n{report}")
        return int(match.group(group))
    smem = _SMEM.search(report)  # absent when the kernel has no static shared memory
    return {"registers": grab(_REGISTERS), "spill_stores": grab(_SPILLS, 1), "spill_loads": grab(_SPILLS, 2),
            "stack_bytes": grab(_STACK), "static_smem": int(smem.group(1)) if smem else 0}


def resource_usage(config: KernelConfig, nvcc: str = "nvcc") -> dict:
    """Compile one variant with nvcc and return its row of the table."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = nvcc_command(config, os.path.join(tmp, "k.cubin"), nvcc=nvcc)
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{done.stdout}{done.stderr}")
    row = asdict(config)
    row.update(threads=config.threads, dynamic_smem=config.dynamic_smem_bytes)
    row.update(parse_ptxas(done.stdout + done.stderr))
    row["smem"] = row["static_smem"] + row["dynamic_smem"]
    return row


def resource_table(ccs=COMPILE_ARCHS, nvcc: str | None = None, jobs: int = 4) -> list[dict]:
    """Rows for every variant the package launches on each compute capability in ``ccs``."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (put the CUDA toolkit's bin/ on PATH or set CUDA_HOME)")
    configs = [c for cc in ccs for c in package_configurations(cc)]
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda c: resource_usage(c, nvcc), configs))


def write_resource_table(path: str = TABLE_PATH, **kwargs) -> list[dict]:
    rows = resource_table(**kwargs)
    path = os.path.join(REPO_ROOT, path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"nvcc": nvcc_version(), "rows": rows}, f, indent=1)
        f.write("\n")
    return rows


def load_resource_table(path: str = TABLE_PATH) -> dict:
    """The committed table; a relative ``path`` is taken from the repository's root."""
    with open(os.path.join(REPO_ROOT, path)) as f:
        return json.load(f)


def resource_rows(ccs=(75, 90), head_dims=(64, 128)) -> tuple[str, list[dict]]:
    """Rows for the notebook: from the committed table when flashref runs from a checkout, else
    compiled now with nvcc (Colab has it). Returns (where they come from, rows)."""
    keep = lambda r: r["cc"] in ccs and r["head_dim"] in head_dims
    try:
        table = load_resource_table()
        return f"ptxas of nvcc {table['nvcc']} (book/data/cupy_resources.json)", [r for r in table["rows"] if keep(r)]
    except FileNotFoundError:
        nvcc = find_nvcc()
        if nvcc is None:
            return "neither the committed table nor nvcc was found", []
        configs = [c for cc in ccs for c in package_configurations(cc) if c.head_dim in head_dims]
        with ThreadPoolExecutor(4) as pool:
            rows = list(pool.map(lambda c: resource_usage(c, nvcc), configs))
        return f"ptxas of nvcc {nvcc_version(nvcc)}, compiled just now", rows


def nvcc_version(nvcc: str | None = None) -> str:
    nvcc = nvcc or find_nvcc()
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release ([\d.]+)", out)
    return match.group(1) if match else "unknown"


if __name__ == "__main__":   # python -m flashref.cupy.resources: rewrite the committed table
    for row in write_resource_table():
        print(row["kernel"], row["dtype"], row["head_dim"], f"sm_{row['cc']}", row["registers"], "regs",
              row["smem"], "B smem", row["spill_stores"], "spills")
