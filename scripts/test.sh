#!/usr/bin/env bash
# Runs every test. Installs what the tests need first (into target/, so nothing leaks):
# the official `openai` Python client (server tests) and ptxas from NVIDIA's CUDA 12.9 wheel
# (PTX kernels are assembled for sm_120a), and builds the CUDA driver double.
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

# The CUDA driver double (libcuda.so + libnccl.so over the PTX emulator) for the CUDA backend
# tests; the tests load it through LD_LIBRARY_PATH=$KILN_CUDA_DOUBLE_DIR, nothing else does.
KILN_CUDA_DOUBLE_FORCE=1 bash scripts/with-cuda-double.sh true
export KILN_CUDA_DOUBLE_DIR="${CARGO_TARGET_DIR:-$PWD/target}/cuda-double"

cargo test --workspace "$@"
