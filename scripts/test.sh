#!/usr/bin/env bash
# The whole test suite, from a fresh clone on a machine with only the Rust toolchain, gcc and
# Python: installs nvcc 13.0 from PyPI (kernels are compiled for sm_80, sm_90a, sm_100 and
# sm_120 and any spill fails), NCCL's wheel from PyPI (the loader's tests) and Open MPI from
# the distribution's packages (apt), then formatting, lints, unit/integration/property/CLI
# tests and doc tests, and the GPU host path against the emulated GPU (emulated-gpu/, a
# stand-in libcuda.so.1). Prints the time of each stage. Usage: scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

stage_start=$(date +%s)
total_start=$stage_start
stage() {
  local now
  now=$(date +%s)
  printf '\n=== [%4ss] %s\n' "$((now - total_start))" "$*"
  stage_start=$now
}
done_stage() {
  printf '=== %s took %ss\n' "$1" "$(($(date +%s) - stage_start))"
}

stage "toolchain"
cargo --version
rustc --version
command -v cargo-clippy >/dev/null 2>&1 || rustup component add clippy rustfmt >/dev/null 2>&1 || true
done_stage toolchain

stage "CUDA compiler (nvcc 13.0 from PyPI, for compiling every kernel; no GPU needed)"
nvcc_venv=${RINGATTN_NVCC_VENV:-target/venv-nvcc}
nvcc_home="$nvcc_venv/lib/python3.11/site-packages/nvidia/cu13"
if [ ! -x "$nvcc_home/bin/nvcc" ]; then
  python3 -m venv "$nvcc_venv"
  "$nvcc_venv/bin/pip" install --quiet nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
fi
nvcc_home=$(cd "$(dirname "$(ls -d "$nvcc_venv"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)")/.." && pwd)
export NVCC="$nvcc_home/bin/nvcc"
export RINGATTN_DENY_SPILLS=1
"$NVCC" --version | tail -2
done_stage nvcc

stage "NCCL from PyPI (nvidia-nccl-cu13: libnccl.so.2 only; loaded by the tests and ringattn doctor, no GPU needed)"
nccl_venv=${RINGATTN_NCCL_VENV:-target/venv-nccl}
if ! ls "$nccl_venv"/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2 >/dev/null 2>&1; then
  python3 -m venv "$nccl_venv"
  "$nccl_venv/bin/pip" install --quiet --no-deps nvidia-nccl-cu13==2.32.3
fi
RINGATTN_TEST_NCCL_DIR=$(cd "$(dirname "$(ls "$nccl_venv"/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2)")" && pwd)
export RINGATTN_TEST_NCCL_DIR
ls "$RINGATTN_TEST_NCCL_DIR"
done_stage nccl

stage "Open MPI from the distribution's packages (the multi-process tests run under mpirun)"
if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1 || ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libopenmpi-dev openmpi-bin libclang-dev >/dev/null
fi
mpirun --version | head -1
done_stage open-mpi

