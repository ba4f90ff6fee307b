#!/usr/bin/env bash
# Static SASS gates: compiles every cuda/*.cu as build.rs does, disassembles
# the cubins and checks, per function of every cubin:
#   * spills   ptxas reports 0 bytes spill stores and 0 bytes spill loads;
#   * local    the SASS holds no LDL / STL (local memory: spills or indexed register arrays);
#   * tensor   the main attention kernels (MAIN_KERNELS below), in the cubins of TC_ARCHS,
#              hold each instruction their entry names (HMMA = mma.sync, LDSM = ldmatrix,
#              LDGSTS = cp.async, HGMMA = wgmma, UTMALDG = a tensor copy, SYNCS = mbarrier
#              operations, USETMAXREG = setmaxnreg; "A|B" accepts either) and none of those
#              it names with "!" (the Hopper kernels: no HMMA). The small kernels (merge.cu, and
#              the element-wise data movements of ops.cu, ringattn_ops_*) need none of
#              these: they are held to the spill and local-memory rules only;
#   * setmaxnreg  no ptxas warning C75xx (setmaxnreg ignored, wgmma serialised, ...) in any
#              family's report (infos such as C7519, an injected warpgroup.arrive, pass); and
#              in every kernel with USETMAXREG, the registers at entry (ptxas's count x the
#              block's threads) cover the split its source declares (`// setmaxnreg-split:
#              1x24 2x240`: warpgroups x registers), whose values must be the SASS's and whose
#              threads the __launch_bounds__ (else setmaxnreg.inc waits forever);
# Prints a table (kernel, arch, registers, stack, spills, LDL/STL, HMMA, HGMMA, LDSM, LDGSTS,
# verdict) and exits 1 naming each failing kernel and rule; 2 when a tool or a compile fails.
# Needs no GPU: nvcc, cuobjdump and nvdisasm come from PyPI into the nvcc venv of
# scripts/test.sh (${RINGATTN_NVCC_VENV:-target/venv-nvcc}), installed on first use.
#
# Usage: scripts/sass-gates.sh [--report-only] [--archs sm_80,sm_90a,sm_100,sm_120] [--tc-archs sm_90a]
#                              [--main 'GLOB:OP,OP|OP']... [--out DIR] [FILE.cu ...]
#   --report-only  print the table, exit 0 whatever the verdicts
#   --main         replaces MAIN_KERNELS (repeatable), e.g. --main 'my_kernel*:HMMA,LDSM'
#   FILE.cu        compile these instead of cuda/*.cu (always with -I cuda, as build.rs)
# Outputs under --out (default target/sass-gates): ARCH/FAMILY.{cubin,ptxas.txt,sass},
# table.txt and report.json.
set -euo pipefail
cd "$(dirname "$0")/.."

# The main attention kernels: a glob over the kernel name, then the SASS instructions it must
# contain in the cubins of TC_ARCHS. Each pattern must match at least one kernel there.
MAIN_KERNELS=(
  "ringattn_flash_fwd_*:HMMA,LDSM,LDGSTS"
  "ringattn_flash_bwd_dq_*:HMMA,LDSM"
  "ringattn_flash_bwd_dkdv_*:HMMA,LDSM"
  "ringattn_flash_bwd_dkdvqfx_*:HMMA,LDSM"
  "ringattn_flash_bwd_dkdvq_*:HMMA,LDSM"
  "ringattn_hopper_flash_fwd_*:HGMMA,UTMALDG,SYNCS,USETMAXREG,!HMMA"
  "ringattn_hopper_flash_bwd_*:HGMMA,UTMALDG,SYNCS,USETMAXREG,!HMMA"
)
TC_ARCHS="sm_90a"
ARCHS="${RINGATTN_CUDA_ARCHS:-sm_80,sm_90a,sm_100,sm_120}" # build.rs's default
# PyPI has no nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm 13.0.* (the oldest 13.x is 13.2.51);
# a newer disassembler reads the cubins of nvcc 13.0. cuobjdump --dump-sass runs nvdisasm,
# which it looks for beside itself.
DISASM_VERSION=13.2.86

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }

