"""Every exercise checker answers, never raises: None says "not answered", a wrong answer gets a falsy
Verdict with a message. (The right answers are checked where the notebooks' solution cells run them.)"""

from __future__ import annotations

import importlib
import math
import inspect
import os
import pkgutil
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import flashref.exercises as exercises
from flashref.exercises import NOT_ANSWERED, Verdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = [importlib.import_module(f"flashref.exercises.{m.name}") for m in pkgutil.iter_modules(exercises.__path__)]
CHECKERS = [(f"{mod.__name__.rsplit('.', 1)[1]}.{name}", fn) for mod in MODULES
            for name, fn in inspect.getmembers(mod, inspect.isfunction)
            if name.startswith("check_") and fn.__module__ == mod.__name__]


def test_every_notebook_topic_has_checkers():
    assert len(MODULES) >= 7 and len(CHECKERS) >= 14


@pytest.mark.parametrize("name,check", CHECKERS, ids=[n for n, _ in CHECKERS])
def test_unanswered_is_not_correct(name, check):
    verdict = check(None)
    assert isinstance(verdict, Verdict) and not verdict
    assert repr(verdict) == NOT_ANSWERED


@pytest.mark.parametrize("wrong_answer", [-12345.678, "not a number"])
@pytest.mark.parametrize("name,check", CHECKERS, ids=[n for n, _ in CHECKERS])
def test_wrong_answer_gets_a_message(name, check, wrong_answer):
    verdict = check(wrong_answer)
    assert isinstance(verdict, Verdict) and not verdict
    assert repr(verdict).startswith("Not quite")