stage "emulator and host-compiled kernels under AddressSanitizer + UBSan (standalone harness)"
mkdir -p target
# Each kernel family compiles on its own for the host (through the emulator), as for nvcc.
for cu in cuda/*.cu; do
  c++ -x c++ -std=c++17 -Wall -Wextra -Werror -I cuda -fsyntax-only "$cu"
done
mkdir -p target/emu-harness-obj
# -O0: a third of -O1's compile time (the harness runs in a second either way), and no access
# optimised away from the sanitizers' view.
sanitize="-std=c++17 -g -O0 -fsanitize=address,undefined -fno-sanitize-recover=undefined -Wall -Wextra -Wno-psabi -I cuda"
# One object per translation unit, two at a time (the flash families are the slow ones).
printf '%s\n' cuda/emu/harness.cpp cuda/emu/kernels.cpp cuda/emu/kernels_fwd.cpp cuda/emu/kernels_bwd.cpp \
  cuda/emu/kernels_fwd_hopper.cpp cuda/emu/kernels_bwd_hopper.cpp cuda/emu/selftest.cpp cuda/emu/selftest_ptx.cpp |
  xargs -P "$(nproc)" -I{} sh -c 'c++ '"$sanitize"' -c "$1" -o "target/emu-harness-obj/$(basename "$1" .cpp).o"' _ {}
c++ -fsanitize=address,undefined target/emu-harness-obj/*.o -pthread -o target/emu-harness
ASAN_OPTIONS=detect_leaks=1 target/emu-harness
done_stage sanitizers

stage "cargo fmt --check; the library's dependencies without the CLI's"
cargo fmt --all -- --check
if cargo tree -e normal --no-default-features --features cuda | grep -E '^[^a-z]*(clap|indicatif|plotters) '; then
  echo "the library (no default features) depends on a CLI crate" >&2
  exit 1
fi
done_stage fmt

stage "cargo test with features candle + mpi, linted as it builds (clippy -D warnings; unit, integration, property, CLI, candle, MPI and doc tests)"
# Clippy lints ringattn's targets while they compile for the tests: clippy-driver wraps rustc
# for the workspace's crates and denies every rustc and clippy warning, as `cargo clippy --
# -D warnings` has it do for a check build (CLIPPY_ARGS, separated as cargo-clippy separates
# them). Dependencies are compiled as without it. A separate `cargo clippy` would check every
# dependency again: two minutes of a cold run. The candle-cuda stage lints the same targets
# with cuda on top.
export RUSTC_WORKSPACE_WRAPPER CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__
RUSTC_WORKSPACE_WRAPPER=$(rustup which clippy-driver 2>/dev/null || command -v clippy-driver)
# The wrapper lints: a crate with a clippy warning (and nothing rustc warns of) must not build.
canary=target/clippy-canary
mkdir -p "$canary/src"
printf '[package]\nname = "clippy-canary"\nversion = "0.0.0"\nedition = "2021"\n[workspace]\n' >"$canary/Cargo.toml"
printf 'fn main() {\n    let v = [1, 2, 3];\n    for i in 0..v.len() {\n        println!("{}", v[i]);\n    }\n}\n' >"$canary/src/main.rs"
if cargo build -q --manifest-path "$canary/Cargo.toml" >"$canary/build.log" 2>&1 ||
  ! grep -q '^error: the loop variable `i` is only used to index `v`' "$canary/build.log"; then
  cat "$canary/build.log" >&2
  echo "clippy-driver as RUSTC_WORKSPACE_WRAPPER did not deny clippy::needless_range_loop: the tests' build would not be linted" >&2
  exit 1
fi
# One build for the default features' tests, the candle operation against the oracle and the
# MPI jobs: the features only add code. tests/mpi.rs runs the collectives' check (an example)
# under mpirun: `cargo test` builds examples without their plain-named binaries, so build it.
cargo build --features candle,mpi --example collectives
cargo test --all-targets --features candle,mpi
cargo test --doc --features candle,mpi
# The training example against one rank with plain candle attention (short runs; the README
# has the 60-step ones): f32 ring and Ulysses on 4 threads, bf16 on the emulated kernels,
# and 4 MPI processes.
cargo build --features candle,mpi --example train_lm
for st in ring ulysses; do
  target/debug/examples/train_lm --world 4 --strategy "$st" --steps 10 --seq 256 --compare-single \
    --json "target/train_lm-$st.json" >/dev/null
  python3 scripts/check_train_lm.py "target/train_lm-$st.json"
done
# Learnable sinks and soft-capped scores, Ulysses over 4 threads, against one rank.
target/debug/examples/train_lm --world 4 --strategy ulysses --steps 10 --seq 256 --sinks --softcap 30 \
  --compare-single --json target/train_lm-sinks.json >/dev/null
python3 scripts/check_train_lm.py target/train_lm-sinks.json
target/debug/examples/train_lm --world 4 --strategy ring --steps 2 --seq 128 --backend emu --dtype bf16 \
  --compare-single --json target/train_lm-emu.json >/dev/null
python3 scripts/check_train_lm.py target/train_lm-emu.json
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  mpirun -n 4 target/debug/examples/train_lm --comm mpi --strategy usp --steps 5 --seq 128 --compare-single \
  --json target/train_lm-mpi.json >/dev/null
python3 scripts/check_train_lm.py target/train_lm-mpi.json
unset RUSTC_WORKSPACE_WRAPPER CLIPPY_ARGS
done_stage test

stage "features cuda + mpi: clean failure without a GPU; 4-rank mpirun jobs (every strategy, killed and silent ranks)"
cargo test --features cuda,mpi --lib cuda
# tests/mpi.rs runs the collectives' check (an example) under mpirun: build it first, since
# `cargo test --test ...` builds only the named test targets.
cargo build --features cuda,mpi --example collectives
cargo test --features cuda,mpi --test cuda --test cli --test mpi --test doctor --test device_check --bin ringattn
done_stage cuda-mpi-features

stage "the GPU host path on the emulated GPU (emulated-gpu/: a stand-in libcuda.so.1 running the kernels on the host emulator): driver rules and planted faults; verify on both kernel families, every strategy; the CUDA tests"
# Linted as ringattn's targets are (the stand-in is a workspace member).
RUSTC_WORKSPACE_WRAPPER=$(rustup which clippy-driver 2>/dev/null || command -v clippy-driver) \
  CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__ cargo test -p ringattn-emulated-gpu
launches=target/emulated-gpu-launches.log
rm -f "$launches"
export RINGATTN_EMU_GPU_LOG=$launches
scripts/with-emulated-gpu target/debug/ringattn doctor | tee target/emulated-gpu-doctor.txt
grep -q "EMULATED" target/emulated-gpu-doctor.txt
for kernels in fa2 hopper; do
  for mask in "" --causal; do
    # Head dim 96: the Hopper kernels' columns past the data (class 128) filled by the copies.
    # shellcheck disable=SC2086 # $mask is one optional argument
    scripts/with-emulated-gpu target/debug/ringattn verify --backend cuda --kernels "$kernels" \
      --shape 2,200,6,2,96 --dtype bf16 $mask >/dev/null
    for strategy in ring allgather ulysses usp; do
      # shellcheck disable=SC2086
      scripts/with-emulated-gpu target/debug/ringattn verify --backend cuda --kernels "$kernels" \
        --strategy "$strategy" --world 4 --shape 1,256,4,2,64 --dtype bf16 $mask >/dev/null
    done
    echo "verify --backend cuda --kernels $kernels ${mask:-full}: single and 4 strategies x 4 ranks pass"
  done
done
# Multi-head latent attention's head dims (d_qk 192, d_v 128; 96 and 64) on the GPU host path:
# device buffers and tensor maps of their own widths, the FA2 family's pair (_d192_v128) and
# _dv entry points.
for kernels in fa2 hopper; do
  scripts/with-emulated-gpu target/debug/ringattn verify --backend cuda --kernels "$kernels" \
    --shape 1,160,4,2,192,128 --dtype bf16 --causal >/dev/null
  for strategy in ring ulysses usp; do
    scripts/with-emulated-gpu target/debug/ringattn verify --backend cuda --kernels "$kernels" \
      --strategy "$strategy" --world 4 --shape 1,160,4,2,96,64 --dtype bf16 --causal >/dev/null
  done
  echo "verify --backend cuda --kernels $kernels, d_qk != d_v: single and 3 strategies x 4 ranks pass"
done
for entry in flash_fwd_bf16_d192_v128 flash_bwd_dq_bf16_d192_v128 flash_bwd_dkdv_bf16_d192_v128 flash_fwd_bf16_d96_dv; do
  grep -q "^launch ringattn_$entry" "$launches" ||
    { echo "ringattn_$entry never ran for unequal head dims" >&2; exit 1; }
done
# --kernels hopper reaches the backward: the launch log names the Hopper backward kernel.
grep -q "^launch ringattn_hopper_flash_bwd_" "$launches" ||
  { echo "the Hopper backward never ran under --kernels hopper" >&2; exit 1; }
grep -c "^launch " "$launches" | sed 's/^/kernel launches on the emulated GPU: /'
unset RINGATTN_EMU_GPU_LOG
# The GPU tests (skipped without a GPU in the stage above) on the emulated GPU.
scripts/with-emulated-gpu cargo test --features cuda,mpi --test cuda
# --comm nccl over 2 and 4 processes (mpirun) and torchrun-style, a stalled peer.
RINGATTN_EMULATED_GPU_LIB=$PWD/target/emulated-gpu/debug OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  cargo test --features cuda,mpi --test emulated_gpu
# The device check end to end (quick mode, shapes scaled for the emulator): every step to a
# result, its JSON labelled emulated.
rm -rf target/device-check-emulated
OUT=target/device-check-emulated scripts/with-emulated-gpu bash scripts/device-check.sh --bin target/debug/ringattn \
  >target/device-check-emulated.log 2>&1 || { tail -40 target/device-check-emulated.log >&2; exit 1; }
tail -3 target/device-check-emulated.log
python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); assert d["emulated_gpu"] and d["verify_summary"]["failed"] == 0, d["steps_summary"]' \
  target/device-check-emulated/device-check.json
done_stage emulated-gpu

stage "candle-core with CUDA beside ringattn (cuda, candle, mpi): lints of every target, and a downstream crate (ci/candle-cuda)"
# cudarc gets `dynamic-linking` from candle-core and `fallback-dynamic-loading` from ringattn,
# which agree; candle compiles its CUDA kernels with the nvcc above (CUDA_COMPUTE_CAP: no GPU
# to ask; CUDAFORGE_THREADS: every core). Check only: linking would need libcuda, which a
# machine without a driver lacks. ringattn's kernels come from this run's nvcc cache.
scripts/check-candle-cuda.sh
done_stage candle-cuda

stage "static SASS gates: no spills or local memory in any kernel; HMMA + LDSM (+ LDGSTS) in the FA2-class kernels, HGMMA + UTMALDG + SYNCS + USETMAXREG and no HMMA in the Hopper ones; the kernel budget"
scripts/sass-gates.sh
# The main loops' instructions and shared-memory bytes per HMMA (docs/kernel-budget.md), gated
# against the committed baseline (docs/kernel-budget.json): no kernel gets worse.
python3 scripts/kernel-budget.py
done_stage sass-gates

printf '\n=== all stages passed in %ss\n' "$(($(date +%s) - total_start))"
