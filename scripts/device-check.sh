#!/usr/bin/env bash
# The GPU device check: one prepared script, run once on
# the lent H200, whose device time is scarce (about 15 minutes in all, the machine's start
# included), so it must not waste it:
#   0. preflight, in seconds: glibc (`ldd --version`), `uname -a`, nvidia-smi's name, driver
#      and compute capability, `ldd BIN` (missing libraries and GLIBC errors show here),
#      `BIN --version`, `BIN doctor --json` (features, embedded kernel images, driver, GPUs,
#      NCCL) and a tiny `BIN verify --backend cuda`. It REFUSES to go on -- one line
#      `device-check: refused: ...`, the JSON with the reason, exit 3, no other step -- when
#      BIN is missing or cannot run here, has no `doctor` (a stale build), lacks the cuda
#      feature or its kernels (nvcc missing at build), or there is a GPU the build cannot use
#      (no embedded image fits it, or the driver is older than required); it STOPS the same
#      way when the tiny verify hangs on a GPU. With no GPU or no driver at all (a test
#      machine) it records `no GPU: ...` and goes on: every GPU step then fails fast with the
#      binary's own `no CUDA driver found ...`;
#   1. facts: host, nvidia-smi (full, and a query before and after), torch/CUDA/cuDNN;
#   2. `ringattn verify --backend cuda` over a matrix of shapes, dtypes and masks (forward and
#      backward against the float64 oracle), pass/fail per case; the Hopper family's cases
#      first (--kernels hopper runs its forward and backward; d 32 and 96 among them);
#   3. sequence parallelism on the one GPU: every strategy with 2, 4 and 8 ranks
#      (threads sharing the GPU, device-resident buffers, sends as device copies) against the
#      oracle; then the ring's overlap, zigzag and contiguous layouts, 4 ranks, bf16, h=32,
#      h_kv=8, d=128, causal, forward+backward (`bench --strategies ring --world 4`): wall time
#      against the kernels' time and the hidden share, at s = 32768 in all (4 x 8k tokens,
#      3 iterations); --full adds s = 131072 (4 x 32k, 1 iteration);
#   3b. the Hopper kernels beside the FA2 ones (bench, forward and backward), in a budget of
#      their own;
#   4. timings side by side, in the time left: PyTorch SDPA flash and cuDNN (device_bench.py
#      torch) and `ringattn bench --backend cuda` (device_bench.py ringattn), b*s = 16k tokens,
#      s in {4k, 16k} (quick) or {1k, 2k, 4k, 8k, 16k, 32k} (--full), d in {64, 128}
#      (h = 32 / 16), causal and not, bf16, forward and backward; TFLOP/s of the visible
#      (query, key) pairs (causal: s(s+1)/2 per head), the same model for both;
#   5. the tables, printed last.
# $OUT/device-check.json is rewritten after every step (a kill at any time leaves valid JSON
# with the steps so far) and at the end with the tables' data; device-check.log is appended
# to directly (no tee process to lose its tail). Every step runs under `timeout`, cut to what
# is left of a global deadline: quick mode (the default) runs at most 330 s of steps, then
# the summary (about 2 s): under 6 minutes, typically 3-4; --full at most 540 s (under 9.5
# minutes; a call of its own, timeout_s=600).
# Exit status: 0 every step passed; 1 some step failed or timed out; 2 none failed but some
# were skipped (out of time; named on the last line); 3 refused or stopped at step 0; 4 no GPU
# here (every GPU step failed fast); 64 bad arguments.
#
# Usage (repo root, python3 with torch on the device):
#   bash scripts/device-check.sh [--full] [--dry-run] [--bin PATH] [--python PY]
#                                [--torch-device cuda|cpu] [--budget SECONDS] [--seqs LIST] [--tokens N]
#   --bin           the binary (default target/release/ringattn, the carried one)
#   --dry-run       step 0 for real (seconds), then print the other steps' commands
#   --torch-device  cpu: the torch side on the CPU (math backend; a test path without a GPU)
#   --budget        the global deadline in seconds (default 330 quick, 540 --full)
#   --seqs, --tokens  the timed sequence lengths and b*s (defaults above; small ones for tests)
# Output: $OUT (the folder whose files come back from the GPU machine) or target/device-check/
# when OUT is unset:
#   device-check.json, device-check.log, and (with $OUT) work.tar.gz holding every step's log
#   and JSON, re-archived after every step (few files come back from the GPU machine).
#
# Build here first, with nvcc 13.0 (scripts/test.sh installs it; the device's driver is CUDA
# 13.0, R580), RINGATTN_CUDA_ARCHS unset (build.rs's default: sm_80, sm_90a, sm_100, sm_120
# cubins + PTX of the newest; the H200 loads sm_90a), no debug info, stripped: the carry limit
# is 64 MiB in all. Measured 2026-12-05 (nvcc 13.0.88): the images are 57.0 MiB, embedded
# deflate-compressed as 10.8 MiB; the stripped binary is 17.6 MiB (18,466,816 bytes):
#   NVCC=$(ls -d target/venv-nvcc/lib/python3*/site-packages/nvidia/cu13)/bin/nvcc \
#     CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release --features cuda && strip target/release/ringattn
#   ls -l target/release/ringattn && target/release/ringattn doctor --json   # features.cuda: true
# On the GPU machine, from the repository root with that binary in place, quick mode:
#   bash scripts/device-check.sh        # allow 7 minutes (420 s) for the call
# Here, on the emulated GPU (the stand-in driver, emulated-gpu/; scripts/test.sh runs it):
#   scripts/with-emulated-gpu bash scripts/device-check.sh --bin target/debug/ringattn
# which finds the device emulated (doctor's emulated_gpu), runs every step on shapes scaled
# for the emulator, leaves the torch comparison out (n/a, not counted as a skip) and labels
# the mode `quick-emulated` and every table EMULATED: about a minute, no GPU figure.
# NCCL comes from the device's python package (nvidia-nccl-cu13): before the steps, the folder
# printed by `python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))'`
# is prepended to LD_LIBRARY_PATH when it exists (doctor then reports NCCL found).

