#!/usr/bin/env bash
# One device call (issue 39): install the project without touching the machine's own torch, then
# benchmarks/gpu_check.py writes $OUT/gpu_check.json, gpu_check.md and gpu_check.log (under 8 minutes).
#
#   bash benchmarks/gpu_check.sh [gpu_check.py flags]          # e.g. --budget 420 --skip cuda_tests
#
# The device machine has torch + CUDA, transformers and tokenizers but no package registry: wheels it
# lacks (gguf, for the default model) travel in .whl/ (carry it); the default model's GGUF (98 MB, over
# one call's 64 MiB) can travel split as .model/*.part* over two calls on a warm machine
# (benchmarks/gpu_prep.sh makes both and shows the two calls). Without them a
# random model of the default model's shape stands in, and the report says so.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the CPU kernels' build cache inside the (ignored) checkout: a second call on a warm machine reuses it
export XDG_CACHE_HOME="$PWD/.gpu_check_cache"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# --no-build-isolation: no registry to fetch setuptools from; PYTHONPATH covers a failed install
$PY -m pip install -q --no-deps --no-build-isolation -e . || echo "gpu_check.sh: pip install -e . failed; using PYTHONPATH"
EXTRA=()
if ls .model/*.part* >/dev/null 2>&1; then  # benchmarks/gpu_prep.sh made them
  cat .model/*.part* > /tmp/default_model.gguf
  if ! ls .model/*.sha256 >/dev/null 2>&1 || (cd /tmp && cat "$OLDPWD"/.model/*.sha256 | sha256sum --quiet -c -); then
    EXTRA=(--default-model /tmp/default_model.gguf)
  else
    echo "gpu_check.sh: the joined .model parts fail their sha256 (a part missing?): the random stand-in runs"
  fi
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/nvidia-smi.txt"
$PY benchmarks/gpu_check.py --out "$OUT" ${EXTRA[@]+"${EXTRA[@]}"} "$@" 2>&1 | tee "$OUT/gpu_check.log"
