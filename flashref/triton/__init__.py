"""FlashAttention in Triton: a fused forward and a recomputing backward as one PyTorch op.

Taught in notebooks ``07_triton_forward`` and ``08_triton_backward``; flash-decoding (:mod:`flashref.triton.decode`)
in ``13_beyond_one_gpu_and_decoding``.

    from flashref.triton import flash_attention
    o = flash_attention(q, k, v, causal=True)        # (B, H, N, d) torch tensors; differentiable
    o, lse = flash_attention_forward(q, k, v)         # no autograd; lse is (B, H, N_q) fp32, natural log
    o = flash_decode(q, k_cache, v_cache, cache_seqlens)  # few queries against a KV cache, keys split

On a machine with a CUDA device the kernels are compiled and autotuned over configs pruned to the GPU's
shared memory (:mod:`flashref.triton.configs`). On an H100 (sm_90) plain attention runs the Gluon kernels of
:mod:`flashref.triton.hopper` (forward) and :mod:`flashref.triton.hopper_backward` instead (notebook
``14_flashattention3_on_hopper``; ``kernel="triton"`` keeps the teaching ones, :func:`forward_kernel` and
:func:`backward_kernel` say which run). Without one, the very same kernels run in Triton's CPU
interpreter on CPU tensors (slowly: use small shapes); for that ``TRITON_INTERPRET=1`` must be set before
any kernel is defined, which this module does on import.
"""

from __future__ import annotations

import os
import sys
import warnings

import importlib.util

# The optional parts: say what to install rather than a bare "No module named 'torch'". triton is looked
# up, not imported: the interpreter must be switched on (below) before its first import.
for _name in ("torch", "triton"):
    if importlib.util.find_spec(_name) is None:
        raise ModuleNotFoundError(f"flashref.triton needs torch and triton, and {_name} is not installed: "
                                  f"pip install 'flashref[gpu]' (on Colab both are already there)", name=_name)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# FLASHREF_TRITON_COMPILE_ONLY=1 keeps the kernels compilable on a machine without a GPU (the compile
# test: kernels defined under the interpreter cannot be handed to triton.compile).
if not _cuda_available() and os.environ.get("FLASHREF_TRITON_COMPILE_ONLY", "") != "1":
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "") != "1":
        # Triton's own library functions (tl.max, tl.sum, ...) were compiled for a GPU at import time;
        # under the interpreter every kernel calling them would fail with an opaque error.
        raise ImportError("flashref.triton: there is no CUDA device, so the kernels run in Triton's CPU "
                          "interpreter, which must be switched on before triton is first imported. Import "
                          "flashref.triton before triton, or set TRITON_INTERPRET=1 in the environment.")
    os.environ["TRITON_INTERPRET"] = "1"

# Fused multiply-add stays on (Triton's long-standing default); saying so silences Triton 3.9's warning.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"

from flashref.triton.ops import (  # noqa: E402  (the environment must be set first)
    FlashAttentionFunction,
    FlashAttentionVarlenFunction,
    dropout_mask,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    flash_attention_varlen,
    backward_kernel,
    forward_kernel,
)


def __getattr__(name):
    """flash_decode and KVCache load :mod:`flashref.triton.decode` on first use (PEP 562): a notebook that never
    decodes does not read that file, so its stamp does not go stale when the decoding kernels change."""
    if name in ("flash_decode", "KVCache"):
        from flashref.triton import decode

        return getattr(decode, name)
    raise AttributeError(f"module 'flashref.triton' has no attribute {name!r}")


def _release(version: str) -> tuple:
    """(major, minor) of a version string such as "3.6.0" or "3.8.0rc1"."""
    major, minor = (version.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _numpy_refuses_one_element_ints() -> bool:
    """Whether this NumPy refuses ``int()`` of a one-element 1-D array (deprecated in NumPy 1.25; NumPy 2.4.6 and
    2.5.2 raise TypeError)."""
    import numpy as np

    try:
        int(np.array([0]))
    except TypeError:
        return True
    return False


def interpreter_problem(triton_version: str | None = None, numpy_refuses: bool | None = None) -> str | None:
    """Why Triton's CPU interpreter cannot run this package's kernels here, or None (the installed Triton and NumPy
    unless given). Triton 3.6's interpreter reads a loop bound held in a tensor with ``int()`` of a one-element
    array, which recent NumPy refuses (Triton 3.7.1, the pinned one, squeezes the array first); the teaching
    forward's loops over listed tiles take their bounds from tensors, so such a pair fails at the first launch,
    inside the interpreter (seen with Triton 3.6.0 and NumPy 2.5.2 on the GPU machine, where only a run that hides
    the GPUs interprets: ``python -m flashref.bench ring --device cpu``). On import without a GPU this module warns
    with the reason."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        triton_version = triton_version or version("triton")
    except PackageNotFoundError:
        return "triton is not installed"
    if numpy_refuses is None:
        numpy_refuses = _numpy_refuses_one_element_ints()
    if _release(triton_version) < (3, 7) and numpy_refuses:
        import numpy as np

        return (f"Triton {triton_version}'s interpreter cannot run the kernels under NumPy {np.__version__}, which "
                f"refuses int() of a one-element array: the interpreter needs triton>=3.7")
    return None


_PROBLEM = interpreter_problem() if INTERPRETED else None
if _PROBLEM:
    warnings.warn(f"flashref.triton: {_PROBLEM}", RuntimeWarning, stacklevel=2)

__all__ = ["flash_attention", "flash_attention_forward", "flash_attention_backward", "flash_attention_varlen",
           "FlashAttentionFunction", "FlashAttentionVarlenFunction", "dropout_mask", "flash_decode", "KVCache",
           "forward_kernel", "backward_kernel", "INTERPRETED", "interpreter_problem"]
