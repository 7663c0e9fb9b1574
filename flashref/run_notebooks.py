"""Execute the course notebooks in place and stamp each one.

    python -m flashref.run_notebooks                 # every notebook under notebooks/
    python -m flashref.run_notebooks notebooks/03_*.ipynb

    python -m flashref.run_notebooks --status         # only write book/status.md again from the stamps

The committed outputs come from this script on a GPU (the CPU-only NumPy notebooks may be run on a
CPU). Each notebook's metadata gets ``metadata["flashref"] = {"device": ..., "code_sha256": ...,
"inputs": {...}, "versions": {...}, "seconds": ..., "executed": ...}``: the device that produced the
outputs, the hash of the notebook's own code, the sha256 of every file of this repository that the
notebook's kernel read while it ran (the flashref modules it imported, the ``.cu`` sources it compiled,
the benchmark files it loaded), the versions of Python and the libraries in that kernel, how long the
run took and its date (UTC). A test fails when either hash no longer matches, so an edit to a kernel
file names the notebooks to execute again. After a run the script writes the book's status page
(``book/status.md``, :func:`status_page`) from every notebook's stamp; a test keeps the two equal.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the kernel may read that is not an input of the outputs: tools, caches, the notebooks themselves.
#: top-level folders whose files are never a notebook's inputs: tools, build outputs and caches (.tcache: a
#: Triton or CuPy kernel cache kept in the checkout on the GPU machine, so that it survives between calls)
_NOT_INPUTS = (".git", ".venv", ".whl", "_build", "notebooks", ".pytest_cache", ".tcache")

#: the distributions whose versions a stamp records (the first CuPy wheel found is CuPy's), read from the
#: kernel's own environment: the kernel may run another Python than this script
VERSIONED = ("torch", "triton", "numpy", ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy"))
STATUS_PAGE = os.path.join("book", "status.md")

# Installed in the notebook's kernel (as an IPython startup file) before its first cell runs: it writes the
# kernel's Python and library versions to a file, then installs an audit hook that appends to a log every
# file under the repository that is opened for reading. Imports open a module's .py (or its cached .pyc,
# mapped back to the .py); CuPy's sources and benchmark JSON are opened as files. The versions are read
# before the hook is installed, from the distributions' metadata (no library is imported).
_RECORDER = """
import os, sys
def _flashref_record_versions(path, names):
    import json, platform
    from importlib import metadata
    found = {"python": platform.python_version()}
    for name in names:
        for dist in ([name] if isinstance(name, str) else name):
            try:
                found[dist.split("-")[0]] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                pass
    with open(path, "w") as f:
        json.dump(found, f)
_flashref_record_versions(os.environ["FLASHREF_VERSIONS_FILE"], _FLASHREF_VERSIONED)
del _flashref_record_versions, _FLASHREF_VERSIONED
def _flashref_record_inputs(root, log):
    seen = set()
    def hook(event, args):
        if event != "open" or not isinstance(args[0], str) or any(c in (args[1] or "r") for c in "wax+"):
            return
        path = os.path.abspath(args[0])
        if path.endswith(".pyc") and os.sep + "__pycache__" + os.sep in path:
            folder, name = os.path.split(path)
            path = os.path.join(os.path.dirname(folder), name.split(".")[0] + ".py")
        if path.startswith(root + os.sep) and path not in seen and os.path.isfile(path):
            seen.add(path)
            with open(log, "a") as f:
                f.write(path + "\\n")
    sys.addaudithook(hook)
_flashref_record_inputs(os.environ["FLASHREF_ROOT"], os.environ["FLASHREF_INPUTS_LOG"])
del _flashref_record_inputs
"""


def code_sha256(nb) -> str:
    """sha256 of the code cells' sources, each as one string, joined by blank lines."""
    sources = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            src = cell["source"]
            sources.append("".join(src) if isinstance(src, list) else src)
    return hashlib.sha256("\n\n".join(sources).encode()).hexdigest()


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _is_input(rel: str) -> bool:
    return rel.split(os.sep)[0] not in _NOT_INPUTS and "__pycache__" not in rel


