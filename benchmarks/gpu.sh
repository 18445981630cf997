#!/usr/bin/env bash
# The GPU measurements in one go, on a machine with one CUDA GPU (no Ray, MLflow or OpenSlide needed): makes its
# own data, then
#   score_cuda.json   benchmarks/score.py --in-process: 1.07-GP stores, scorer + classifiers on the GPU, fp32 and
#                     bf16 (slides/s, GPU utilisation, seconds per part, bf16 against fp32 on the same slides)
#   score_cuda_cpucls.json  the same with the classifiers on the CPU (fp32)
#   train_cuda.json / train_cpu.json  benchmarks/train_speed.py, the demo config: slide-steps/s on the GPU and on
#                     one CPU core
#   pytest_gpu.txt    the tests marked gpu
#   bash benchmarks/gpu.sh OUTDIR [TRAINED_CHECKPOINT] [COUNT]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUTDIR}; model=${2:-}; count=${3:-64}
mkdir -p "$out"
py=${PYTHON:-python3}
dev=${DEVICE:-cuda}  # DEVICE=cpu: a dry run of the script on a machine without a GPU
work=${WORK:-/tmp/foveate-gpu}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
echo "cpus $(nproc)" >>"$out/gpu.txt"
margs=(); [ -n "$model" ] && margs=(--model "$model")
timeout 180 "$py" benchmarks/score.py --in-process --device "$dev" --classifier-device "$dev" --precision fp32,bf16 \
  --count "$count" --size 32768 --jobs "$(nproc)" --batch 16 --prefetch 16 --classifiers 2 --passes 2 \
  --work-dir "$work" --json "$out/score_cuda.json" "${margs[@]}"
timeout 100 "$py" benchmarks/score.py --in-process --device "$dev" --classifier-device cpu --precision fp32 \
  --count "$count" --size 32768 --batch 16 --prefetch 4 --classifiers 8 --passes 2 \
  --work-dir "$work" --json "$out/score_cuda_cpucls.json" "${margs[@]}"
timeout 40 "$py" benchmarks/array_stores.py "$work/train" --count 32 --size 2048 --jobs "$(nproc)"
timeout 80 "$py" benchmarks/train_speed.py --config demo --stores "$work/train" --epochs 3 --device "$dev" \
  --set data.labels="$work/train/labels.csv" --json "$out/train_cuda.json"
timeout 60 "$py" benchmarks/train_speed.py --config demo --stores "$work/train" --epochs 2 --device cpu \
  --set data.labels="$work/train/labels.csv" --json "$out/train_cpu.json"
timeout 90 "$py" -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors tests/test_gpu_stages.py \
  tests/test_topk.py tests/test_nms.py tests/test_sinkhorn.py tests/test_lapsum.py tests/test_attention_sampling.py \
  tests/test_topk_loss.py tests/test_evidence.py tests/test_model.py 2>&1 | tail -30 | tee "$out/pytest_gpu.txt"
