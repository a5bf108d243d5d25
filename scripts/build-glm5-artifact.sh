#!/usr/bin/env bash
# Rebuilds the shipped prebuilt plan artifacts/GLM-5-NVFP4-sm120a-tp8 from the GLM-5-NVFP4
# skeleton (`kiln synth glm5`: the full tensor table, headers only) with ptxas from NVIDIA's
# CUDA 12.9 wheel. tests/kernels_plan.rs compiles the same plan and requires it to equal the
# shipped files byte for byte, so run this after any change to the compiler or the kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/test-venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check "nvidia-cuda-nvcc-cu12==12.9.86"
KILN_PTXAS="$("$venv/bin/python" -c 'import nvidia.cuda_nvcc as m, os; print(os.path.join(list(m.__path__)[0], "bin", "ptxas"))')"
export KILN_PTXAS
cargo build --quiet
out=artifacts/GLM-5-NVFP4-sm120a-tp8
skeleton="$(mktemp -d)"
trap 'rm -rf "$skeleton"' EXIT
target/debug/kiln synth glm5 -o "$skeleton/ckpt"
# README.md beside the plan is kept; kernels/ is rewritten.
target/debug/kiln compile "$skeleton/ckpt" --target sm_120a --tp 8 --portable -o "$out"
target/debug/kiln inspect "$out" | head -12
