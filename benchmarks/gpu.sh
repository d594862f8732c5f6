#!/usr/bin/env bash
# One-GPU benchmark of the issue's targets (ResNet-50 synthetic and real-JPEG training,
# BERT/MiniLM batching and gradient checkpointing); what each section measures and the
# targets are in benchmarks/gpu_bench.py's docstring. Writes ONE JSON file.
#
#   bash benchmarks/gpu.sh [out.json]          # default gpu-bench.json; ~6 min, under 9 on one H200
#   PYTHON=/path/to/python bash benchmarks/gpu.sh out.json
#   CUDA_VISIBLE_DEVICES=3 bash benchmarks/gpu.sh   # pick the GPU
#
# Each section runs in its own process under `timeout` (caps below: 510 s in all, plus
# at most 5 s each to kill a section that ignores SIGTERM, plus 20 s of nvidia-smi) and
# merges its figures into the file as soon as it has them; a section that hits its cap
# or fails is recorded under "failures" and the next one runs. Nothing here changes GPU
# settings (clocks, MIG, persistence).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-gpu-bench.json}
case "$OUT" in
  /*) ;;
  *) OUT="$PWD/$OUT" ;;
esac
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x "$REPO/.venv/bin/python" ]; then
  PY="$REPO/.venv/bin/python"
else
  PY=python3
fi
cd "$REPO" || exit 1
rm -f "$OUT" "$OUT.tmp"
START=$SECONDS

# Environment: passed to the env section, which stores it in the JSON.
GPU_BENCH_NVIDIA_SMI=$(timeout 10 nvidia-smi -L 2>&1 || echo "nvidia-smi -L failed")
GPU_BENCH_NVIDIA_SMI_QUERY=$(timeout 10 nvidia-smi \
  --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit,temperature.gpu \
  --format=csv 2>&1 || echo "nvidia-smi --query-gpu failed")
export GPU_BENCH_NVIDIA_SMI GPU_BENCH_NVIDIA_SMI_QUERY
echo "$GPU_BENCH_NVIDIA_SMI"
echo "python: $PY; out: $OUT"

# GPU_BENCH_SKIP="bert fsdp": sections not to run (a machine without the text extra's model
# package, say); each is recorded under "failures" as skipped, not silently left out.
# section NAME CAP_S [extra gpu_bench arguments...]
section() {
  local name=$1 cap=$2
  shift 2
  if [[ " ${GPU_BENCH_SKIP:-} " == *" $name "* ]]; then
    echo "== $name: skipped (GPU_BENCH_SKIP)"
    timeout 20 "$PY" -m benchmarks.gpu_bench --record-failure "$name" --rc 0 --out "$OUT" || true
    return
  fi
  echo "== $name (at most ${cap} s; $((SECONDS - START)) s so far)"
  # The soft cap inside Python leaves 15 s for writing the file before the hard one.
  timeout --kill-after=5 "$cap" "$PY" -m benchmarks.gpu_bench --section "$name" --out "$OUT" \
    --time-cap-s $((cap - 15)) "$@"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "!! $name failed (exit status $rc)"
    timeout 20 "$PY" -m benchmarks.gpu_bench --record-failure "$name" --rc "$rc" --out "$OUT" || true
  fi
}

section env 25
section resnet-synthetic 200
section resnet-jpeg 110
section bert 70
section summary 15

# FSDP on one GPU: the largest Llama-shaped model one GPU fine-tunes with FSDP + CPU
# offload and without (benchmarks/fsdp.py --device cuda; each size its own process).
if [[ " ${GPU_BENCH_SKIP:-} " == *" fsdp "* ]]; then
  echo "== fsdp: skipped (GPU_BENCH_SKIP)"
else
echo "== fsdp (at most 90 s; $((SECONDS - START)) s so far)"
timeout --kill-after=5 90 "$PY" -m benchmarks.fsdp --device cuda --output "${OUT%.json}-fsdp.json" \
  || echo "!! fsdp failed or hit its cap (exit status $?); partial figures in ${OUT%.json}-fsdp.json"
fi

echo "wrote $OUT in $((SECONDS - START)) s"
