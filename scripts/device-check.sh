#!/usr/bin/env bash
# The GPU device check (issue 5, item 7): one prepared script for the lent H200 machine.
#   1. facts: host, nvidia-smi (full and a query before/after), torch/CUDA/cuDNN versions, binary;
#   2. `ringattn verify --backend cuda` over a matrix of shapes, dtypes and masks (forward and
#      backward against the float64 oracle), pass/fail per case;
#   3. timings side by side: PyTorch SDPA flash and cuDNN backends (scripts/device_bench.py
#      torch) and `ringattn bench --backend cuda` (scripts/device_bench.py ringattn), on
#      b*s = 16k tokens, s in {4k, 16k} (quick) or {1k, 2k, 4k, 8k, 16k, 32k} (--full),
#      d in {64, 128} (h = 32 / 16), causal and not, bf16, forward and backward;
#   4. sequence parallelism on the one GPU (issue 6): every strategy with 2, 4 and 8 ranks
#      (threads sharing the GPU, device-resident buffers, sends as device copies) against the
#      float64 oracle (`verify --backend cuda --strategy S --world W`), and the overlap of the
#      ring, contiguous and zigzag, 4 ranks x 32k tokens, bf16, d=128, causal, forward and
#      backward (`bench --backend cuda --strategies ring --world 4`): wall time against the
#      GPU time of the attention kernels, and the hidden share from the runs with instant
#      communication and without kernels;
#   5. $OUT/device-check.json with everything (facts, verify reports, timings, ratios,
#      overlap), and short tables printed last.
# Every step runs under `timeout`; a failed step is recorded and the script goes on. A global
# deadline bounds the whole run: quick mode (the default) ends within 5.5 minutes of its start
# (310 s deadline + at most 10 s kill grace + the summary; typically 2.5-4 minutes), --full
# within 9.5 minutes (540 s deadline; a call of its own with timeout_s=600).
#
# Usage (repo root, release binary at target/release/ringattn, python3 with torch):
#   bash scripts/device-check.sh [--full] [--dry-run] [--bin PATH] [--python PY]
#                                [--torch-device cuda|cpu] [--budget SECONDS] [--seqs LIST] [--tokens N]
#   --dry-run       print the commands instead of running them (the summary still runs)
#   --torch-device  cpu: the torch side on the CPU (math backend; a test path without a GPU)
#   --seqs, --tokens  the timed sequence lengths and b*s (defaults above; small ones for tests)
# Output: $OUT (the device tool's folder) or target/device-check/ when OUT is unset:
#   device-check.json, device-check.log, and (with $OUT) work.tar.gz holding every step's log
#   and JSON (the device tool brings back at most 8 files from $OUT, hence one archive).
#
# Build here first, with nvcc 13.0 (scripts/test.sh installs it; the device's driver is CUDA
# 13.0) and without debug info, so the carried binary stays well under the 64 MiB limit
# (about 27 MiB, 18 of them the embedded cubins and PTX):
#   NVCC=$(ls -d target/venv-nvcc/lib/python3*/site-packages/nvidia/cu13)/bin/nvcc \
#     CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release --features cuda && strip target/release/ringattn
# Device tool call (the lead's), e.g.:
#   run(command="bash scripts/device-check.sh", carry=["target/release/ringattn"], timeout_s=400)
set -uo pipefail # no -e: every step's failure is recorded and the script continues
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1

mode=quick
dry=0
bin=target/release/ringattn
py=${PYTHON:-python3}
torch_device=cuda
budget=
seqs_arg=
tokens=16384
while [ $# -gt 0 ]; do
  case "$1" in
    --full) mode=full ;;
    --dry-run) dry=1 ;;
    --bin) bin=$2; shift ;;
    --python) py=$2; shift ;;
    --torch-device) torch_device=$2; shift ;;
    --budget) budget=$2; shift ;;
    --seqs) seqs_arg=$2; shift ;;
    --tokens) tokens=$2; shift ;;
    -h | --help) sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "device-check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

