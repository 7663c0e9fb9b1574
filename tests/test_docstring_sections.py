"""Where the package names the section of a notebook that teaches it ("Taught in notebook ``06_cupy_kernel``
("How much shared memory a tile takes")"), the section exists: a renamed heading must not leave a docstring
pointing at nothing."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "flashref", "**", "*.py"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "flashref", "**", "*.cu"), recursive=True))
# "notebook ``NN_name``" or "notebook NN", then within a few words one or more quoted titles
REFERENCE = re.compile(r'[Nn]otebooks? (?:``)?(\d{1,2})[a-z_0-9]*(?:``)?[\s,(]{1,4}'
                       r'((?:"[^"]{3,120}"(?:,? (?:and|or) |, )?)+)')


def _headings(number: str) -> set:
    path, = glob.glob(os.path.join(ROOT, "notebooks", f"{number}_*.ipynb"))
    cells = json.load(open(path))["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return {re.sub(r"\s+", " ", m).strip() for m in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


def _references():
    for path in SOURCES:
        source = open(path).read()
        for match in REFERENCE.finditer(source):
            line = source.count("\n", 0, match.start()) + 1
            for title in re.findall(r'"([^"]{3,120})"', match.group(2)):
                title = re.sub(r"\s+(?:#|//)?\s*", " ", title).strip()  # a title wrapped over two lines
                yield os.path.relpath(path, ROOT), line, match.group(1).zfill(2), title


REFERENCES = list(_references())


def test_the_package_names_sections():
    assert len(REFERENCES) >= 8


@pytest.mark.parametrize("path, line, number, title", REFERENCES, ids=[f"{p}:{n}" for p, n, _, _ in REFERENCES])
def test_each_named_section_exists(path, line, number, title):
    headings = _headings(number)
    plain = {h.replace("`", "") for h in headings}
    short = title.replace("`", "")  # a heading's first clause will do: "SRAM per GPU" for "SRAM per GPU, and why ..."
    assert short in plain or any(h.startswith(short + sep) for h in plain for sep in (",", ":")), \
        f"{path}:{line} names section {title!r} of notebook {number}, which has: {sorted(headings)}"
