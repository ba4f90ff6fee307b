#!/usr/bin/env python3
"""Summarises scripts/docs-auto-bench.sh's runs: per batch, auto's measured time against the
best and worst fixed strategy × layout, and the cost model's predictions against every
measurement. Writes summary.md and summary.json beside the runs."""
import json
import pathlib
import statistics
import sys

out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
rows, errors = [], []
for path in sorted(out.glob("b*.json")):
    runs = json.loads(path.read_text())
    auto = [r for r in runs if r.get("choice")]
    fixed = [r for r in runs if not r.get("choice")]
    if not auto or not fixed:
        continue
    a = auto[0]
    best = min(fixed, key=lambda r: r["median_s"])
    worst = max(fixed, key=lambda r: r["median_s"])
    for r in runs:
        if r.get("predicted_s"):
            errors.append((r["predicted_s"] / r["median_s"] - 1.0) * 100.0)
    rows.append({
        "batch": path.stem,
        "documents": a["documents"],
        "auto": a["choice"],
        "auto_ms": a["median_s"] * 1e3,
        "auto_predicted_ms": a["predicted_s"] * 1e3,
        "best": f'{best["strategy"]} {best["layout"]}',
        "best_ms": best["median_s"] * 1e3,
        "worst": f'{worst["strategy"]} {worst["layout"]}',
        "worst_ms": worst["median_s"] * 1e3,
        "zigzag_ring_ms": next((r["median_s"] * 1e3 for r in fixed if r["strategy"] == "ring" and r["layout"] == "zigzag"), None),
        "auto_over_best": a["median_s"] / best["median_s"],
        "auto_is_worst": a["median_s"] >= worst["median_s"],
    })
if not rows:
    sys.exit(f"no batch with auto and fixed runs under {out}")
md = ["| batch | docs | auto's choice | auto ms | best fixed | best ms | auto / best | worst fixed | worst ms |",
      "|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    md.append(f'| {r["batch"]} | {r["documents"]} | {r["auto"]} | {r["auto_ms"]:.0f} | {r["best"]} | {r["best_ms"]:.0f} | '
              f'{r["auto_over_best"]:.3f} | {r["worst"]} | {r["worst_ms"]:.0f} |')
within = sum(r["auto_over_best"] <= 1.10 for r in rows)
md.append("")
md.append(f"auto within 10% of the best fixed on {within} of {len(rows)} batches; the worst on "
          f"{sum(r['auto_is_worst'] for r in rows)}; max auto / best {max(r['auto_over_best'] for r in rows):.3f}")
md.append(f"model vs measured over {len(errors)} configurations: mean |error| "
          f"{statistics.mean(abs(e) for e in errors):.1f}%, median {statistics.median(errors):+.1f}%, "
          f"range {min(errors):+.1f}% to {max(errors):+.1f}%")
(out / "summary.md").write_text("\n".join(md) + "\n")
(out / "summary.json").write_text(json.dumps({"batches": rows, "model_error_pct": errors}, indent=1) + "\n")
print("\n".join(md))
