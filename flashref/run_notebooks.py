"""Execute the course notebooks in place and stamp each one.

    python -m flashref.run_notebooks                 # every notebook under notebooks/
    python -m flashref.run_notebooks notebooks/03_*.ipynb

The committed outputs come from this script on a GPU (the CPU-only NumPy notebooks may be run on a
CPU). Each notebook's metadata gets ``metadata["flashref"] = {"device": ..., "code_sha256": ...,
"inputs": {...}}``: the device that produced the outputs, the hash of the notebook's own code, and the
sha256 of every file of this repository that the notebook's kernel read while it ran (the flashref
modules it imported, the ``.cu`` sources it compiled, the benchmark files it loaded). A test fails when
either hash no longer matches, so an edit to a kernel file names the notebooks to execute again.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the kernel may read that is not an input of the outputs: tools, caches, the notebooks themselves.
#: top-level folders whose files are never a notebook's inputs: tools, build outputs and caches (.tcache: a
#: Triton or CuPy kernel cache kept in the checkout on the GPU machine, so that it survives between calls)
_NOT_INPUTS = (".git", ".venv", ".whl", "_build", "notebooks", ".pytest_cache", ".tcache")

# Installed in the notebook's kernel (as an IPython startup file) before its first cell runs: an audit hook
# that appends to a log every file under the repository that is opened for reading. Imports open a module's
# .py (or its cached .pyc, mapped back to the .py); CuPy's sources and benchmark JSON are opened as files.
_RECORDER = """
import os, sys
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


def _recording_environment(tmp: str) -> str:
    """An IPython profile folder whose startup file installs the input recorder; returns the log's path."""
    startup = os.path.join(tmp, "profile_default", "startup")
    os.makedirs(startup)
    with open(os.path.join(startup, "00_flashref_inputs.py"), "w") as f:
        f.write(_RECORDER)
    log = os.path.join(tmp, "inputs.log")
    open(log, "w").close()
    return log


def execute(path: str, timeout: int) -> str:
    """Run one notebook top to bottom in its own folder, write it back stamped; return the device."""
    import nbformat

    from flashref.notebook import device_name

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as tmp:
        log = _recording_environment(tmp)
        env = {"IPYTHONDIR": tmp, "FLASHREF_ROOT": ROOT, "FLASHREF_INPUTS_LOG": log}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the kernel inherits this process's environment
        try:
            device = _run(nb, path, timeout, device_name())
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        with open(log) as f:
            inputs = input_hashes(line.strip() for line in f if line.strip())
    if "flashref" in _code(nb) and not any(rel.startswith("flashref" + os.sep) for rel in inputs):
        raise RuntimeError(f"{path} imports flashref, but its kernel read no file of {ROOT}/flashref: it "
                           f"imported an installed copy; set PYTHONPATH={ROOT} (or pip install -e .)")
    nb.metadata["flashref"] = {"device": device, "code_sha256": code_sha256(nb), "inputs": inputs}
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", help="notebooks to run (default: notebooks/*.ipynb)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a cell may run")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(glob.glob("notebooks/*.ipynb"))
    for path in paths:
        start = time.time()
        device = execute(path, args.timeout)
        print(f"{path}: executed on {device} in {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