def input_hashes(paths, root: str = ROOT) -> dict:
    """``{path relative to root: sha256}`` of the files a notebook read, in sorted order."""
    rels = sorted({os.path.relpath(p, root) for p in paths} - {"."})
    return {rel: file_sha256(os.path.join(root, rel)) for rel in rels if _is_input(rel)}


def stale_inputs(nb, root: str = ROOT) -> list:
    """The files a notebook's stamp records that changed (or vanished) since its outputs were made."""
    stamp = nb["metadata"].get("flashref", {})
    changed = []
    for rel, digest in stamp.get("inputs", {}).items():
        path = os.path.join(root, rel)
        if not os.path.isfile(path) or file_sha256(path) != digest:
            changed.append(rel)
    return changed


def colab_setup_source(url: str, branch: str) -> str:
    """The first code cell of every notebook: on Colab only, install flashref; elsewhere do nothing."""
    return (
        "# Colab only: install flashref from the course repository. torch and triton stay as Colab ships them.\n"
        "import sys\n"
        "if \"google.colab\" in sys.modules:\n"
        f"    %pip install -q \"flashref @ git+{url}@{branch}\""
    )


def _recording_environment(tmp: str) -> tuple:
    """An IPython profile folder whose startup file runs the recorder; returns the paths of the inputs' log
    and of the versions file it writes."""
    startup = os.path.join(tmp, "profile_default", "startup")
    os.makedirs(startup)
    with open(os.path.join(startup, "00_flashref_inputs.py"), "w") as f:
        f.write(f"_FLASHREF_VERSIONED = {VERSIONED!r}\n" + _RECORDER)
    log = os.path.join(tmp, "inputs.log")
    open(log, "w").close()
    return log, os.path.join(tmp, "versions.json")


def execute(path: str, timeout: int) -> str:
    """Run one notebook top to bottom in its own folder, write it back stamped; return the device."""
    import nbformat

    from flashref.notebook import device_name

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as tmp:
        log, versions_file = _recording_environment(tmp)
        env = {"IPYTHONDIR": tmp, "FLASHREF_ROOT": ROOT, "FLASHREF_INPUTS_LOG": log,
               "FLASHREF_VERSIONS_FILE": versions_file}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the kernel inherits this process's environment
        start = time.time()
        try:
            device = _run(nb, path, timeout, device_name())
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        seconds = round(time.time() - start)
        with open(log) as f:
            inputs = input_hashes(line.strip() for line in f if line.strip())
        with open(versions_file) as f:
            versions = json.load(f)
    if "flashref" in _code(nb) and not any(rel.startswith("flashref" + os.sep) for rel in inputs):
        raise RuntimeError(f"{path} imports flashref, but its kernel read no file of {ROOT}/flashref: it "
                           f"imported an installed copy; set PYTHONPATH={ROOT} (or pip install -e .)")
    nb.metadata["flashref"] = {"device": device, "code_sha256": code_sha256(nb), "inputs": inputs,
                               "versions": versions, "seconds": seconds,
                               "executed": time.strftime("%Y-%m-%d", time.gmtime())}
    nbformat.write(nb, path)
    return device


def _code(nb) -> str:
    return "\n\n".join(c.source for c in nb.cells if c.cell_type == "code")


def _run(nb, path: str, timeout: int, device: str) -> str:
    """Execute ``nb`` in place; cells tagged `gpu` are skipped without CUDA."""
    from nbclient import NotebookClient

    # Without CUDA, cells tagged `gpu` are skipped (nbclient's `skip-execution` tag) so a notebook can be
    # drafted on a CPU; such a run is stamped "cpu" and a GPU run must replace it before it is committed.
    skipped = [c for c in nb.cells if device == "cpu" and "gpu" in c.metadata.get("tags", [])]
    for cell in skipped:
        cell.metadata["tags"] = cell.metadata["tags"] + ["skip-execution"]
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}})
    try:
        client.execute()
    finally:
        for cell in skipped:
            cell.metadata["tags"] = [t for t in cell.metadata["tags"] if t != "skip-execution"]
    return device


