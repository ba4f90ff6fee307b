#!/usr/bin/env python3
"""Helpers of scripts/device-check.sh (issue 5, item 7): timings on the GPU machine.

Subcommands:
  torch     PyTorch SDPA (flash and cuDNN backends) forward and backward on the benchmark shapes,
            timed with CUDA events (warm-up, then the median of the iterations). --device cpu
            times the math backend with a host clock (a test path for machines without a GPU).
  ringattn  `ringattn bench --backend cuda` on the same shapes, one process per shape, cheapest
            shape first; a shape whose predicted time (from the slowest rates seen so far) does
            not fit is run with fewer iterations or recorded as "skipped: slow".
  summarize merges the facts, the verify runs and both timings into device-check.json and
            prints the comparison table last.

Shapes: b * s = --tokens (default 16384; b = max(1, tokens // s)), s in --seqs, d in --dims,
h = 32 for d = 64, 16 for d = 128 and 2048 // d for other d (the same h*d = 2048, so every d
does the same FLOPs), h_kv = h, causal and not. FLOPs: forward 4*b*h*s^2*d (halved when
causal), backward 2.5 times the forward.
Every result is written to the JSON file as soon as it is measured, so a timeout loses only
the shape in flight.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

PASSES = ("forward", "backward")


# ----------------------------------------------------------------------------- shapes, FLOPs
def heads_for(d):
    return {64: 32, 128: 16}.get(d, max(1, 2048 // d))


def shapes(args):
    out = []
    for s in args.seqs:
        for d in args.dims:
            for causal in args.causal:
                b = max(1, args.tokens // s)
                out.append(dict(b=b, s=s, h=heads_for(d), d=d, causal=causal))
    return sorted(out, key=lambda c: (flops(c, "forward"), c["d"], c["causal"]))


def flops(c, pass_):
    f = 4.0 * c["b"] * c["h"] * c["s"] * c["s"] * c["d"]
    if c["causal"]:
        f /= 2
    return f * (2.5 if pass_ == "backward" else 1.0)


def key(c):
    return f"b{c['b']}_s{c['s']}_h{c['h']}_d{c['d']}_{'causal' if c['causal'] else 'full'}"


def int_list(s):
    return [int(x) for x in s.split(",") if x.strip()]


def causal_list(s):
    return {"both": [True, False], "yes": [True], "no": [False]}[s]


def write_json(path, value):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)


def stats(samples_ms, c, pass_):
    med = statistics.median(samples_ms)
    return dict(median_ms=med, min_ms=min(samples_ms), samples_ms=samples_ms,
                tflops=flops(c, pass_) / (med * 1e-3) / 1e12)


# ----------------------------------------------------------------------------- torch
def cmd_torch(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    names = args.backends or (["flash", "cudnn"] if cuda else ["math"])
    backend_of = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                  "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    result = dict(torch=torch.__version__, device=str(dev), dtype=args.dtype, warmup=args.warmup,
                  iters=args.iters, records=[])
    if cuda:
        p = torch.cuda.get_device_properties(dev)
        result.update(device_name=p.name, sms=p.multi_processor_count, cuda=torch.version.cuda,
                      cudnn=torch.backends.cudnn.version())

    def timed(fn):
        for _ in range(args.warmup):
            fn()
        samples = []
        if cuda:
            torch.cuda.synchronize()
            for _ in range(args.iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
        else:
            for _ in range(args.iters):
                t = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t) * 1e3)
        return samples

    gen = torch.Generator(device=dev).manual_seed(0)
    for c in shapes(args):
        # [b, h, s, d], random normal (never zeros: METHOD.md).
        q, k, v, g = (torch.randn(c["b"], c["h"], c["s"], c["d"], device=dev, dtype=dtype, generator=gen)
                      for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)
        for name in names:
            base = dict(backend=name, shape=key(c), **c)
            try:
                with sdpa_kernel([backend_of[name]]):
                    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=c["causal"]))
                    result["records"].append(dict(base, **{"pass": "forward"}, **stats(fwd, c, "forward")))
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=c["causal"])
                    bwd = timed(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
                    result["records"].append(dict(base, **{"pass": "backward"}, **stats(bwd, c, "backward")))
                    del out
            except Exception as e:  # noqa: BLE001 -- record any failure of one backend and go on
                msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
                result["records"].append(dict(base, error=msg))
            last = [r for r in result["records"] if r["shape"] == key(c) and r["backend"] == name]
            print("torch " + name + " " + key(c) + ": " + ", ".join(
                f"{r['pass']} {r['median_ms']:.3f} ms {r['tflops']:.1f} TFLOP/s" if "pass" in r else r["error"]
                for r in last), flush=True)
            if args.json:
                write_json(args.json, result)
        del q, k, v, g
        if cuda:
            torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, result)
    return 0


# ----------------------------------------------------------------------------- ringattn
def ringattn_cmd(args, c, warmup, iters, path):
    cmd = [args.bin, "bench", "--backend", "cuda", "--batch", str(c["b"]), "--seq", str(c["s"]),
           "--heads", str(c["h"]), "--kv-heads", str(c["h"]), "--head-dim", str(c["d"]),
           "--dtype", args.dtype]
    if c["causal"]:
        cmd.append("--causal")
    return cmd + ["--pass", "both", "--warmup", str(warmup), "--iters", str(iters), "--json", path]


def pass_name(p):
    p = str(p).lower()
    return "forward" if p.startswith("f") else "backward" if p.startswith("b") else p


def cmd_ringattn(args):
    t0 = time.monotonic()
    os.makedirs(args.work, exist_ok=True)
    result = dict(bin=args.bin, dtype=args.dtype, warmup=args.warmup, iters=args.iters, budget_s=args.budget,
                  records=[])
    if not args.dry_run:
        try:
            probe = subprocess.run([args.bin, "bench", "--help"], capture_output=True, text=True, timeout=30)
            ok = probe.returncode == 0
            why = (probe.stderr or probe.stdout).strip().splitlines()[:1]
        except (OSError, subprocess.TimeoutExpired) as e:
            ok, why = False, [str(e)]
        if not ok:
            msg = f"`{args.bin} bench` unavailable: {why[0] if why else '?'}"
            print("ringattn: " + msg, flush=True)
            result["error"] = msg
            write_json(args.json, result)
            return 0
    rate = {}  # the slowest TFLOP/s seen per pass: predicts the next shape's time
    overhead = 5.0  # seconds of process start-up, context and allocation; refined as runs complete
    for c in shapes(args):
        base = dict(shape=key(c), **c)
        left = args.budget - (time.monotonic() - t0)
        limit = min(args.max_run, left)

        def cost(w, n):
            if len(rate) < 2:
                return None
            return overhead + (w + n) * sum(flops(c, p) / (rate[p] * 1e12) for p in PASSES)

        plan = None
        if len(rate) < 2:
            plan = (args.warmup, args.iters)
        else:
            for w, n in ((args.warmup, args.iters), (1, 3)):
                if cost(w, n) <= limit:
                    plan = (w, n)
                    break
        if plan is None or limit < 5:
            pred = cost(1, 3)
            why = f"skipped: slow (predicted {pred:.0f} s with 1+3 iterations, {limit:.0f} s allowed)" if pred \
                else f"skipped: slow ({limit:.0f} s allowed)"
            result["records"].append(dict(base, status=why))
            print(f"ringattn {key(c)}: {why}", flush=True)
            write_json(args.json, result)
            continue
        path = os.path.join(args.work, f"bench-{key(c)}.json")
        cmd = ringattn_cmd(args, c, *plan, path)
        if args.dry_run:
            print("DRY-RUN: " + " ".join(cmd), flush=True)
            result["records"].append(dict(base, status="dry-run", cmd=cmd))
            continue
        pred = cost(*plan)
        timeout = limit if pred is None else min(limit, max(30.0, 2 * pred + 15))
        started = time.monotonic()
        try:
            if os.path.exists(path):
                os.remove(path)
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            rc, out = p.returncode, (p.stdout + p.stderr)
        except subprocess.TimeoutExpired as e:
            rc, out = 124, f"timeout after {timeout:.0f} s: {(e.stdout or b'')!r}"[-2000:]
        wall = time.monotonic() - started
        with open(os.path.join(args.work, f"bench-{key(c)}.log"), "w") as f:
            f.write(" ".join(cmd) + "\n" + out)
        rec = dict(base, cmd=cmd, rc=rc, wall_s=round(wall, 2), warmup=plan[0], iters=plan[1])
        if rc == 124:
            rec["status"] = f"timeout after {timeout:.0f} s"
            # Everything larger is slower still: predict from this bound.
            for p_ in PASSES:
                rate[p_] = min(rate.get(p_, math.inf), sum(plan) * flops(c, p_) / 1e12 / max(wall, 1e-3))
        elif rc != 0 or not os.path.exists(path):
            rec["status"] = f"error rc={rc}: " + " | ".join(out.strip().splitlines()[-3:])[:400]
        else:
            try:
                j = json.load(open(path))
                rec["bench"] = j
                rec["status"] = "ok" if plan == (args.warmup, args.iters) else "ok (reduced iterations)"
                timed = 0.0
                for r in j.get("results", []):
                    p_ = pass_name(r.get("pass"))
                    med = float(r["median_ms"])
                    rec[p_] = dict(median_ms=med, min_ms=r.get("min_ms"), tflops_reported=r.get("tflops"),
                                   tflops=flops(c, p_) / (med * 1e-3) / 1e12, samples_ms=r.get("samples_ms"))
                    rate[p_] = min(rate.get(p_, math.inf), rec[p_]["tflops"])
                    timed += sum(plan) * med * 1e-3
                overhead = max(2.0, min(30.0, wall - timed))
            except (ValueError, KeyError, TypeError) as e:
                rec["status"] = f"error: unreadable bench JSON ({e})"
        result["records"].append(rec)
        print(f"ringattn {key(c)}: {rec['status']} in {wall:.1f} s" + "".join(
            f", {p_} {rec[p_]['median_ms']:.3f} ms {rec[p_]['tflops']:.2f} TFLOP/s" for p_ in PASSES if p_ in rec),
            flush=True)
        write_json(args.json, result)
    write_json(args.json, result)
    return 0


# ----------------------------------------------------------------------------- summarize
def load(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def read_text(path, limit=4000):
    try:
        with open(path, errors="replace") as f:
            t = f.read()
        return t[-limit:]
    except OSError:
        return None


def cmd_summarize(args):
    w = args.work
    steps = []
    if os.path.exists(os.path.join(w, "steps.tsv")):
        for line in open(os.path.join(w, "steps.tsv")):
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 5:
                continue
            name, rc, secs, log, cmd = parts[:5]
            rc_i = int(rc) if rc.lstrip("-").isdigit() else None
            status = {None: rc, 0: "pass"}.get(rc_i) or (
                "FAIL (accuracy)" if rc_i == 3 and name.startswith("verify") else
                "timeout" if rc_i in (124, 137) else f"error rc={rc_i}")
            steps.append(dict(name=name, rc=rc_i, status=status, seconds=float(secs or 0), cmd=cmd,
                              log_tail=read_text(log, 1500) if log else None))
    verify = []
    for s in steps:
        if s["name"].startswith("verify-"):
            report = load(os.path.join(w, s["name"] + ".json"))
            verify.append(dict(s, report=report))
    torch_res = load(args.torch_json, {}) or {}
    ra_res = load(args.ringattn_json, {}) or {}
    def last_json(path):
        for line in reversed((read_text(path) or "").strip().splitlines()):
            try:
                return json.loads(line)
            except ValueError:
                continue
        return None

    machine = dict(
        host=read_text(os.path.join(w, "facts-host.log")),
        nvidia_smi=read_text(os.path.join(w, "facts-nvidia-smi.log")),
        nvidia_smi_before=read_text(os.path.join(w, "facts-query-before.log")),
        nvidia_smi_after=read_text(os.path.join(w, "facts-query-after.log")),
        torch=last_json(os.path.join(w, "facts-torch.log")),
        binary=read_text(os.path.join(w, "facts-binary.log")),
    )
    # The comparison, one row per shape and pass.
    tor = {}
    for r in torch_res.get("records", []):
        tor[(r["shape"], r["backend"], r.get("pass"))] = r
    rows = []
    ra_by_shape = {r["shape"]: r for r in ra_res.get("records", [])}
    shape_keys = list(dict.fromkeys([r["shape"] for r in ra_res.get("records", [])] +
                                    [r["shape"] for r in torch_res.get("records", [])]))
    cfg = {}
    for r in ra_res.get("records", []) + torch_res.get("records", []):
        cfg.setdefault(r["shape"], {k: r[k] for k in ("b", "s", "h", "d", "causal")})
    shape_keys.sort(key=lambda k: (cfg[k]["s"], cfg[k]["d"], not cfg[k]["causal"]))
    # Columns: the torch backends timed (flash, cudnn on the GPU; math on the CPU test path).
    backends = list(dict.fromkeys(r["backend"] for r in torch_res.get("records", []))) or ["flash", "cudnn"]
    for sk in shape_keys:
        for p in PASSES:
            ra = ra_by_shape.get(sk, {})
            row = dict(shape=sk, **cfg[sk], **{"pass": p},
                       ringattn_tflops=ra.get(p, {}).get("tflops"), ringattn_ms=ra.get(p, {}).get("median_ms"),
                       ringattn_status=ra.get("status", ra_res.get("error", "not run")))
            for be in backends:
                # A backend that failed on a shape has one record with "error" and no pass.
                t = tor.get((sk, be, p)) or tor.get((sk, be, None)) or {}
                row.update({f"{be}_tflops": t.get("tflops"), f"{be}_ms": t.get("median_ms"),
                            f"{be}_error": t.get("error")})
                a_, b_ = row["ringattn_tflops"], row[f"{be}_tflops"]
                row[f"ringattn_over_{be}"] = a_ / b_ if a_ and b_ else None
            rows.append(row)
    n_pass = sum(v["status"] == "pass" for v in verify)
    # Sequence parallelism on one GPU: the ring's overlap runs (ringattn bench sweeps).
    overlap = []
    for s in steps:
        if s["name"].startswith("overlap-"):
            rep = load(os.path.join(w, s["name"], "bench.json"))
            for r in (rep or {}).get("records", []):
                overlap.append(dict(name=s["name"], **r))
            if not rep:
                overlap.append(dict(name=s["name"], status=s["status"]))
    summary = dict(
        mode=args.mode, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), elapsed_s=args.elapsed,
        machine=machine, steps=[{k: v for k, v in s.items() if k != "log_tail" or s["status"] != "pass"}
                                for s in steps],
        verify=verify, verify_summary=dict(total=len(verify), passed=n_pass, failed=len(verify) - n_pass),
        torch=torch_res, ringattn=ra_res, comparison=rows, parallel_overlap=overlap,
        flop_model="forward 4*b*h*s^2*d (halved when causal), backward 2.5x forward; ratios = ringattn TFLOP/s "
                   "over torch TFLOP/s (> 1: ringattn faster)",
    )
    write_json(args.out, summary)

    # Printed last: verify verdicts, then the timing table.
    print(f"\n== verify: {n_pass}/{len(verify)} pass")
    for v in verify:
        if v["status"] != "pass":
            tail = (v.get("log_tail") or "").strip().splitlines()[-1:] or [""]
            print(f"   {v['name']}: {v['status']}  {tail[0][:120]}")
    other = [s for s in steps if not s["name"].startswith("verify-") and s["status"] != "pass"]
    for s in other:
        print(f"   step {s['name']}: {s['status']}")
    def fmt(x, width, prec):
        return f"{x:{width}.{prec}f}" if x is not None else f"{'-':>{width}}"

    short = {"flash": "flash", "cudnn": "cuDNN", "efficient": "mem-eff", "math": "math"}
    print(f"\n== timings ({torch_res.get('dtype', ra_res.get('dtype', '?'))}; TFLOP/s by the same FLOP model; "
          f"ratio > 1: ringattn faster); full data: {args.out}")
    print(f"{'b x s, h, d, mask':<26} {'pass':<8} {'ringattn':>8} "
          + " ".join(f"{short.get(be, be):>7}" for be in backends) + " "
          + " ".join(f"{'ra/' + short.get(be, be)[:2]:>6}" for be in backends) + "  note")
    for r in rows:
        label = f"{r['b']}x{r['s']}, h{r['h']}, d{r['d']}, {'causal' if r['causal'] else 'full'}"
        note = "" if r["ringattn_tflops"] is not None else r["ringattn_status"]
        errors = [f"{be}: {r[be + '_error']}" for be in backends if r[f"{be}_error"]]
        if errors:
            note += ("; " if note else "") + errors[0][:60]
        print(f"{label:<26} {r['pass']:<8} {fmt(r['ringattn_tflops'], 8, 2)} "
              + " ".join(fmt(r[f"{be}_tflops"], 7, 1) for be in backends) + " "
              + " ".join(fmt(r[f"ringattn_over_{be}"], 6, 3) for be in backends) + f"  {note[:70]}")
    print("\n== sequence parallelism on one GPU (ranks = threads; time = slowest rank, forward + backward; "
          "hidden = 1 - (run - compute only) / comm only)")
    print(f"{'run':<26} {'world':>5} {'seq':>8} {'ms':>10} {'compute-only ms':>16} {'comm-only ms':>13} {'hidden':>7}")
    for o in overlap:
        if "seconds" not in o:
            print(f"{o['name']:<26} {o.get('status', 'not run')}")
            continue
        ms = lambda x: fmt(x * 1e3 if x is not None else None, 10, 1)
        hid = f"{o['hidden'] * 100:6.1f}%" if o.get("hidden") is not None else "      -"
        print(f"{o['name']:<26} {o['world']:>5} {o['seq']:>8} {ms(o['seconds'])} {ms(o.get('compute_only_s')):>16} "
              f"{ms(o.get('comm_only_s')):>13} {hid}")
    return 0


# ----------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def shape_args(p):
        p.add_argument("--seqs", type=int_list, default=[4096, 16384], help="sequence lengths (comma-separated)")
        p.add_argument("--dims", type=int_list, default=[64, 128], help="head dims (comma-separated)")
        p.add_argument("--tokens", type=int, default=16384, help="b*s per shape (b = max(1, tokens // s))")
        p.add_argument("--causal", type=causal_list, default=[True, False], help="both | yes | no")
        p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
        p.add_argument("--warmup", type=int, default=3)
        p.add_argument("--iters", type=int, default=10)
        p.add_argument("--json", required=True, help="output JSON (rewritten after every shape)")

    t = sub.add_parser("torch", help="time torch SDPA (flash, cuDNN)")
    shape_args(t)
    t.add_argument("--device", default="cuda", help="cuda (default) or cpu (math backend, host clock)")
    t.add_argument("--backends", type=lambda s: s.split(","), default=None,
                   help="flash,cudnn[,efficient,math] (default flash,cudnn on cuda; math on cpu)")

    r = sub.add_parser("ringattn", help="time `ringattn bench --backend cuda`")
    shape_args(r)
    r.add_argument("--bin", default="target/release/ringattn")
    r.add_argument("--work", required=True, help="folder for each shape's bench JSON and log")
    r.add_argument("--budget", type=float, default=120.0, help="seconds for all shapes together")
    r.add_argument("--max-run", type=float, default=60.0, help="seconds for one shape")
    r.add_argument("--dry-run", action="store_true", help="print the commands only")

    s = sub.add_parser("summarize", help="merge everything into device-check.json, print the table")
    s.add_argument("--work", required=True)
    s.add_argument("--torch-json", required=True)
    s.add_argument("--ringattn-json", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--mode", default="quick")
    s.add_argument("--elapsed", type=float, default=None)

    args = ap.parse_args(argv)
    return {"torch": cmd_torch, "ringattn": cmd_ringattn, "summarize": cmd_summarize}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