report_only=0
out=target/sass-gates
main_override=()
sources=()
while [ $# -gt 0 ]; do
  case "$1" in
    --report-only) report_only=1 ;;
    --archs) ARCHS=$2; shift ;;
    --tc-archs) TC_ARCHS=$2; shift ;;
    --main) main_override+=("$2"); shift ;;
    --out) out=$2; shift ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "sass-gates: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) sources+=("$1") ;;
  esac
  shift
done
if [ ${#main_override[@]} -gt 0 ]; then MAIN_KERNELS=("${main_override[@]}"); fi
explicit_sources=${#sources[@]}
if [ ${#sources[@]} -eq 0 ]; then sources=(cuda/*.cu); fi

# --- tools (same pins as scripts/test.sh for nvcc) ---
nvcc_venv=${RINGATTN_NVCC_VENV:-target/venv-nvcc}
if ! ls "$nvcc_venv"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc >/dev/null 2>&1; then
  echo "sass-gates: installing nvcc 13.0 from PyPI into $nvcc_venv"
  python3 -m venv "$nvcc_venv"
  "$nvcc_venv/bin/pip" install --quiet nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
fi
nvccs=("$nvcc_venv"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)
bin=$(cd "$(dirname "${nvccs[0]}")" && pwd)
if [ ! -x "$bin/cuobjdump" ] || [ ! -x "$bin/nvdisasm" ]; then
  echo "sass-gates: installing cuobjdump and nvdisasm $DISASM_VERSION from PyPI into $nvcc_venv"
  "$nvcc_venv/bin/pip" install --quiet "nvidia-cuda-cuobjdump==$DISASM_VERSION" "nvidia-cuda-nvdisasm==$DISASM_VERSION"
fi
nvcc=${NVCC:-$bin/nvcc}
cuobjdump=$bin/cuobjdump
python=$nvcc_venv/bin/python
for tool in "$nvcc" "$cuobjdump" "$bin/nvdisasm"; do
  if ! "$tool" --version >/dev/null 2>&1; then
    echo "sass-gates: $tool does not run" >&2
    exit 2
  fi
done
echo "sass-gates: $("$nvcc" --version | grep -o 'release [0-9.]*'), cuobjdump $("$cuobjdump" --version | grep -o 'release [0-9.]*')"

# --- compile (as build.rs: nvcc -cubin -O3 -lineinfo -std=c++17 -Xptxas -v [the family's
# `// ptxas-options:` line, each as -Xptxas] -I cuda -arch=ARCH) ---
mkdir -p "$out"
rm -rf "$out"/sm_* "$out/table.txt" "$out/report.json"
IFS=',' read -r -a archs <<<"$ARCHS"

# build.rs's nvcc cache (${RINGATTN_NVCC_CACHE:-target/nvcc-cache}) holds the same cubins and
# ptxas reports when a cuda build of these sources ran (same flags; each entry records the
# sources and the `nvcc --version` it was built from): disassemble those rather than compile
# again. Only for the default sources (every cuda/*.cu) and when every cubin is there.
same_sources() { # DIR: its sources/ holds exactly the files of cuda/ (not cuda/emu), byte for byte
  local dir=$1 f
  [ -f "$dir/sources/.complete" ] || return 1
  [ "$(cd cuda && find . -maxdepth 1 -type f | sort)" = \
    "$(cd "$dir/sources" && find . -maxdepth 1 -type f ! -name .complete | sort)" ] || return 1
  for f in cuda/*; do
    [ -f "$f" ] || continue
    cmp -s "$f" "$dir/sources/$(basename "$f")" || return 1
  done
}
cached=""
if [ "$explicit_sources" -eq 0 ] && [ -d "${RINGATTN_NVCC_CACHE:-target/nvcc-cache}" ]; then
  version=$("$nvcc" --version 2>&1)
  for dir in "${RINGATTN_NVCC_CACHE:-target/nvcc-cache}"/*/; do
    [ -f "$dir/nvcc-version.txt" ] && [ "$(cat "$dir/nvcc-version.txt")" = "$version" ] || continue
    same_sources "$dir" || continue
    complete=1
    for arch in "${archs[@]}"; do
      arch=${arch// /}
      case "$arch" in sm_*) ;; *) arch=sm_$arch ;; esac
      for cu in "${sources[@]}"; do
        family=$(basename "$cu" .cu)
        [ -f "$dir/$family.$arch.cubin" ] && [ -f "$dir/$family.$arch.ptxas.txt" ] || complete=0
      done
    done
    if [ $complete -eq 1 ]; then cached=${dir%/}; break; fi
  done
fi
if [ -n "$cached" ]; then
  echo "sass-gates: disassembling build.rs's cubins of these sources ($cached)"
else
  echo "sass-gates: compiling (no complete build.rs cache entry for these sources)"
fi
pids=()
jobs_desc=()
for arch in "${archs[@]}"; do
  arch=${arch// /}
  case "$arch" in sm_*) ;; *) arch=sm_$arch ;; esac
  mkdir -p "$out/$arch"
  for cu in "${sources[@]}"; do
    family=$(basename "$cu" .cu)
    (
      if [ -n "$cached" ]; then
        cp "$cached/$family.$arch.cubin" "$out/$arch/$family.cubin" &&
          cp "$cached/$family.$arch.ptxas.txt" "$out/$arch/$family.ptxas.txt"
      else
        # The family's own ptxas options (build.rs family_ptxas_options: a `// ptxas-options:` line).
        extra=()
        for opt in $(sed -n 's|^// ptxas-options:||p' "$cu" | head -n 1); do extra+=(-Xptxas "$opt"); done
        "$nvcc" -cubin -O3 -lineinfo -std=c++17 -Xptxas -v "${extra[@]}" -I cuda "-arch=$arch" "$cu" \
          -o "$out/$arch/$family.cubin" >"$out/$arch/$family.ptxas.txt" 2>&1
      fi &&
        "$cuobjdump" --dump-sass "$out/$arch/$family.cubin" >"$out/$arch/$family.sass" 2>"$out/$arch/$family.cuobjdump.err"
    ) &
    pids+=($!)
    jobs_desc+=("$cu for $arch")
  done
done
failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "sass-gates: compiling or disassembling ${jobs_desc[$i]} failed:" >&2
    failed=1
  fi
done
if [ $failed -ne 0 ]; then
  for f in "$out"/*/*.ptxas.txt "$out"/*/*.cuobjdump.err; do
    [ -s "$f" ] && grep -qiE 'error|fatal' "$f" && { echo "--- $f" >&2; cat "$f" >&2; }
  done
  exit 2
fi

# --- gates ---
cat >"$out/gates.py" <<'PY'
import fnmatch, glob, json, os, re, sys
from collections import Counter

out = os.environ["OUT_DIR"]
report_only = os.environ["REPORT_ONLY"] == "1"
tc_archs = {a.strip() for a in os.environ["TC_ARCHS"].split(",") if a.strip()}
main = []
for spec in sys.argv[1:]:
    pattern, _, ops = spec.partition(":")
    main.append((pattern, [alt.split("|") for alt in ops.split(",") if alt]))
COUNTED = ["LDL", "STL", "HMMA", "HGMMA", "LDSM", "LDGSTS", "UTMALDG", "SYNCS", "USETMAXREG"]

def ptxas_report(text):
    """Per function: registers, stack frame, spill stores, spill loads; and the entry names."""
    funcs, entries, entry, cur = {}, [], None, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            entry = m.group(1); entries.append(entry)
            funcs.setdefault(entry, {})
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            cur = m.group(1); funcs.setdefault(cur, {})
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur:
            funcs[cur].update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and entry:
            funcs[entry]["regs"] = int(m.group(1))
    return funcs, entries

INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
def sections(text):
    """The disassembly's `Function : name` sections: name -> their lines."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = m.group(1); out[cur] = []
        elif cur is not None:
            out[cur].append(line)
    return out
def sass_counts(funcs):
    """Per section: counts of the opcodes of COUNTED (base name before '.')."""
    return {name: Counter(m.group(1) for m in map(INSN.search, lines) if m and m.group(1) in COUNTED)
            for name, lines in funcs.items()}

# setmaxnreg: the registers a block gets at entry (ptxas's count x its threads) must cover the
# split its warpgroups move to (`setmaxnreg.dec` lowers a warpgroup, `.inc` waits until the
# block's pool holds what it asks: with too few at entry it waits forever). Each family that
# uses it declares its warpgroups' split in its source, `// setmaxnreg-split: 1x24 2x240`
# (count x registers per thread), checked against the SASS's USETMAXREG values, the
# family's __launch_bounds__ threads and ptxas's count.
sources = {os.path.basename(p)[:-3]: p for p in os.environ.get("SOURCES", "").split()}
SETMAXREG = re.compile(r"USETMAXREG\.(TRY_ALLOC|DEALLOC)\.CTAPOOL\s+(?:U?P\w+,\s*)?(0x[0-9a-fA-F]+|\d+)")
def setmaxnreg_values(funcs):
    """Per section: the USETMAXREG register counts, ('inc'|'dec', n)."""
    return {name: {("inc" if m.group(1) == "TRY_ALLOC" else "dec", int(m.group(2), 0))
                   for m in map(SETMAXREG.search, lines) if m}
            for name, lines in funcs.items()}
def declared_split(family):
    path = sources.get(family)
    text = open(path).read() if path and os.path.exists(path) else ""
    m = re.search(r"^// setmaxnreg-split:(.*)$", text, re.M)
    if not m:
        return None, set()
    split = [tuple(int(x) for x in part.split("x")) for part in m.group(1).split()]
    return split, {int(x) for x in re.findall(r"__launch_bounds__\((\d+)", text)}
def setmaxnreg_rules(name, family, regs, values):
    split, bounds = declared_split(family)
    if split is None:
        return [f"setmaxnreg without a `// setmaxnreg-split:` declaration in {sources.get(family, family)}"]
    rules = []
    threads = 128 * sum(c for c, _ in split)
    if bounds != {threads}:
        rules.append(f"setmaxnreg split {split} is {threads} threads, __launch_bounds__ {sorted(bounds)}")
    want = {r for _, r in split}
    got = {n for _, n in values}
    if got != want:
        rules.append(f"setmaxnreg values {sorted(got)} in the SASS, {sorted(want)} declared")
    if regs is None:
        return rules + ["no ptxas register count for a setmaxnreg kernel"]
    for kind, n in values:
        if (kind == "dec" and n > regs) or (kind == "inc" and n < regs):
            rules.append(f"setmaxnreg.{kind} to {n} with {regs} registers at entry")
    need, have = sum(128 * c * r for c, r in split), regs * threads
    if need > have:
        rules.append(f"setmaxnreg split needs {need} registers, the block has {regs} x {threads} = {have} at entry: .inc would wait forever")
    return rules

rows, failures = [], []
matched = {p: 0 for p, _ in main}
for ptxas in sorted(glob.glob(os.path.join(out, "*", "*.ptxas.txt"))):
    arch = os.path.basename(os.path.dirname(ptxas))
    family = os.path.basename(ptxas)[: -len(".ptxas.txt")]
    ptxas_text = open(ptxas).read()
    for w in sorted(set(re.findall(r"warning[^\n]*?(\(C75\d\d\)[^\n]*)", ptxas_text))):
        failures.append(f"{family} [{arch}]: ptxas warning {w}")
    funcs, entries = ptxas_report(ptxas_text)
    funcs_sass = sections(open(os.path.join(out, arch, family + ".sass")).read())
    sass = sass_counts(funcs_sass)
    maxreg = setmaxnreg_values(funcs_sass)
    for name in entries + sorted(set(funcs) - set(entries)) + sorted(set(sass) - set(funcs)):
        f, c = funcs.get(name, {}), sass.get(name, Counter())
        rules = []
        if f.get("spill_st", 0) or f.get("spill_ld", 0):
            rules.append(f"spills ({f['spill_st']} B stores, {f['spill_ld']} B loads)")
        if name not in sass:
            rules.append("no SASS section")
        if c["LDL"] or c["STL"]:
            rules.append(f"local memory ({c['LDL']} LDL, {c['STL']} STL)")
        if maxreg.get(name):
            rules += setmaxnreg_rules(name, family, f.get("regs"), maxreg[name])
        if arch in tc_archs:
            for pattern, needs in main:
                if fnmatch.fnmatchcase(name, pattern):
                    matched[pattern] += 1
                    for alts in needs:
                        banned = [op[1:] for op in alts if op.startswith("!")]
                        if banned:
                            rules += [f"{op} present ({c[op]})" for op in banned if c[op]]
                        elif not any(c[op] for op in alts):
                            rules.append(f"no {'/'.join(alts)}")
        row = dict(kernel=name, family=family, arch=arch, entry=name in entries,
                   registers=f.get("regs"), stack=f.get("stack", 0),
                   spill_stores=f.get("spill_st", 0), spill_loads=f.get("spill_ld", 0),
                   **{op: c[op] for op in COUNTED}, failures=rules)
        rows.append(row)
        failures += [f"{name} [{arch}]: {r}" for r in rules]
for pattern, n in matched.items():
    if tc_archs and n == 0:
        failures.append(f"main kernel pattern {pattern!r}: matches no kernel in {','.join(sorted(tc_archs))}")

head = f"{'kernel':<36} {'arch':<7} {'regs':>4} {'stack':>5} {'spill st/ld':>11} {'LDL/STL':>7} {'HMMA':>5} {'HGMMA':>5} {'LDSM':>5} {'LDGSTS':>6}  verdict"
lines = [head, "-" * len(head)]
for r in rows:
    verdict = "pass" if not r["failures"] else "FAIL: " + "; ".join(r["failures"])
    lines.append(f"{r['kernel']:<36} {r['arch']:<7} {r['registers'] if r['registers'] is not None else '-':>4} "
                 f"{r['stack']:>5} {str(r['spill_stores']) + '/' + str(r['spill_loads']):>11} "
                 f"{str(r['LDL']) + '/' + str(r['STL']):>7} {r['HMMA']:>5} {r['HGMMA']:>5} {r['LDSM']:>5} "
                 f"{r['LDGSTS']:>6}  {verdict}")
table = "\n".join(lines)
print(table)
open(os.path.join(out, "table.txt"), "w").write(table + "\n")
json.dump(dict(main_kernels=[p for p, _ in main], tc_archs=sorted(tc_archs), rows=rows, failures=failures),
          open(os.path.join(out, "report.json"), "w"), indent=1)
if failures:
    print(f"\nsass-gates: {len(failures)} failure(s){' (--report-only: not failing)' if report_only else ''}:")
    for f in failures:
        print(f"  {f}")
    sys.exit(0 if report_only else 1)
print(f"\nsass-gates: all {len(rows)} functions pass")
PY
set +e
REPORT_ONLY=$report_only TC_ARCHS=$TC_ARCHS OUT_DIR=$out SOURCES="${sources[*]}" "$python" "$out/gates.py" "${MAIN_KERNELS[@]}"
status=$?
set -e
# Canary of the setmaxnreg rule: the same reports with the Hopper kernels given 8 registers
# fewer at entry than ptxas gave them must fail it (a gate that cannot fail is no gate).
if [ "$status" -eq 0 ] && [ "$explicit_sources" -eq 0 ] && [ -f "$out/sm_90a/flash_fwd_hopper.ptxas.txt" ]; then
  canary=$out/setmaxnreg-canary
  rm -rf "$canary"
  mkdir -p "$canary/sm_90a"
  cp "$out/sm_90a/flash_fwd_hopper.ptxas.txt" "$out/sm_90a/flash_fwd_hopper.sass" "$canary/sm_90a/"
  "$python" - "$canary/sm_90a/flash_fwd_hopper.ptxas.txt" <<'PY'
import re, sys
p = sys.argv[1]
text = open(p).read()
open(p, "w").write(re.sub(r"Used (\d+) registers", lambda m: f"Used {int(m.group(1)) - 8} registers", text))
PY
  if REPORT_ONLY=0 TC_ARCHS=sm_90a OUT_DIR=$canary SOURCES="${sources[*]}" "$python" "$out/gates.py" \
    >"$canary/log" 2>&1 || ! grep -q ".inc would wait forever" "$canary/log"; then
    cat "$canary/log" >&2
    echo "sass-gates: the setmaxnreg canary (8 registers fewer at entry) did not fail the gate" >&2
    exit 1
  fi
  echo "sass-gates: the setmaxnreg canary (8 registers fewer at entry) fails the gate, as it must"
fi
exit "$status"