def _data_source(path: str) -> str:
    """What a benchmark data file was measured on: its GPU, or the CPU, or the compiler that produced it."""
    with open(path) as f:
        data = json.load(f)
    if data.get("device"):
        return f"{data['gpus']} x {data['device']}" if data.get("gpus", 1) > 1 else data["device"]
    if data.get("machine"):
        return f"{data['machine'].get('cpu_cores', '?')}-core CPU"
    if data.get("nvcc"):
        return f"nvcc {data['nvcc']} (compiled only)"
    return "not recorded"


def _data_cell(inputs, root: str) -> str:
    """The benchmark files a notebook read, grouped by what they were measured on."""
    by_source = {}
    for rel in inputs:
        if rel.startswith("book/data/") and rel.endswith(".json"):
            name = os.path.splitext(os.path.basename(rel))[0]
            by_source.setdefault(_data_source(os.path.join(root, rel)), []).append(f"`{name}`")
    return "; ".join(f"{source}: {', '.join(names)}" for source, names in sorted(by_source.items())) or "none"


def _status_row(path: str, root: str) -> str:
    import nbformat

    nb = nbformat.read(path, as_version=4)
    stamp = nb.metadata.get("flashref", {})
    versions = stamp.get("versions", {})
    name = os.path.splitext(os.path.basename(path))[0]
    gpu_cells = sum("gpu" in c.metadata.get("tags", []) for c in nb.cells)
    cells = [f"{{doc}}`../notebooks/{name}`", stamp.get("device", "not stamped"), stamp.get("executed", "?"),
             f"{stamp['seconds']} s" if "seconds" in stamp else "?",
             *(versions.get(lib, "–") for lib in ("python", "torch", "triton", "numpy", "cupy")),
             str(gpu_cells), _data_cell(stamp.get("inputs", {}), root)]
    return "| " + " | ".join(cells) + " |"


def status_page(notebooks, root: str = ROOT) -> str:
    """The book's status page (``book/status.md``): one row per notebook, read from its stamp: where, when and
    with which versions its committed outputs were produced, how many of its cells need a GPU, and which
    benchmark files it shows, with the device each was measured on (a chapter executed on one GPU may show
    a benchmark measured on another)."""
    rows = [_status_row(path, root) for path in sorted(notebooks)]
    return "\n".join([
        "# How the notebooks were run",
        "",
        "Every output in this book, numbers and plots, comes from one execution of its notebook by",
        "`python -m flashref.run_notebooks`, which stamps the notebook with the device, the date, the time the",
        "run took, the versions of Python and the libraries in the notebook's kernel, and the sha256 of every",
        "file of the repository the kernel read (the `flashref` modules, the CUDA sources, the benchmark data).",
        "This table is written from those stamps by the same script. The tests check that it matches them, and",
        "that no code cell and no file a notebook read has changed since its run: every row below is the",
        "current code's output. A GPU chapter was executed on a GPU; its cells tagged `gpu` are skipped, visibly,",
        "where there is none. The benchmark files a chapter shows carry their own device and versions, and",
        "were measured in their own runs (`python -m flashref.bench`, the README's GPU notes).",
        "",
        "| Chapter | Executed on | Date (UTC) | Run time | Python | torch | Triton | NumPy | CuPy "
        "| Cells only a GPU runs | Benchmark data shown, measured on |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])


def write_status_page(notebooks, root: str = ROOT) -> str:
    """Write :func:`status_page` to ``book/status.md`` under ``root``; return its path."""
    path = os.path.join(root, STATUS_PAGE)
    with open(path, "w") as f:
        f.write(status_page(notebooks, root))
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", help="notebooks to run (default: notebooks/*.ipynb)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a cell may run")
    parser.add_argument("--status", action="store_true", help=f"execute nothing; write {STATUS_PAGE} again")
    args = parser.parse_args(argv)
    paths = [] if args.status else args.notebooks or sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
    for path in paths:
        start = time.time()
        device = execute(path, args.timeout)
        print(f"{path}: executed on {device} in {time.time() - start:.0f} s", flush=True)
    print(f"wrote {write_status_page(glob.glob(os.path.join(ROOT, 'notebooks', '*.ipynb')))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
