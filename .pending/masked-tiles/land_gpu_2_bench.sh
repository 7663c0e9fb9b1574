# Device call 2 (one call per argument, each under the 600 s limit):
#   bash .pending/masked-tiles/land_gpu_2_bench.sh "mods --parts window-kernels window"
#   bash .pending/masked-tiles/land_gpu_2_bench.sh "hopper --parts training"
#   bash .pending/masked-tiles/land_gpu_2_bench.sh "mods --parts alibi"          (if time is left)
# Each replaces its saved rows (--append replaces what it measures again, group by group). The data files come
# back in $OUT/data.tgz, refreshed after each row's run: unpack over book/data.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
echo "== $1"
timeout 560 python3 -m flashref.bench $1 --append 2>&1 | tee $OUT/bench.log | tail -45
tar czf $OUT/data.tgz book/data/*.json
