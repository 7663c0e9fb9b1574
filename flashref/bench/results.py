"""The benchmarks' plumbing, one home for each piece: the committed results under ``book/data/`` read back
(:func:`load`: a checkout reads its own copy; on Colab, where only the package is installed, the copy in the
course repository is fetched), a run's results started, recorded row by row and saved (:func:`start`,
:func:`recorder`, :func:`save`) with the device, the library versions (:func:`versions`) and the exact
command, and the FLOP count every benchmark divides its time by (:func:`flops`, :func:`pair_flops`).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

from flashref import REPOSITORY_BRANCH, REPOSITORY_URL, reference

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAW_URL = (REPOSITORY_URL.replace("https://github.com/", "https://raw.githubusercontent.com/")
           + f"/{REPOSITORY_BRANCH}/")


def load(name: str, path: str | None = None) -> dict:
    """The results file ``book/data/<name>`` (or ``path`` when given) as a dict."""
    import urllib.request

    candidate = path or os.path.join(REPO_ROOT, "book", "data", name)
    if os.path.exists(candidate):
        with open(candidate) as f:
            return json.load(f)
    if path:
        raise FileNotFoundError(path)
    with urllib.request.urlopen(RAW_URL + "book/data/" + name, timeout=30) as response:
        return json.loads(response.read())


def save(data: dict, path: str, indent: int | None = 1) -> None:
    """Write ``data`` as JSON to ``path`` (its folder made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)
        f.write("\n")


def versions() -> dict:
    """Python, torch, triton, CUDA and CuPy (None where it does not import) versions, saved beside every
    measurement."""
    import platform

    import torch
    import triton

    v = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
         "cuda": torch.version.cuda}
    try:
        import cupy

        v["cupy"] = cupy.__version__
    except Exception:  # noqa: BLE001 (any import failure means: no CuPy here)
        v["cupy"] = None
    return v


def command(suite: str, argv=None) -> str:
    """The command line of a run, to save with its results: ``python -m flashref.bench <suite> <argv>``
    (``argv``: the suite's arguments, default ``sys.argv[1:]``)."""
    return " ".join(["python -m flashref.bench", suite, shlex.join(sys.argv[1:] if argv is None else argv)]).strip()


def start(append_to: str | None, device: str, versions: dict, command: str, **fields) -> dict:
    """The results of a run, to fill: ``{device, versions, **fields, command, seconds: None, results: []}``,
    or (``append_to``, the path of an existing file) that file's, with ``command`` added to its commands and
    ``fields`` set. Rows measured on another GPU or with other versions are not mixed in: that is an error
    (a library the file does not name, such as CuPy in a file written before it was recorded, is no
    difference)."""
    if append_to is None or not os.path.exists(append_to):
        return {"device": device, "versions": versions, **fields, "command": command, "seconds": None, "results": []}
    data = load(os.path.basename(append_to), append_to)
    saved = data.get("versions") or {}
    differ = sorted(k for k in saved.keys() & versions.keys() if saved[k] != versions[k])
    if data.get("device") != device or differ:
        raise ValueError(f"--append: {append_to} was measured on {data.get('device')} with {saved}, "
                         f"this run is on {device} with {versions}; write a new file instead")
    data["command"] = f"{data['command']}; {command}"
    data.update(fields)
    return data


def recorder(data: dict, path: str, show=None, indent: int | None = 1, group=None):
    """``add(row)``: appends ``row`` to ``data["results"]``, shows it (``show(row)``, when given) and saves
    ``data`` to ``path`` at once, so a run cut short keeps what it measured; ``data["seconds"]`` counts on
    from the seconds the results held when the recorder was made. ``group(row)``: what a row measures (a
    part, a length); the rows ``data`` held before (a run appended to) that are of a group this run measures
    again are dropped when its first row of that group is added, so no measurement is in the file twice and a
    run cut short loses at most the old rows of the group it was in."""
    started, seconds0 = time.time(), data["seconds"] or 0.0
    earlier = {id(row) for row in data["results"]}
    begun = set()

    def add(row: dict) -> None:
        if group is not None and group(row) not in begun:
            begun.add(group(row))
            data["results"] = [r for r in data["results"] if id(r) not in earlier or group(r) != group(row)]
        data["results"].append(row)
        if show is not None:
            show(row)
        data["seconds"] = seconds0 + time.time() - started
        save(data, path, indent)

    return add


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says the GPU ran out of memory (a result to record, not a failure)."""
    return "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"


#: The work of each pass against the forward's: the backward recomputes S = Q K^T beside its four products
#: (dV, dP, dQ, dK), five in all against the forward's two (notebook ``05_backward_recomputation``).
BACKWARD = 2.5
PASSES = {"fwd": 1.0, "bwd": BACKWARD, "fwd+bwd": 1.0 + BACKWARD}


def flops(B: int, H: int, N_q: int, N_k: int, d: int, causal: bool, mode: str = "fwd") -> float:
    """FLOPs of attention in the benchmarks: the forward's ``4 B H N_q N_k d``, half when causal
    (:func:`flashref.reference.forward_flops`, notebook ``01_standard_attention``), times
    :data:`PASSES` of ``mode`` (``"fwd"`` 1, ``"bwd"`` 2.5, ``"fwd+bwd"`` 3.5)."""
    return PASSES[mode] * reference.forward_flops(N_q, N_k, d, heads=H, batch=B, causal=causal)


def pair_flops(B: int, H: int, pairs: int, d: int, mode: str = "fwd") -> float:
    """FLOPs of attention that computes only ``pairs`` (query, key) pairs a head (a block-sparse mask,
    :func:`flashref.block_masks.visible_pairs`): the same ``4 d`` a pair as :func:`flops`."""
    return PASSES[mode] * reference.forward_flops(pairs, 1, d, heads=H, batch=B)
