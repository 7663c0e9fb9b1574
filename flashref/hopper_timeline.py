"""Which unit of one H100 SM is busy when: a schedule model of the forward kernel's main loop, one picture per
idea of FlashAttention-3 (notebook ``14_flashattention3_on_hopper``), and of the backward's tile pairs in two
kernels or one (:func:`backward`).

The model has three units: the TMA copy engine (loads K and V tiles), the tensor cores (the products
S = Q K^T and O += P V) and the exponential units (softmax). Each *stream* (a program, or a warpgroup of one)
runs its operations in program order. An operation starts when its stream has reached it, its inputs are
ready and its unit is free; a unit does one operation at a time. Copies and products are asynchronous:
the stream issues them and goes on. Softmax runs on the stream's own warps, so the stream waits for it.
Waits are written as inputs: "softmax j needs S_j" is the wait for S_j.

Operation times come from the H100 SXM's data sheet (:data:`H100`): dense fp16 tensor-core throughput, the
exponential (special function) throughput FlashAttention-3's paper quotes, both divided among 132 SMs, and
an assumed 64 bytes a clock from L2 into each SM. It is a model for pictures, not a measurement: the
measured effect of each idea is the benchmark's (``python -m flashref.bench hopper``).
"""

from __future__ import annotations

from typing import NamedTuple

#: H100 SXM rates (data sheet; exponentials as FlashAttention-3's paper gives them), per second, whole GPU.
H100 = dict(sms=132, fp16_flops=989e12, fp8_flops=1979e12, exp_per_s=3.9e12, l2_bytes_per_sm=64 * 1.755e9)

UNITS = ("TMA", "tensor cores", "exponentials")


class Op(NamedTuple):
    """One operation of a stream: ``name`` (unique in the schedule), its unit (one of :data:`UNITS`),
    ``seconds`` on it, the names of the operations it waits for, and whether the stream waits for it to end
    (``sync``: softmax) or only issues it (copies, products)."""
    name: str
    unit: str
    seconds: float
    after: tuple = ()
    sync: bool = False


class Busy(NamedTuple):
    """An interval a unit spends on one operation of one stream."""
    stream: str
    name: str
    unit: str
    start: float
    end: float


def tile_seconds(block_m: int, block_n: int, d: int, *, fp8: bool = False, rates: dict = H100) -> dict:
    """Seconds one SM spends on a ``block_m x block_n`` tile at head dim ``d``: ``{"load": K and V tiles from
    L2, "S": Q K^T, "PV": P V, "softmax": block_m * block_n exponentials}``; the products at the fp16 or
    (``fp8``) FP8 tensor-core rate, one byte or two a value."""
    flops_per_sm = (rates["fp8_flops"] if fp8 else rates["fp16_flops"]) / rates["sms"]
    gemm = 2 * block_m * block_n * d / flops_per_sm
    return {"load": 2 * block_n * d * (1 if fp8 else 2) / rates["l2_bytes_per_sm"], "S": gemm, "PV": gemm,
            "softmax": block_m * block_n / (rates["exp_per_s"] / rates["sms"])}


def simulate(streams: dict) -> list:
    """``streams``: ``{stream name: [Op, ...]}`` in program order. Returns the :class:`Busy` intervals, list
    scheduling: of the operations next in their streams, the one that can start earliest goes first. An input
    named ``"<op>@start"`` is ready when that operation starts (is issued) rather than when it ends."""
    done, unit_free = {}, {u: 0.0 for u in UNITS}
    issue_at, position = {s: 0.0 for s in streams}, {s: 0 for s in streams}
    busy = []

    def earliest(stream):
        op = streams[stream][position[stream]]
        if any(name not in done for name in op.after):
            return None  # waits for an operation of another stream not yet placed
        return max([issue_at[stream], unit_free[op.unit]] + [done[name] for name in op.after])

    while any(position[s] < len(ops) for s, ops in streams.items()):
        ready = [(t, s) for s in streams if position[s] < len(streams[s]) and (t := earliest(s)) is not None]
        if not ready:
            raise ValueError("the schedule waits in a circle: an operation waits for one that comes after it")
        start, stream = min(ready, key=lambda x: x[0])
        op = streams[stream][position[stream]]
        end = start + op.seconds
        busy.append(Busy(stream, op.name, op.unit, start, end))
        done[op.name], done[op.name + "@start"], unit_free[op.unit] = end, start, end
        issue_at[stream] = end if op.sync else start
        position[stream] += 1
    return busy


def _loads(prefix, n_tiles, t, stages, freed_by):
    """TMA copies of K_j and V_j into a ring of ``stages`` slots: copy j waits for tile j - stages's slot,
    freed by the operation ``freed_by(j - stages)``."""
    return [Op(f"{prefix}load{j}", "TMA", t["load"], (freed_by(j - stages),) if j >= stages else ())
            for j in range(n_tiles)]


