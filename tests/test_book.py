"""The book builds with Jupyter Book 1.x, nitpicky and with warnings as errors, as `make book` does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_book_builds_without_warnings(tmp_path):
    jupyter_book = shutil.which("jupyter-book", path=os.path.dirname(sys.executable)) or shutil.which("jupyter-book")
    assert jupyter_book, "jupyter-book is not installed (make test installs it)"
    result = subprocess.run(
        [jupyter_book, "build", ROOT, "--path-output", str(tmp_path), "-W", "-n", "--keep-going"],
        capture_output=True, text=True, timeout=1200,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    assert "WARNING" not in log, log[-6000:]
    html = tmp_path / "_build" / "html"
    for page in ("book/intro.html", "book/memory_hierarchy.html", "notebooks/01_standard_attention.html",
                 "notebooks/08_triton_backward.html", "notebooks/09_measured_io.html",
                 "notebooks/10_dropout_masks_sparsity.html", "notebooks/11_attention_in_a_model.html",
                 "notebooks/12_packing_and_score_mods.html", "notebooks/13_beyond_one_gpu_and_decoding.html",
                 "notebooks/14_flashattention3_on_hopper.html"):
        assert (html / page).exists(), f"{page} missing from the build"
    # The animated tile walk plays in the rendered page: matplotlib's JavaScript player and its frames.
    tiled = (html / "notebooks/03_tiled_forward.html").read_text()
    assert tiled.count('<div class="animation">') == 2 and tiled.count("data:image/png;base64") > 20
