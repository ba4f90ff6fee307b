#!/usr/bin/env python3
"""Helpers of scripts/device-check.sh: timings on the GPU
machine, the preflight verdict on `ringattn doctor --json`, and the summary JSON.

Subcommands:
  facts     torch, CUDA and GPU facts as one JSON line (a clear line when torch is missing).
  verdict   reads `ringattn doctor --json` output and prints one line VERDICT<TAB>TEXT:
            ok (GPU 0 usable), nogpu (no driver or no GPU: every GPU step will fail fast),
            nocuda (built without the cuda feature), nokernels (cuda feature, but no kernel
            images: nvcc was missing at build time), refuse (a GPU the build cannot use: no
            embedded image fits it, or the driver is too old), unknown (no usable report).
  torch     PyTorch SDPA (flash and cuDNN backends) forward and backward on the benchmark shapes,
            timed with CUDA events (warm-up, then the median of the iterations). --device cpu
            times the math backend with a host clock (a test path for machines without a GPU).
  ringattn  `ringattn bench --backend cuda` on the same shapes, one process per shape, cheapest
            shape first; a shape whose predicted time (from the slowest rates seen so far) does
            not fit is run with fewer iterations or recorded as "skipped: slow".
  summarize merges the preflight, the facts, the verify runs and both timings into
            device-check.json and prints the comparison table last (--quiet: the JSON only; the
            device check rewrites it after every step, so a kill leaves the steps so far).

Shapes: b * s = --tokens (default 16384; b = max(1, tokens // s)), s in --seqs, d in --dims,
h = 32 for d = 64, 16 for d = 128 and 2048 // d for other d (the same h*d = 2048, so every d
does the same FLOPs), h_kv = h, causal and not. FLOPs count the visible (query, key) pairs:
forward 4*d*h*b*pairs with pairs = s*s (full) or s*(s+1)/2 (causal, s_q = s_k = s; not
s^2/2), backward 2.5 times the forward; `dense_flops` (4*b*h*s^2*d, no mask) is reported
beside. Both sides write 16-bit o (torch SDPA returns the input dtype; `ringattn bench` too);
the FLOP fields `ringattn bench` may report per result (flops, visible_pairs, tiles_total,
tiles_visible) are kept when present, never required.
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
# Failures of `ringattn` that every later run would repeat.
FATAL_MARKERS = ("no CUDA driver found", "no CUDA GPU found", "lacks the `cuda` feature", "older than the",
                 "failed to initialise")
# Optional per-result fields of `ringattn bench --json`, kept when present.
REPORTED_FIELDS = ("flops", "dense_flops", "visible_pairs", "tiles_total", "tiles_visible", "executed_flops", "o_dtype")
# Steps that need the GPU (on a machine without one they fail, with the binary's message).
GPU_STEPS = ("preflight-verify", "verify-", "overlap-", "bench-")


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


def visible_pairs(c):
    """Visible (query, key) pairs of one head: s*s, or s*(s+1)/2 when causal (s_q = s_k = s)."""
    s = c["s"]
    return s * (s + 1) // 2 if c["causal"] else s * s


def flops(c, pass_):
    """FLOPs of the visible pairs: forward 4*d per pair and head, backward 2.5 times that."""
    f = 4.0 * c["d"] * c["h"] * c["b"] * visible_pairs(c)
    return f * (2.5 if pass_ == "backward" else 1.0)


def dense_flops(c, pass_):
    """FLOPs without the mask (every pair): 4*b*h*s^2*d, backward 2.5 times that."""
    f = 4.0 * c["b"] * c["h"] * c["s"] * c["s"] * c["d"]
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
                tflops=flops(c, pass_) / (med * 1e-3) / 1e12, flops=flops(c, pass_),
                dense_flops=dense_flops(c, pass_), visible_pairs=visible_pairs(c))


# ----------------------------------------------------------------------------- torch
def import_torch():
    """(torch, None), or (None, the one-line reason torch cannot be used)."""
    try:
        import torch  # noqa: PLC0415 -- optional: the GPU machine has it, test machines may not
        return torch, None
    except Exception as e:  # noqa: BLE001 -- ImportError, or a broken install's OSError
        return None, f"torch not installed ({type(e).__name__}: {str(e).strip()[:200]})"


def cmd_facts(args):
    """torch, CUDA and GPU facts as one JSON line; exit 1 when torch cannot be imported."""
    torch, why = import_torch()
    if torch is None:
        print(json.dumps(dict(torch=None, error=why)))
        print(f"facts: {why}", file=sys.stderr)
        return 1
    f = dict(torch=torch.__version__, cuda=torch.version.cuda, available=torch.cuda.is_available())
    if f["available"]:
        p = torch.cuda.get_device_properties(0)
        f.update(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                 memory_gib=round(p.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version(),
                 l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
    print(json.dumps(f))
    return 0


def cmd_torch(args):
    torch, why = import_torch()
    dev_name = args.device
    if torch is None or (dev_name.startswith("cuda") and not torch.cuda.is_available()):
        if torch is not None:
            why = (f"torch: no CUDA device (torch.cuda.is_available() is False; torch {torch.__version__}, "
                   f"built for CUDA {torch.version.cuda})")
        print(why, flush=True)
        if args.json:
            write_json(args.json, dict(device=dev_name, dtype=args.dtype, error=why, records=[]))
        return 1
    import torch.nn.functional as F  # noqa: PLC0415
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    dev = torch.device(dev_name)
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
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=c["causal"])
                    # o in the input dtype (16-bit), as `ringattn bench` writes it.
                    o_dtype = str(out.dtype).replace("torch.", "")
                    result["records"].append(dict(base, **{"pass": "forward"}, **stats(fwd, c, "forward"),
                                                  o_dtype=o_dtype))
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
    # Failure when no shape could be timed by any backend.
    return 0 if any("median_ms" in r for r in result["records"]) else 1


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
            return 1
    fatal = None  # a failure every later shape would repeat (no driver, no GPU, no cuda feature)
    rate = {}  # the slowest TFLOP/s seen per pass: predicts the next shape's time
    overhead = 5.0  # seconds of process start-up, context and allocation; refined as runs complete
    for c in shapes(args):
        base = dict(shape=key(c), **c)
        if fatal:
            result["records"].append(dict(base, status=f"skipped: {fatal}"))
            continue
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
            fatal = next((line.strip().removeprefix("error: ")[:300] for line in out.splitlines()
                          if any(m in line for m in FATAL_MARKERS)), None)
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
                                   tflops=flops(c, p_) / (med * 1e-3) / 1e12, samples_ms=r.get("samples_ms"),
                                   flops=flops(c, p_), dense_flops=dense_flops(c, p_),
                                   visible_pairs=visible_pairs(c))
                    # What `ringattn bench` reports of its own FLOP count and tiles, when it does
                    # (per result, or once for the report); the TFLOP/s above use this script's
                    # model on both sides.
                    for k_ in REPORTED_FIELDS:
                        v_ = r.get(k_, j.get(k_))
                        if v_ is not None:
                            rec[p_][f"{k_}_reported" if k_ in rec[p_] else k_] = v_
                    rep_flops = rec[p_].get("flops_reported")
                    if isinstance(rep_flops, (int, float)) and rep_flops > 0:
                        rec[p_]["flops_reported_over_model"] = rep_flops / flops(c, p_)
                    if rec[p_].get("tiles_total") and rec[p_].get("tiles_visible") is not None:
                        rec[p_]["tiles_visible_share"] = rec[p_]["tiles_visible"] / rec[p_]["tiles_total"]
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
    if fatal:
        result["error"] = fatal
        print(f"ringattn: stopped after the first failure every shape would repeat: {fatal}", flush=True)
    write_json(args.json, result)
    if args.dry_run:
        return 0
    return 0 if any(r.get("status", "").startswith("ok") for r in result["records"]) else 1


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


def log_message(text):
    """The line of a failed step's log that says why: an `error:` line, a `no CUDA` line,
    torch's line, else the last non-empty line."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    for pat in ("no CUDA", "error:", "not installed", "lacks the", "refused", "Error", "FAIL", "timeout"):
        for ln in lines:
            if pat in ln:
                return ln[:300]
    return lines[-1][:300] if lines else ""


