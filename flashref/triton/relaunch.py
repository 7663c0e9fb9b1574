"""Launching a compiled Triton kernel again without Triton's dispatcher: the host-time lever of a training step.

``kernel[grid](*args, **meta)`` makes Triton's dispatcher bind every argument to its parameter, work out each
one's specialization (a tensor's dtype and whether its address is 16-byte aligned, an integer's value modulo 16,
a TMA descriptor's tile and layout), hash that into a key and look the compiled kernel up, every launch. Measured
on the H100 machine's host (B 4, H 16, N 4K, d 64, a sliding-window block mask): a forward + backward step took
1.2 ms of host time against 0.7 ms of GPU time, and Triton's dispatcher was about 40% of the host's share (five
launches). A training loop launches the same kernels with the same kinds of arguments step after step, so
:func:`launch` keys each launch by what Triton's specialization can depend on, worked out more cheaply (the
dtypes, the alignments, the integers' values themselves, the descriptors' tiles, the constexprs and options),
and the next launch of that key goes straight to the kernel Triton compiled for the first: the launch Triton's
dispatcher itself makes at its end, with the same arguments. Under the interpreter there is nothing compiled:
every launch goes through Triton, as before. :mod:`flashref.triton.decode` plans whole decoding calls the same
way (its calls are a few microseconds of GPU time each)."""

from __future__ import annotations

import inspect

import torch

from flashref.triton import INTERPRETED

_RECIPES: dict = {}
_VALUED: dict = {}  # per kernel: for each parameter, whether Triton specializes on an integer's value
_MAX_RECIPES = 512  # launch keys kept (a sweep over sequence lengths makes one per length and kernel)
_FAST = {"on": not INTERPRETED}  # off for good if this Triton's compiled kernels refuse the arguments


class _Unkeyable(Exception):
    """An argument whose specialization :func:`_spec` cannot vouch for: such a launch goes through Triton."""


def _spec(x, valued: bool = True):
    """A key of everything Triton's specialization of ``x`` can depend on (more, where cheaper: an integer's
    value rather than its divisibility by 16). ``valued=False``: a parameter Triton does not specialize on
    (``do_not_specialize``, a dropout seed say): an integer then keys only the width Triton passes it in."""
    if isinstance(x, torch.Tensor):
        return x.dtype, x.data_ptr() % 16 == 0
    kind = type(x)
    if kind is int:
        return (kind, x) if valued else (kind, -2**31 <= x < 2**31, x < 2**63)  # i32, i64 or u64
    if kind is bool:
        return kind, x
    if kind is float:  # runtime floats are never specialized: every value takes the same kernel
        return kind
    if x is None:
        return None
    base = getattr(x, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(x, "block_shape"):  # a host-side TMA descriptor
        return (kind, base.dtype, base.data_ptr() % 16 == 0, tuple(x.shape), tuple(x.strides), tuple(x.block_shape),
                getattr(x, "layout", None), getattr(x, "padding", None))
    raise _Unkeyable(kind)


def _tail(kernel, n_args: int, meta: dict):
    """The values of the kernel's parameters after the ``n_args`` given in order: from ``meta`` (constexprs given
    by name), else the parameter's default; what Triton's dispatcher hands the compiled kernel after the given
    arguments. None if a parameter has neither (Triton would have refused the launch)."""
    params = getattr(kernel, "params", None)
    if params is None:
        return None
    tail = []
    for p in params[n_args:]:
        if p.name in meta:
            tail.append(meta[p.name])
        elif p.default is not inspect.Parameter.empty:
            tail.append(p.default)
        else:
            return None
    return tuple(tail)


def _valued(kernel) -> tuple:
    """For each of the kernel's parameters, whether Triton specializes on its value (not ``do_not_specialize``)."""
    valued = _VALUED.get(kernel)
    if valued is None:
        valued = _VALUED[kernel] = tuple(not getattr(p, "do_not_specialize", False) for p in kernel.params)
    return valued


def launch(kernel, grid: tuple, *args, **meta):
    """``kernel[grid](*args, **meta)``: the first launch of a key through Triton (which compiles the kernel if it
    must), the next ones straight to the kernel it compiled. ``args`` fill the kernel's first parameters in order;
    ``meta`` holds constexprs and compile options (``num_warps``, ``maxnreg``, ...), all part of the key. Returns
    what Triton's launch returns (on a GPU the compiled kernel)."""
    if not _FAST["on"]:
        return kernel[grid](*args, **meta)
    try:
        key = (kernel, torch.cuda.current_device(), tuple(map(_spec, args, _valued(kernel))), tuple(meta.items()))
        recipe = _RECIPES.get(key)
    except (_Unkeyable, TypeError, AttributeError):  # (a value that cannot be hashed; a kernel without params)
        return kernel[grid](*args, **meta)
    if recipe is None:
        compiled = kernel[grid](*args, **meta)
        tail = _tail(kernel, len(args), meta)
        if tail is not None and callable(getattr(compiled, "__getitem__", None)) and hasattr(compiled, "function"):
            if len(_RECIPES) >= _MAX_RECIPES:
                _RECIPES.clear()
            _RECIPES[key] = (compiled, tail)
        return compiled
    compiled, tail = recipe
    try:
        compiled[(*grid, 1, 1)[:3]](*args, *tail)  # (the compiled kernel's launcher reads three grid dimensions)
    except TypeError:  # a Triton whose compiled kernels take other arguments: refused before launching
        _FAST["on"] = False
        _RECIPES.clear()
        return kernel[grid](*args, **meta)
    return compiled


class Bound:
    """``kernel[grid](*args, **meta)`` for a caller that launches it again and again with arguments that Triton
    specializes alike: the same dtypes, the same alignments, integers of the same values where Triton specializes
    on them. The first launch goes through :func:`launch`; the next ones go straight to the kernel it compiled,
    without keying the arguments at all. What a plan of one call signature holds (:class:`flashref.triton.ops.
    StepPlan`), whose key vouches for the arguments."""

    __slots__ = ("kernel", "grid", "meta", "runner", "tail")

    def __init__(self, kernel, grid: tuple, **meta):
        self.kernel, self.grid, self.meta, self.runner, self.tail = kernel, tuple(grid), meta, None, ()

    def __call__(self, *args):
        if self.runner is not None and _FAST["on"]:
            try:
                return self.runner(*args, *self.tail)
            except TypeError:  # (as in launch: refused before launching)
                _FAST["on"] = False
                _RECIPES.clear()
        compiled = launch(self.kernel, self.grid, *args, **self.meta)
        tail = _tail(self.kernel, len(args), self.meta) if _FAST["on"] else None
        if tail is not None and callable(getattr(compiled, "__getitem__", None)) and hasattr(compiled, "function"):
            self.runner, self.tail = compiled[(*self.grid, 1, 1)[:3]], tail
        return compiled