def serial(n_tiles=4, t=None, stages=1, prefix=""):
    """One program: each tile's copy, S, softmax and P V wait for the one before (``stages=1``); with more
    stages the copies run ahead into a ring, the rest stays in line."""
    t = t or tile_seconds(128, 128, 128)
    ops = []
    loads = _loads(prefix, n_tiles, t, stages, lambda j: f"{prefix}PV{j}")
    for j in range(n_tiles):
        if stages == 1:  # the one slot: this tile's copy is issued once the last tile is used
            ops.append(loads[j])
        previous = (f"{prefix}PV{j - 1}",) if j > 0 else ()  # in line: S_j after P_{j-1} V_{j-1}
        ops += [Op(f"{prefix}S{j}", "tensor cores", t["S"], (f"{prefix}load{j}",) + previous),
                Op(f"{prefix}softmax{j}", "exponentials", t["softmax"], (f"{prefix}S{j}",), sync=True),
                Op(f"{prefix}PV{j}", "tensor cores", t["PV"], (f"{prefix}softmax{j}",))]
    if stages == 1:
        return {prefix + "program": ops}
    return {prefix + "TMA": loads, prefix + "program": ops}


def overlapped(n_tiles=4, t=None, stages=3, as_compiled=False):
    """Intra-warpgroup overlap as FlashAttention-3 writes it: S_j and P_{j-1} V_{j-1} are issued together,
    softmax j waits for S_j alone and runs while P_{j-1} V_{j-1} does. ``as_compiled``: as ptxas (CUDA 13)
    schedules our Gluon kernel's version, the wait for P_{j-1} V_{j-1} moved up before softmax j."""
    t = t or tile_seconds(128, 128, 128)
    ops = [Op("S0", "tensor cores", t["S"], ("load0",)),
           Op("softmax0", "exponentials", t["softmax"], ("S0",), sync=True)]
    for j in range(1, n_tiles):
        ops += [Op(f"S{j}", "tensor cores", t["S"], (f"load{j}",)),
                Op(f"PV{j - 1}", "tensor cores", t["PV"], (f"softmax{j - 1}",)),
                Op(f"softmax{j}", "exponentials", t["softmax"], (f"S{j}",) + ((f"PV{j - 1}",) * as_compiled),
                   sync=True)]
    ops.append(Op(f"PV{n_tiles - 1}", "tensor cores", t["PV"], (f"softmax{n_tiles - 1}",)))
    return {"TMA": _loads("", n_tiles, t, stages, lambda j: f"PV{j}"), "program": ops}


def two_programs(n_tiles=4, t=None, stages=2):
    """Two programs on one SM, each in line as :func:`serial` with tile times ``t`` (pass the half tile's,
    ``tile_seconds(64, 128, 128)``: the default is the whole tile's); nothing coordinates them: the warp
    schedulers give a unit to whichever is ready."""
    streams = {}
    for p in ("A ", "B "):  # each program's tile: half the rows
        streams.update(serial(n_tiles, t, stages, prefix=p))
    return streams


def warp_specialized(n_tiles=4, t=None, stages=2, pingpong=False, overlap=False):
    """A producer warp issues the copies; two consumer warpgroups of half the rows each. K_j and V_j have slots of
    their own, each refilled once both consumers are done with it (modelled: once WG1 is). Round r of a consumer
    issues P_{r-1} V_{r-1} and S_r, waits for both, then runs softmax r. With ``pingpong`` a consumer issues
    round r's products only once the other has issued its own (warpgroup 0 goes first). With ``overlap`` (step
    7) each consumer issues S_r first, runs softmax r as soon as S_r is done, while P_{r-1} V_{r-1} runs, and
    waits for P_{r-1} V_{r-1} before the next round's products."""
    t = t or tile_seconds(64, 128, 128)
    wgs = ("WG0", "WG1")
    half = dict(t, load=t["load"] / 2)  # K_j and V_j: half the bytes each
    loads = []
    for j in range(n_tiles):
        loads += [Op(f"loadK{j}", "TMA", half["load"], (f"WG1 S{j - stages}",) if j >= stages else ()),
                  Op(f"loadV{j}", "TMA", half["load"], (f"WG1 PV{j - stages}",) if j >= stages else ())]
    streams = {"producer": loads}
    issued = {}  # (warpgroup, round) -> the last product it issues that round
    for w, wg in enumerate(wgs):
        ops = []
        for r in range(n_tiles + 1):
            turn = ()
            if pingpong and w == 1:
                turn = (f"{issued[0, r]}@start",)
            elif pingpong and r > 0:
                last = f"PV{r - 2}" if overlap and r >= 2 else f"S{r - 1}"  # WG1's last product of round r - 1
                turn = (f"WG1 {last}@start",)
            pv = [Op(f"{wg} PV{r - 1}", "tensor cores", t["PV"], (f"{wg} softmax{r - 1}", f"loadV{r - 1}") + turn)
                  ] if r > 0 else []
            waited = (f"{wg} PV{r - 2}",) if overlap and r >= 2 else ()  # the last round's wait for O
            s = [Op(f"{wg} S{r}", "tensor cores", t["S"], (f"loadK{r}",) + turn + waited)] if r < n_tiles else []
            products = s + pv if overlap else pv + s
            issued[w, r] = products[-1].name
            ops += products
            if r < n_tiles:  # softmax r waits for S_r, and (without overlap) for P_{r-1} V_{r-1} too
                ops.append(Op(f"{wg} softmax{r}", "exponentials", t["softmax"],
                              tuple(p.name for p in (s if overlap else products)), sync=True))
        streams[wg] = ops
    return streams


