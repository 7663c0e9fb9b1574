"""flashref.hbm counts the bytes the Triton kernels really load and store: checked by running the kernels
in Triton's interpreter and recording every load and store (its addresses, under its mask)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from flashref import hbm

torch = pytest.importorskip("torch")
if torch.cuda.is_available():
    pytest.skip("counts loads in Triton's CPU interpreter; on a GPU, ncu counts them (flashref.bench hbm)",
                allow_module_level=True)
flashref_triton = pytest.importorskip("flashref.triton")  # switches the interpreter on before triton loads

from triton.runtime import interpreter  # noqa: E402

from flashref.triton import configs, flash_attention_backward, flash_attention_forward  # noqa: E402

SHAPES = [(1, 1), (1, 37), (37, 1), (33, 47), (64, 64), (100, 70)]


@pytest.fixture
def recorder(monkeypatch):
    """{kernel name: [read bytes, written bytes, set of addresses read, set written]}, from the interpreter."""
    log = collections.defaultdict(lambda: [0, 0, set(), set()])
    current = {}
    run, load, store = interpreter.InterpretedFunction.run, interpreter.InterpreterBuilder.create_masked_load, \
        interpreter.InterpreterBuilder.create_masked_store

    def traced_run(self, *args, **kwargs):
        current["name"] = self.fn.__name__
        return run(self, *args, **kwargs)

    def record(entry, ptrs, mask, read):
        mask = np.broadcast_to(mask.data, ptrs.data.shape)
        addresses = ptrs.data[mask]
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        entry[0 if read else 1] += int(addresses.size) * size
        entry[2 if read else 3].update((int(a), size) for a in addresses.ravel())

    def traced_load(self, ptrs, mask, *args, **kwargs):
        record(log[current["name"]], ptrs, mask, True)
        return load(self, ptrs, mask, *args, **kwargs)

    def traced_store(self, ptrs, value, mask, *args, **kwargs):
        record(log[current["name"]], ptrs, mask, False)
        return store(self, ptrs, value, mask, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", traced_run)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", traced_load)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_store", traced_store)
    return log


def _inputs(N_q, N_k, d, dtype, B=2, H=3):
    g = torch.Generator().manual_seed(N_q + N_k)
    return [torch.randn(B, H, n, d, generator=g).to(dtype) for n in (N_q, N_k, N_k, N_q)]


def _assert_counts(traffic, entry):
    read, write, read_set, write_set = entry
    assert (traffic.read, traffic.write) == (read, write), traffic.kernel
    assert traffic.compulsory_read == sum(size for _, size in read_set), traffic.kernel
    assert traffic.compulsory_write == sum(size for _, size in write_set), traffic.kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N_q,N_k", SHAPES)
def test_forward_bytes_are_the_kernels_loads_and_stores(recorder, N_q, N_k, causal, dtype):
    q, k, v, _ = _inputs(N_q, N_k, 24, dtype)
    flash_attention_forward(q, k, v, causal=causal)
    cfg = configs.INTERPRETER["forward"]
    want = hbm.flash_forward(2, 3, N_q, N_k, 24, cfg.block_m, cfg.block_n, causal, elem=q.element_size())
    assert set(recorder) == {"flash_fwd_kernel"}
    _assert_counts(want, recorder["flash_fwd_kernel"])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N_q,N_k", SHAPES)
def test_backward_bytes_are_the_kernels_loads_and_stores(recorder, N_q, N_k, causal):
    q, k, v, do = _inputs(N_q, N_k, 16, torch.float16)
    o, lse = flash_attention_forward(q, k, v, causal=causal)
    recorder.clear()
    flash_attention_backward(q, k, v, o, lse, do, causal=causal)
    blocks = {name: (configs.INTERPRETER[name].block_m, configs.INTERPRETER[name].block_n) for name in ("dkdv", "dq")}
    launches = hbm.flash_backward(2, 3, N_q, N_k, 16, blocks["dkdv"], blocks["dq"], causal, elem=2)
    kernels = ["flash_bwd_preprocess_kernel", "flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel"]
    assert sorted(recorder) == sorted(kernels)
    for traffic, name in zip(launches, kernels):
        _assert_counts(traffic, recorder[name])


def test_the_flash_forward_moves_n_squared_d_bytes_and_standard_n_squared():
    """At fixed tiles the forward's requested bytes grow as N^2 d / BLOCK_M (K and V read once per Q tile),
    plain attention's as N^2 whatever d; causal halves the flash kernel's K/V traffic, not plain's."""
    n = np.array([1024, 2048, 4096, 8192, 16384])
    flash = [hbm.total(hbm.flash_forward(1, 1, N, N, 64, 128, 64)) for N in n]
    plain = [hbm.total(hbm.standard_forward(1, 1, N, N, 64)) for N in n]
    assert np.polyfit(np.log(n), np.log(flash), 1)[0] == pytest.approx(2.0, abs=0.05)
    assert np.polyfit(np.log(n), np.log(plain), 1)[0] == pytest.approx(2.0, abs=0.05)
    N = 16384
    ratio = hbm.total(hbm.standard_forward(1, 1, N, N, 64)) / hbm.total(hbm.flash_forward(1, 1, N, N, 64, 128, 64))
    # fp16: plain writes S, reads and writes it to scale it and again for softmax, and reads P: 12 N^2 bytes;
    # the flash forward reads K and V once per Q tile: 4 N^2 d / BLOCK_M bytes. Ratio 3 BLOCK_M / d = 6.
    assert ratio == pytest.approx(3 * 128 / 64, rel=0.01)
    causal = hbm.total(hbm.flash_forward(1, 1, N, N, 64, 128, 64, causal=True))
    assert causal / hbm.total(hbm.flash_forward(1, 1, N, N, 64, 128, 64)) == pytest.approx(0.5, abs=0.01)
    assert hbm.total(hbm.standard_forward(1, 1, N, N, 64, causal=True)) > hbm.total(hbm.standard_forward(1, 1, N, N, 64))


@pytest.mark.parametrize("kwargs,name,error", [({"N_q": 0}, "N_q", ValueError), ({"d": 2.5}, "d", TypeError),
                                               ({"block_m": True}, "block_m", TypeError)])
def test_bad_sizes_are_named(kwargs, name, error):
    args = dict(B=1, H=1, N_q=8, N_k=8, d=4, block_m=4, block_n=4) | kwargs
    with pytest.raises(error, match=f"{name} must be a positive integer"):
        hbm.flash_forward(**args)