# shellcheck disable=SC2016 # single quotes hold code for `bash -c` and literal backquotes
set -uo pipefail # no -e: every step's failure is recorded and the script continues
{ # the whole script is one compound command: bash parses it all before running (an edit of
# this file during a run cannot derail it)
export PYTHONUNBUFFERED=1

mode=quick
dry=0
bin=target/release/ringattn
py=${PYTHON:-python3}
torch_device=cuda
budget=
seqs_arg=
tokens=16384
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --full) mode=full ;;
    --dry-run) dry=1 ;;
    --bin | --python | --torch-device | --budget | --seqs | --tokens)
      if [ $# -lt 2 ]; then echo "device-check: $1 needs a value" >&2; exit 64; fi
      case "$1" in
        --bin) bin=$2 ;;
        --python) py=$2 ;;
        --torch-device) torch_device=$2 ;;
        --budget) budget=$2 ;;
        --seqs) seqs_arg=$2 ;;
        --tokens) tokens=$2 ;;
      esac
      shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "device-check: unknown argument $1 (see --help)" >&2; exit 64 ;;
  esac
  shift
done
if [ -n "$budget" ] && ! [ "$budget" -gt 0 ] 2>/dev/null; then
  echo "device-check: --budget $budget: expected a positive number of seconds" >&2
  exit 64
