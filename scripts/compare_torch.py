#!/usr/bin/env python3
"""Side-by-side CPU timing of ringattn and PyTorch's scaled_dot_product_attention.

The machine is noisy (shared 2-core VM), so the two are run alternately, ROUNDS times each,
and the medians and their ratio are reported. Needs torch (a venv: see scripts/compare-torch.sh)
and the peer script ../shared/peers/torch_sdpa.py (or --peer PATH).

Usage: compare_torch.py [--shape b,s,hq,hkv,d] [--causal] [--dtype f32|bf16] [--rounds N] [--json FILE]

Both sides take inputs of --dtype (ringattn's CPU backend computes bf16 in f32 today; torch
uses its own bf16 kernels).
"""
import argparse, json, os, re, statistics, subprocess, sys

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,4096,8,8,64")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--peer", default=os.path.join(ROOT, "..", "shared", "peers", "torch_sdpa.py"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch
    rows = {"ours_fwd": [], "ours_bwd": [], "torch_fwd": [], "torch_bwd": []}
    for r in range(a.rounds):
        of, ob = ours(a.shape, a.causal, a.reps, a.dtype)
        tf, tb = torch_peer(a.peer, a.shape, a.causal, a.reps, a.dtype)
        for k, v in zip(rows, (of, ob, tf, tb)):
            rows[k].append(v)
        print(f"round {r + 1}: ringattn fwd {of:.1f} bwd {ob:.1f} GFLOP/s | torch fwd {tf:.1f} bwd {tb:.1f} GFLOP/s",
              flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "shape": a.shape, "causal": a.causal, "dtype": a.dtype, "rounds": a.rounds,
        "torch_version": torch.__version__, "threads": torch.get_num_threads(),
        "median_gflops": med,
        "fwd_ratio": med["ours_fwd"] / med["torch_fwd"], "bwd_ratio": med["ours_bwd"] / med["torch_bwd"],
        "samples": rows,
    }
    print(f"median GFLOP/s  ringattn fwd {med['ours_fwd']:.1f} bwd {med['ours_bwd']:.1f}  "
          f"torch fwd {med['torch_fwd']:.1f} bwd {med['torch_bwd']:.1f}  "
          f"ratio fwd {result['fwd_ratio']:.2f} bwd {result['bwd_ratio']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
