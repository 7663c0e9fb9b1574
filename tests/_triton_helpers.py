"""Shared by the Triton tests: inputs, plain attention in low precision (the tolerance rule's baseline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

# The one plain PyTorch attention of the package: every step in the inputs' dtype (matmul, softmax, matmul).
from flashref.torch_attention import make_qkv, plain_attention  # noqa: F401  (make_qkv: the tests' inputs)


def plain_forward_backward(q, k, v, do, causal=False, sm_scale=None):
    """Plain attention's output and gradients, computed in the dtype of the inputs."""
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = plain_attention(qq, kk, vv, causal, sm_scale)
    o.backward(do)
    return o.detach(), qq.grad, kk.grad, vv.grad


def flash_forward_backward(fn, q, k, v, do, causal=False, sm_scale=None):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = fn(qq, kk, vv, causal=causal, sm_scale=sm_scale)
    o.backward(do)
    return o.detach(), qq.grad, kk.grad, vv.grad


# --- the feature tests (GQA, dropout, block masks, window, softcap, ALiBi): shared inputs and baseline ---

import math  # noqa: E402

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: Silences NumPy's RuntimeWarnings raised inside Triton's interpreter, for the tests that cause them knowingly. The
#: interpreter computes every lane of a tile in NumPy, the padded ones too (key slots past N_k read as 0, rows past
#: N_q, whose exponent or sum overflows), as a GPU computes and discards them; other tests feed NaN or a wrong
#: kernel on purpose. NumPy warns about the inf and NaN in those lanes; the tests check what the kernels store.
#: Applied test by test, where a test was seen to warn, so that a warning anywhere else still shows.
INTERPRETER_LANES = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@pytest.fixture(autouse=True)
def no_autotune(monkeypatch):
    """Launch the first config that fits: the feature tests check arithmetic, not speed. Autouse in the test
    modules that import it."""
    monkeypatch.setenv("FLASHREF_TRITON_AUTOTUNE", "0")


def np64(x):
    return x.detach().cpu().double().numpy()


def feature_inputs(B, H, H_kv, N_q, N_k, d, dtype, seed=0, scale=1.0):
    """q, k, v, dO drawn on the CPU (so the CPU and the GPU check the same numbers), k and v with H_kv heads;
    q scaled by ``scale`` for larger logits."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N_q, d, generator=g) * scale
    k, v = (torch.randn(B, H_kv, N_k, d, generator=g) for _ in range(2))
    do = torch.randn(B, H, N_q, d, generator=g)
    return [x.to(DEVICE, dtype) for x in (q, k, v, do)]


def token_mask(N_q, N_k, causal=False, window=(-1, -1)):
    """Query i sees key j: causal (j <= i) and the window i - left <= j <= i + right, as a bool (N_q, N_k)."""
    i = torch.arange(N_q)[:, None]
    j = torch.arange(N_k)[None, :]
    mask = torch.ones(N_q, N_k, dtype=torch.bool)
    if causal:
        mask &= j <= i
    left, right = window
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def plain_with_features(q, k, v, do, causal, visible=None, keep=None, p=0.0, window=(-1, -1), softcap=0.0,
                        slopes=None):
    """Plain attention in q's dtype with the same features, the tolerance rule's baseline: grouped K/V heads,
    the softcap and ALiBi bias on the scores, the causal, window and ``visible`` masks, dropout's ``keep``.
    Returns the output and the gradients."""
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    G = q.shape[1] // k.shape[1]
    N_q, N_k = q.shape[2], k.shape[2]
    s = qq @ kk.repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        distance = (torch.arange(N_q)[:, None] - torch.arange(N_k)[None, :]).abs().to(q.device, q.dtype)
        s = s - slopes.reshape(-1, q.shape[1], 1, 1).to(q.dtype) * distance
    mask = token_mask(N_q, N_k, causal, window).to(q.device)
    if visible is not None:
        mask = mask & torch.as_tensor(visible, device=q.device)
    s = s.masked_fill(~mask, float("-inf"))
    P = torch.nan_to_num(torch.softmax(s, -1))  # rows that see no key: 0, as the kernels give
    if keep is not None:
        P = torch.where(keep, P / (1 - p), torch.zeros_like(P))
    o = P @ vv.repeat_interleave(G, 1)
    o.backward(do)
    return [o.detach(), qq.grad, kk.grad, vv.grad]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_child(script: str, fp_fusion: bool = False) -> str:
    """Run ``script`` in a child Python with the kernels defined for compiling, and return what it printed. Kernels
    defined under Triton's interpreter cannot be compiled, so the child runs with ``TRITON_INTERPRET`` unset and
    ``FLASHREF_TRITON_COMPILE_ONLY=1`` (see flashref/triton/compile_check.py); ``fp_fusion`` sets
    ``TRITON_DEFAULT_FP_FUSION=1``, as a GPU run does. A failed child fails the test with the end of its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(FLASHREF_TRITON_COMPILE_ONLY="1", PYTHONPATH=ROOT)
    if fp_fusion:
        env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def compiled_json(script: str, fp_fusion: bool = False):
    """:func:`compile_child` for a script whose last line prints its findings as JSON: those findings."""
    return json.loads(compile_child(script, fp_fusion).strip().splitlines()[-1])


def compile_in_child(script: str) -> list[list[str]]:
    """:func:`compile_child` for a script that prints a line of fields a kernel: its lines, split into fields."""
    return [line.split() for line in compile_child(script).strip().splitlines()]