def read_steps(w):
    steps = []
    path = os.path.join(w, "steps.tsv")
    if not os.path.exists(path):
        return steps
    for line in open(path, errors="replace"):
        parts = line.rstrip("\n").split("\t")
        if len(parts) < 5:
            continue
        name, rc, secs, log, cmd = parts[:5]
        rc_i = int(rc) if rc.lstrip("-").isdigit() else None
        if rc_i is None:
            status = rc  # "skipped: ...", "dry-run"
        elif rc_i == 0:
            status = "pass"
        elif rc_i == 3 and "verify" in name:
            status = "FAIL (accuracy)"
        elif rc_i in (124, 137):
            status = "timeout"
        else:
            status = f"error rc={rc_i}"
        try:
            seconds = float(secs or 0)
        except ValueError:
            seconds = None
        tail = read_text(log, 1500) if log else None
        step = dict(name=name, rc=rc_i, status=status, seconds=seconds, cmd=cmd,
                    needs_gpu=name.startswith(GPU_STEPS))
        if status != "pass":
            step["message"] = status[len("skipped: "):] if status.startswith("skipped: ") else log_message(tail)
            step["log_tail"] = tail
        steps.append(step)
    return steps


def cmd_verdict(args):
    """One line VERDICT<TAB>TEXT from `ringattn doctor --json` (see the module's docstring)."""
    def say(verdict, text):
        print(f"{verdict}\t{' '.join(str(text).split())}")
        return 0

    doc = load(args.doctor)
    if not isinstance(doc, dict):
        text = (read_text(args.doctor, 300) or "").strip().splitlines()
        return say("unknown", f"doctor printed no JSON report ({text[0][:150] if text else 'nothing'})")
    feats = doc.get("features") or {}
    if not feats.get("cuda"):
        return say("nocuda", "built without the cuda feature")
    imgs = doc.get("images") or {}
    if not imgs.get("architectures") or not imgs.get("bytes"):
        return say("nokernels", "built with the cuda feature but embeds no CUDA kernels (nvcc was not found "
                                "when it was built)")
    drv = doc.get("driver") or {}
    gpus = [g for g in (doc.get("gpus") or []) if isinstance(g, dict)]
    problems = doc.get("problems") or []
    derr = drv.get("error") or (problems[0] if problems else None)
    if not drv.get("found"):
        return say("nogpu", derr or "no CUDA driver found")
    too_old = derr or (f"the CUDA driver supports CUDA {drv.get('version')}, older than the "
                       f"{drv.get('required')} the embedded kernels need")
    if not gpus:
        if drv.get("ok") is False and derr and "no CUDA GPU" not in derr:
            return say("refuse", too_old)
        return say("nogpu", derr or "no CUDA GPU found: the driver reports no device")
    if drv.get("ok") is False:
        return say("refuse", too_old)
    g = next((g for g in gpus if g.get("ordinal") == 0), gpus[0])
    gname = f"GPU {g.get('ordinal', 0)} ({g.get('name')}, compute capability {g.get('compute_capability')})"
    if g.get("ok") is False:
        return say("refuse", f"{gname}: no embedded kernel image fits it: {g.get('problem') or '?'} "
                             f"(images for {', '.join(imgs.get('architectures') or []) or 'none'}, "
                             f"CUDA {imgs.get('cuda_version')}; add its architecture to RINGATTN_CUDA_ARCHS)")
    nccl = doc.get("nccl") or {}
    nccl_text = (f"NCCL {nccl.get('version') or '?'} at {nccl.get('path')}" if nccl.get("found")
                 else f"no NCCL ({nccl.get('error') or 'not found'}; only --comm nccl needs it)")
    return say("ok", f"{gname}, {g.get('memory_mib')} MiB, loads the {g.get('image')}; driver CUDA "
                     f"{drv.get('version')} (needs {drv.get('required')}); {nccl_text}")


