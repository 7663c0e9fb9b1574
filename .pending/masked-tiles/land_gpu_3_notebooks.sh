# Device call 3 of 3 (carry [".whl"]; about 450 s): the GPU notebooks the branch stales, executed and stamped,
# then nbval on them. Unpack $OUT/nb.tgz over notebooks/.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m pip install -q --no-index --find-links .whl nbval nbclient nbconvert ipykernel 2>&1 | tail -2
for nb in 08 14 10 07 12 11 13 09 06; do
    timeout 200 python3 -m flashref.run_notebooks notebooks/${nb}_*.ipynb > $OUT/nb$nb.log 2>&1; echo nb$nb rc=$? $SECONDS
    tar czf $OUT/nb.tgz notebooks/*.ipynb
done
timeout 120 python3 -m pytest -q -p no:cacheprovider --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg -n 4 \
    --dist loadfile notebooks/0[6-9]*.ipynb notebooks/1*.ipynb > $OUT/nbval.log 2>&1; echo nbval rc=$?; tail -3 $OUT/nbval.log
