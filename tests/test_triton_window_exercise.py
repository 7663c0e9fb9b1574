"""The Triton-kernel exercise of notebook 07: the checker accepts the solution and names each mistake.
The kernels run in Triton's interpreter without a GPU, compiled on one."""

import importlib.util
import re

import pytest

import flashref.triton  # noqa: F401  (the interpreter is switched on before triton is imported)
from flashref.exercises import triton_window as ex
from tests._triton_helpers import INTERPRETER_LANES

SKELETON = '''
import triton
import triton.language as tl


@triton.jit
def kernel(Q, K, V, O, N, sm_scale, WINDOW: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    base = tl.program_id(1) * N * D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < N, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in range(0, N, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :], mask=offs_n[:, None] < N, other=0.0)
        v = tl.load(V + base + offs_n[:, None] * D + offs_d[None, :], mask=offs_n[:, None] < N, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        i = offs_m[:, None]
        j = offs_n[None, :]
        keep = KEEP
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = M_SAFE
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    tl.store(O + base + offs_m[:, None] * D + offs_d[None, :], acc / l_i[:, None], mask=offs_m[:, None] < N)
'''
SAFE = 'tl.where(m_new == float("-inf"), 0.0, m_new)'
RIGHT = "(j <= i) & (j > i - WINDOW) & (j < N)"


def kernel_with(tmp_path, keep, m_safe=SAFE, name="variant"):
    path = tmp_path / f"{name}.py"
    path.write_text(SKELETON.replace("KEEP", keep).replace("M_SAFE", m_safe))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel


@INTERPRETER_LANES  # padded rows past N that see no key divide 0 by 0 (never stored)
def test_the_right_kernel_passes(tmp_path):
    verdict = ex.check_window_kernel(kernel_with(tmp_path, RIGHT))
    assert verdict, repr(verdict)


@pytest.mark.parametrize("keep,m_safe,words", [
    ("j < N", SAFE, "no mask but the sequence's end"),
    ("(j <= i) & (j < N)", SAFE, "the window is missing"),
    ("(j <= i) & (j >= i - WINDOW) & (j < N)", SAFE, "one too many"),
    ("(j <= i) & (j > i - WINDOW + 1) & (j < N)", SAFE, "one too few"),
    ("(j - i < WINDOW) & (i - j < WINDOW) & (j < N)", SAFE, "later keys"),
    (RIGHT, "m_new", "NaN or inf"),
    ("(j <= i) & (j > i - 2 * WINDOW) & (j < N)", SAFE, "first at query row"),
])
@INTERPRETER_LANES  # wrong kernels, on purpose
def test_mistakes_are_named(tmp_path, keep, m_safe, words):
    verdict = ex.check_window_kernel(kernel_with(tmp_path, keep, m_safe, name=re.sub(r"\W", "_", keep)[:20] + "x"))
    assert not verdict and words in repr(verdict), repr(verdict)


def test_unanswered_and_not_a_kernel(tmp_path):
    unwritten = kernel_with(tmp_path, "j < N  # your code: the window")
    assert not ex.check_window_kernel(unwritten) and "your code" in repr(ex.check_window_kernel(unwritten))
    assert not ex.check_window_kernel(None) and "Not answered" in repr(ex.check_window_kernel(None))
    assert "@triton.jit kernel itself" in repr(ex.check_window_kernel(lambda: None))
