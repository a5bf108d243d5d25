#!/usr/bin/env bash
# Runs CMD... with kiln's CUDA driver double as libcuda.so + libnccl.so (kernels run in the PTX
# emulator). Builds the double unless KILN_CUDA_DOUBLE_NO_BUILD=1. The simulated machine is set
# with KILN_DOUBLE_* variables (runtime/cuda-double/src/config.rs): GPUS (8), ARCH (sm_120a |
# sm_90a), SMS, MEMORY, CONTEXT_MEMORY, DRIVER_VERSION, P2P (ok | drop | off), NCCL_TIMEOUT_S.
#
# Never use this on a machine with a real GPU: libcuda.so is searched before libcuda.so.1, so the
# double would shadow the driver. It refuses when /dev/nvidiactl exists (KILN_CUDA_DOUBLE_FORCE=1
# overrides, e.g. to rehearse in CI containers that expose the device node).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if [ -e /dev/nvidiactl ] && [ "${KILN_CUDA_DOUBLE_FORCE:-0}" != 1 ]; then
  echo "with-cuda-double: this machine has an NVIDIA driver (/dev/nvidiactl); refusing to shadow it (KILN_CUDA_DOUBLE_FORCE=1 overrides)" >&2
  exit 2
fi
target="${CARGO_TARGET_DIR:-$root/target}"
if [ "${KILN_CUDA_DOUBLE_NO_BUILD:-0}" != 1 ]; then
  (cd "$root" && cargo build --quiet -p kiln-cuda-double)
fi
lib="$target/debug/libkiln_cuda_double.so"
if [ ! -f "$lib" ]; then
  echo "with-cuda-double: $lib is missing (build it with: cargo build -p kiln-cuda-double)" >&2
  exit 2
fi
dir="$target/cuda-double"
mkdir -p "$dir"
for name in libcuda.so libcuda.so.1 libnccl.so libnccl.so.2; do
  ln -sf ../debug/libkiln_cuda_double.so "$dir/$name"
done
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KILN_CUDA_DOUBLE_DIR="$dir"
if [ $# -eq 0 ]; then
  exit 0
fi
exec "$@"