def backward(n_tiles=4, fused=False, t=None, stages=2):
    """The backward's tile pairs at d = 128 (64 keys x 64 queries), one warpgroup in line with a producer's ring of
    ``stages`` slots: the dK/dV kernel (``"dK/dV"``: each query tile's Q_i and dO_i copied, S^T and dP^T, the
    exponentials of P^T, then dV and dK; the next tile waits for all of them) and then the dQ kernel (``"dQ"``:
    each key tile's K_j and V_j, S and dP again, the exponentials again, then dQ), each over ``n_tiles`` pairs.
    ``fused``: one kernel (:mod:`flashref.triton.hopper_backward_fused`) whose step adds dQ's product after dK's
    and hands dQ's fp32 tile to the TMA unit to reduce into memory (``red``), which nobody waits for."""
    t = t or tile_seconds(64, 64, 128)
    streams = {}
    kernels = [("dK/dV", "QdO")] if fused else [("dK/dV", "QdO"), ("dQ", "KV")]
    before = ()  # a kernel starts once the one before it has ended
    for k, (kernel, copied) in enumerate(kernels):
        p = f"{kernel} "
        products = ["dV", "dK", "dQ"] if fused else (["dV", "dK"] if k == 0 else ["dQ"])
        done = [f"{p}{products[-1]}{i}" for i in range(n_tiles)]  # a tile's slot is free once its products are
        copies = [Op(f"{p}{copied}{i}", "TMA", t["load"], (done[i - stages],) if i >= stages else before)
                  for i in range(n_tiles)]
        ops = []
        for i in range(n_tiles):
            last = (done[i - 1],) if i else before  # in line: the next tile waits for every product of this one
            ops += [Op(f"{p}S{i}", "tensor cores", t["S"], (f"{p}{copied}{i}",) + last),
                    Op(f"{p}dP{i}", "tensor cores", t["S"], (f"{p}{copied}{i}",) + last),
                    Op(f"{p}e{i}", "exponentials", t["softmax"], (f"{p}S{i}",), sync=True)]
            ops += [Op(f"{p}{x}{i}", "tensor cores", t["PV"], (f"{p}e{i}", f"{p}dP{i}")) for x in products]
        streams[f"{kernel} copies"] = copies
        streams[f"{kernel} kernel"] = ops
        if fused:  # each a 64 x 128 fp32 tile out, as many bytes as the Q_i and dO_i tiles in: queued to the TMA
            streams["dQ reduces"] = [Op(f"red{i}", "TMA", t["load"], (done[i],)) for i in range(n_tiles)]
        before = (done[-1],)
    return streams


def makespan(busy) -> float:
    """Seconds from the first start to the last end."""
    return max(b.end for b in busy) - min(b.start for b in busy)


def utilization(busy, unit: str) -> float:
    """The share of the makespan ``unit`` is busy."""
    return sum(b.end - b.start for b in busy if b.unit == unit) / makespan(busy)


def draw(ax, busy, title: str = "", legend: bool = True):
    """One row a unit, one bar an operation (microseconds), coloured by stream; bars wide enough carry their
    operation's name (KV j: the copy of K_j and V_j, K j and V j each alone; S j, PV j: the products; e j: softmax
    j's exponentials)."""
    import matplotlib.pyplot as plt

    streams = list(dict.fromkeys(b.stream for b in busy))
    colours = dict(zip(streams, plt.get_cmap("tab10").colors))
    span = makespan(busy)
    for b in busy:
        row = UNITS.index(b.unit)
        ax.barh(row, (b.end - b.start) * 1e6, left=b.start * 1e6, color=colours[b.stream], edgecolor="white",
                height=0.7, label=b.stream)
        if b.end - b.start > span / 40:
            name = b.name.split()[-1].replace("loadK", "K").replace("loadV", "V").replace("load", "KV")
            name = name.replace("softmax", "e")
            ax.text((b.start + b.end) / 2 * 1e6, row, name, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(UNITS)), UNITS, fontsize=8)
    ax.set_ylim(len(UNITS) - 0.5, -0.5)
    ax.set_title(title, fontsize=9, loc="left")
    if legend and len(streams) > 1:
        handles, labels = ax.get_legend_handles_labels()
        first = dict(zip(labels, handles))
        ax.legend(first.values(), first.keys(), fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 0.98),
                  ncol=len(first), frameon=False)
