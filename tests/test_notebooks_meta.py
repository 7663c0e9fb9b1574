"""The notebooks keep the course's promises: in the table of contents, the Colab setup cell generated
from the one repository URL, exercises with hidden solutions, and outputs stamped from a run of the
current code (on a GPU when the notebook uses one)."""

from __future__ import annotations

import glob
import os
import re
import shutil

import nbformat
import pytest

from flashref.run_notebooks import (STATUS_PAGE, _code, code_sha256, colab_setup_source, execute, stale_inputs,
                                    status_page)
from flashref.publish import configured

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
GPU_WORDS = ("flashref.triton", "flashref.cupy", "import triton", "import cupy")


def _load(path):
    return nbformat.read(path, as_version=4)


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 5


def test_package_names_the_repository_of_config_yml():
    import flashref

    assert (flashref.REPOSITORY_URL, flashref.REPOSITORY_BRANCH) == configured()


def test_toc_lists_every_notebook_in_order():
    toc = open(os.path.join(ROOT, "_toc.yml")).read()
    listed = re.findall(r"file:\s*notebooks/(\S+)", toc)
    names = [os.path.splitext(os.path.basename(p))[0] for p in NOTEBOOKS]
    assert listed == names, "the table of contents must list every notebook, in numbered order"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_opens_with_title_and_goals_then_colab_setup(path):
    nb = _load(path)
    first, second = nb.cells[0], nb.cells[1]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert "learn" in first.source.lower(), "the first cell says what the reader will learn"
    url, branch = configured()
    assert second.cell_type == "code"
    assert second.source == colab_setup_source(url, branch)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_ends_with_checked_exercises_and_hidden_solutions(path):
    nb = _load(path)
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    exercises = re.findall(r"\{exercise-start\}[^\n]*\n:label:\s*(\S+)", markdown)
    solutions = re.findall(r"\{solution-start\}\s*(\S+)\s*\n:class:\s*dropdown", markdown)
    assert len(exercises) >= 2, "at least two exercises"
    assert sorted(exercises) == sorted(solutions), "every exercise has a solution hidden in a dropdown"
    assert "flashref.exercises" in _code(nb), "exercises are checked by flashref.exercises"


def _uses_gpu(nb) -> bool:
    return any("gpu" in c.metadata.get("tags", []) for c in nb.cells) or any(w in _code(nb) for w in GPU_WORDS)


def _rerun_advice(path, nb) -> str:
    where = "on a GPU (README.md, GPU notes)" if _uses_gpu(nb) else "(a CPU will do)"
    return f"execute it again {where}: python -m flashref.run_notebooks notebooks/{os.path.basename(path)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_outputs_are_stamped_from_current_code(path):
    nb = _load(path)
    stamp = nb.metadata.get("flashref")
    assert stamp, "run `python -m flashref.run_notebooks` to execute and stamp it"
    assert stamp["code_sha256"] == code_sha256(nb), f"the code changed since the outputs were made; {_rerun_advice(path, nb)}"
    if _uses_gpu(nb):
        assert stamp["device"] != "cpu", "a GPU notebook's committed outputs must come from a GPU run"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_stamp_says_with_which_versions_when_and_how_long(path):
    stamp = _load(path).metadata.get("flashref", {})
    missing = {"versions", "seconds", "executed"} - set(stamp)
    assert not missing, f"the stamp lacks {sorted(missing)}; {_rerun_advice(path, _load(path))}"
    assert {"python", "numpy"} <= set(stamp["versions"]), stamp["versions"]
    if _uses_gpu(_load(path)):
        assert {"torch", "triton"} <= set(stamp["versions"]), stamp["versions"]


def test_status_page_is_written_from_the_stamps():
    """book/status.md is what run_notebooks writes from the committed notebooks' stamps, and the book lists it."""
    with open(os.path.join(ROOT, STATUS_PAGE)) as f:
        committed = f.read()
    assert committed == status_page(NOTEBOOKS, ROOT), "write it again: python -m flashref.run_notebooks --status"
    for path in NOTEBOOKS:
        assert f"{{doc}}`../notebooks/{os.path.splitext(os.path.basename(path))[0]}`" in committed
    assert "file: book/status" in open(os.path.join(ROOT, "_toc.yml")).read()


