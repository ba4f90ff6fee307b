#!/usr/bin/env bash
# Checks that a crate using candle-core with CUDA and ringattn with `cuda` + `candle` builds
# (ci/candle-cuda; its program runs ring_attention on CUDA tensors where a GPU is) and lints
# ringattn with both features: cudarc gets `dynamic-linking` from candle and `fallback-dynamic-loading`
# from ringattn, which agree. Needs nvcc (scripts/test.sh installs it from PyPI into
# target/venv-nvcc); candle's kernel build asks CUDA_COMPUTE_CAP (no GPU here). About 12
# minutes cold on 2 cores for the check, 9 more for the lint (candle compiles its CUDA
# kernels; both reuse target/candle-cuda-check). Usage: scripts/check-candle-cuda.sh
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc_home=$(cd "$(dirname "$(ls -d target/venv-nvcc/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)")/.." && pwd)
export PATH="$nvcc_home/bin:$PATH" CUDA_HOME="$nvcc_home" CUDA_PATH="$nvcc_home" NVCC="$nvcc_home/bin/nvcc"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CARGO_TARGET_DIR="$PWD/target/candle-cuda-check"
cargo check --manifest-path ci/candle-cuda/Cargo.toml
# ringattn's own candle + cuda code (src/candle/cuda.rs), linted.
cargo clippy --no-default-features --features candle,cuda --lib -- -D warnings
echo "candle-core (cuda) and ringattn (cuda, candle) build side by side"
