#!/usr/bin/env bash
# Trains kiln's demo model and writes the shipped checkpoint artifacts/demo-model (never run by CI).
#   1. target/train-venv: torch + transformers from PyPI (pinned; CPU is enough);
#   2. scripts/demo_model/train.py: tokenizer, training (~40 min on 2 cores), calibration, BF16 export;
#   3. kiln quantize: ModelOpt NVFP4 with the calibrated input scales -> artifacts/demo-model;
#   4. scripts/demo_model/make_golden.py: transformers' logits of the result (tests/goldens/demo);
#   5. scripts/demo_model/train_mtp.py: the MTP layer (a draft model, ~12 min) into the same checkpoint.
# Extra arguments go to train.py (e.g. --smoke for a 2-minute run into target/demo-train).
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=target/train-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check "torch==2.15.0" "transformers==5.24.0" "safetensors==0.8.0" "tokenizers==0.23.3" "numpy==2.4.6" "jinja2==3.1.6"
"$venv/bin/python" scripts/demo_model/train.py --out target/demo-train "$@"
cargo build --release --quiet
rm -rf artifacts/demo-model
./target/release/kiln quantize target/demo-train/bf16 --calibration target/demo-train/calibration.json -o artifacts/demo-model
cp target/demo-train/train_log.json artifacts/demo-model/train_log.json
"$venv/bin/python" scripts/demo_model/make_golden.py
"$venv/bin/python" scripts/demo_model/train_mtp.py
