# Device call 2 of 3 (about 8-9 minutes): the rows the branch changes, each replacing its saved rows (--append).
# The data files come back in $OUT/data.tgz: unpack over book/data. Order: the window's kernels (issue 16's
# decision), the window and ALiBi forward + backward against Flex, then forward + backward against cuDNN.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for part in "mods --parts window-kernels window --append" "hopper --parts training --append" \
            "mods --parts alibi --append"; do
    echo "== $part"; timeout 300 python3 -m flashref.bench $part 2>&1 | tee -a $OUT/bench.log | tail -40
    tar czf $OUT/data.tgz book/data/*.json
done
