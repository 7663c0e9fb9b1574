"""Compile the kernels for a GPU we do not have, and read the shared memory each config needs.

    FLASHREF_TRITON_COMPILE_ONLY=1 python -m flashref.triton.compile_check      # prints a table
    FLASHREF_TRITON_COMPILE_ONLY=1 python -m flashref.triton.compile_check shared|wgmma|hopper|overlap  # one
    print(report_in_child("wgmma"))                                              # the same, from a notebook

Triton compiles for any target on a CPU machine: ``triton.compile(ASTSource(fn, signature, constexprs),
target=GPUTarget("cuda", capability, 32))`` runs the whole pipeline down to a cubin (``ptxas`` ships with
Triton) and reports ``metadata.shared``, the bytes of shared memory one program needs. That is how
``tests/test_triton_compile.py`` checks that every config a T4, an A100 or an H100 would keep fits it.
Kernels defined under the interpreter cannot be compiled, so this must run with ``TRITON_INTERPRET`` unset
(``FLASHREF_TRITON_COMPILE_ONLY=1`` tells :mod:`flashref.triton` not to set it). Notebook ``07_triton_forward``.
"""

from __future__ import annotations

import os
import sys

from flashref.triton import configs

_TY = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _signature(kernel: str, dtype: str):
    """Argument types in the kernel's order (pointers, then strides and sizes as i32, scales as fp32)."""
    ptr = f"*{_TY[dtype]}"
    f32p = "*fp32"
    strides = lambda n: ["i32"] * (4 * n)  # noqa: E731
    bm = ["*i8", "*i32"]  # the block mask and its lists of visible blocks
    lists = ["i32"] * 3  # the lists' strides
    features = ["i32", "i32", "i64", "i32", "fp32"]  # TUNE_N, GROUP, seed, drop_below, keep_scale
    # ALIBI_SLOPES, CU_Q, CU_K, stride_ab, stride_ah, win_left, win_right, cap_in, cap_out
    mods = ["*fp32", "*i32", "*i32"] + ["i32"] * 4 + ["fp32"] * 2
    if kernel == "forward":
        return [ptr] * 4 + [f32p] * 3 + bm + strides(5) + lists + ["i32"] * 3 + ["fp32"] + features + mods
    if kernel == "dkdv":  # SPLIT after GROUP
        return [ptr] * 6 + [f32p] * 4 + bm + strides(8) + lists + ["i32"] * 3 + ["fp32", "fp32"] + features[:2] \
            + ["i32"] + features[2:] + mods
    if kernel == "dq":
        return [ptr] * 5 + [f32p] * 3 + bm + strides(6) + lists + ["i32"] * 3 + ["fp32", "fp32"] + features + mods
    raise ValueError(f"kernel must be 'forward', 'dkdv' or 'dq', got {kernel!r}")


def _kernel(kernel: str):
    from flashref.triton.backward import flash_bwd_dkdv_kernel, flash_bwd_dq_kernel
    from flashref.triton.forward import flash_fwd_kernel

    return {"forward": flash_fwd_kernel, "dkdv": flash_bwd_dkdv_kernel, "dq": flash_bwd_dq_kernel}[kernel]


