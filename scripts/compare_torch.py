#!/usr/bin/env python3
"""Side-by-side CPU timing of ringattn and PyTorch's scaled_dot_product_attention.

The machine is noisy (shared 2-core VM), so the two are run alternately, ROUNDS times each,
and the medians and their ratio are reported. Needs torch (a venv: see scripts/compare-torch.sh)
and the peer script ../shared/peers/torch_sdpa.py (or --peer PATH).

Usage: compare_torch.py [--shape b,s,hq,hkv,d] [--causal] [--dtype f32|bf16] [--rounds N] [--json FILE]
       compare_torch.py --matrix DIR [--shape ...] [--rounds N]

Both sides take inputs of --dtype: ringattn multiplies bf16 operands with f32 accumulation
(AVX512_BF16 where the processor has it, else widened to f32), torch runs its own bf16 kernels.
--matrix runs the four configurations (f32 and bf16, full and causal) one after another and
writes DIR/cpu-vs-torch-s{S}-{full,causal}[-bf16].json, then prints a Markdown table of them.
Every JSON records when (UTC), at which commit and on which processor it was measured.
"""
import argparse, datetime, json, os, platform, re, statistics, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ours(shape, causal, reps, dtype):
    exe = os.path.join(ROOT, "target", "release", "examples", "throughput")
    out = subprocess.run([exe, shape, "causal" if causal else "full", str(reps), "default", dtype], check=True,
                         capture_output=True, text=True).stdout
    m = re.search(r"fwd ([\d.]+) ms ([\d.]+) GFLOP/s\s+bwd ([\d.]+) ms ([\d.]+) GFLOP/s", out)
    return float(m.group(2)), float(m.group(4))


def torch_peer(peer, shape, causal, reps, dtype):
    tmp = os.path.join(ROOT, "target", "torch_peer.json")
    subprocess.run([sys.executable, peer, "--device", "cpu", "--dtype", dtype, "--shapes", shape,
                    "--causal", "yes" if causal else "no", "--bwd", "--reps", str(reps), "--json", tmp],
                   check=True, capture_output=True, text=True)
    row = json.load(open(tmp))[0]
    return row["fwd_tflops"] * 1e3, row["bwd_tflops"] * 1e3


def machine():
    """The processor and the instruction sets the comparison depends on."""
    model, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    wanted = ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    return {"cpu": model, "logical_cpus": os.cpu_count(), "isa": [x for x in wanted if x in flags]}


def commit():
    """The checkout's commit, with "-dirty" when tracked files differ from it; None outside git."""
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], check=True,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def compare(a, causal, dtype, json_path):
    """One configuration: a.rounds alternating rounds; prints them and the medians; returns the result."""
    import torch
    rows = {"ours_fwd": [], "ours_bwd": [], "torch_fwd": [], "torch_bwd": []}
    started = datetime.datetime.now(datetime.timezone.utc)
    for r in range(a.rounds):
        of, ob = ours(a.shape, causal, a.reps, dtype)
        tf, tb = torch_peer(a.peer, a.shape, causal, a.reps, dtype)
        for k, v in zip(rows, (of, ob, tf, tb)):
            rows[k].append(v)
        print(f"round {r + 1}: ringattn fwd {of:.1f} bwd {ob:.1f} GFLOP/s | torch fwd {tf:.1f} bwd {tb:.1f} GFLOP/s",
              flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "shape": a.shape, "causal": causal, "dtype": dtype, "rounds": a.rounds,
        "measured_at_utc": started.strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": commit(), "machine": machine(),
        "torch_version": torch.__version__, "threads": torch.get_num_threads(),
        "median_gflops": med,
        "fwd_ratio": med["ours_fwd"] / med["torch_fwd"], "bwd_ratio": med["ours_bwd"] / med["torch_bwd"],
        "samples": rows,
    }
    print(f"median GFLOP/s  ringattn fwd {med['ours_fwd']:.1f} bwd {med['ours_bwd']:.1f}  "
          f"torch fwd {med['torch_fwd']:.1f} bwd {med['torch_bwd']:.1f}  "
          f"ratio fwd {result['fwd_ratio']:.2f} bwd {result['bwd_ratio']:.2f}", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def table(results):
    """The results as the README's Markdown table."""
    lines = ["| shape, dtype | ringattn fwd | torch fwd | ratio | ringattn bwd | torch bwd | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["median_gflops"]
        name = f"{'causal' if r['causal'] else 'full'}, {r['dtype']}"
        lines.append(f"| {name} | {m['ours_fwd']:.0f} GFLOP/s | {m['torch_fwd']:.0f} GFLOP/s | {r['fwd_ratio']:.2f} "
                     f"| {m['ours_bwd']:.0f} GFLOP/s | {m['torch_bwd']:.0f} GFLOP/s | {r['bwd_ratio']:.2f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,4096,8,8,64")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--peer", default=os.path.join(ROOT, "..", "shared", "peers", "torch_sdpa.py"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--matrix", metavar="DIR", default=None,
                    help="run f32 and bf16, full and causal, writing one JSON each into DIR")
    a = ap.parse_args()
    if a.matrix is None:
        compare(a, a.causal, a.dtype, a.json)
        return
    if a.json or a.causal or a.dtype != "f32":
        ap.error("--matrix runs every dtype and mask itself and names its own files")
    os.makedirs(a.matrix, exist_ok=True)
    s = a.shape.split(",")[1]
    results = []
    for dtype in ["f32", "bf16"]:
        for causal in [False, True]:
            name = f"cpu-vs-torch-s{s}-{'causal' if causal else 'full'}{'-bf16' if dtype == 'bf16' else ''}.json"
            print(f"== {dtype}, {'causal' if causal else 'full'} -> {os.path.join(a.matrix, name)}", flush=True)
            results.append(compare(a, causal, dtype, os.path.join(a.matrix, name)))
    print(table(results))


if __name__ == "__main__":
    main()