fi
# Paths given relative to the caller's folder stay right after the cd to the repository root.
repo=$(cd "$(dirname "$0")/.." && pwd) || exit 64
if [ "$PWD" != "$repo" ]; then
  case "$bin" in /*) ;; */*) [ -e "$bin" ] && bin=$PWD/$bin ;; esac
  case "${OUT:-/}" in /*) ;; *) OUT=$PWD/$OUT ;; esac
fi
cd "$repo" || exit 64

# --- budgets (seconds) ---
# overlap_runs: SEQ:ITERS:LIMIT, one `bench` sweep per layout each.
if [ "$mode" = full ]; then
  total=${budget:-540} verify_budget=100 verify_case=45 par_budget=90 par_case=40
  torch_budget=110 ra_budget=170 ra_max_run=90 kbench_budget=80 kbench_case=30
  seqs=1024,2048,4096,8192,16384,32768
  par_cases="ring:2 ring:4 ring:8 allgather:2 allgather:4 allgather:8 ulysses:2 ulysses:4 ulysses:8 usp:4 usp:8"
  overlap_runs="32768:3:45 131072:1:100"
else
  total=${budget:-330} verify_budget=50 verify_case=30 par_budget=45 par_case=25
  torch_budget=60 ra_budget=80 ra_max_run=40 kbench_budget=40 kbench_case=15
  seqs=4096,16384
  par_cases="ring:2 ring:4 ring:8 allgather:4 ulysses:4 usp:8"
  overlap_runs="32768:3:40"
fi
seqs=${seqs_arg:-$seqs}
dims=64,128
reserve=15 # kept for the summary (and a step's kill grace)
mode_label=$mode$([ "$dry" = 1 ] && echo -dry-run)
build_line='NVCC=$(ls -d target/venv-nvcc/lib/python3*/site-packages/nvidia/cu13)/bin/nvcc CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release --features cuda && strip target/release/ringattn'

out=${OUT:-target/device-check}
mkdir -p "$out" || exit 64
if [ -n "${OUT:-}" ]; then
  work=$(mktemp -d "${TMPDIR:-/tmp}/ringattn-device-check.XXXXXX") || exit 64
else
  work=$out/work
  rm -rf "$work"
  mkdir -p "$work" || exit 64
fi
logf=$out/device-check.log
: >"$logf"
# With $OUT, the work folder lives in /tmp and travels as work.tar.gz: removed once archived.
# shellcheck disable=SC2317 # called by the trap
cleanup() { [ -n "${OUT:-}" ] && [ -s "$out/work.tar.gz" ] && rm -rf "$work"; }
trap cleanup EXIT
start=$(date +%s)
deadline=$((start + total))
steps=$work/steps.tsv
: >"$steps"
state=running # running | done | refused | stopped
reason=       # why refused or stopped
gpu_note=     # "no GPU: ..." when there is none
verdict=      # the preflight verdict: VERDICT<TAB>TEXT (device_bench.py verdict)
nccl_dir=
last_rc=0
last_secs=0 # whole seconds the last step ran (rounded up)

# Console and log file, both written directly (nothing in the background to lose a tail).
log() {
  printf '%s\n' "$*"
  printf '%s\n' "$*" >>"$logf"
}

spy=$py # the summary's python: the torch one, or any python3
"$spy" -c 'import json' >/dev/null 2>&1 || spy=python3

