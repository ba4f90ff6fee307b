#!/usr/bin/env bash
# Packed-document batches over 2 MPI processes (one core and one compute thread each):
# every strategy × layout and `auto` per batch, with the calibrated cost model's prediction
# beside each measurement: how close auto comes to the best fixed configuration, and how
# far the model's predictions are from the measured times.
#
#   scripts/docs-auto-bench.sh [OUT_DIR]     (default bench-results/history/<date>-auto)
#
# Needs a release build with MPI (`cargo build --release --features mpi`) and mpirun.
# Calibration first, on the same machine and binding: the single-thread kernel rate of a
# dense causal bench, and an MPI ping-pong for the link.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-results/history/$(date +%F)-auto}
bin=target/release/ringattn
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export RAYON_NUM_THREADS=1
mpi=(mpirun -n 2 --bind-to core)
shape=(--heads 8 --head-dim 64 --dtype bf16 --causal)
lscpu | grep -E "Model name|Flags" | sed 's/Flags:.*\(amx_bf16\).*/Flags: ... \1 .../' > "$out/cpu.txt" || true
echo "calibration: dense causal bench on one thread, MPI ping-pong"
taskset -c 0 "$bin" bench --backend cpu "${shape[@]}" --seq 8192 --json "$out/calibration-bench.json" | tail -2
"${mpi[@]}" "$bin" pingpong --comm mpi --json "$out/calibration-pingpong.json" | tail -1
cal=(--calibration "$out/calibration-bench.json" --calibration "$out/calibration-pingpong.json")
# name seq distribution
batches=(
  "b1 8192 lognormal"
  "b2 16384 lognormal"
  "b3 32768 lognormal"
  "b4 65536 lognormal"
  "b5 16384 lognormal:4000:0.7:256:16384"
  "b6 32768 lognormal:400:1.2:32:8192"
  "b7 49152 16384,2048,1024,512,8192,256,4096"
  "b8 24576 lognormal:8000:0.5:1024:24576"
)
for b in "${batches[@]}"; do
  read -r name seq dist <<<"$b"
  echo "== $name: $seq tokens, documents $dist"
  "${mpi[@]}" "$bin" bench --comm mpi --docs "$dist" --doc-seeds 1 --seq "$seq" "${shape[@]}" \
    --strategies ring,allgather,ulysses,auto --layout zigzag,balanced,contiguous "${cal[@]}" \
    --json "$out/$name.json" | tee "$out/$name.txt"
done
python3 scripts/docs-auto-summary.py "$out"
