"""The notebooks keep the course's promises: in the table of contents, the Colab setup cell generated
from the one repository URL, exercises with hidden solutions, and outputs stamped from a run of the
current code (on a GPU when the notebook uses one)."""

from __future__ import annotations

import glob
import os
import re

import nbformat
import pytest

from flashref.run_notebooks import code_sha256, colab_setup_source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
GPU_WORDS = ("flashref.triton", "flashref.cupy", "import triton", "import cupy")


def _read_yaml_value(path: str, key: str) -> str:
    text = open(path).read()
    match = re.search(rf"^\s*{key}:\s*(\S+)\s*$", text, re.M)
    assert match, f"{key} not found in {path}"
    return match.group(1)


def _load(path):
    return nbformat.read(path, as_version=4)


def _code(nb) -> str:
    return "\n\n".join(c.source for c in nb.cells if c.cell_type == "code")


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 5


def test_package_names_the_repository_of_config_yml():
    import flashref

    assert flashref.REPOSITORY_URL == _read_yaml_value(os.path.join(ROOT, "_config.yml"), "url")


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
    url = _read_yaml_value(os.path.join(ROOT, "_config.yml"), "url")
    branch = _read_yaml_value(os.path.join(ROOT, "_config.yml"), "branch")
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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_outputs_are_stamped_from_current_code(path):
    nb = _load(path)
    stamp = nb.metadata.get("flashref")
    assert stamp, "run `python -m flashref.run_notebooks` to execute and stamp it"
    assert stamp["code_sha256"] == code_sha256(nb), "the code changed since the outputs were made"
    uses_gpu = any("gpu" in c.metadata.get("tags", []) for c in nb.cells) or any(w in _code(nb) for w in GPU_WORDS)
    if uses_gpu:
        assert stamp["device"] != "cpu", "a GPU notebook's committed outputs must come from a GPU run"