# A JSON string of $1 (for the fallback writer, when python cannot run).
json_str() {
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\t'/ }
  s=${s//$'\n'/ }
  s=${s//$'\r'/ }
  printf '"%s"' "$s"
}

# write_json [--print]: (re)writes $out/device-check.json from the steps so far (atomically,
# by device_bench.py summarize; a minimal one from the shell when python cannot run), then
# re-archives the work folder. --print: also prints the tables (the end of the run).
write_json() {
  local quiet=--quiet rc
  [ "${1:-}" = --print ] && quiet=
  # shellcheck disable=SC2086 # $quiet is one optional argument
  timeout 30 "$spy" scripts/device_bench.py summarize --work "$work" --torch-json "$work/torch.json" \
    --ringattn-json "$work/ringattn.json" --out "$out/device-check.json" --mode "$mode_label" \
    --elapsed $(($(date +%s) - start)) --state "$state" --reason "$reason" --gpu-note "$gpu_note" \
    --verdict "$verdict" --nccl-dir "$nccl_dir" $quiet </dev/null 2>&1 | tee -a "$logf"
  rc=${PIPESTATUS[0]}
  if [ "$rc" != 0 ]; then
    log "device-check: the summary writer failed (exit $rc); a minimal JSON instead"
    {
      printf '{"mode":%s,"state":%s,"reason":%s,"no_gpu":%s,"elapsed_s":%s,"summary_writer":"failed","steps":[' \
        "$(json_str "$mode_label")" "$(json_str "$state")" "$(json_str "$reason")" "$(json_str "$gpu_note")" \
        $(($(date +%s) - start))
      local first=1 name status secs rest
      while IFS=$'\t' read -r name status secs rest; do
        [ "$first" = 1 ] || printf ','
        first=0
        printf '{"name":%s,"status":%s,"seconds":%s}' "$(json_str "$name")" "$(json_str "$status")" \
          "$(json_str "$secs")"
      done <"$steps"
      printf ']}\n'
    } >"$out/device-check.json.tmp" && mv -f "$out/device-check.json.tmp" "$out/device-check.json"
  fi
  if [ -n "${OUT:-}" ]; then
    tar -czf "$out/work.tar.gz.tmp" -C "$work" . 2>/dev/null && mv -f "$out/work.tar.gz.tmp" "$out/work.tar.gz"
  fi
}

# record NAME STATUS SECONDS LOG CMD: one line of steps.tsv (STATUS: the exit status, or
# "skipped: why", "dry-run").
record() {
  local cmd=$5
  cmd=${cmd//$'\t'/ }
  cmd=${cmd//$'\n'/ }
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$cmd" >>"$steps"
}

# skip NAME WHY CMD...: records a step that does not run.
skip() {
  local name=$1 why=$2
  shift 2
  log "--- $name: skipped ($why)"
  record "$name" "skipped: $why" 0 "" "$*"
  write_json
}

# run_step NAME LIMIT CMD...: runs CMD under timeout (LIMIT cut to what is left of the global
# deadline), its output to the console, the log file and $work/NAME.log; records it in
# steps.tsv and rewrites the JSON. rc (also in $last_rc) 124/137: timed out.
run_step() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - $(date +%s) - reserve))
  [ "$limit" -gt "$left" ] && limit=$left
  local slog=$work/$name.log
  last_secs=0
  if [ "$dry" = 1 ]; then
    log "DRY-RUN [$name, timeout ${limit}s] $*"
    record "$name" dry-run 0 "" "$*"
    last_rc=0
    return 0
  fi
  if [ "$limit" -lt 5 ]; then
    last_rc=124
    skip "$name" "out of time" "$@"
    return 0
  fi
  log "--- $name [timeout ${limit}s]: $*"
  local t0 t1 secs
  t0=$(date +%s%N)
  : >"$slog"
  timeout -k 10 "$limit" "$@" </dev/null 2>&1 | tee -a "$logf" "$slog"
  last_rc=${PIPESTATUS[0]}
  t1=$(date +%s%N)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", (b - a) / 1e9 }')
  record "$name" "$last_rc" "$secs" "$slog" "$*"
  last_secs=$((${secs%.*} + 1))
  log "--- $name: rc=$last_rc in ${secs}s"
  write_json
  return 0
}

# refuse WHY / stop WHY: the one line, the JSON with the reason, exit 3.
finish_early() {
  state=$1
  reason="$1: $2"
  write_json
  log "device-check: $reason"
  exit 3
}
refuse() { finish_early refused "$1"; }

log "device-check: $mode mode, deadline ${total}s, bin $bin, out $out, work $work$([ "$dry" = 1 ] && echo ', DRY RUN (step 0 for real)')"

# NCCL from the python package (nvidia-nccl-cu13), for doctor and --comm nccl.
nccl_dir=$(timeout 20 "$py" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' \
  2>/dev/null </dev/null) || nccl_dir=
if [ -n "$nccl_dir" ] && [ -d "$nccl_dir" ]; then
  export LD_LIBRARY_PATH="$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "device-check: NCCL from the python package: LD_LIBRARY_PATH starts with $nccl_dir"
else
  nccl_dir=
  log "device-check: no python NCCL package (nvidia.nccl) for $py; LD_LIBRARY_PATH unchanged"
fi

# --- 0. preflight: is the binary usable here? (for real even with --dry-run: seconds) ---
dry_run=$dry
dry=0
run_step preflight-host 10 bash -c 'ldd --version 2>&1 | head -1; uname -a'
if command -v nvidia-smi >/dev/null 2>&1; then
  run_step preflight-nvidia-smi 15 nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv
else
  skip preflight-nvidia-smi "nvidia-smi not found"
fi
if [ ! -f "$bin" ]; then
  refuse "$bin not found (build it here and carry it: $build_line; run(..., carry=[\"$bin\"]))"
fi
[ -x "$bin" ] || chmod u+x "$bin" 2>/dev/null
run_step preflight-ldd 10 ldd "$bin"
run_step preflight-binary 15 bash -c 'ls -l "$0"; sha256sum "$0"; "$0" --version' "$bin"
if [ "$last_rc" != 0 ]; then
  why=$(grep -v "^-\|^[0-9a-f]\{64\} " "$work/preflight-binary.log" | grep . | tail -1)
  refuse "$bin cannot run here (\`--version\` exit $last_rc: ${why:-no output}); rebuild: $build_line"
fi
run_step preflight-doctor 20 bash -c '"$0" doctor --json >"$1"' "$bin" "$work/doctor.json"
doctor_rc=$last_rc
if [ "$doctor_rc" != 0 ] && grep -qi "unrecognized subcommand\|unexpected argument\|unknown subcommand" \
  "$work/preflight-doctor.log"; then
  refuse "$bin has no \`doctor --json\`: a build older than this check (rebuild: $build_line)"
fi
verdict=$(timeout 20 "$spy" scripts/device_bench.py verdict "$work/doctor.json" 2>/dev/null </dev/null | head -1)
if [ -z "$verdict" ]; then
  # No python to read the JSON: the cuda feature is what can be told without it.
  if tr -d ' \n\t' <"$work/doctor.json" 2>/dev/null | grep -q '"cuda":true'; then
    verdict=$'unknown\tno python to read doctor\'s report'
  elif tr -d ' \n\t' <"$work/doctor.json" 2>/dev/null | grep -q '"cuda":false'; then
    verdict=$'nocuda\tbuilt without the cuda feature'
  else
    verdict=$'unknown\tdoctor printed no JSON report'
  fi
fi
verdict_kind=${verdict%%$'\t'*}
verdict_text=${verdict#*$'\t'}
case "$verdict_kind" in
  nocuda) refuse "$bin was built without the cuda feature (rebuild: $build_line)" ;;
  nokernels) refuse "$bin has the cuda feature but embeds no CUDA kernels: nvcc was not found when it was built (rebuild: $build_line)" ;;
  refuse) refuse "$verdict_text" ;;
  nogpu)
    gpu_note="no GPU: $verdict_text"
    log "device-check: $gpu_note; every GPU step will fail fast" ;;
  ok) log "device-check: preflight: $verdict_text" ;;
  *)
    why=$(grep . "$work/preflight-doctor.log" | head -1)
    log "device-check: doctor gave no usable report (exit $doctor_rc: ${why:-$verdict_text}); the tiny verify decides" ;;
