#!/usr/bin/env bash
# Device run of session 33 (one call): the CUDA tests, then the shipped perturbed_mean config trained at stride 32 +
# nms_ties first on objects-binary 128 x 4096 (made there: gpu_data.py), seeds 0-9 side by side on the one GPU.
# Needs the wheels in .whl (zarr, numcodecs, donfig, google-crc32c, imagecodecs, openslide) and .whl/py (difftopk,
# diffsort). Output: $OUT/env.txt, tests.log, data.log, train.log (lines prefixed [sS]).
set -u
T0=$(date +%s)
[ -n "${SKIP_PIP:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/py${PYTHONPATH:+:$PYTHONPATH} RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
LIMIT=${LIMIT:-540} D=${D:-/tmp/d} PY=${PY:-python3} COUNT=${COUNT:-128} SIZE=${SIZE:-4096} EPOCHS=${EPOCHS:-20} DEVICE=${DEVICE:-cuda}
SEEDS=${SEEDS:-0 1 2 3 4 5 6 7 8 9} TESTS=${TESTS:-tests/test_attention_sampling.py tests/test_lapsum.py tests/test_model.py tests/test_nms.py tests/test_sinkhorn.py tests/test_topk.py tests/test_topk_loss.py tests/test_evidence.py}
{ nvidia-smi -L; nproc; $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"; } > "$OUT/env.txt" 2>&1
$PY benchmarks/results/objects_v2/s33/gpu_data.py $D --count $COUNT --size $SIZE --classes 2 --jobs 14 > "$OUT/data.log" 2>&1 &
DATA=$!
$PY -m pytest -q -p no:cacheprovider $TESTS -rs > "$OUT/tests.log" 2>&1
echo "pytest rc $? at $(( $(date +%s) - T0 ))s" >> "$OUT/tests.log"
wait $DATA || { echo "data failed" >> "$OUT/data.log"; exit 1; }
echo "data done at $(( $(date +%s) - T0 ))s" >> "$OUT/data.log"
REM=$(( LIMIT - ($(date +%s) - T0) ))
for S in $SEEDS; do
  ( timeout "$REM" $PY benchmarks/selection_hits.py --config ${CONFIG:-perturbed_mean} --stores $D/stores --epochs $EPOCHS \
      --device $DEVICE --set seed=$S --set model.stride=32 --set model.nms_ties=first 2>&1 \
      | sed -u "s/^/[s$S] /" >> "$OUT/train.log" ) &
done
wait
echo "all done at $(( $(date +%s) - T0 ))s" >> "$OUT/train.log"