def test_status_page_says_where_each_benchmark_file_was_measured(tmp_path):
    """A row of the status page: the stamp's facts, the `gpu` cells counted, and the data files grouped by what
    they were measured on (a ring run on two GPUs says so; a CPU run and a compile-only file name theirs)."""
    import json

    data = tmp_path / "book" / "data"
    data.mkdir(parents=True)
    files = {"ring": {"device": "GPU A", "gpus": 2}, "one": {"device": "GPU A"}, "two": {"device": "GPU B"},
             "cpu": {"machine": {"cpu_cores": 2}}, "nvcc": {"nvcc": "13.0"}, "bare": {"results": []}}
    for name, content in files.items():
        (data / f"{name}.json").write_text(json.dumps(content))
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# T"), nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["gpu"]})]
    nb.metadata["flashref"] = {"device": "GPU B", "code_sha256": code_sha256(nb), "seconds": 7,
                               "executed": "2026-01-02", "versions": {"python": "3.12.0", "torch": "2.11.0"},
                               "inputs": {f"book/data/{name}.json": "0" for name in files} | {"flashref/x.py": "0"}}
    path = tmp_path / "07_probe.ipynb"
    nbformat.write(nb, path)
    row = status_page([str(path)], str(tmp_path)).splitlines()[-1]
    assert row == ("| {doc}`../notebooks/07_probe` | GPU B | 2026-01-02 | 7 s | 3.12.0 | 2.11.0 | – | – | – "
                   "| 1 | 2 x GPU A: `ring`; 2-core CPU: `cpu`; GPU A: `one`; GPU B: `two`; not recorded: `bare`; "
                   "nvcc 13.0 (compiled only): `nvcc` |")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_outputs_are_stamped_from_current_package_code(path):
    """The stamp records every file of the repository the notebook's kernel read (flashref modules, .cu
    sources, benchmark data) with its sha256: an edit to any of them makes the outputs stale."""
    nb = _load(path)
    inputs = nb.metadata.get("flashref", {}).get("inputs")
    assert inputs, f"the stamp does not say which package files the outputs came from; {_rerun_advice(path, nb)}"
    assert any(rel.startswith("flashref/") for rel in inputs), "a notebook that imports flashref reads its modules"
    changed = stale_inputs(nb, ROOT)
    assert not changed, (f"notebooks/{os.path.basename(path)} shows outputs of code that has changed since it "
                         f"was executed on {nb.metadata['flashref']['device']} ({', '.join(changed)}); "
                         f"{_rerun_advice(path, nb)}")


def _copy_inputs(notebooks, root):
    for path in notebooks:
        for rel in _load(path).metadata["flashref"]["inputs"]:
            dest = os.path.join(root, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(os.path.join(ROOT, rel), dest)


@pytest.mark.parametrize("kernel_file", ["flashref/triton/forward.py", "flashref/cuda/flash_mma.cu"])
def test_a_one_line_kernel_edit_makes_the_gpu_notebooks_stale(tmp_path, kernel_file):
    """What the stamp test above sees after a kernel edit: the notebooks that ran that file, and only them."""
    _copy_inputs(NOTEBOOKS, tmp_path)
    with open(tmp_path / kernel_file, "a") as f:
        f.write("\n// an edit\n" if kernel_file.endswith(".cu") else "\n# an edit\n")
    stale = [os.path.basename(p) for p in NOTEBOOKS if stale_inputs(_load(p), str(tmp_path))]
    ran_it = [os.path.basename(p) for p in NOTEBOOKS if kernel_file in _load(p).metadata["flashref"]["inputs"]]
    assert ran_it, f"some notebook runs {kernel_file}"
    assert stale == ran_it
    assert all(_uses_gpu(_load(os.path.join(ROOT, "notebooks", name))) for name in stale)


def test_execute_records_what_the_kernel_read(tmp_path):
    """run_notebooks' recorder, on a small notebook: imported flashref modules and opened data files are
    inputs; files written, and files outside the repository, are not."""
    outside = tmp_path / "outside.txt"
    outside.write_text("not part of the repository")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import json, flashref.online_softmax\n"
        f"json.load(open({os.path.join(ROOT, 'book', 'data', 'numpy_bench.json')!r}))\n"
        f"open({str(outside)!r}).read()\n"
        f"open({str(tmp_path / 'written.txt')!r}, 'w').write('x')\n"
        "print('ran')")]
    path = tmp_path / "probe.ipynb"
    nbformat.write(nb, path)
    execute(str(path), timeout=120)
    stamp = nbformat.read(path, as_version=4).metadata["flashref"]
    assert "flashref/online_softmax.py" in stamp["inputs"] and "flashref/__init__.py" in stamp["inputs"]
    assert "book/data/numpy_bench.json" in stamp["inputs"]
    assert not any("outside" in rel or "written" in rel or rel.endswith(".pyc") for rel in stamp["inputs"])
    assert stamp["code_sha256"] == code_sha256(nb)
    # the kernel's own versions (this test's kernel runs this Python), the run's length and date
    import platform
    from importlib import metadata

    assert stamp["versions"]["python"] == platform.python_version()
    assert stamp["versions"]["numpy"] == metadata.version("numpy")
    assert stamp["versions"]["torch"] == metadata.version("torch")
    assert isinstance(stamp["seconds"], int) and 0 <= stamp["seconds"] < 120
    assert re.fullmatch(r"20\d\d-\d\d-\d\d", stamp["executed"])
    assert not any(rel.startswith("flashref.egg-info") for rel in stamp["inputs"]), "metadata reads are not inputs"
