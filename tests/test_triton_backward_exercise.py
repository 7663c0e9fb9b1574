"""The Triton-kernel exercise of notebook 08: the checker accepts the solution and names each mistake.
The kernels run in Triton's interpreter without a GPU, compiled on one."""

import importlib.util

import pytest

import flashref.triton  # noqa: F401  (the interpreter is switched on before triton is imported)
from flashref.exercises import triton_backward as ex

SKELETON = '''
import triton
import triton.language as tl


@triton.jit
def dv_kernel(Q, K, DO, LSE, DV, N_q, N_k, sm_scale, D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k = tl.load(K + bh * N_k * D + offs_n[:, None] * D + offs_d[None, :], mask=offs_n[:, None] < N_k, other=0.0)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    for start_m in range(0, N_q, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m[:, None] < N_q
        q = tl.load(Q + bh * N_q * D + offs_m[:, None] * D + offs_d[None, :], mask=rows, other=0.0)
        do = tl.load(DO + bh * N_q * D + offs_m[:, None] * D + offs_d[None, :], mask=rows, other=0.0)
        lse = tl.load(LSE + bh * N_q + offs_m, mask=offs_m < N_q, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        p = P_LINE
        dv += tl.dot(tl.trans(p), do, input_precision="ieee")
    tl.store(DV + bh * N_k * D + offs_n[:, None] * D + offs_d[None, :], dv, mask=offs_n[:, None] < N_k)
'''
RIGHT = "tl.exp(s * sm_scale - lse[:, None])"


def kernel_with(tmp_path, p_line, name="variant"):
    path = tmp_path / f"{name}.py"
    path.write_text(SKELETON.replace("P_LINE", p_line))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dv_kernel


def test_the_right_kernel_passes(tmp_path):
    verdict = ex.check_dv_kernel(kernel_with(tmp_path, RIGHT))
    assert verdict, verdict.message
    assert verdict.message.startswith("Correct.")


@pytest.mark.parametrize("p_line,hint", [
    ("tl.exp(s - lse[:, None])", "without sm_scale"),
    ("tl.exp(s * sm_scale)", "without the normalization"),
    ("tl.exp(s * sm_scale - lse[:, None]) * (offs_m[:, None] < 0)", "differs from P^T dO"),
    ("s * 0.0  # your code", "Not answered yet"),
    ("tl.exp(s * scale - lse[:, None])", "is not defined"),
])
def test_each_mistake_is_named(tmp_path, p_line, hint):
    verdict = ex.check_dv_kernel(kernel_with(tmp_path, p_line, name=f"v{abs(hash(p_line))}"))
    assert not verdict
    assert hint in verdict.message, verdict.message


def test_no_answer_and_a_wrong_object():
    assert ex.check_dv_kernel(None).message.startswith("Not answered yet")
    assert "pass your @triton.jit kernel" in ex.check_dv_kernel(lambda: 0).message