def cmd_summarize(args):
    w = args.work
    steps = read_steps(w)
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

    verdict, _, verdict_text = (args.verdict or "").partition("\t")
    preflight = dict(
        verdict=verdict or None, verdict_text=verdict_text or None,
        host=read_text(os.path.join(w, "preflight-host.log")),
        nvidia_smi=read_text(os.path.join(w, "preflight-nvidia-smi.log")),
        ldd=read_text(os.path.join(w, "preflight-ldd.log")),
        binary=read_text(os.path.join(w, "preflight-binary.log")),
        doctor=load(os.path.join(w, "doctor.json")),
        doctor_stderr=read_text(os.path.join(w, "preflight-doctor.log"), 2000),
        verify=load(os.path.join(w, "preflight-verify.json")),
        nccl_library_dir=args.nccl_dir or None,
    )
    machine = dict(
        host=read_text(os.path.join(w, "facts-host.log")),
        nvidia_smi=read_text(os.path.join(w, "facts-nvidia-smi.log")),
        nvidia_smi_before=read_text(os.path.join(w, "facts-query-before.log")),
        nvidia_smi_after=read_text(os.path.join(w, "facts-query-after.log")),
        torch=last_json(os.path.join(w, "facts-torch.log")),
        binary=preflight["binary"],
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
            ra_p = ra.get(p, {})
            row = dict(shape=sk, **cfg[sk], **{"pass": p}, flops=flops(cfg[sk], p),
                       dense_flops=dense_flops(cfg[sk], p), visible_pairs=visible_pairs(cfg[sk]),
                       ringattn_tflops=ra_p.get("tflops"), ringattn_ms=ra_p.get("median_ms"),
                       ringattn_status=ra.get("status", ra_res.get("error", "not run")))
            for k_ in ("flops_reported", "tiles_total", "tiles_visible", "tiles_visible_share"):
                if k_ in ra_p:
                    row[f"ringattn_{k_}"] = ra_p[k_]
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
                overlap.append(dict(name=s["name"], status=s["status"], message=s.get("message")))
    counts = dict(total=len(steps), passed=sum(s["status"] == "pass" for s in steps),
                  dry_run=sum(s["status"] == "dry-run" for s in steps),
                  skipped=sum(s["status"].startswith("skipped") for s in steps))
    counts["failed"] = counts["total"] - counts["passed"] - counts["dry_run"] - counts["skipped"]
    emulated = "emulated" in (args.mode or "")
    summary = dict(
        mode=args.mode, emulated_gpu=emulated,
        note=("EMULATED GPU: ringattn's stand-in driver ran the kernels on the CPU; these are no GPU figures"
              if emulated else None),
        state=args.state, reason=args.reason or None, no_gpu=args.gpu_note or None,
        finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), elapsed_s=args.elapsed,
        preflight=preflight, machine=machine, steps_summary=counts, steps=steps,
        verify=verify, verify_summary=dict(total=len(verify), passed=n_pass, failed=len(verify) - n_pass),
        torch=torch_res, ringattn=ra_res, comparison=rows, parallel_overlap=overlap,
        flop_model="FLOPs of the visible (query, key) pairs: forward 4*d*h*b*pairs, pairs = s^2 (full) or "
                   "s(s+1)/2 (causal, s_q = s_k = s), backward 2.5x forward, the same model for both sides; "
                   "dense_flops = 4*b*h*s^2*d (no mask) beside; both sides write 16-bit o; ratios = ringattn "
                   "TFLOP/s over torch TFLOP/s (> 1: ringattn faster)",
    )
    write_json(args.out, summary)
    if args.quiet:
        return 0

    # Printed last: the preflight, the verify verdicts, then the tables.
    if emulated:
        print("\n== EMULATED GPU: ringattn's stand-in driver (scripts/with-emulated-gpu) ran the kernels on the CPU; "
              "every timing below is the emulator's, no GPU figure")
    print(f"\n== preflight: {verdict or '?'}: {verdict_text or '-'}")
    if args.gpu_note:
        print(f"== {args.gpu_note} (every GPU step fails fast with the binary's message)")
    print(f"== steps: {counts['passed']} pass, {counts['failed']} failed, {counts['skipped']} skipped"
          + (f", {counts['dry_run']} dry-run" if counts["dry_run"] else "") + f" of {counts['total']}")
    n_dry = sum(v["status"] == "dry-run" for v in verify)
    print(f"== verify: {n_pass}/{len(verify)} pass" + (f" ({n_dry} dry-run)" if n_dry else ""))
    # Failed steps, those with the same status and message on one line (no GPU: all of them).
    groups = {}
    for s in steps:
        if s["status"] not in ("pass", "dry-run"):
            groups.setdefault((s["status"], s.get("message") or ""), []).append(s["name"])
    for (status, message), names in groups.items():
        label = names[0] if len(names) == 1 else f"{len(names)} steps ({', '.join(names)})"
        print(f"   {label}: {status}" + (f"\n      {message[:200]}" if message and message != status[9:] else ""))

    def fmt(x, width, prec):
        return f"{x:{width}.{prec}f}" if x is not None else f"{'-':>{width}}"

    short = {"flash": "flash", "cudnn": "cuDNN", "efficient": "mem-eff", "math": "math"}
    print(f"\n== timings ({torch_res.get('dtype', ra_res.get('dtype', '?'))}; TFLOP/s of the visible pairs, "
          f"the same model both sides; ratio > 1: ringattn faster); full data: {args.out}")
    print(f"{'b x s, h, d, mask':<26} {'pass':<8} {'ringattn':>8} "
          + " ".join(f"{short.get(be, be):>7}" for be in backends) + " "
          + " ".join(f"{'ra/' + short.get(be, be)[:2]:>6}" for be in backends) + "  note")
    timed = [r for r in rows if r["ringattn_tflops"] is not None or any(r[f"{be}_tflops"] is not None
                                                                        for be in backends)]
    for r in timed:
        label = f"{r['b']}x{r['s']}, h{r['h']}, d{r['d']}, {'causal' if r['causal'] else 'full'}"
        note = "" if r["ringattn_tflops"] is not None else r["ringattn_status"]
        errors = [f"{be}: {r[be + '_error']}" for be in backends if r[f"{be}_error"]]
        if errors:
            note += ("; " if note else "") + errors[0][:60]
        print(f"{label:<26} {r['pass']:<8} {fmt(r['ringattn_tflops'], 8, 2)} "
              + " ".join(fmt(r[f"{be}_tflops"], 7, 1) for be in backends) + " "
              + " ".join(fmt(r[f"ringattn_over_{be}"], 6, 3) for be in backends) + f"  {note[:70]}")
    if not timed:
        why = [f"{k}: {x}" for k, x in (("ringattn", ra_res.get("error")), ("torch", torch_res.get("error"))) if x]
        print(f"(no timings{' -- ' + '; '.join(why)[:240] if why else ''})")
    print("\n== sequence parallelism on one GPU (ranks = threads; time = slowest rank, forward + backward; "
          "hidden = 1 - (run - compute only) / comm only)")
    print(f"{'run':<32} {'world':>5} {'seq':>8} {'ms':>10} {'compute-only ms':>16} {'comm-only ms':>13} {'hidden':>7}")
    for o in overlap:
        if "seconds" not in o:
            print(f"{o['name']:<32} {o.get('status', 'not run')}  {(o.get('message') or '')[:80]}")
            continue

        def ms(x):
            return fmt(x * 1e3 if x is not None else None, 10, 1)

        hid = f"{o['hidden'] * 100:6.1f}%" if o.get("hidden") is not None else "      -"
        print(f"{o['name']:<32} {o['world']:>5} {o['seq']:>8} {ms(o['seconds'])} {ms(o.get('compute_only_s')):>16} "
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

    sub.add_parser("facts", help="torch/CUDA/GPU facts as one JSON line")

    v = sub.add_parser("verdict", help="one line VERDICT<TAB>TEXT from `ringattn doctor --json`")
    v.add_argument("doctor", help="the file holding doctor's JSON")

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
    s.add_argument("--state", default="done", help="running | done | refused | stopped")
    s.add_argument("--reason", default="", help="why the check was refused or stopped")
    s.add_argument("--gpu-note", default="", help="`no GPU: ...` when there is none")
    s.add_argument("--verdict", default="", help="the preflight verdict line (VERDICT<TAB>TEXT)")
    s.add_argument("--nccl-dir", default="", help="the NCCL library folder added to LD_LIBRARY_PATH")
    s.add_argument("--quiet", action="store_true", help="write the JSON only (no tables)")

    args = ap.parse_args(argv)
    return {"facts": cmd_facts, "verdict": cmd_verdict, "torch": cmd_torch, "ringattn": cmd_ringattn,
            "summarize": cmd_summarize}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