# --- budgets (seconds) ---
if [ "$mode" = full ]; then
  total=${budget:-540} verify_budget=150 verify_case=90 torch_budget=120 ra_budget=150 ra_max_run=90
  par_budget=60 overlap_budget=60
  seqs=1024,2048,4096,8192,16384,32768
  par_cases="ring:2 ring:4 ring:8 allgather:2 allgather:4 allgather:8 ulysses:2 ulysses:4 ulysses:8 usp:4 usp:8"
else
  total=${budget:-310} verify_budget=60 verify_case=40 torch_budget=70 ra_budget=80 ra_max_run=45
  par_budget=40 overlap_budget=50
  seqs=4096,16384
  par_cases="ring:2 ring:4 ring:8 allgather:4 ulysses:4 usp:8"
fi
seqs=${seqs_arg:-$seqs}
dims=64,128
reserve=15 # kept for the summary

out=${OUT:-target/device-check}
mkdir -p "$out"
if [ -n "${OUT:-}" ]; then
  work=$(mktemp -d "${TMPDIR:-/tmp}/ringattn-device-check.XXXXXX")
else
  work=$out/work
  rm -rf "$work"
  mkdir -p "$work"
fi
exec > >(tee "$out/device-check.log") 2>&1
start=$(date +%s)
deadline=$((start + total))
steps=$work/steps.tsv
: >"$steps"
echo "device-check: $mode mode, deadline ${total}s, out $out, work $work$([ "$dry" = 1 ] && echo ', DRY RUN')"

# run_step NAME LIMIT CMD...: runs CMD under timeout (LIMIT capped by the global deadline),
# its output to the console and to $work/NAME.log; appends NAME, rc, seconds, log, command to
# steps.tsv. rc 124/137: timed out.
run_step() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - $(date +%s) - reserve))
  [ "$limit" -gt "$left" ] && limit=$left
  local log=$work/$name.log
  if [ "$limit" -lt 5 ]; then
    echo "--- $name: skipped (out of time)"
    printf '%s\t%s\t0\t\t%s\n' "$name" "skipped: out of time" "$*" >>"$steps"
    return
  fi
  if [ "$dry" = 1 ]; then
    echo "DRY-RUN [timeout ${limit}s] $*"
    printf '%s\t%s\t0\t\t%s\n' "$name" "dry-run" "$*" >>"$steps"
    return
  fi
  echo "--- $name [timeout ${limit}s]: $*"
  local t0 t1 rc
  t0=$(date +%s%N)
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  t1=$(date +%s%N)
  local secs
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", (b - a) / 1e9 }')
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$log" "$*" >>"$steps"
  echo "--- $name: rc=$rc in ${secs}s"
}

