#!/usr/bin/env bash
# The candle + CUDA stage of scripts/test.sh on its own: lints every target of ringattn with
# `candle`, `cuda` and `mpi` (candle-core then builds with its own `cuda`: cudarc gets
# `dynamic-linking` from candle and `fallback-dynamic-loading` from ringattn, which agree) and
# checks ci/candle-cuda, a downstream crate with candle-core (cuda) beside ringattn (cuda,
# candle) whose program runs ring_attention on CUDA tensors where a GPU is. Needs nvcc
# (scripts/test.sh installs it from PyPI into target/venv-nvcc); candle's kernel build asks
# CUDA_COMPUTE_CAP (no GPU here). Candle's own CUDA kernels are not compiled: a check build
# never links or loads them, and scripts/nvcc-check-only.sh answers their nvcc calls with
# empty outputs (ringattn's kernels go to the real nvcc). Every dependency is checked with
# these features: minutes cold, seconds warm. Usage: scripts/check-candle-cuda.sh
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc_home=$(cd "$(dirname "$(ls -d target/venv-nvcc/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)")/.." && pwd)
export PATH="$nvcc_home/bin:$PATH" CUDA_HOME="$nvcc_home" CUDA_PATH="$nvcc_home"
export RINGATTN_REAL_NVCC="$nvcc_home/bin/nvcc" NVCC="$PWD/scripts/nvcc-check-only.sh"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
export RINGATTN_NVCC_CACHE="$PWD/target/nvcc-cache" RINGATTN_EMU_CACHE="$PWD/target/emu-cache" RINGATTN_DENY_SPILLS=1
export CARGO_TARGET_DIR="$PWD/target/candle-cuda"
cargo clippy --all-targets --features candle,cuda,mpi -- -D warnings
cargo check -p candle-cuda-check
echo "candle-core (cuda) and ringattn (cuda, candle, mpi) build side by side"
