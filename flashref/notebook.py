"""Small helpers the notebooks share: show the package's source, name the device."""

from __future__ import annotations

import inspect


def show_source(obj) -> None:
    """Render the source of a flashref function or class in the notebook, so the notebook shows the
    package's code instead of a pasted copy that could drift from it."""
    source = inspect.getsource(obj)
    try:
        from IPython.display import Markdown, display
    except ImportError:  # plain Python: print it
        print(source)
        return
    display(Markdown(f"```python\n{source}```"))


def device_name() -> str:
    """The CUDA device torch sees, or ``"cpu"``."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def has_cuda() -> bool:
    """True when torch sees a CUDA device."""
    return device_name() != "cpu"
