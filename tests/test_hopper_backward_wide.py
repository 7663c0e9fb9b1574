"""The d = 256 dK/dV kernel whose consumer warpgroups split the head dim (flashref.triton.hopper_backward_wide):
compiled for the H100 on any machine (no spills, within the H100's shared memory), and on an H100 dK and dV within
the course's tolerance rule against float32 on uneven shapes, causal and not, fp16 and bf16, bitwise the same from
run to run (marker ``gpu``)."""

from __future__ import annotations

import pytest
import torch

import flashref.triton  # noqa: F401  (before triton: the interpreter switch)
from tests._triton_helpers import compile_in_child, make_qkv

_COMPILE = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from flashref.triton import hopper, hopper_backward_wide as hw
from flashref.triton.compile_check import ptxas_usage

cfg = hw.default_config()
bm, bn, half = cfg["block_m"], cfg["block_n"], 128
for causal in (False, True):
    ql = gl.NVMMASharedLayout.get_default_for([bm, half], gl.float16)
    kl = gl.NVMMASharedLayout.get_default_for([bn, half], gl.float16)
    sl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32)
    sig = {"q_desc": f"tensordesc<fp16[{bm}, {half}],{ql!r}>", "k_desc": f"tensordesc<fp16[{bn}, {half}],{kl!r}>",
           "v_desc": f"tensordesc<fp16[{bn}, {half}],{kl!r}>", "do_desc": f"tensordesc<fp16[{bm}, {half}],{ql!r}>",
           "lse_desc": f"tensordesc<fp32[1, {bm}],{sl!r}>", "delta_desc": f"tensordesc<fp32[1, {bm}],{sl!r}>",
           "DK": "*fp16", "DV": "*fp16", "N_q": "i32", "N_k": "i32", "sm_scale": "fp32", "qk_scale": "fp32"}
    cx = dict(HEAD_D=256, BLOCK_M=bm, BLOCK_N=bn, STAGES=cfg["stages"], CAUSAL=causal, num_warps=cfg["num_warps"])
    sig.update({k: "constexpr" for k in cx})
    k = triton.compile(GluonASTSource(hw.hopper_wide_bwd_dkdv_kernel, sig, cx, {}), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg["num_warps"], maxnreg=hopper.WS_MAXNREG))
    ptx = k.asm["ptx"]
    print(causal, k.metadata.shared, ptxas_usage(k)["spill_stores"], ptx.count("wgmma.mma_async"),
          ptx.count("cp.async.bulk.tensor"), len(re.findall(r"mbarrier\.try_wait", ptx)))
"""


def test_compiles_for_the_h100_without_spills():
    """Causal and not: wgmma products and TMA copies in the PTX, shared memory within the H100's 227 KB (the two
    column halves of K, V and a ring of two Q, dO pairs, and the two exchanged 64 x 64 fp32 tiles: 225 KB), no
    register spills (in a child process: compiling needs the interpreter off)."""
    pytest.importorskip("triton.experimental.gluon")
    lines = compile_in_child(_COMPILE)
    assert [line[0] for line in lines] == ["False", "True"]
    for causal, shared, spills, wgmma, tma, waits in lines:
        assert int(shared) <= 227 * 1024 and int(spills) == 0, (causal, shared, spills)
        # each consumer: S^T or dP^T from two halves, then dV's and dK's halves; the producer's copies; the
        # ring's, the exchange's and K/V's barriers waited on
        assert int(wgmma) > 0 and int(tma) > 0 and int(waits) >= 4, (causal, wgmma, tma, waits)


def test_only_head_dim_256():
    from flashref.triton import hopper_backward_wide as hw

    q = torch.zeros(1, 1, 8, 128)
    with pytest.raises(ValueError, match="head dim in"):
        hw.hopper_wide_dkdv(q, q, q, q, None, None, None, False, 0.1)


def _grads(q, k, v, do, causal):
    from flashref.torch_attention import plain_attention

    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    plain_attention(qq, kk, vv, causal).backward(do)
    return kk.grad, vv.grad


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_dk_dv_within_the_rule_on_uneven_shapes(dtype, causal):
    """dK and dV from the forward's statistics, within 3x the error of plain attention's in the same precision, on
    lengths no tile divides, one query, one key, N_q != N_k; and the same bits when run again."""
    from flashref.tolerance import assert_within_tolerance
    from flashref.triton import flash_attention_forward, ops

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward needs an sm_90 GPU")
    from flashref.triton import hopper_backward_wide as hw

    for i, (N_q, N_k) in enumerate([(113, 203), (1, 239), (239, 1), (300, 97), (1023, 1024), (2048, 2048)]):
        q, k, v, do = make_qkv(2, 3, N_q, N_k, 256, dtype, "cuda", seed=i)
        o, lse = flash_attention_forward(q, k, v, causal, kernel="triton")
        m2, l2 = ops._stats_from_lse(lse)
        delta = ops._delta(o, do)
        got = hw.hopper_wide_dkdv(q, k, v, do, m2, l2, delta, causal, 256 ** -0.5)
        again = hw.hopper_wide_dkdv(q, k, v, do, m2, l2, delta, causal, 256 ** -0.5)
        assert all(torch.equal(a, b) for a, b in zip(got, again)), (N_q, N_k)
        ref, base = _grads(*(x.float() for x in (q, k, v, do)), causal), _grads(q, k, v, do, causal)
        for name, g, r, b in zip(("dk", "dv"), got, ref, base):
            assert g.dtype == dtype and g.shape == b.shape
            assert_within_tolerance(g, r, b, factor=3.0, name=f"{name} ({N_q}, {N_k}, causal={causal})")
