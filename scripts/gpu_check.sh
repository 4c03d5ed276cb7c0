#!/usr/bin/env bash
# One prepared run for a lent H200 (the device tool), e.g.
#   run(command="bash scripts/gpu_check.sh", timeout_s=540)
# Builds the extension with CUDA straight from CMake (the lent image has jax + jax-cuda
# plugins, CMake, nanobind and Python 3.12 but no scikit-build-core and no network),
# drops the modules into hisparse_jax/, then runs scripts/gpu_check.py (<= 8 minutes):
# host-pool path probe, CUDA == reference, the swap-in sweep next to pinned H2D bandwidth,
# a decode-like step with command buffers (CUDA graphs) off and on.
# Results: $OUT/gpu_check.json (or out/gpu_check.json) and a printed summary.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-out}
mkdir -p "$OUT_DIR"
"$PY" -c 'import jax, sys; print("python", sys.version.split()[0], "jax", jax.__version__, jax.devices())'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
cmake -S . -B build/gpu -DPython_EXECUTABLE="$(command -v "$PY")" -DCMAKE_BUILD_TYPE=Release \
  > "$OUT_DIR/gpu_build.log" 2>&1 || { tail -30 "$OUT_DIR/gpu_build.log"; exit 1; }
cmake --build build/gpu -j "$(nproc)" >> "$OUT_DIR/gpu_build.log" 2>&1 || { tail -30 "$OUT_DIR/gpu_build.log"; exit 1; }
ls build/gpu/_ffi_cuda*.so > /dev/null || { echo "the CUDA module was not built (nvcc missing?)"; exit 1; }
cp build/gpu/_ffi_cpu*.so build/gpu/_ffi_cuda*.so hisparse_jax/
timeout 470 "$PY" scripts/gpu_check.py --out "$OUT_DIR/gpu_check.json" "$@"
