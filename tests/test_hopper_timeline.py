"""flashref.hopper_timeline, the schedule model behind notebook 14's pictures: the scheduler keeps its rules (a
unit does one thing at a time, nothing starts before its inputs end, streams keep program order), and each
picture shows what its caption says."""

from __future__ import annotations

import pytest

from flashref import hopper_timeline as ht

HALF = ht.tile_seconds(64, 128, 128)
SCHEDULES = {"serial": ht.serial(5), "ring": ht.serial(5, stages=3), "overlap": ht.overlapped(5),
             "overlap as compiled": ht.overlapped(5, as_compiled=True), "two programs": ht.two_programs(5, HALF),
             "warp specialized": ht.warp_specialized(5), "ping-pong": ht.warp_specialized(5, pingpong=True),
             "overlap in each consumer": ht.warp_specialized(5, overlap=True),
             "overlap and ping-pong": ht.warp_specialized(5, pingpong=True, overlap=True),
             "backward, two kernels": ht.backward(5), "backward, one kernel": ht.backward(5, fused=True)}


def _overlap(a, b) -> float:
    return max(0.0, min(a.end, b.end) - max(a.start, b.start))


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_scheduler_keeps_its_rules(name):
    streams = SCHEDULES[name]
    busy = ht.simulate(streams)
    assert len(busy) == sum(len(ops) for ops in streams.values())
    for unit in ht.UNITS:
        spans = sorted((b for b in busy if b.unit == unit), key=lambda b: b.start)
        assert all(a.end <= b.start + 1e-15 for a, b in zip(spans, spans[1:])), f"{unit} does two things at once"
    at = {b.name: b for b in busy}
    for ops in streams.values():
        for op in ops:
            for dep in op.after:
                ready = at[dep[:-len("@start")]].start if dep.endswith("@start") else at[dep].end
                assert at[op.name].start >= ready - 1e-15, f"{op.name} started before {dep}"
        starts = [at[op.name].start for op in ops]
        assert starts == sorted(starts), "a stream runs in program order"


def test_each_idea_shortens_the_loop_and_keeps_the_tensor_cores_busier():
    span = {name: ht.makespan(ht.simulate(s)) for name, s in SCHEDULES.items()}
    tc = {name: ht.utilization(ht.simulate(s), "tensor cores") for name, s in SCHEDULES.items()}
    assert span["serial"] > span["ring"] > span["overlap"]
    assert span["overlap as compiled"] == pytest.approx(span["ring"], rel=0.05)  # the wait moved: no overlap left
    assert span["warp specialized"] < span["ring"] and span["ping-pong"] <= span["warp specialized"]
    assert tc["serial"] < 0.55 and tc["ping-pong"] > 0.85  # of 5 tiles: the first S and the last P V stand alone


def test_serial_overlaps_nothing_and_ping_pong_overlaps_exponentials_with_products():
    busy = ht.simulate(SCHEDULES["serial"])
    assert sum(_overlap(a, b) for a in busy for b in busy if a.unit != b.unit) == 0
    busy = ht.simulate(SCHEDULES["ping-pong"])
    exps = [b for b in busy if b.unit == "exponentials"]
    products = [b for b in busy if b.unit == "tensor cores"]
    for e in exps[1:-1]:  # every softmax but the first and last runs beside the other warpgroup's products
        hidden = sum(_overlap(e, p) for p in products if p.stream != e.stream)
        assert hidden >= 0.9 * (e.end - e.start), e


def test_overlap_in_each_consumer_runs_its_softmax_under_its_own_product():
    """Step 7: softmax r of a consumer starts once S_r is done and runs beside its own P_{r-1} V_{r-1}; without
    overlap it waits for that product to end. A K slot is refilled once both consumers' S is done with it, a V slot
    once their P V is."""
    for overlap in (False, True):
        at = {b.name: b for b in ht.simulate(ht.warp_specialized(5, overlap=overlap))}
        for wg in ("WG0", "WG1"):
            for r in range(1, 5):
                e, pv = at[f"{wg} softmax{r}"], at[f"{wg} PV{r - 1}"]
                if overlap:
                    assert e.start < pv.end and _overlap(e, pv) > 0, (wg, r)
                else:
                    assert e.start >= pv.end, (wg, r)
        for j in range(2, 5):  # two stages
            assert at[f"loadK{j}"].start >= at[f"WG1 S{j - 2}"].end and at[f"loadV{j}"].start >= at[f"WG1 PV{j - 2}"].end
    # the other consumer's products already fill the tensor cores: the model gains little from step 7
    tc = {o: ht.utilization(ht.simulate(ht.warp_specialized(16, overlap=o)), "tensor cores") for o in (False, True)}
    assert tc[True] == pytest.approx(tc[False], abs=0.02) and tc[False] > 0.95


def test_tile_times_follow_the_data_sheet():
    t = ht.tile_seconds(128, 128, 128)
    assert t["S"] == t["PV"] == pytest.approx(2 * 128**3 / (989e12 / 132))
    # FlashAttention-3's point: exponentials take about half as long as the two products at d = 128 in fp16
    assert t["softmax"] / (t["S"] + t["PV"]) == pytest.approx(0.495, abs=0.01)
    assert ht.tile_seconds(128, 128, 128, fp8=True)["S"] == pytest.approx(t["S"] * 989 / 1979)


def test_a_circular_wait_is_an_error():
    streams = {"a": [ht.Op("x", "TMA", 1.0, ("y",))], "b": [ht.Op("y", "TMA", 1.0, ("x",))]}
    with pytest.raises(ValueError, match="circle"):
        ht.simulate(streams)


def test_the_one_kernel_backward_does_five_products_a_tile_pair_where_two_kernels_do_seven():
    """The same tile pairs: the one kernel's tensor cores work 5/7 of the two kernels' time, the loop is shorter
    by about that, and its dQ tiles go out through the TMA unit (as many reduces as tile pairs) while the
    warpgroup goes on; the dQ kernel starts only once the dK/dV kernel has ended."""
    n = 16
    two, one = ht.simulate(ht.backward(n)), ht.simulate(ht.backward(n, fused=True))

    def products(busy):
        return sum(b.end - b.start for b in busy if b.unit == "tensor cores")

    assert products(one) == pytest.approx(products(two) * 5 / 7)
    assert ht.makespan(one) < 0.8 * ht.makespan(two)
    reduces = [b for b in one if b.name.startswith("red")]
    assert len(reduces) == n and all(b.unit == "TMA" for b in reduces)
    last_dkdv = max(b.end for b in two if b.stream.startswith("dK/dV"))
    assert min(b.start for b in two if b.stream.startswith("dQ")) >= last_dkdv - 1e-15