def _run_without(modules, code):
    """Run ``code`` in a fresh interpreter in which importing any of ``modules`` fails, as on a machine
    without them."""
    blocker = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    return subprocess.run([sys.executable, "-c", blocker + code], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize("missing", [("torch",), ("triton",)])
def test_flashref_triton_without_its_optional_parts_says_what_to_install(missing):
    code = "import flashref.triton\n"
    result = _run_without(missing, code)
    assert result.returncode != 0
    assert f"flashref.triton needs torch and triton, and {missing[0]} is not installed: pip install 'flashref[gpu]'" \
        in result.stderr


def test_flashref_triton_says_when_its_interpreter_cannot_run_the_kernels():
    """Triton 3.6's interpreter under a NumPy that refuses int() of a one-element array (the GPU machine's pair)
    cannot run the kernels, and flashref.triton says why; Triton 3.7, or a NumPy that converts, can."""
    from flashref.triton import interpreter_problem

    problem = interpreter_problem("3.6.0", numpy_refuses=True)
    assert "Triton 3.6.0" in problem and "triton>=3.7" in problem
    for triton_version, refuses in [("3.7.1", True), ("3.6.0", False), ("3.8.0rc1", True), ("3.10.0", True)]:
        assert interpreter_problem(triton_version, numpy_refuses=refuses) is None, (triton_version, refuses)
    assert interpreter_problem("2.3.1", numpy_refuses=True) is not None


def test_checkers_need_neither_torch_nor_triton():
    result = _run_without(("torch", "triton"), (
        "from flashref.exercises import triton_kernels as ex\n"
        "from flashref.kernel_tiles import tile_counts\n"
        "c = tile_counts(4096, 4096, 128, 64, True)\n"
        "assert ex.check_causal_fraction_skipped(c['skipped'] / (c['full'] + c['masked'] + c['skipped']))\n"
        "assert not ex.check_causal_fraction_skipped(0.1)\n"
        "print('ok')\n"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_every_exercise_module_imports_without_torch_or_triton():
    """A checker that needs torch imports it when called; the module itself loads on a NumPy-only machine."""
    names = sorted(p.stem for p in (pathlib.Path(ROOT) / "flashref" / "exercises").glob("*.py") if p.stem != "__init__")
    result = _run_without(("torch", "triton"), "".join(f"import flashref.exercises.{n}\n" for n in names) + "print('ok')")
    assert result.returncode == 0, result.stderr
    assert len(names) >= 15 and result.stdout.strip() == "ok"


def test_measured_io_checkers_accept_right_answers_and_explain_wrong_ones():
    from flashref.exercises import measured_io as ex

    B, H, N, d = ex.PREDICT["B"], ex.PREDICT["H"], ex.PREDICT["N"], ex.PREDICT["d"]
    right = B * H * 3 * N * d * 2
    assert ex.check_predicted_dram_read(right)
    assert "ncu measured" in repr(ex.check_predicted_dram_read(right))
    assert "factor of 2" in repr(ex.check_predicted_dram_read(right // 2))
    assert "one head" in repr(ex.check_predicted_dram_read(right // (B * H)))
    assert "O is written" in repr(ex.check_predicted_dram_read(right * 4 // 3))
    assert not ex.check_predicted_dram_read("lots") and not ex.check_predicted_dram_read(None)

    from flashref.bench import hbm_bench

    measured = hbm_bench.totals(hbm_bench.find(hbm_bench.load_results(), "plain", "fwd", ex.PASSES["N"], ex.PASSES["d"]))
    passes = ex.nn_passes(measured["dram"])
    assert 5.5 < passes < 6.5 and ex.check_nn_passes(passes)
    assert "twice" in repr(ex.check_nn_passes(passes / 2))
    assert not ex.check_nn_passes(1.0)

    assert ex.check_roofline_time(lambda f, b, p, w: max(f / p, b / w))
    assert "added" in repr(ex.check_roofline_time(lambda f, b, p, w: f / p + b / w))
    assert "shorter" in repr(ex.check_roofline_time(lambda f, b, p, w: min(f / p, b / w)))
    assert "units" in repr(ex.check_roofline_time(lambda f, b, p, w: max(f * p, b * w)))
    assert "raised" in repr(ex.check_roofline_time(lambda f, b, p, w: 1 / 0))
    assert not ex.check_roofline_time(None) and not ex.check_roofline_time(3)
    assert "Not answered yet" in repr(ex.check_roofline_time(lambda f, b, p, w: None))


def _attention(q, k, v, causal):
    s = q @ k.T / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape, bool)), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def _tiled(q, k, v, bq, bk, rescale=True):
    o = np.empty_like(q)
    for i in range(0, q.shape[0], bq):
        q_i = q[i:i + bq]
        m, l, acc = np.full(len(q_i), -np.inf), np.zeros(len(q_i)), np.zeros_like(q_i)
        for j in range(0, k.shape[0], bk):
            s = q_i @ k[j:j + bk].T / np.sqrt(q.shape[-1])
            m_new = np.maximum(m, s.max(axis=-1))
            alpha = np.exp(m - m_new) if rescale else 1.0
            p = np.exp(s - m_new[:, None])
            l = l * alpha + p.sum(axis=-1)
            acc = acc * np.reshape(alpha, (-1, 1)) + p @ v[j:j + bk]
            m = m_new
        o[i:i + bq] = acc / l[:, None]
    return o


def _tile_backward(q, k, v, do, lse, delta, scale, with_delta=True, scaled=True):
    p = np.exp(scale * q @ k.T - lse[:, None])
    ds = p * (do @ v.T - (delta[:, None] if with_delta else 0))
    c = scale if scaled else 1.0
    return c * ds @ k, c * ds.T @ q, p.T @ do


def _merge(m_a, l_a, m_b, l_b):
    m = max(m_a, m_b)
    return (m, 0.0) if m == -math.inf else (m, l_a * math.exp(m_a - m) + l_b * math.exp(m_b - m))


def _merge_splits(o, lse, weigh=True):
    m = lse.max(0)
    w = np.exp(lse - m)
    total = w.sum(0)
    merged = (w[..., None] * o).sum(0) / total[:, None] if weigh else o.sum(0) / len(o)
    return merged, m + np.log(total)


ex_sink_w = 3  # the window of the checker's first case, (n_blocks, window) = (8, 3)


def _sink_window(n, w, sink=True, extra=0, causal=True):
    gap = np.arange(n)[:, None] - np.arange(n)[None, :]
    mask = ((gap >= 0) | (not causal)) & (gap < w + extra)
    mask[:, 0] |= sink
    return mask[None, None]


def _quantize_blocks(x, rows, zero_guard=True, one_scale=False, short_block=True, cast=True):
    """A reader's per-block e4m3 quantizer, right by default; each switch makes one mistake."""
    import torch

    B, H, N, d = x.shape
    n_blocks = -(-N // rows) if short_block else N // rows
    blocks = torch.nn.functional.pad(x, (0, 0, 0, n_blocks * rows - N))[:, :, :n_blocks * rows]
    blocks = blocks.reshape(B, H, n_blocks, rows, d)
    amax = blocks.abs().amax(dim=(-1, -2))
    if one_scale:
        amax = torch.full_like(amax, float(x.abs().max()))
    scale = amax / 448
    if zero_guard:
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    x8 = (blocks / scale[..., None, None]).reshape(B, H, n_blocks * rows, d)
    x8 = torch.nn.functional.pad(x8, (0, 0, 0, max(0, N - n_blocks * rows)))[:, :, :N]
    return (x8.to(torch.float8_e4m3fn) if cast else x8), scale


@pytest.mark.parametrize("check, right, wrongs", [
    ("standard_attention.check_attention_function", _attention, [
        (lambda q, k, v, c: _attention(q * np.sqrt(q.shape[-1]), k, v, c), "not scaled"),
        (lambda q, k, v, c: _attention(q, k, v, False), "causal mask is missing"),
        (lambda q, k, v, c: _attention(q, k, v, c) if q.shape[0] < 2 or np.abs(q).max() < 10 else q * np.nan,
         "NaN or inf"),
        (lambda q, k, v, c: _attention(q, k, v, c)[:, :1], "output has shape")]),  # noqa: E501
    ("online_softmax.check_merge_function", _merge, [
        (lambda m_a, l_a, m_b, l_b: (max(m_a, m_b), l_a + l_b), "added l_a and l_b"),
        (lambda m_a, l_a, m_b, l_b: (max(m_a, m_b), l_a * math.exp(m_a - max(m_a, m_b)) + l_b * math.exp(m_b - max(m_a, m_b))),
         "NaN"),
        (lambda m_a, l_a, m_b, l_b: (min(m_a, m_b), l_a), "the merged max is the larger")]),
    ("tiling.check_tiled_forward", _tiled, [
        (lambda q, k, v, bq, bk: _tiled(q, k, v, bq, bk, rescale=False), "exp(m_old - m_new)"),
        (lambda q, k, v, bq, bk: __import__("flashref").reference.attention(q, k, v), "N x N scores"),
        (lambda q, k, v, bq, bk: _tiled(q * np.sqrt(q.shape[-1]), k, v, bq, bk), "the scores are not scaled"),
        (lambda q, k, v, bq, bk: _tiled(q / np.sqrt(q.shape[-1]), k, v, bq, bk), "the scores are scaled by 1/d")]),
    ("backward.check_tile_backward", _tile_backward, [
        (lambda *a: _tile_backward(*a, with_delta=False), "miss D"),
        (lambda *a: _tile_backward(*a, scaled=False), "miss the scale"),
        (lambda *a: (lambda dq, dk, dv: (dq, dk, 2 * dv))(*_tile_backward(*a)), "dV is off"),
        # right on the notebook's tile (scale 0.5), wrong on the checker's others: the case is named
        (lambda *a: _tile_backward(*a[:6], 0.5), "on one query row against 3 keys: dV is off")]),
    ("sparsity.check_sink_window_mask", _sink_window, [
        (lambda n, w: _sink_window(n, w, sink=False), "the sink, is missing"),
        (lambda n, w: _sink_window(n, w, extra=1), f"sees {ex_sink_w + 1} blocks of the window instead of {ex_sink_w}"),
        (lambda n, w: _sink_window(n, w, causal=False), "later key blocks"),
        (lambda n, w: _sink_window(n, w)[0, 0], "add the two leading dimensions"),
        (lambda n, w: _sink_window(n, w).astype(np.int8), "dtype bool"),
        (lambda n, w: _sink_window(n, w) & ~np.eye(n, dtype=bool), "(1, 1), (2, 2)"),
        (lambda n, w: [[True]], "bool tensor (or NumPy array)")]),
    ("hopper.check_quantize_blocks", _quantize_blocks, [
        (lambda x, rows: _quantize_blocks(x, rows, zero_guard=False), "all-zero block has amax 0"),
        (lambda x, rows: _quantize_blocks(x, rows, one_scale=True), "the scales are off"),
        (lambda x, rows: _quantize_blocks(x, rows, short_block=False), "A short last block has a scale too"),
        (lambda x, rows: _quantize_blocks(x, rows, cast=False), "torch.float8_e4m3fn tensor"),
        (lambda x, rows: _quantize_blocks(x, rows)[0], "return a pair")]),
    ("beyond.check_merge_splits", _merge_splits, [
        (lambda o, lse: ((np.exp(lse)[..., None] * o).sum(0) / np.exp(lse).sum(0)[:, None],
                         np.log(np.exp(lse).sum(0))), "NaN or inf"),  # exact, but exp(lse) overflows
        (lambda o, lse: _merge_splits(o, lse, weigh=False), "weighs exp(lse_s - lse)"),
        (lambda o, lse: (_merge_splits(o, lse)[0], lse.max(0)), "log sum_s exp(lse_s)"),
        (lambda o, lse: _merge_splits(o, lse)[0], "return a pair")]),
])
def test_coding_exercises_accept_the_right_function_and_name_what_is_wrong(check, right, wrongs):
    import importlib

    module, name = check.split(".")
    fn = getattr(importlib.import_module(f"flashref.exercises.{module}"), name)
    assert fn(right), repr(fn(right))
    assert not fn(None) and "Not answered" in repr(fn(None))
    assert not fn(lambda *a: None) and "returns None" in repr(fn(lambda *a: None))
    assert not fn(42) and "pass your function" in repr(fn(42))
    assert "raised ZeroDivisionError" in repr(fn(lambda *a: 1 / 0))
    for bad, words in wrongs:
        verdict = fn(bad)
        assert not verdict and words in repr(verdict), repr(verdict)


def test_misleading_hints_are_fixed():
    from flashref import reference
    from flashref.exercises import backward, online_softmax, standard_attention

    assert "fp32" in repr(standard_attention.check_tile_bytes(32 * 128 * 4))
    q, k, v, do = backward.delta_problem()
    delta = np.sum(do * reference.attention(q, k, v, causal=True), axis=-1)
    assert "float32 precision" in repr(backward.check_delta(delta.astype(np.float32)))
    assert backward.check_delta(delta)
    message = repr(online_softmax.check_online_logsumexp(lambda x, b: float("nan")))
    assert message.startswith("Not quite: on the case small scores: your function returned nan")

    def without_rescale(x, block):  # the running max moves on, the running sum is never rescaled
        m, l = -math.inf, 0.0
        for start in range(0, len(x), block):
            m = max(m, float(np.max(x[start:start + block])))
            if m > -math.inf:
                l += float(np.sum(np.exp(x[start:start + block] - m)))
        return m + math.log(l)

    assert "multiply the running sum by exp(m_old - m_new)" in repr(online_softmax.check_online_logsumexp(without_rescale))


def test_tiled_accesses_function_checker():
    from flashref.exercises import io_complexity as ex

    def closed_form(N, d, M, initial_write=True, ceil=True, writes=True):
        B_c = -(-M // (4 * d))
        T_c = -(-N // B_c) if ceil else max(1, N // B_c)
        total = 2 * N * d + T_c * N * (2 * d + 2)
        return total + ((T_c + int(initial_write)) * N * (d + 2) if writes else 0)

    assert ex.check_tiled_accesses_function(closed_form)
    assert "reads only" in repr(ex.check_tiled_accesses_function(lambda *a: closed_form(*a, writes=False)))
    assert "O = 0" in repr(ex.check_tiled_accesses_function(lambda *a: closed_form(*a, initial_write=False)))
    assert "ceil(N / B_c)" in repr(ex.check_tiled_accesses_function(lambda *a: closed_form(*a, ceil=False)))
    assert "returns None" in repr(ex.check_tiled_accesses_function(lambda *a: None))
    assert not ex.check_tiled_accesses_function(None) and not ex.check_tiled_accesses_function(1)


def test_sparsity_checkers_accept_right_answers_and_name_the_mistake():
    import torch

    from flashref.exercises import sparsity as ex

    assert ex.SINK_CASES[0] == (8, ex_sink_w)
    # the kernels' form: a torch bool tensor, built from flashref.block_masks-style index arithmetic
    def torch_sink(n, w):
        i = torch.arange(n)
        mask = (i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < w)
        mask[:, 0] = True
        return mask[None, None]

    assert ex.check_sink_window_mask(torch_sink)
    assert "dtype torch.float32" in repr(ex.check_sink_window_mask(lambda n, w: torch_sink(n, w).float()))

    B, H, N = ex.MASK_B, ex.MASK_H, ex.MASK_N
    right = B * H * N * N
    assert ex.check_dropout_mask_bytes(right) and "3 GiB" in repr(ex.check_dropout_mask_bytes(right))
    for wrong_answer, words in [(right / (B * H), "B H = 48"), (right / H, "B H = 48"), (right / 8, "one bit"),
                                (right * 2, "boolean"), (3, "in bytes"),
                                (B * H * N * ex.MASK_D * 2, "size of Q, K or V"), (12345, "B H N x N")]:
        verdict = ex.check_dropout_mask_bytes(wrong_answer)
        assert not verdict and words in repr(verdict), repr(verdict)

    def cache(heads):
        return 2 * ex.GQA_LAYERS * heads * ex.GQA_D * ex.GQA_N * 2

    saved = cache(ex.GQA_H) - cache(ex.GQA_H_KV)
    assert ex.check_gqa_cache_saved(saved) and "8.75 GiB saved" in repr(ex.check_gqa_cache_saved(saved))
    for wrong_answer, words in [(cache(ex.GQA_H_KV), "GQA keeps"), (cache(ex.GQA_H), "whole multi-head cache"),
                                (saved / 2, "both K and V"), (saved / ex.GQA_LAYERS, "one layer"),
                                (saved / ex.GQA_N, "one token"), (saved * 2, "not 4"), (saved / 2**30, "in bytes"),
                                (77, "H_kv = 64 and H_kv = 8")]:
        verdict = ex.check_gqa_cache_saved(wrong_answer)
        assert not verdict and words in repr(verdict), repr(verdict)


def test_model_checkers_accept_right_answers_and_name_the_mistake():
    import torch

    from flashref.exercises import model as ex

    def mask(N, w, extra=0, causal=True):
        i, j = np.arange(N)[:, None], np.arange(N)[None, :]
        return ((j <= i) | (not causal)) & (j > i - w - extra)

    def torch_mask(N, w):
        i = torch.arange(N)
        return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)

    assert ex.check_window_mask(mask) and ex.check_window_mask(torch_mask)
    assert not ex.check_window_mask(None) and "Not answered" in repr(ex.check_window_mask(None))
    assert "returns None" in repr(ex.check_window_mask(lambda *a: None))
    assert "pass your function" in repr(ex.check_window_mask(42))
    assert "raised ZeroDivisionError" in repr(ex.check_window_mask(lambda *a: 1 / 0))
    for bad, words in [(lambda N, w: mask(N, w, causal=False), "later token"),
                       (lambda N, w: mask(N, w, extra=1), "one too many"),
                       (lambda N, w: mask(N, w, extra=-1), "one too few"),
                       (lambda N, w: mask(N, w).T.copy(), "later token"),
                       (lambda N, w: mask(N, w).astype(np.int8), "dtype int8"),
                       (lambda N, w: mask(N, w)[:1], "shape"),
                       (lambda N, w: mask(N, w) & ~np.eye(N, dtype=bool), "entry (query 0, key 0)")]:
        verdict = ex.check_window_mask(bad)
        assert not verdict and words in repr(verdict), repr(verdict)

    want = 1 / ((1 - ex.SHARE) + ex.SHARE / ex.KERNEL_SPEEDUP)
    assert ex.check_end_to_end_speedup(want) and ex.check_end_to_end_speedup(round(want, 1))
    for wrong_answer, words in [(ex.KERNEL_SPEEDUP, "kernels' own speed-up"), (1 / (1 - ex.SHARE), "infinitely fast"),
                                (ex.SHARE * ex.KERNEL_SPEEDUP + 1 - ex.SHARE, "averages the speed-ups"),
                                (3.0, "is not it")]:
        verdict = ex.check_end_to_end_speedup(wrong_answer)
        assert not verdict and words in repr(verdict), repr(verdict)


def test_the_end_to_end_exercise_quotes_the_committed_model_run():
    """SHARE, KERNEL_SPEEDUP and MEASURED are the committed run's figures at N = 4096, rounded as quoted."""
    from flashref.bench import model_bench
    from flashref.exercises import model as ex

    rows = {r["attention"]: r for r in model_bench.rows(model_bench.load_results(), "speed", T=4096)
            if "compiled" not in r}
    plain, flashref = rows["plain"], rows["flashref"]
    assert round(plain["attention_share"], 2) == ex.SHARE
    assert round(plain["attention_gpu_us"] / flashref["attention_gpu_us"]) == ex.KERNEL_SPEEDUP
    assert round(plain["total_gpu_us"] / flashref["total_gpu_us"], 2) == ex.MEASURED


def test_causal_tile_rule_checker_accepts_the_kernels_rule_and_names_each_mistake():
    from flashref.exercises import cupy_kernels as ex

    rule = ex.causal_tile_rule
    assert ex.check_causal_tile_rule(rule)
    assert "returns None" in repr(ex.check_causal_tile_rule(lambda *a: None))
    assert "pass your function" in repr(ex.check_causal_tile_rule(42))
    assert "raised ZeroDivisionError" in repr(ex.check_causal_tile_rule(lambda *a: 1 / 0))
    for bad, words in [
        (lambda i0, j0, bm, bn, N: "mask" if rule(i0, j0, bm, bn, N) != "skip" else "skip", "only slower"),
        (lambda i0, j0, bm, bn, N: "skip" if j0 > i0 else rule(i0, j0, bm, bn, N), "go missing"),
        (lambda i0, j0, bm, bn, N: "full" if rule(i0, j0, bm, bn, N) == "skip" else rule(i0, j0, bm, bn, N),
         "half the work"),
        (lambda i0, j0, bm, bn, N: "full" if j0 + bn > N and rule(i0, j0, bm, bn, N) == "mask" else
         rule(i0, j0, bm, bn, N), "past the last key"),
        (lambda i0, j0, bm, bn, N: "full" if rule(i0, j0, bm, bn, N) == "mask" and j0 + bn <= N else
         rule(i0, j0, bm, bn, N), "comes after row"),
        (lambda *a: "maybe", '"skip", "mask" or "full"'),
    ]:
        verdict = ex.check_causal_tile_rule(bad)
        assert not verdict and words in repr(verdict), repr(verdict)


def test_beyond_numbers():
    from flashref.exercises import beyond as ex

    # K and V of 8 heads x 64K keys x 128 dims in fp16 (and q, o) at 3.35 TB/s: about 80 microseconds
    want = 2 * (2 * 8 * 65536 * 128 + 2 * 32 * 128) / 3.35e12 * 1e6
    assert ex.check_decode_time(want)
    assert "once per query head" in repr(ex.check_decode_time(4 * want - 3 * 2 * 2 * 32 * 128 / 3.35e12 * 1e6))
    assert "not both" in repr(ex.check_decode_time(want / 2))
    assert not ex.check_decode_time(2 * want)
    pairs = ex.causal_pairs_contiguous(4096, 4)
    assert pairs[0] == 1024 * 1025 // 2 and sum(pairs) == 4096 * 4097 // 2  # the whole causal triangle
    assert ex.check_causal_imbalance(pairs[-1] / pairs[0]) and not ex.check_causal_imbalance(4.0)


def test_hopper_numbers():
    from flashref.exercises import hopper as ex

    # 128 x 128 exponentials at 3.9e12/s against 4 * 128 * 128 * 64 FLOPs at 1979e12/s: about 1.98
    want = (128 * 128 / 3.9e12) / (4 * 128 * 128 * 64 / 1979e12)
    assert ex.check_exp_ratio(want)
    assert "twice as long" in repr(ex.check_exp_ratio(want))
    assert not ex.check_exp_ratio(want / 2) and not ex.check_exp_ratio(1 / want)  # fp16 rates; upside down
    # 32 programs of 128 keys each add 4096 x 64 fp32 numbers; dQ is 4096 x 64 fp16 numbers: 64x
    assert ex.check_dq_reduce_ratio(64) and "N_k / 128" in repr(ex.check_dq_reduce_ratio(64.0))
    assert not ex.check_dq_reduce_ratio(32) and not ex.check_dq_reduce_ratio(128)  # fp16 shares; 64-key tiles
    assert not ex.check_dq_reduce_ratio(None) and not ex.check_dq_reduce_ratio("64x")


def test_the_reduce_exercise_uses_the_fused_kernels_tiles():
    """FUSED_DQ's keys a program is the one-kernel backward's shipped tile (its module needs Gluon, which a
    reader's Colab may lack, so the exercise holds the number and this checks it)."""
    from flashref.exercises import hopper as ex
    from flashref.triton import hopper_backward_fused

    d = ex.FUSED_DQ["d"]
    assert d in hopper_backward_fused.HEAD_DIMS
    assert hopper_backward_fused.default_config(d)["block_n"] == ex.FUSED_DQ["keys_per_program"]


def test_checkers_answer_what_a_reader_may_return_without_raising():
    """Answers that once escaped a checker as an exception: the reader's own error, a torch tensor where
    NumPy was expected, a list where a word was, strings where arrays were, a bf16 or sparse mask."""
    import torch

    from flashref import reference
    from flashref.exercises import backward, beyond, cupy_kernels, model, score_mods, sparsity

    cases = [
        (score_mods.check_cu_seqlens, lambda lengths: 1 / 0, "raised ZeroDivisionError"),
        (score_mods.check_cu_seqlens, lambda lengths: [0, [1, 2]], "not a 1-D array of integers"),
        (score_mods.check_cu_seqlens, lambda lengths: torch.zeros(3, requires_grad=True), "dtype float32"),
        (cupy_kernels.check_causal_tile_rule, lambda *a: ["skip"], 'one of "skip", "mask" or "full"'),
        (beyond.check_merge_splits, lambda o, lse: ("o", "lse"), "arrays of numbers"),
        (sparsity.check_sink_window_mask, lambda n, w: torch.ones(1, 1, n, n, dtype=torch.bfloat16), "bfloat16"),
        (model.check_window_mask, lambda N, w: torch.ones(N, N, dtype=torch.bool).to_sparse(), "dense bool"),
        (model.check_window_mask, lambda N, w: torch.ones(N, N, dtype=torch.bool, device="meta"), "dense bool"),
        (backward.check_delta, [[1.0, 2.0], [3.0]], "array of numbers"),
    ]
    for check, answer, words in cases:
        verdict = check(answer)
        assert isinstance(verdict, Verdict) and not verdict and words in repr(verdict), repr(verdict)
    q, k, v, do = backward.delta_problem()
    delta = np.sum(do * reference.attention(q, k, v, causal=True), axis=-1)
    assert backward.check_delta(torch.tensor(delta))  # the right answer, as a torch tensor


@pytest.mark.parametrize("name,check", CHECKERS, ids=[n for n, _ in CHECKERS])
def test_an_integer_beyond_any_float_is_a_wrong_answer(name, check):
    for answer in (10**400, (10**400, 1), (float("inf"), 1)):
        verdict = check(answer)
        assert isinstance(verdict, Verdict) and not verdict, (answer, verdict)


def test_quantize_checker_answers_a_scale_that_is_no_tensor():
    import torch

    from flashref.exercises import hopper

    verdict = hopper.check_quantize_blocks(lambda x, rows: (x.to(torch.float8_e4m3fn), None))
    assert not verdict and "scale should be a float32 tensor" in repr(verdict), repr(verdict)
