"""Run the test suite under each OpenBLAS kernel family that NumPy may pick, once for each distinct set of kernels.

    python tests/openblas_cores.py [pytest arguments]

NumPy's OpenBLAS chooses its kernels for the CPU it finds, and they round sums in different orders, so a result
that passes on one machine can fail on another. OPENBLAS_CORETYPE forces a family; conftest.py checks in every
pytest worker that the kernels OpenBLAS reports are the ones asked for. What runs:

- **The whole suite** under each family a CI machine's NumPy picks (:data:`CI_CORES`): Haswell (Intel without
  AVX-512, and AMD EPYC, whose Zen name OpenBLAS maps to the Haswell kernels) and SkylakeX (Intel with AVX-512).
- **The NumPy arithmetic** (:data:`NUMPY_TESTS`: the float64 reference, the online softmax, the tiled NumPy
  algorithm, the IO model and the NumPy notebooks 01-05) under the families of older CPUs a reader may have
  (:data:`OLD_CORES`). The whole suite under each of those, on top, took CI past its time limit.
- A family whose kernels were already tested (Zen runs the Haswell ones) is not run again, and a family this CPU
  cannot run (SkylakeX needs AVX-512) is reported as not tested here, never as passed.
- Where no CI family can run (a CPU without AVX2), the whole suite runs once under the kernels OpenBLAS picks for
  this CPU itself.

The table at the end says, for each family, which kernels ran, what ran under them and whether it passed.
"""

from __future__ import annotations

import os
import subprocess
import sys

CI_CORES = ("Haswell", "SkylakeX", "Zen")
OLD_CORES = ("Sandybridge", "Prescott")
NUMPY_TESTS = ("tests/test_reference.py", "tests/test_reference_features.py", "tests/test_online_softmax.py",
               "tests/test_numpy_flash.py", "tests/test_numpy_flash_memory.py", "tests/test_iomodel.py",
               "notebooks/01_standard_attention.ipynb", "notebooks/02_online_softmax.ipynb",
               "notebooks/03_tiled_forward.ipynb", "notebooks/04_io_complexity.ipynb",
               "notebooks/05_backward_recomputation.ipynb")
PROBE = "from conftest import openblas_core; print(openblas_core())"


def runnable(core: str) -> str | None:
    """The kernels OpenBLAS reports when asked for ``core``, or None when the CPU cannot run them."""
    env = dict(os.environ, OPENBLAS_CORETYPE=core)
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def plan() -> list[tuple[str, str | None, str]]:
    """(family, kernels it runs or None, "suite" / "numpy" / "" for nothing new), in the order they run."""
    steps, tested = [], set()
    for core in CI_CORES + OLD_CORES:
        kernels = runnable(core)
        scope = "suite" if core in CI_CORES else "numpy"
        if kernels is None or kernels.lower() in tested:
            scope = ""
        else:
            tested.add(kernels.lower())
        steps.append((core, kernels, scope))
    return steps


def run(core: str | None, kernels: str, scope: str, args) -> str:
    """Run pytest under ``core`` (None: no OPENBLAS_CORETYPE, the kernels OpenBLAS picks for this CPU)."""
    env = dict(os.environ, OPENBLAS_CORETYPE=core, FLASHREF_EXPECT_OPENBLAS_CORE=kernels) if core else dict(os.environ)
    paths = list(NUMPY_TESTS) if scope == "numpy" else []
    what = "the whole suite" if scope == "suite" else "the NumPy arithmetic"
    forced = f"OPENBLAS_CORETYPE={core}" if core else "OPENBLAS_CORETYPE unset"
    print(f"\n=== {forced} (OpenBLAS runs its {kernels} kernels): {what}", flush=True)
    code = subprocess.run([sys.executable, "-m", "pytest", *args, *paths], env=env).returncode
    verdict = "passed" if code == 0 else f"FAILED (pytest exit code {code})"
    return f"{what} {verdict}, with the {kernels} kernels"


#: The row of the table for the run under the kernels this CPU's OpenBLAS picks itself.
OWN = "(own choice)"


def main(args) -> int:
    results = {}
    steps = plan()
    for core, kernels, scope in steps:
        if kernels is None:
            results[core] = "NOT TESTED: this CPU cannot run these kernels (the probe crashed)"
        elif not scope:
            results[core] = f"runs the {kernels} kernels, already tested above"
        else:
            results[core] = run(core, kernels, scope, args)
    if not any(scope == "suite" for _, _, scope in steps):
        # No CI family ran here (a CPU without AVX2, or probes that crash): the whole suite still runs once, under
        # the kernels OpenBLAS picks for this CPU, so that `make test` never passes having run only a subset.
        results[OWN] = run(None, "this CPU's own", "suite", args)
    print("\nThe tests under each OpenBLAS core type:")
    for core, result in results.items():
        print(f"  {core:12s} {result}")
    return 1 if any("FAILED" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