def _launch_specialization(fn, constexprs: dict, signature: dict) -> dict:
    """Specialize the arguments as a real launch on contiguous tensors does, so the compiled figure is the
    one the GPU sees: Triton turns an integer argument equal to 1 (the head-dim strides) into a constant,
    and marks pointers and integers divisible by 16 (base addresses, row strides) with that fact. Both let
    it load 16-byte vectors and pipeline them with asynchronous copies; without them it compiles scalar
    loads that need far less shared memory (seen: 96 KB instead of 224 KB for the largest H100 forward)."""
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            continue
        if name.startswith("stride_") and name.endswith("d"):
            constexprs[name] = 1
            signature[name] = "constexpr"
        elif name in ("stride_ab", "stride_ah"):  # the slopes' strides: 0 or 1 or H, no alignment to claim
            continue
        elif signature[name].startswith("*") or name.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_config(kernel: str, cfg: configs.TileConfig, capability: int, head_dim: int, dtype: str = "float16",
                   causal: bool = False, block_size: int | None = None, dropout: bool = False,
                   window: bool = False, softcap: bool = False, alibi: bool = False, varlen: bool = False,
                   one_head: bool = True, d_split: int | None = None):
    """Compile one config of ``kernel`` for a GPU of compute ``capability`` as a launch on contiguous tensors
    would; return the compiled kernel (``.metadata.shared`` is its shared memory in bytes). ``block_size``
    compiles the block-sparse variant, ``dropout`` the one with fused dropout, ``window``, ``softcap``,
    ``alibi`` and ``varlen`` those with the score modifications and packed batches; ``one_head=False`` the dK/dV
    kernel with its loop over a group's query heads (grouped-query attention); ``d_split`` the dK/dV kernel's
    column split (default: what the deterministic backward launches for this head dim on a GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashref.triton.forward import DOT_IEEE, DOT_NATIVE

    if os.environ.get("TRITON_INTERPRET", "") == "1":
        raise RuntimeError("kernels defined under TRITON_INTERPRET=1 cannot be compiled: run with "
                           "FLASHREF_TRITON_COMPILE_ONLY=1 and TRITON_INTERPRET unset")
    fn = _kernel(kernel)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
                  "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "CAUSAL": causal,
                  "DOT": (DOT_IEEE if dtype == "float32" else DOT_NATIVE).value, "HAS_BM": block_size is not None,
                  "BLOCK_SIZE": block_size or 1, "LIST_SIZE": configs.list_size(block_size) if block_size else 1,
                  "DROPOUT": dropout, "WINDOW": window, "SOFTCAP": softcap,
                  "ALIBI": alibi, "VARLEN": varlen}
    if kernel == "dkdv":
        constexprs["ATOMIC_DQ"] = False  # the default, deterministic path
        constexprs["ONE_HEAD"] = one_head  # True: multi-head attention, one query head per program
        constexprs["D_SPLIT"] = d_split or configs.column_split(constexprs["BLOCK_D"])
    types = _signature(kernel, dtype)
    runtime = [n for n in fn.arg_names if n not in constexprs]
    if len(runtime) != len(types):
        raise AssertionError(f"{kernel}: {len(runtime)} runtime arguments, signature has {len(types)}")
    signature = dict(zip(runtime, types))
    signature.update({n: "constexpr" for n in constexprs})
    attrs = _launch_specialization(fn, constexprs, signature)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", capability, 32)
    return triton.compile(src, target=target, options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def compile_hopper(head_dim: int, switches: dict | None = None, causal: bool = False, dtype: str = "float16",
                   window: bool = False, dropout: bool = False, block_size: int | None = None, token: bool = False):
    """Compile :mod:`flashref.triton.hopper`'s Gluon forward for an H100 (sm_90) as a launch of
    :func:`~flashref.triton.hopper.hopper_forward` with these switches would (none: its defaults), or of
    :func:`~flashref.triton.hopper.fp8_attention` for ``dtype="float8_e4m3"``; return the compiled kernel. Its
    PTX shows the TMA copies, wgmma products and register moves it asks for. ``window``: the kernel that takes
    ``window_size``; ``dropout``: the kernel that drops P (without switches, the tile of
    :func:`~flashref.triton.hopper.dropout_config`); ``block_size``: the kernel that walks a block mask's lists
    (without switches, the tile of :func:`~flashref.triton.hopper.block_mask_config`); ``token``: the kernel that
    reads Q, K, V and writes O in the (B, N, H, d) layout (:func:`~flashref.triton.hopper.token_major`)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    import triton
    from flashref.triton import hopper

    if os.environ.get("TRITON_INTERPRET", "") == "1":
        raise RuntimeError("kernels defined under TRITON_INTERPRET=1 cannot be compiled: run with "
                           "FLASHREF_TRITON_COMPILE_ONLY=1 and TRITON_INTERPRET unset")
    fp8 = dtype == "float8_e4m3"
    if dropout and not switches:  # the tile flash_attention runs dropout on
        cfg = hopper.dropout_config(head_dim)
    elif block_size is not None and not switches:  # the tile flash_attention runs a block mask on
        cfg = hopper.block_mask_config(head_dim, block_size)
    else:
        # FP8 runs warp-specialized, without overlap (as fp8_attention does)
        fp8_switches = {"warp_specialize": True, "overlap": False} if fp8 else {}
        cfg = hopper.config(head_dim, **dict(switches or {}, **fp8_switches))
    ty, gdt = {"float16": ("fp16", gl.float16), "bfloat16": ("bf16", gl.bfloat16),
               "float8_e4m3": ("fp8e4nv", gl.float8e4nv)}[dtype]
    q_block, kv_block = hopper._descriptor_blocks(cfg, head_dim)
    v_block = kv_block[::-1] if fp8 else kv_block  # FP8 reads V transposed
    lay = {repr(b): gl.NVMMASharedLayout.get_default_for(b, gdt) for b in (q_block, kv_block, v_block)}
    signature = {"q_desc": f"tensordesc<{ty}{q_block},{lay[repr(q_block)]!r}>",
                 "k_desc": f"tensordesc<{ty}{kv_block},{lay[repr(kv_block)]!r}>",
                 "v_desc": f"tensordesc<{ty}{v_block},{lay[repr(v_block)]!r}>",
                 "O": "*fp16" if fp8 else f"*{ty}", "LSE": "*fp32", "M2": "*fp32", "L2": "*fp32"}
    if cfg["warp_specialize"]:
        signature.update(QS="*fp32", KS="*fp32", VS="*fp32")
    signature.update({"N_q": "i32", "N_k": "i32", "qk_scale": "fp32", "win_left": "i32", "win_right": "i32"})
    signature.update({"seed": "i64", "drop_below": "i32", "keep_scale": "fp32"})
    signature.update({"LISTS": "*i32", "stride_lb": "i32", "stride_lh": "i32", "stride_li": "i32", "H": "i32"})
    fn, constexprs, options = hopper.kernel_and_constexprs(cfg, head_dim, causal, window, dropout, block_size, token)
    if fp8:
        constexprs["FP8"] = True
    signature.update({n: "constexpr" for n in constexprs})
    attrs = {(fn.arg_names.index("O"),): [["tt.divisibility", 16]]}  # torch's allocations are 16-byte aligned
    src = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(options, num_warps=constexprs["num_warps"]))


