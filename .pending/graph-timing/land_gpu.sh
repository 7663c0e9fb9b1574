# Device call to try and land branch graph-timing (carry [".whl"]; about 300 s on an H100). From the repository root:
#   git fetch .pending/graph-timing.bundle graph-timing:graph-timing && git checkout graph-timing
#   bash .pending/graph-timing/land_gpu.sh    (copy it to .exp first: the branch has no .pending)
# Runs the new GPU test, the decode bench (every row gains graph_us), notebook 13 and nbval on it.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl nbval nbclient nbconvert ipykernel 2>&1 | tail -2
timeout 120 python3 -m pytest -q -o addopts= -p no:cacheprovider tests/test_decode_bench.py 2>&1 | tail -3
timeout 330 python3 -m flashref.bench decode 2>&1 | grep -v Warn | tail -40
tar czf $OUT/data.tgz book/data/decode_bench.json
timeout 100 python3 -m flashref.run_notebooks notebooks/13_*.ipynb > $OUT/nb13.log 2>&1; echo nb13 rc=$? $SECONDS
tar czf $OUT/nb.tgz notebooks/13_*.ipynb
timeout 60 python3 -m pytest -q -p no:cacheprovider --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg notebooks/13_*.ipynb 2>&1 | tail -2