esac
dry=$dry_run
run_step preflight-verify 45 "$bin" verify --backend cuda --shape 1,64,2,2,64 --dtype bf16 --causal \
  --json "$work/preflight-verify.json"
if [ "$dry" = 0 ]; then
  if grep -q 'lacks the `cuda` feature' "$work/preflight-verify.log"; then
    refuse "$bin was built without the cuda feature (rebuild: $build_line)"
  fi
  if [ -z "$gpu_note" ] && [ "$verdict_kind" != ok ]; then
    no_cuda=$(grep -m1 -o 'no CUDA \(driver\|GPU\) found.*' "$work/preflight-verify.log")
    if [ -n "$no_cuda" ]; then
      gpu_note="no GPU: $no_cuda"
      log "device-check: $gpu_note; every GPU step will fail fast"
    fi
  fi
  if [ -z "$gpu_note" ] && { [ "$last_rc" = 124 ] || [ "$last_rc" = 137 ]; }; then
    finish_early stopped "the tiny verify (1x64 tokens) timed out on the GPU: every GPU step would hang until its timeout"
  fi
fi
# ringattn's stand-in driver (scripts/with-emulated-gpu): the same steps on shapes scaled for
# the emulator, the torch comparison not applicable, and every figure labelled emulated.
emulated=0
if tr -d ' \n\t' <"$work/doctor.json" 2>/dev/null | grep -q '"emulated_gpu":true'; then
  emulated=1
  mode_label=$mode_label-emulated
  seqs=${seqs_arg:-128}
  [ "$tokens" = 16384 ] && tokens=128
  overlap_runs="512:1:45"
  log "device-check: EMULATED GPU (ringattn's stand-in driver: the kernels run on the CPU): shapes scaled for the emulator, no torch comparison, no figure here is a GPU figure"