def ptxas_usage(compiled, capability: int = 90) -> dict:
    """Registers a thread and bytes of register spills (stores and loads to local memory) of a compiled
    kernel, as ``ptxas -v`` reports them for its PTX (the ptxas that ships with Triton): how close a config
    comes to the 255 registers a thread may hold. A spill is a trip to memory inside the tile loop, so the
    figure explains a config that is slower than its tile size promises, and it needs no GPU."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    arch = "sm_90a" if capability == 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        done = subprocess.run([get_ptxas(capability).path, "-v", f"--gpu-name={arch}", ptx, "-o", os.devnull],
                              capture_output=True, text=True, check=True)
    text = done.stdout + done.stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": int(re.search(r"Used (\d+) registers", text).group(1)),
            "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2))}


def table(gpus=("T4", "A100", "H100"), head_dims=(64, 128), dtype="float16", kernels=("forward", "dkdv", "dq")):
    """Rows (gpu, kernel, head_dim, config, estimated bytes, compiled bytes, limit) for every kept config."""
    rows = []
    for gpu in gpus:
        spec = configs.GPUS[gpu]
        for kernel in kernels:
            for d in head_dims:
                block_d = max(16, 1 << (d - 1).bit_length())
                kept = configs.candidates(kernel, block_d, 2 if dtype != "float32" else 4, spec["shared_bytes"],
                                          t4=gpu == "T4", capability=spec["capability"])
                for cfg in kept:
                    compiled = compile_config(kernel, cfg, spec["capability"], d, dtype)
                    estimate = configs.shared_bytes_estimate(kernel, cfg, block_d, 2, spec["capability"])
                    rows.append((gpu, kernel, d, cfg, estimate, compiled.metadata.shared, spec["shared_bytes"]))
    return rows


def shared_report() -> str:
    """The forward's shared memory at d = 128 in a T4 config and an H100 config, against each GPU's limit."""
    lines = []
    for gpu, cfg in [("T4", configs.TileConfig(64, 64, 4, 2)), ("H100", configs.TileConfig(128, 64, 4, 3))]:
        spec = configs.GPUS[gpu]
        k = compile_config("forward", cfg, spec["capability"], 128)
        lines.append(f"{gpu}: forward {cfg.block_m}x{cfg.block_n}, d=128, {cfg.num_stages} stages: "
                     f"{k.metadata.shared // 1024} KB of {spec['shared_bytes'] // 1024} KB")
    return "\n".join(lines)


def wgmma_report() -> str:
    """What the PTX of the forward (128 x 128 tiles, 8 warps, 3 stages, d = 128) for an H100 holds: its
    asynchronous tensor-core products (wgmma), exponentials, barriers, and how often it waits for every
    product in flight (``wgmma.wait_group 0``)."""
    import re

    import triton

    k = compile_config("forward", configs.TileConfig(128, 128, 8, 3), 90, 128)
    ptx = k.asm["ptx"]
    waits = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)]
    return (f"Triton {triton.__version__}, forward 128x128/8w/3s, d=128, for an H100: "
            f"{k.metadata.shared // 1024} KB of shared memory, {ptx.count('wgmma.mma_async')} wgmma instructions, "
            f"{ptx.count('ex2.approx')} exp2, {ptx.count('bar.sync')} barriers\n"
            f"waits for the tensor cores: {len(waits)}; waits until no product is in flight: {waits.count(0)}")


def sass(compiled) -> str:
    """The SASS (the GPU's own instructions, after ptxas) of a compiled kernel, as the ``cuobjdump`` that ships
    beside Triton's ``ptxas`` disassembles its cubin."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    tool = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout


def exponentials_under_a_product(sass_text: str) -> int:
    """The most exponentials (``MUFU.EX2``) the SASS runs between a wait that leaves one product in flight
    (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) and the next wait for every product (``0x0``): the softmax work that
    overlaps a product on the tensor cores inside one warpgroup. 0 where the wait for the product comes first."""
    import re

    best, counting, n = 0, False, 0
    for op in re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([01])|(MUFU\.EX2)", sass_text):
        if op[0] == "1":
            counting, n = True, 0
        elif op[0] == "0":
            if counting:
                best = max(best, n)
            counting = False
        elif counting:
            n += 1
    return best


def hopper_report(head_dim: int = 128) -> str:
    """For each step of :data:`flashref.bench.hopper_bench.STEPS`, what the Gluon forward compiled for an H100
    holds: shared memory, registers a thread (so programs an SM), its TMA copies, wgmma instructions, its
    waits for the tensor cores (``wait 1`` lets one product run on while the program goes on), the exponentials
    its SASS runs while a product is in flight (:func:`exponentials_under_a_product`: the PTX's order is not the
    GPU's) and, when warp-specialized, the register counts ``setmaxnreg`` sets: 24 a thread for the producer, 240
    for each consumer (256 is the kernel's own warps before they split, 120 the workers' while they wait for their
    partition)."""
    import re

    from flashref.bench.hopper_bench import STEPS
    from flashref.triton import hopper

    lines = [f"Gluon forward, d = {head_dim}, for an H100 (sm_90):"]
    for name, switches in STEPS:
        k = compile_hopper(head_dim, switches)
        ptx, use = k.asm["ptx"], ptxas_usage(k)
        warps = k.metadata.num_warps  # every partition's warps, rounded up to whole warpgroups
        per_sm = min(228 * 1024 // (k.metadata.shared + 1024), 65536 // (use["registers"] * 32 * warps))
        waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)
        moves = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
        regs = f"setmaxnreg {'/'.join(map(str, moves))}" if moves else f"{use['registers']} registers"
        lines.append(f"  {name}: {k.metadata.shared // 1024} KB shared, {warps} warps, {regs}, "
                     f"{per_sm} program(s) an SM, {ptx.count('cp.async.bulk.tensor')} TMA copies, "
                     f"{ptx.count('wgmma.mma_async')} wgmma, waits {' '.join(waits)}, "
                     f"exp2 under a product {exponentials_under_a_product(sass(k))}")
    return "\n".join(lines)


def overlap_report(head_dim: int = 128) -> str:
    """Whether the softmax of the overlapped loops runs under P V on the GPU: for step 3 (one warpgroup, the wait
    for O after the exponentials as written) and step 7 (each consumer, the wait in a block of its own) of
    :data:`flashref.bench.hopper_bench.STEPS`, the exponentials a thread's SASS runs between the wait for S (one
    product left in flight) and the wait for O: none, or the whole softmax (one per score a thread holds, and
    alpha's)."""
    from flashref.bench.hopper_bench import STEPS
    from flashref.triton import hopper

    lines = []
    for name, switches in (STEPS[2], STEPS[6]):
        k = compile_hopper(head_dim, switches)
        scores = hopper.config(head_dim, **switches)["block_n"] // 2  # a warpgroup's 64 rows over its 128 threads
        n = exponentials_under_a_product(sass(k))
        under = "none" if n == 0 else "the whole softmax" if n >= scores else "part of the softmax"
        lines.append(f"{name:52s} exponentials under P V: {under}")
    return "\n".join(lines)


REPORTS = {"shared": shared_report, "wgmma": wgmma_report, "hopper": hopper_report, "overlap": overlap_report}


def report_in_child(name: str) -> str:
    """One of :data:`REPORTS`, computed in a child Python with the interpreter off, so it works in a process
    whose kernels run interpreted (a notebook on a CPU machine) as well as on a GPU."""
    import subprocess

    if name not in REPORTS:
        raise ValueError(f"name must be one of {sorted(REPORTS)}, got {name!r}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FLASHREF_TRITON_COMPILE_ONLY"] = "1"
    done = subprocess.run([sys.executable, "-m", "flashref.triton.compile_check", name], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compile_check {name} failed:\n{done.stderr[-2000:]}")
    return done.stdout.rstrip("\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        if argv[0] not in REPORTS:
            print(f"usage: python -m flashref.triton.compile_check [{'|'.join(REPORTS)}]", file=sys.stderr)
            return 2
        print(REPORTS[argv[0]]())
        return 0
    for gpu, kernel, d, cfg, est, shared, limit in table():
        print(f"{gpu:5s} {kernel:8s} d={d:<4d} M={cfg.block_m:<4d} N={cfg.block_n:<4d} warps={cfg.num_warps} "
              f"stages={cfg.num_stages}  estimate {est / 1024:6.1f} KB  compiled {shared / 1024:6.1f} KB  "
              f"limit {limit / 1024:.0f} KB  {'fits' if shared <= limit else 'DOES NOT FIT'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
