"""Run the whole test suite once under each OpenBLAS kernel family that CI machines may pick.

    python tests/openblas_cores.py [pytest arguments]

NumPy's OpenBLAS chooses its kernels for the CPU it finds (Haswell or Zen on AMD EPYC, SkylakeX on recent
Intel, ...), and they round sums in different orders, so a result that passes on one machine can fail on
another. OPENBLAS_CORETYPE forces a family; the table at the end says which kernels OpenBLAS really ran
for each (its DYNAMIC_ARCH build maps some names: Prescott runs the Katmai kernels, Zen the Haswell ones),
and conftest.py checks in every pytest worker that those kernels are in use. A family this CPU cannot run
(SkylakeX needs AVX-512) is reported as not tested here, never as passed.
"""

from __future__ import annotations

import os
import subprocess
import sys

CORES = ("Prescott", "Sandybridge", "Haswell", "SkylakeX", "Zen")
PROBE = "from conftest import openblas_core; print(openblas_core())"


def runnable(core: str) -> str | None:
    """The core OpenBLAS reports when asked for ``core``, or None when the CPU cannot run it."""
    env = dict(os.environ, OPENBLAS_CORETYPE=core)
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def main(args) -> int:
    results = {}
    for core in CORES:
        reported = runnable(core)
        if reported is None:
            results[core] = "NOT TESTED: this CPU cannot run these kernels (the probe crashed)"
            continue
        print(f"\n=== OPENBLAS_CORETYPE={core} (OpenBLAS runs its {reported} kernels)", flush=True)
        env = dict(os.environ, OPENBLAS_CORETYPE=core, FLASHREF_EXPECT_OPENBLAS_CORE=reported)
        code = subprocess.run([sys.executable, "-m", "pytest", *args], env=env).returncode
        verdict = "passed" if code == 0 else f"FAILED (pytest exit code {code})"
        results[core] = f"{verdict}, with the {reported} kernels"
    print("\nThe test suite under each OpenBLAS core type:")
    for core, result in results.items():
        print(f"  {core:12s} {result}")
    return 1 if any(r.startswith("FAILED") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
