set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .whl nbval nbclient nbconvert ipykernel && export PYTHONPATH=$PWD
nvidia-smi -L
t0=$(date +%s)
timeout 200 python3 -m flashref.run_notebooks notebooks/13_*.ipynb 2>&1 | tail -5
timeout 150 python3 -m pytest -q -p no:cacheprovider notebooks/13_*.ipynb 2>&1 | tail -3
tar czf $OUT/notebooks.tgz notebooks/13_*.ipynb
echo "nb $(( $(date +%s) - t0 )) s"
timeout 280 python3 .exp/d256_sweep.py 2>&1 | grep -v Warning | tee $OUT/sweep.log
echo "sweep $(( $(date +%s) - t0 )) s"
