"""Launching a compiled Triton kernel again without Triton's per-call bookkeeping (notebook
``11_attention_in_a_model`` measures why it matters).

``kernel[grid](*args, **kwargs)`` binds every argument to the kernel's signature, works out its
specialization (the dtype and 16-byte alignment of each pointer, whether each integer is 1 or a multiple
of 16), turns that into a cache key, finds the compiled kernel and launches it. For these kernels' 40 to
60 arguments that costs on the order of 100 us of CPU time per launch, as much as a small attention call
takes on the GPU, and a model step makes four launches per layer.

:class:`Relauncher` keeps, per specialization, the compiled kernel that Triton's own first launch
returned, and launches it directly afterwards. Its key is a superset of what Triton specializes on (the
values of constexpr arguments; per tensor its dtype and alignment; per integer whether it is 1, a multiple
of 16 and its width), so a kernel compiled for one case is never launched for another. The first launch
of every key, and every launch while a profiler hook is installed, goes through Triton's own path.
"""

from __future__ import annotations

import torch
import triton

try:  # Triton 3.3+: the compiled kernel's launcher takes every argument, constexprs included
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver

    _SUPPORTED = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 3)
except ImportError:  # an older Triton: always take Triton's own path
    _SUPPORTED = False


def _spec(value, constexpr: bool):
    """The part of a cache key one argument contributes."""
    if constexpr:
        return value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return bool, value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, -2**31 <= value < 2**31, value < 2**63
    return type(value)


class Relauncher:
    """``Relauncher(kernel)(grid, args, kwargs)`` launches like ``kernel[grid](*args, **kwargs)``, where
    ``kwargs`` holds every argument not in ``args`` (the kernels here have no defaults) plus the launch
    options ``num_warps`` and ``num_stages``."""

    OPTIONS = ("num_warps", "num_stages")

    def __init__(self, kernel):
        self.kernel = kernel
        # Anything but a JITFunction of a supported Triton (a stand-in in a test, an interpreted kernel) is
        # launched the usual way.
        self.enabled = _SUPPORTED and hasattr(kernel, "arg_names") and hasattr(kernel, "params")
        self.names = list(kernel.arg_names) if self.enabled else []
        self.constexpr = [p.is_constexpr for p in kernel.params] if self.enabled else []
        self.compiled = {}

    def __call__(self, grid, args, kwargs):
        if not self.enabled or _knobs.runtime.launch_enter_hook is not None:
            self.kernel[grid](*args, **kwargs)
            return
        values = (*args, *(kwargs[name] for name in self.names[len(args):]))
        device = torch.cuda.current_device()
        key = (device, tuple(kwargs.get(o) for o in self.OPTIONS),
               tuple(_spec(v, c) for v, c in zip(values, self.constexpr)))
        compiled = self.compiled.get(key)
        if compiled is None:  # Triton's path: it compiles (or finds the compiled kernel) and launches
            compiled = self.kernel[grid](*args, **kwargs)
            if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
                self.compiled[key] = compiled
            return
        stream = _driver.active.get_current_stream(device)
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                     compiled.function, compiled.packed_metadata, None,
                     _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook, *values)
