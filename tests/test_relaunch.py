"""flashref.triton.relaunch: a launch whose key was seen goes straight to the kernel Triton compiled for it, with the
arguments Triton's dispatcher would hand that kernel; anything that could change Triton's specialization (an
integer's value, a tensor's dtype or alignment, a descriptor's tile, a constexpr, an option) makes a new key and goes
through Triton. On any machine with stand-ins for a kernel and its compiled form; on an H100 (marker ``gpu``) a
training step with the relaunches gives the bits of one launched through Triton every time."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

import flashref.triton  # noqa: F401  (before triton: the interpreter switch)
from flashref.triton import relaunch


class _Compiled:
    """A compiled kernel's stand-in: ``self[grid](*args)`` records the launch."""

    function = None

    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("compiled", grid, args))


class _Kernel:
    """A JIT function's stand-in with parameters (X, n, scale, BLOCK: constexpr, EVEN: constexpr = True), or with a
    ``seed`` that Triton does not specialize on (``do_not_specialize``) after ``scale``: launching it through
    "Triton" records the launch and returns the compiled stand-in."""

    def __init__(self, seed=False):
        self.calls = []
        empty = inspect.Parameter.empty
        names = ("X", "n", "scale", *(("seed",) if seed else ()), "BLOCK")
        self.params = [SimpleNamespace(name=name, default=empty, do_not_specialize=name == "seed") for name in names]
        self.params.append(SimpleNamespace(name="EVEN", default=True, do_not_specialize=False))
        self.compiled = _Compiled(self.calls)

    def __getitem__(self, grid):
        def through_triton(*args, **meta):
            self.calls.append(("triton", grid, args, meta))
            return self.compiled
        return through_triton


