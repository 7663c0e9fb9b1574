"""Execute the course notebooks in place and stamp each one.

    python -m flashref.run_notebooks                 # every notebook under notebooks/
    python -m flashref.run_notebooks notebooks/03_*.ipynb

The committed outputs come from this script on a GPU (the CPU-only NumPy notebooks may be run on a
CPU). Each notebook's metadata gets ``metadata["flashref"] = {"device": ..., "code_sha256": ...}``:
the device that produced the outputs and the hash of the code it ran, so a test can tell when a
notebook's code changed after its outputs were made.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import sys
import time


def code_sha256(nb) -> str:
    """sha256 of the code cells' sources, each as one string, joined by blank lines."""
    sources = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            src = cell["source"]
            sources.append("".join(src) if isinstance(src, list) else src)
    return hashlib.sha256("\n\n".join(sources).encode()).hexdigest()


def colab_setup_source(url: str, branch: str) -> str:
    """The first code cell of every notebook: on Colab only, install flashref; elsewhere do nothing."""
    return (
        "# Colab only: install flashref from the course repository. torch and triton stay as Colab ships them.\n"
        "import sys\n"
        "if \"google.colab\" in sys.modules:\n"
        f"    %pip install -q \"flashref @ git+{url}@{branch}\""
    )


def execute(path: str, timeout: int) -> str:
    """Run one notebook top to bottom in its own folder, write it back stamped; return the device."""
    import nbformat
    from nbclient import NotebookClient

    from flashref.notebook import device_name

    nb = nbformat.read(path, as_version=4)
    device = device_name()
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
    nb.metadata["flashref"] = {"device": device, "code_sha256": code_sha256(nb)}
    nbformat.write(nb, path)
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
