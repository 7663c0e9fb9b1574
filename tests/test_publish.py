"""`python -m flashref.publish URL` changes every copy of the repository's address, and only those."""

from __future__ import annotations

import glob
import os
import shutil

import nbformat
import pytest

from flashref import REPOSITORY_URL
from flashref.publish import configured, publish
from flashref.run_notebooks import ROOT, colab_setup_source

FILES = ["_config.yml", "README.md", "flashref/__init__.py"] + \
    [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))]


@pytest.fixture
def copy(tmp_path):
    for rel in FILES:
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(ROOT, rel), tmp_path / rel)
    return tmp_path


def _text(root, rel):
    return open(os.path.join(root, rel)).read()


def test_publish_rewrites_every_copy_and_back(copy):
    url, branch = "https://github.com/someone/attention-course", "gh-pages"
    assert configured(str(copy)) == (REPOSITORY_URL, "main")
    stale = publish(url, branch, root=str(copy))
    assert len(stale) == len(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
    config = _text(copy, "_config.yml")
    assert f"url: {url}\n" in config and f"branch: {branch}\n" in config
    package = _text(copy, "flashref/__init__.py")
    assert f'REPOSITORY_URL = "{url}"' in package and f'REPOSITORY_BRANCH = "{branch}"' in package
    readme = _text(copy, "README.md")
    assert REPOSITORY_URL not in readme
    assert f"https://colab.research.google.com/github/someone/attention-course/blob/{branch}/notebooks/" in readme
    for rel in FILES:
        if rel.endswith(".ipynb"):
            nb = nbformat.read(os.path.join(copy, rel), as_version=4)
            first_code = next(c for c in nb.cells if c.cell_type == "code")
            assert first_code.source == colab_setup_source(url, branch)
            assert REPOSITORY_URL not in _text(copy, rel)
    # and back: every file byte for byte as committed (nothing else was touched)
    publish(REPOSITORY_URL, "main", root=str(copy))
    for rel in FILES:
        assert _text(copy, rel) == _text(ROOT, rel), rel


@pytest.mark.parametrize("url", ["github.com/a/b", "https://gitlab.com/a/b", "https://github.com/a/b/",
                                 "https://github.com/a/b.git", None])
def test_publish_refuses_a_bad_url(copy, url):
    with pytest.raises(ValueError, match="url must look like https://github.com/OWNER/NAME"):
        publish(url, root=str(copy))
    for rel in FILES:
        assert _text(copy, rel) == _text(ROOT, rel)
