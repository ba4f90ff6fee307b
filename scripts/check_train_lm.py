#!/usr/bin/env python3
"""Checks a `train_lm --compare-single --json` report against the bounds of its dtype.

f32: the largest loss difference from the single-rank run <= 1e-4, the step-1 gradient
relative error <= 1e-5 (with --sinks, the sinks' own too). bf16 attention (q, k, v and o rounded once per layer, unit roundoff
u = 2^-8): each attention output carries at most about 2u relative error, so over the model's
2 layers the loss and the step-1 gradients stay within 2 * layers * u = 4u of the f32 run
(relative). Replicas must be bit-identical in both. Usage: check_train_lm.py REPORT.json
[--min-drop X] (the final loss at least X below the first)."""
import json
import sys

report = json.load(open(sys.argv[1]))
u = 2.0 ** -8
bf16 = report["dtype"] != "F32"
loss_bound = 4 * u * max(report["single_losses"]) if bf16 else 1e-4
grad_bound = 4 * u if bf16 else 1e-5
problems = []
if report["max_abs_loss_diff"] > loss_bound:
    problems.append(f"max |loss diff| {report['max_abs_loss_diff']:.3e} > {loss_bound:.3e}")
if report["step1_grad_rel_err"] > grad_bound:
    problems.append(f"step-1 gradient error {report['step1_grad_rel_err']:.3e} > {grad_bound:.3e}")
# With learnable sinks, their own step-1 gradients (a small part of the whole) as well.
if report.get("step1_sinks_grad_rel_err", 0.0) > grad_bound:
    problems.append(f"the sinks' step-1 gradient error {report['step1_sinks_grad_rel_err']:.3e} > {grad_bound:.3e}")
if not report["replicas_identical"]:
    problems.append("replicas differ")
if "--min-drop" in sys.argv:
    drop = float(sys.argv[sys.argv.index("--min-drop") + 1])
    losses = report["losses"]
    if losses[0] - losses[-1] < drop:
        problems.append(f"loss fell {losses[0] - losses[-1]:.3f} < {drop}")
name = f"{report['strategy']} x{report['world']} {report['dtype']} {report['backend']}"
if problems:
    print(f"train_lm {name}: " + "; ".join(problems))
    sys.exit(1)
print(f"train_lm {name}: loss diff {report['max_abs_loss_diff']:.2e} <= {loss_bound:.1e}, "
      f"gradient {report['step1_grad_rel_err']:.2e} <= {grad_bound:.1e}, replicas identical")