@pytest.fixture
def fast(monkeypatch):
    """The relaunches switched on (as on a GPU) with no recipe yet; the current device is 0."""
    monkeypatch.setattr(relaunch, "_FAST", {"on": True})
    monkeypatch.setattr(relaunch, "_RECIPES", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _paths(kernel):
    return [call[0] for call in kernel.calls]


def test_a_second_launch_of_a_key_goes_to_the_compiled_kernel_with_triton_s_arguments(fast):
    kernel, x = _Kernel(), torch.zeros(64)
    assert relaunch.launch(kernel, (4, 2), x, 100, 0.5, BLOCK=32, num_warps=4) is kernel.compiled
    y = torch.ones(64)  # other data, the same key
    assert relaunch.launch(kernel, (4, 2), y, 100, 0.25, BLOCK=32, num_warps=4) is kernel.compiled
    assert _paths(kernel) == ["triton", "compiled"]
    # every parameter in order: the constexpr from meta, the default of the one not given; three grid dimensions
    assert kernel.calls[1] == ("compiled", (4, 2, 1), (y, 100, 0.25, 32, True))


@pytest.mark.parametrize("change", ["an integer's value", "a tensor's dtype", "a tensor's alignment", "a constexpr",
                                    "an option"])
def test_what_can_change_the_specialization_makes_a_new_key(fast, change):
    kernel, x = _Kernel(), torch.zeros(64, dtype=torch.float16)
    args, meta = [x, 128, 0.5], dict(BLOCK=32, num_warps=4)
    relaunch.launch(kernel, (1,), *args, **meta)
    if change == "an integer's value":
        args[1] = 129  # (not divisible by 16: another kernel)
    elif change == "a tensor's dtype":
        args[0] = x.float()
    elif change == "a tensor's alignment":
        args[0] = x[1:]  # two bytes past a 16-byte boundary
    elif change == "a constexpr":
        meta["BLOCK"] = 64
    else:
        meta["num_warps"] = 8
    relaunch.launch(kernel, (1,), *args, **meta)
    relaunch.launch(kernel, (1,), *args, **meta)  # and that key in turn is remembered
    assert _paths(kernel) == ["triton", "triton", "compiled"]


def test_a_parameter_triton_does_not_specialize_is_keyed_by_its_width_only(fast):
    """A dropout seed drawn anew at every call must not make a new key each time; its width (32 or 64 bits)
    still does."""
    kernel, x = _Kernel(seed=True), torch.zeros(64)
    for seed in (7, 16, 1, 2**40, 2**41):
        relaunch.launch(kernel, (1,), x, 64, 0.5, seed, BLOCK=32)
    assert _paths(kernel) == ["triton", "compiled", "compiled", "triton", "compiled"]
    assert kernel.calls[2] == ("compiled", (1, 1, 1), (x, 64, 0.5, 1, 32, True))


def test_a_descriptor_is_keyed_by_its_tile_and_layout(fast):
    kernel, x = _Kernel(), torch.zeros(64, 16, dtype=torch.float16)

    def descriptor(block):
        return SimpleNamespace(base=x, shape=[64, 16], strides=[16, 1], block_shape=block, layout="swizzle 32")

    for block in ([16, 16], [16, 16], [32, 16]):
        relaunch.launch(kernel, (1,), descriptor(block), 64, 0.5, BLOCK=32)
    assert _paths(kernel) == ["triton", "compiled", "triton"]


def test_an_argument_it_cannot_key_goes_through_triton_every_time(fast):
    import numpy as np

    kernel, x = _Kernel(), torch.zeros(64)
    for _ in range(2):
        relaunch.launch(kernel, (1,), x, np.int64(64), 0.5, BLOCK=32)  # (a NumPy integer: not keyed)
    assert _paths(kernel) == ["triton", "triton"]


def test_a_compiled_kernel_that_refuses_the_arguments_switches_relaunching_off(fast):
    kernel, x = _Kernel(), torch.zeros(64)

    def refuse(grid):
        def runner(*args):
            raise TypeError("launcher takes other arguments")
        return runner

    kernel.compiled.__class__ = type("_Refusing", (_Compiled,), {"__getitem__": lambda self, grid: refuse(grid)})
    for _ in range(3):
        relaunch.launch(kernel, (1,), x, 64, 0.5, BLOCK=32)
    assert _paths(kernel) == ["triton", "triton", "triton"] and not relaunch._FAST["on"]


def test_under_the_interpreter_every_launch_goes_through_triton():
    assert relaunch._FAST["on"] == (not flashref.triton.INTERPRETED)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense causal", "block mask", "dropout", "window", "atomic dQ", "d 256"])
def test_relaunched_steps_give_the_bits_of_launches_through_triton(case, monkeypatch):
    """Three training steps with the relaunches and the step plans, against the same steps launched through Triton's
    dispatcher on the full path: the same outputs and gradients, bit for bit, and the later steps took the compiled
    kernels directly (with dropout, a new seed at each step, as a training loop draws them: one of them divisible by
    16, one past 32 bits, which the plan then leaves to the full path)."""
    from flashref import block_masks
    from flashref.triton import flash_attention

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    kw = {"dense causal": dict(causal=True),
          "block mask": dict(block_mask=block_masks.sliding_window(3, window=2, device="cuda"), block_size=128),
          "dropout": dict(dropout_p=0.1), "window": dict(window_size=(40, 0)),
          "atomic dQ": dict(causal=True, deterministic=False), "d 256": dict(causal=True)}[case]
    seeds = (7, 16, 2**40 + 3) if case == "dropout" else (None,) * 3
    d = 256 if case == "d 256" else 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 300, d, device="cuda", generator=g, dtype=torch.float16) for _ in range(4))

    def step(seed):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        o = flash_attention(qq, kk, vv, **kw, **({} if seed is None else {"seed": seed}))
        o.backward(do)
        return o, qq.grad, kk.grad, vv.grad

    from flashref.triton import ops

    with monkeypatch.context() as full_path:  # every launch through Triton, every call checked and planned anew
        full_path.setattr(relaunch, "_FAST", {"on": False})
        full_path.setattr(ops, "_plan_key", lambda *args: None)
        through_triton = [step(seed) for seed in seeds]
    monkeypatch.setattr(relaunch, "_FAST", {"on": True})
    monkeypatch.setattr(relaunch, "_RECIPES", {})
    monkeypatch.setattr(ops, "_PLANS", {})
    planned = []
    monkeypatch.setattr(ops.StepPlan, "forward", _counted(ops.StepPlan.forward, planned))
    compiled_calls = []
    for i, seed in enumerate(seeds):
        if i == 1:  # count the launches that went to a compiled kernel
            monkeypatch.setattr(relaunch, "_RECIPES", {key: (_Counting(c, compiled_calls), tail)
                                                       for key, (c, tail) in relaunch._RECIPES.items()})
        for name, got, want in zip(("o", "dq", "dk", "dv"), step(seed), through_triton[i]):
            assert torch.equal(got, want), f"{name} differs at step {i}"
    # the steps after the first relaunched their launches (with dropout, the seed past 32 bits is a new key) and
    # went through the signature's plan (ops.StepPlan) from the second, the one-kernel backward's too
    assert relaunch._FAST["on"] and len(compiled_calls) >= (3 if case == "dropout" else 2 * 3), compiled_calls
    assert len(planned) == (1 if case == "dropout" else 2), planned


def _counted(fn, calls):
    def counted(*args, **kwargs):
        calls.append(args[1:])
        return fn(*args, **kwargs)
    return counted


class _Counting:
    """A compiled kernel that records each launch it is given, then makes it."""

    def __init__(self, compiled, calls):
        self.compiled, self.calls, self.function = compiled, calls, compiled.function

    def __getitem__(self, grid):
        runner = self.compiled[grid]

        def counted(*args):
            self.calls.append(grid)
            runner(*args)
        return counted
