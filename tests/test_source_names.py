"""A static check of the package's source that no test run would reach: ``del`` of a name the function never
binds raises UnboundLocalError only when that line runs (a benchmark's loop once lost its last rows so)."""

from __future__ import annotations

import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "flashref", "**", "*.py"), recursive=True))


def _bound(fn: ast.AST) -> set[str]:
    """The names a function binds itself: arguments, assignment and loop targets, imports, handlers, walrus."""
    names = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
            names.add(node.name)
    return names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_deleted_name_is_bound_in_its_function(path):
    tree = ast.parse(open(path).read(), path)
    wrong = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bound = _bound(fn)
            for node in ast.walk(fn):
                if isinstance(node, ast.Delete):
                    wrong += [f"{fn.name}:{t.lineno} del {t.id}" for t in node.targets
                              if isinstance(t, ast.Name) and t.id not in bound]
    assert not wrong, wrong
