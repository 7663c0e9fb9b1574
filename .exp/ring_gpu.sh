set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .whl nbval nbclient nbconvert ipykernel && export PYTHONPATH=$PWD
nvidia-smi -L
t0=$(date +%s)
timeout 300 python3 -m flashref.bench ring --parts longest --longest-max 6000000 --append 2>&1 | tail -60 | tee $OUT/bench.log
cp book/data/ring_bench.json $OUT/
echo "bench $(( $(date +%s) - t0 )) s"
timeout 150 python3 -m pytest -o addopts= -q -p no:cacheprovider tests/test_ring_gpu.py 2>&1 | tail -15 | tee $OUT/test.log
echo "test $(( $(date +%s) - t0 )) s"
