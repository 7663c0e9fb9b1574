"""One loader for the committed benchmark results under ``book/data/``: a checkout reads its own copy; on
Colab, where only the package is installed, the copy in the course repository is fetched."""

from __future__ import annotations

import json
import os

from flashref import REPOSITORY_URL

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAW_URL = REPOSITORY_URL.replace("https://github.com/", "https://raw.githubusercontent.com/") + "/main/"


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


def versions() -> dict:
    """Python, torch, triton and CUDA versions, saved beside every measurement."""
    import platform

    import torch
    import triton

    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda}
