#!/usr/bin/env bash
# Runs every test. Installs what the tests need first (into target/, so nothing leaks):
# the official `openai` Python client (server tests) and ptxas from NVIDIA's CUDA 12.9 wheel
# (PTX kernels are assembled for sm_120a).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=target/test-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check "openai==3.57.0" "nvidia-cuda-nvcc-cu12==12.9.86"
export KILN_PYTHON="$PWD/$venv/bin/python"
KILN_PTXAS="$("$KILN_PYTHON" -c 'import nvidia.cuda_nvcc as m, os; print(os.path.join(list(m.__path__)[0], "bin", "ptxas"))')"
export KILN_PTXAS
"$KILN_PTXAS" --version | tail -1

cargo test --workspace "$@"
