#!/usr/bin/env bash
# The GPU check (`make gpu-check`): one script for one GPU machine with no network, sized to
# finish in under 8 minutes on an H200-class GPU. See bench/gpu/README.md.
#
#   bench/gpu/gpu-check.sh bundle      on a machine with a package index: the wheels the GPU
#                                      machine may lack (Python 3.12) and the demo vocabulary,
#                                      into bench/gpu/.bundle/ (git-ignored; it travels with the tree)
#   bench/gpu/gpu-check.sh [--dry-run] on the GPU machine: every step below; --dry-run prints them
#
# Results go to $OUT when set (the device machine's output folder), else bench/gpu/results/latest/;
# each step's output to logs/<step>.log there, the figures to gpu-check.json.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUNDLE="$ROOT/bench/gpu/.bundle"
PYTHON="${PYTHON:-python3}"
# The packages the engine, the replica server, the load generator and the tests import that a
# GPU machine with torch, transformers, triton and nvidia-ml-py may not have.
BUNDLED=(starlette uvicorn httptools prometheus-client aiohttp httpx pytest pytest-timeout nvidia-ml-py tqdm)

if [[ "${1:-}" == "bundle" ]]; then
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/wheels"
  pins=()
  for name in "${BUNDLED[@]}"; do  # the versions this project's environment runs
    version="$("$ROOT/.venv/bin/pip" show "$name" 2>/dev/null | sed -n 's/^Version: //p')"
    pins+=("$name${version:+==$version}")
  done
  "$ROOT/.venv/bin/pip" download --quiet --dest "$BUNDLE/wheels" --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any "${pins[@]}"
  "$ROOT/.venv/bin/python" -c "from runtime.engine.encoder import find_packaged_minilm; \
import shutil; shutil.copy(find_packaged_minilm() / 'vocab.txt', '$BUNDLE/vocab.txt')"
  echo "bundle: $(ls "$BUNDLE/wheels" | wc -l) wheels, $(du -sh "$BUNDLE" | cut -f1), in $BUNDLE"
  exit 0
fi

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
OUT_DIR="${OUT:-$ROOT/bench/gpu/results/latest}"
WORK="${GPU_CHECK_WORK:-/tmp/inferops-gpu-check}"
MODEL="$WORK/demo-1b"
SITE="$WORK/site"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export INFEROPS_KERNEL_CACHE="$WORK/kernels"

STEPS=(environment dependencies checkpoint gpu_tests nvml_record workload_a online summary)
declare -A LIMIT=([environment]=60 [dependencies]=120 [checkpoint]=150 [gpu_tests]=180
                  [nvml_record]=30 [workload_a]=150 [online]=180 [summary]=30)

step_command() {
  case "$1" in
    environment) echo "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; \
$PYTHON -c 'import torch, transformers; assert torch.cuda.is_available(), \"no CUDA device\"; \
print(torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name(0))'" ;;
    dependencies) echo "$PYTHON $ROOT/bench/gpu/unpack_missing.py $BUNDLE/wheels $SITE" ;;
    checkpoint) echo "test -f $MODEL/model.safetensors || $PYTHON -m project.cli demo-model $MODEL \
--preset 1b --dtype bfloat16 --vocab $BUNDLE/vocab.txt" ;;
    gpu_tests) echo "cd $ROOT && $PYTHON -m pytest -o addopts='' -p no:cacheprovider -p no:django -m gpu -q \
tests/runtime/engine/test_gpu.py tests/runtime/test_gpu_telemetry.py --junitxml=$OUT_DIR/gpu-tests.xml" ;;
    nvml_record) echo "$PYTHON -m runtime.gpu_telemetry --record $OUT_DIR/nvml-recording.json" ;;
    workload_a) echo "$PYTHON $ROOT/bench/gpu/workloads.py burst --model $MODEL --out $OUT_DIR/workload_a.json" ;;
    online) echo "$PYTHON $ROOT/bench/gpu/workloads.py online --model $MODEL --out $OUT_DIR/online.json \
--log $OUT_DIR/logs/replica.log" ;;
    summary) echo "$PYTHON $ROOT/bench/gpu/workloads.py summary --results $OUT_DIR --out $OUT_DIR/gpu-check.json" ;;
  esac
}

if (( DRY_RUN )); then
  echo "gpu-check (dry run): results into $OUT_DIR, scratch in $WORK"
  for index in "${!STEPS[@]}"; do
    name="${STEPS[$index]}"
    printf 'step %d/%d %s (limit %ss): %s\n' "$((index + 1))" "${#STEPS[@]}" "$name" "${LIMIT[$name]}" \
      "$(step_command "$name")"
  done
  exit 0
fi

mkdir -p "$OUT_DIR/logs" "$WORK"
failed=()
started=$SECONDS
for index in "${!STEPS[@]}"; do
  name="${STEPS[$index]}"
  step_started=$SECONDS
  printf 'step %d/%d %s ... ' "$((index + 1))" "${#STEPS[@]}" "$name"
  if timeout "${LIMIT[$name]}" bash -c "$(step_command "$name")" > "$OUT_DIR/logs/$name.log" 2>&1; then
    echo "ok ($((SECONDS - step_started)) s)"
  else
    status=$?
    echo "FAILED with $status after $((SECONDS - step_started)) s; the last lines of logs/$name.log:"
    tail -n 15 "$OUT_DIR/logs/$name.log" | sed 's/^/    /'
    failed+=("$name")
    [[ "$name" == environment ]] && break  # nothing else can run without the GPU
  fi
done
echo "gpu-check: $((SECONDS - started)) s; ${#failed[@]} step(s) failed${failed:+: ${failed[*]}}"
[[ -f "$OUT_DIR/gpu-check.json" ]] && echo "figures: $OUT_DIR/gpu-check.json"
(( ${#failed[@]} == 0 ))