# --- 1. facts ---
run_step facts-host 20 bash -c 'date -u; uname -a; nproc; free -g; head -2 /etc/os-release; pwd'
run_step facts-nvidia-smi 30 nvidia-smi
query=name,driver_version,memory.total,memory.used,temperature.gpu,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,persistence_mode,compute_mode,mig.mode.current
run_step facts-query-before 30 nvidia-smi --query-gpu=$query --format=csv
run_step facts-torch 60 "$py" -c '
import json, torch
f = dict(torch=torch.__version__, cuda=torch.version.cuda, available=torch.cuda.is_available())
if f["available"]:
    p = torch.cuda.get_device_properties(0)
    f.update(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
             memory_gib=round(p.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version(),
             l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
print(json.dumps(f))'
run_step facts-binary 20 bash -c "ls -l '$bin' && sha256sum '$bin' && '$bin' --version && (git rev-parse HEAD 2>/dev/null || echo 'no git here')"

# --- 2. verify matrix: NAME|b,s,hq,hkv,d|dtype|extra arguments (forward + backward each) ---
verify_cases=(
  "d64-gqa-full|2,257,4,2,64|bf16|"
  "d64-gqa-causal|2,257,4,2,64|bf16|--causal"
  "d128-gqa4-causal|1,640,8,2,128|bf16|--causal"
  "d128-mha-full-f16|1,640,8,8,128|f16|"
  "d128-window|1,513,4,4,128|bf16|--window 64,16"
  "d64-docs-causal|1,600,4,2,64|bf16|--causal --seqlens 100,250,250"
  "d64-mqa-causal-f16|1,384,6,1,64|f16|--causal"
)
if [ "$mode" = full ]; then
  verify_cases+=(
    "d32-causal|2,300,4,4,32|bf16|--causal"
    "d32-full-f16|1,255,4,2,32|f16|"
    "d96-gqa-full|1,500,4,2,96|bf16|"
    "d96-causal-f16|1,333,6,3,96|f16|--causal"
    "d256-causal|1,384,4,2,256|bf16|--causal"
    "d256-window-f16|1,300,2,1,256|f16|--window 32,32"
    "d128-docs-full|1,700,4,4,128|bf16|--seqlens 1,299,400"
    "d128-causal-window|1,777,4,2,128|bf16|--causal --window 128,-1"
    "d64-long-causal|1,2048,4,4,64|bf16|--causal"
    "d128-single-token|1,1,2,1,128|bf16|"
  )
fi
verify_deadline=$(($(date +%s) + verify_budget))
for case in "${verify_cases[@]}"; do
  IFS='|' read -r name shape dtype extra <<<"$case"
  left=$((verify_deadline - $(date +%s)))
  limit=$verify_case
  [ "$limit" -gt "$left" ] && limit=$left
  # shellcheck disable=SC2086 # $extra holds several arguments
  run_step "verify-$name" "$limit" "$bin" verify --backend cuda --shape "$shape" --dtype "$dtype" $extra \
    --json "$work/verify-$name.json"
done

# --- 3. timings ---
run_step bench-torch "$torch_budget" "$py" scripts/device_bench.py torch --device "$torch_device" --dtype bf16 \
  --seqs "$seqs" --dims "$dims" --tokens "$tokens" --warmup 3 --iters 10 --json "$work/torch.json"
left=$((deadline - $(date +%s) - reserve - 15))
[ "$ra_budget" -gt "$left" ] && ra_budget=$left
ra_cmd=("$py" scripts/device_bench.py ringattn --bin "$bin" --work "$work/bench" --dtype bf16 --seqs "$seqs"
  --dims "$dims" --tokens "$tokens" --warmup 3 --iters 10 --budget "$ra_budget" --max-run "$ra_max_run" --json "$work/ringattn.json")
if [ "$dry" = 1 ]; then
  # Prints each `ringattn bench` command it would run.
  dry=0 run_step bench-ringattn 30 "${ra_cmd[@]}" --dry-run
else
  run_step bench-ringattn $((ra_budget + 15)) "${ra_cmd[@]}"
fi

# --- 4. sequence parallelism on one GPU: correctness, then the ring's overlap ---
par_deadline=$(($(date +%s) + par_budget))
for case in $par_cases; do
  IFS=':' read -r strategy world <<<"$case"
  left=$((par_deadline - $(date +%s)))
  limit=30
  [ "$limit" -gt "$left" ] && limit=$left
  run_step "verify-par-$strategy-x$world" "$limit" "$bin" verify --backend cuda --strategy "$strategy" --world "$world" \
    --shape 1,2048,16,4,128 --dtype bf16 --causal --json "$work/verify-par-$strategy-x$world.json"
done
for layout in zigzag contiguous; do
  run_step "overlap-ring-$layout" "$overlap_budget" "$bin" bench --backend cuda --strategies ring --world 4 \
    --layout "$layout" --seq 131072 --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --causal --iters 1 \
    --warmup 0 --out "$work/overlap-ring-$layout"
done
run_step facts-query-after 30 nvidia-smi --query-gpu=$query --format=csv

# --- 5. summary (the tables last) ---
if [ -n "${OUT:-}" ]; then
  tar -czf "$out/work.tar.gz" -C "$work" . 2>/dev/null || echo "device-check: could not archive $work"
fi
summary_py=$py
"$summary_py" -c 'import json' 2>/dev/null || summary_py=python3
timeout 60 "$summary_py" scripts/device_bench.py summarize --work "$work" --torch-json "$work/torch.json" \
  --ringattn-json "$work/ringattn.json" --out "$out/device-check.json" --mode "$mode$([ "$dry" = 1 ] && echo -dry-run)" \
  --elapsed $(($(date +%s) - start)) ||
  echo "device-check: the summary failed (rc $?); raw files in $work"