fi
write_json

# --- 1. facts ---
run_step facts-host 10 bash -c 'date -u; nproc; free -g; head -2 /etc/os-release; pwd; echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"'
query=name,driver_version,memory.total,memory.used,temperature.gpu,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,persistence_mode,compute_mode,mig.mode.current
have_smi=0
command -v nvidia-smi >/dev/null 2>&1 && have_smi=1
if [ "$have_smi" = 1 ]; then
  run_step facts-nvidia-smi 20 nvidia-smi
  run_step facts-query-before 15 nvidia-smi --query-gpu=$query --format=csv
else
  skip facts-nvidia-smi "nvidia-smi not found"
fi
if [ "${emulated:-0}" = 1 ]; then
  skip facts-torch "n/a on the emulated GPU: no GPU to run torch on beside it"
else
  run_step facts-torch 40 "$py" scripts/device_bench.py facts
fi

# --- 2. verify matrix: NAME|b,s,hq,hkv,d|dtype|extra arguments (forward + backward each) ---
verify_cases=(
  # The Hopper kernels (sm_90a: wgmma, TMA, mbarriers), forward and backward (--kernels
  # reaches both), verified on hardware for the first time here: first, so that the phase's
  # time rule never skips them; d 32 and 96 (not multiples of 64) run the tensor copies'
  # out-of-bounds column fill. --kernels auto keeps the FA2 family until these pass
  # (src/cuda/device.rs HOPPER_BY_DEFAULT).
  "hopper-d128-gqa4-causal|1,640,8,2,128|bf16|--causal --kernels hopper"
  "hopper-d64-full-f16|2,257,4,2,64|f16|--kernels hopper"
  "hopper-d96-gqa-causal|1,333,6,3,96|bf16|--causal --kernels hopper"
  "hopper-d32-full|2,300,4,4,32|bf16|--kernels hopper"
  "hopper-d256-causal|1,300,4,2,256|bf16|--causal --kernels hopper"
  "hopper-d128-docs-window|1,700,4,4,128|bf16|--seqlens 1,299,400 --window 64,16 --kernels hopper"
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
if [ "$emulated" = 1 ]; then
  # The same coverage at a quarter of the lengths (the emulator runs each block's threads as
  # fibers on the CPU).
  verify_cases=(
    "hopper-d128-gqa4-causal|1,160,8,2,128|bf16|--causal --kernels hopper"
    "hopper-d64-full-f16|2,65,4,2,64|f16|--kernels hopper"
    "hopper-d96-gqa-causal|1,83,6,3,96|bf16|--causal --kernels hopper"
    "hopper-d32-full|2,75,4,4,32|bf16|--kernels hopper"
    "hopper-d256-causal|1,75,4,2,256|bf16|--causal --kernels hopper"
    "hopper-d128-docs-window|1,175,4,4,128|bf16|--seqlens 1,74,100 --window 64,16 --kernels hopper"
    "d64-gqa-full|2,65,4,2,64|bf16|"
    "d64-gqa-causal|2,65,4,2,64|bf16|--causal"
    "d128-gqa4-causal|1,160,8,2,128|bf16|--causal"
    "d128-mha-full-f16|1,160,8,8,128|f16|"
    "d128-window|1,129,4,4,128|bf16|--window 64,16"
    "d64-docs-causal|1,150,4,2,64|bf16|--causal --seqlens 25,62,63"
    "d64-mqa-causal-f16|1,96,6,1,64|f16|--causal"
  )
fi
# phase_start BUDGET, then phase_step NAME CAP CMD...: run_step with CAP cut to what is left
# of the phase's budget; a step is not started when less is left than the slowest finished
# one of the phase took (it would be killed unfinished). A step that timed out does not
# count: one hanging case says nothing of the others.
phase_start() {
  phase_end=$(($(date +%s) + $1))
  phase_max=0
}
phase_step() {
  local name=$1 limit=$2 left
  shift 2
  left=$((phase_end - $(date +%s)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$dry" = 0 ] && [ "$limit" -lt 5 ]; then
    last_rc=124
    skip "$name" "out of time: the phase's budget is spent" "$@"
    return 0
  fi
  if [ "$dry" = 0 ] && [ "$limit" -lt "$phase_max" ]; then
    last_rc=124
    skip "$name" "out of time: ${limit}s left of the phase, its slowest step took ${phase_max}s" "$@"
    return 0
  fi
  run_step "$name" "$limit" "$@"
  case "$last_rc" in
    124 | 137) ;;
    *) [ "$last_secs" -gt "$phase_max" ] && phase_max=$last_secs ;;
  esac
  return 0
}
phase_start "$verify_budget"
for case in "${verify_cases[@]}"; do
  IFS='|' read -r name shape dtype extra <<<"$case"
  # shellcheck disable=SC2086 # $extra holds several arguments
  phase_step "verify-$name" "$verify_case" "$bin" verify --backend cuda --shape "$shape" --dtype "$dtype" $extra \
    --json "$work/verify-$name.json"
done

# --- 3. sequence parallelism on one GPU: correctness, then the ring's overlap ---
# 1024 tokens, h 16/4 (Ulysses splits and GQA replicas up to 8 ranks): the float64 oracle on
# the host costs about 20 CPU-seconds here, against about 100 for 2048 tokens.
phase_start "$par_budget"
par_shape=1,1024,16,4,128
[ "$emulated" = 1 ] && par_shape=1,256,16,4,64
for case in $par_cases; do
  IFS=':' read -r strategy world <<<"$case"
  phase_step "verify-par-$strategy-x$world" "$par_case" "$bin" verify --backend cuda \
    --strategy "$strategy" --world "$world" --shape "$par_shape" --dtype bf16 --causal \
    --json "$work/verify-par-$strategy-x$world.json"
done
ov_heads=32 ov_kv=8 ov_d=128
[ "$emulated" = 1 ] && ov_heads=8 ov_kv=2 ov_d=64
for run in $overlap_runs; do
  IFS=':' read -r oseq oiters olimit <<<"$run"
  for layout in zigzag contiguous; do
    run_step "overlap-ring-$layout-s$oseq" "$olimit" "$bin" bench --backend cuda --strategies ring --world 4 \
      --layout "$layout" --seq "$oseq" --heads "$ov_heads" --kv-heads "$ov_kv" --head-dim "$ov_d" --dtype bf16 \
      --causal --iters "$oiters" --out "$work/overlap-ring-$layout-s$oseq"
  done
done

# --- 3b. the Hopper kernels against the FA2 kernels, same shape, same run: a phase of its own
# (the same rule as the verify phases: a run is not started unless as much time is left as
# the slowest finished one took), so that it never eats the comparison's time ---
phase_start "$kbench_budget"
kbench_seq=8192 kbench_iters=20 kbench_heads=16 kbench_warmup=3
[ "$emulated" = 1 ] && kbench_seq=256 kbench_iters=1 kbench_heads=2 kbench_warmup=0
for fam in hopper fa2; do
  for pass in forward backward; do
    phase_step "bench-$pass-$fam" "$kbench_case" "$bin" bench --backend cuda --kernels "$fam" --pass "$pass" \
      --seq "$kbench_seq" --heads "$kbench_heads" --head-dim 128 --dtype bf16 --warmup "$kbench_warmup" \
      --iters "$kbench_iters" \
      --json "$work/bench-$pass-$fam.json"
  done
done

# --- 4. timings, in the time left: torch gets up to 45% of it, ringattn the rest ---
left=$((deadline - $(date +%s) - reserve))
torch_limit=$((left * 45 / 100))
[ "$torch_limit" -gt "$torch_budget" ] && torch_limit=$torch_budget
if [ "$emulated" = 1 ]; then
  skip bench-torch "n/a on the emulated GPU: no GPU to run torch on beside it"
else
  run_step bench-torch "$torch_limit" "$py" scripts/device_bench.py torch --device "$torch_device" --dtype bf16 \
    --seqs "$seqs" --dims "$dims" --tokens "$tokens" --warmup 3 --iters 10 --json "$work/torch.json"
fi
iters=(--warmup 3 --iters 10)
[ "$emulated" = 1 ] && iters=(--warmup 1 --iters 2)
left=$((deadline - $(date +%s) - reserve - 15))
[ "$ra_budget" -gt "$left" ] && ra_budget=$left
[ "$ra_budget" -lt 0 ] && ra_budget=0
ra_cmd=("$py" scripts/device_bench.py ringattn --bin "$bin" --work "$work/bench" --dtype bf16 --seqs "$seqs"
  --dims "$dims" --tokens "$tokens" "${iters[@]}" --budget "$ra_budget" --max-run "$ra_max_run"
  --json "$work/ringattn.json")
if [ "$dry" = 1 ]; then
  # Prints each `ringattn bench` command it would run.
  dry=0 run_step bench-ringattn 30 "${ra_cmd[@]}" --dry-run
else
  run_step bench-ringattn $((ra_budget + 15)) "${ra_cmd[@]}"
fi
if [ "$have_smi" = 1 ]; then
  run_step facts-query-after 15 nvidia-smi --query-gpu=$query --format=csv
fi

# --- 5. summary: the JSON with the tables' data, the tables printed last ---
state="done"
write_json --print
elapsed=$(($(date +%s) - start))
# A step failed: its status is a non-zero exit (a timeout too). Skipped: it did not run (out
# of time); nvidia-smi's absence is no skip of a check.
failed=$(awk -F'\t' '$2 != "0" && $2 != "dry-run" && $2 !~ /^skipped/ { n++ } END { print n + 0 }' "$steps")
skipped_names=$(awk -F'\t' '$2 ~ /^skipped/ && $2 !~ /^skipped: (nvidia-smi not found|n\/a on the emulated GPU)/ { printf "%s%s", s, $1; s = ", " }' "$steps")
total_steps=$(wc -l <"$steps")
if [ -n "$gpu_note" ] && [ "$dry" = 0 ]; then
  status=4
elif [ "$failed" -gt 0 ]; then
  status=1
elif [ -n "$skipped_names" ]; then
  status=2
else
  status=0
fi
log ""
log "device-check: done in ${elapsed}s, $total_steps steps, $failed failed${skipped_names:+, skipped: $skipped_names}${gpu_note:+ ($gpu_note)}; exit $status; JSON $out/device-check.json$([ -n "${OUT:-}" ] && echo ", logs $out/work.tar.gz")"
exit "$status"
}
