"""Point the course at the repository it is published from, in one command:

    python -m flashref.publish https://github.com/OWNER/NAME [--branch main]

The address lives in ``_config.yml`` (``repository.url`` and ``repository.branch``, the source the book's
buttons use), and is repeated where the book cannot read that file: ``flashref.REPOSITORY_URL`` and
``REPOSITORY_BRANCH`` (code on Colab fetches committed data from them), the README's Colab and pip links,
and every notebook's Colab setup cell (``flashref.run_notebooks.colab_setup_source``). This rewrites all
of them; tests keep them equal. Notebooks must then be executed again: their first cell changed, and so
did ``flashref/__init__.py``, which every notebook reads.
"""

from __future__ import annotations

import argparse
import glob
import os
import re

from flashref.run_notebooks import ROOT, colab_setup_source

_GITHUB = re.compile(r"https://github\.com/([A-Za-z0-9_.-]+)/([A-Za-z0-9_.-]+)")


def check_url(url: str) -> str:
    """A GitHub repository's address (Colab opens notebooks only from GitHub), without a trailing / or .git."""
    if not isinstance(url, str) or not _GITHUB.fullmatch(url) or url.endswith(".git"):
        raise ValueError(f"url must look like https://github.com/OWNER/NAME (no trailing / or .git), got {url!r}")
    return url


def _colab(url: str, branch: str) -> str:
    return url.replace("https://github.com/", "https://colab.research.google.com/github/") + f"/blob/{branch}/"


def _rewrite(path: str, edit) -> bool:
    with open(path) as f:
        old = f.read()
    new = edit(old)
    if new != old:
        with open(path, "w") as f:
            f.write(new)
    return new != old


def configured(root: str = ROOT) -> tuple:
    """(url, branch) as ``_config.yml`` says today: the source every copy is made from."""
    with open(os.path.join(root, "_config.yml")) as f:
        text = f.read()
    return tuple(re.search(rf"^[ \t]*{key}:[ \t]*(\S+)[ \t]*$", text, re.M).group(1) for key in ("url", "branch"))


def publish(url: str, branch: str = "main", root: str = ROOT) -> list:
    """Rewrite every copy of the address; return the notebooks (paths) that must be executed again."""
    check_url(url)
    if not re.fullmatch(r"[A-Za-z0-9_./-]+", branch or ""):
        raise ValueError(f"branch must be a git branch name, got {branch!r}")

    old_url, old_branch = configured(root)

    def config(text):
        text = re.sub(r"^([ \t]*url:[ \t]*)\S+[ \t]*$", lambda m: m.group(1) + url, text, count=1, flags=re.M)
        return re.sub(r"^([ \t]*branch:[ \t]*)\S+[ \t]*$", lambda m: m.group(1) + branch, text, count=1, flags=re.M)

    def package(text):
        text = re.sub(r'^REPOSITORY_URL = ".*"$', f'REPOSITORY_URL = "{url}"', text, count=1, flags=re.M)
        return re.sub(r'^REPOSITORY_BRANCH = ".*"$', f'REPOSITORY_BRANCH = "{branch}"', text, count=1, flags=re.M)

    def readme(text):
        return text.replace(_colab(old_url, old_branch), _colab(url, branch)).replace(old_url, url)

    _rewrite(os.path.join(root, "_config.yml"), config)
    _rewrite(os.path.join(root, "flashref", "__init__.py"), package)
    _rewrite(os.path.join(root, "README.md"), readme)
    return [path for path in sorted(glob.glob(os.path.join(root, "notebooks", "*.ipynb")))
            if _rewrite(path, lambda text: _setup_cell(text, url, branch))]


def _setup_cell(text: str, url: str, branch: str) -> str:
    """The notebook with its Colab setup cell (the first code cell) made for ``url``; other cells untouched."""
    import nbformat

    nb = nbformat.reads(text, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    source = colab_setup_source(url, branch)
    if cell.source == source:
        return text
    cell.source = source
    return nbformat.writes(nb) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashref.publish", description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="https://github.com/OWNER/NAME")
    parser.add_argument("--branch", default="main")
    args = parser.parse_args(argv)
    stale = publish(args.url, args.branch)
    print(f"The course now points at {args.url} ({args.branch}).")
    print("Execute the notebooks again on a GPU (README, 'GPU notes'):", *map(os.path.relpath, stale), sep="\n  ")


if __name__ == "__main__":
    main()
