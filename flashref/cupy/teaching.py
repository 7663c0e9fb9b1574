"""Helpers for reading the CUDA kernels piece by piece and for reasoning about shared memory.

Taught in notebook ``06_cupy_kernel``, which shows each kernel in excerpts next to the prose that
explains them. An excerpt is chosen by name, by marker comments in the ``.cu`` file::

    // [excerpt: online-softmax]
    ...the lines shown...
    // [/excerpt: online-softmax]

so editing a kernel cannot silently shift what the notebook shows: a missing or unbalanced marker is a
``ValueError`` that says which. Excerpts may nest; marker lines are never shown.
"""

from __future__ import annotations

import re

from flashref.cupy.config import SOURCES, check_kernel, source

__all__ = ["excerpt", "excerpt_names", "show_cuda", "listing", "bank_conflict_ways"]

_OPEN = re.compile(r"^\s*//\s*\[excerpt:\s*([A-Za-z0-9_-]+)\s*\]\s*$")
_CLOSE = re.compile(r"^\s*//\s*\[/excerpt:\s*([A-Za-z0-9_-]+)\s*\]\s*$")
_ANY_MARKER = re.compile(r"^\s*//\s*\[/?excerpt\b")


def excerpt_spans(kernel: str) -> dict[str, tuple[int, int]]:
    """name -> (line of the opening marker, line of the closing marker), 0-based, for ``kernel``'s source.

    Raises ``ValueError`` when a marker is malformed, a name is opened twice, a closing marker has no
    opening one, or an opened excerpt is never closed."""
    check_kernel(kernel)
    where = f"flashref/cuda/{SOURCES[kernel]}"
    spans: dict[str, tuple[int, int]] = {}
    open_at: dict[str, int] = {}
    for n, line in enumerate(source(kernel).splitlines()):
        opened, closed = _OPEN.match(line), _CLOSE.match(line)
        if opened:
            name = opened.group(1)
            if name in open_at or name in spans:
                raise ValueError(f"{where}, line {n + 1}: excerpt {name!r} is opened a second time")
            open_at[name] = n
        elif closed:
            name = closed.group(1)
            if name not in open_at:
                raise ValueError(f"{where}, line {n + 1}: excerpt {name!r} is closed but was not opened")
            spans[name] = (open_at.pop(name), n)
        elif _ANY_MARKER.match(line):
            raise ValueError(f"{where}, line {n + 1}: malformed excerpt marker {line.strip()!r} "
                             "(write `// [excerpt: name]` and `// [/excerpt: name]`)")
    if open_at:
        name, n = next(iter(open_at.items()))
        raise ValueError(f"{where}, line {n + 1}: excerpt {name!r} is opened but never closed")
    return spans


def excerpt_names(kernel: str) -> list[str]:
    """The names of ``kernel``'s excerpts, in the order they open in the source."""
    spans = excerpt_spans(kernel)
    return sorted(spans, key=lambda name: spans[name][0])


def excerpt(kernel: str, name: str) -> str:
    """The lines of ``kernel``'s source between the markers of excerpt ``name`` (markers not shown,
    indentation kept). An unknown name is a ``ValueError`` that lists the names there are."""
    spans = excerpt_spans(kernel)
    if name not in spans:
        names = ", ".join(sorted(spans, key=lambda n: spans[n][0]))
        raise ValueError(f"flashref/cuda/{SOURCES[kernel]} has no excerpt {name!r}; it has: {names}")
    start, end = spans[name]
    lines = source(kernel).splitlines()[start + 1:end]
    return "\n".join(line for line in lines if not _ANY_MARKER.match(line))


def listing(kernel: str) -> str:
    """The whole source of ``kernel`` without the excerpt markers."""
    check_kernel(kernel)
    return "\n".join(line for line in source(kernel).rstrip().splitlines() if not _ANY_MARKER.match(line))


def show_cuda(kernel: str, name: str | None = None) -> None:
    """Display excerpt ``name`` of ``kernel`` (or, without a name, the whole source) as a CUDA code block."""
    text = listing(kernel) if name is None else excerpt(kernel, name)
    try:
        from IPython.display import Markdown, display
    except ImportError:
        print(text)
        return
    display(Markdown(f"```cuda\n{text}\n```"))


def bank_conflict_ways(word_addresses) -> int:
    """How many shared-memory passes one warp-wide access takes: shared memory has 32 banks of 4 bytes,
    word address a lives in bank a mod 32, and distinct words in one bank are served one after another
    (threads reading the *same* word share one pass: a broadcast)."""
    banks: dict[int, set] = {}
    for a in word_addresses:
        banks.setdefault(int(a) % 32, set()).add(int(a))
    return max(len(words) for words in banks.values())
