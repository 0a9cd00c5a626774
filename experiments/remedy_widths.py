"""Issue 49's winning remedy at other widths (plan experiments/plans/issue49-widths.plan, whose
reading this applies): centred modes and the frozen random table at widths 64 and 256, each at
its best seed-1 rate; centred modes against plain LEV at that width (issue 42's three seeds) and
against the frozen table (this plan's seeds), per seed, the paired t-test, Holm over the widths of
each comparison; the input embedding's statistics at every kind's rate.

    python experiments/remedy_widths.py   # writes experiments/results/issue49/v8000/remedy_widths.{json,md}

Nothing is typed in: a run not collected yet is absent, a bracket whose best rate is at an end
without the next rate out is marked "(open)", and a comparison waits for both kinds' seeds.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from remedies import REPO, best_rate, collect, write_results  # noqa: E402
from screen import STAT_STEPS, _f, mean_statistics, statistics_cells  # noqa: E402

from megatron_lev.evaluation.seeds import holm, paired_t_test  # noqa: E402

RATES = ("5e-4", "1e-3", "2e-3", "4e-3", "8e-3", "1.6e-2", "3.2e-2")  # ascending: a bracket's neighbours
PLAIN_LEV = {"64": "8e-3", "256": "2e-3"}  # issue 42's rate for plain LEV at each width (its three seeds)
KINDS = (("centred modes", "lev-center-w{width}"), ("frozen random table", "frozen-w{width}"))


def _differences(a: dict, b: dict) -> dict:
    return {s: a[s]["loss"] - b[s]["loss"] for s in sorted(a) if s in b}


def build(runs: str, baseline_runs: str) -> dict:
    found = collect([runs], RATES)
    plain_found = collect([baseline_runs], RATES)
    widths = []
    for width, plain_rate in PLAIN_LEV.items():
        plain = plain_found.get((f"lev-w{width}", plain_rate), {})
        rows = [{"label": "plain LEV (issue 42)", "run": f"lev-w{width}-lr{plain_rate}", "rate": plain_rate,
                 "bracket_closed": True, "seed1_by_rate": {}, "seeds": sorted(plain),
                 "loss": {s: r["loss"] for s, r in plain.items()}, "statistics": mean_statistics(plain)}]
        chosen = {}
        for label, pattern in KINDS:
            name = pattern.format(width=width)
            rate, closed = best_rate(found, name, RATES)
            if rate is None:
                continue
            seeds = found[(name, rate)]
            chosen[label] = seeds
            rows.append({"label": label, "run": f"{name}-lr{rate}", "rate": rate, "bracket_closed": closed,
                         "seed1_by_rate": {r: found[(name, r)]["1"]["loss"] for r in RATES
                                           if "1" in found.get((name, r), {})},
                         "seeds": sorted(seeds), "loss": {s: r["loss"] for s, r in seeds.items()},
                         "statistics": mean_statistics(seeds)})
        for row in rows:
            row["loss_mean"] = float(np.mean(list(row["loss"].values()))) if row["loss"] else None
        comparisons = {}
        centred = chosen.get("centred modes")
        for against, other in (("plain LEV", plain), ("frozen random table", chosen.get("frozen random table"))):
            diffs = _differences(centred, other) if centred and other else {}
            comparisons[against] = {"per_seed": diffs, "mean": float(np.mean(list(diffs.values()))) if diffs else None,
                                    "test": paired_t_test(diffs) if len(diffs) > 1 else None}
        widths.append({"width": width, "rows": rows, "centred_minus": comparisons})
    for against in ("plain LEV", "frozen random table"):
        tested = {w["width"]: w["centred_minus"][against]["test"]["p"] for w in widths
                  if w["centred_minus"][against]["test"] and w["centred_minus"][against]["test"]["p"] is not None}
        adjusted = holm(tested)
        for w in widths:
            w["centred_minus"][against]["p_holm"] = adjusted.get(w["width"])
    return {"runs": runs, "baseline_runs": baseline_runs, "stat_steps": list(STAT_STEPS), "widths": widths}


def _comparison_cells(comparison: dict) -> tuple[str, str]:
    per_seed = ", ".join(f"{v:+.3f}" for v in comparison["per_seed"].values())
    if comparison["test"] is None or comparison["test"]["p"] is None:
        return per_seed or "—", "—"
    return per_seed, f"{comparison['test']['p']:.3f} ({_f(comparison['p_holm'], '.3f')})"


def markdown(result: dict) -> str:
    lines = ["| width | kind | seed 1 by rate | rate | seeds | loss (mean) | "
             + " | ".join(f"step {s}: RMS / cosine / eff. rank" for s in result["stat_steps"]) + " |",
             "|---" * (6 + len(result["stat_steps"])) + "|"]
    for w in result["widths"]:
        for row in w["rows"]:
            by_rate = ", ".join(f"{r}: {v:.4f}" for r, v in row["seed1_by_rate"].items())
            rate = row["rate"] + ("" if row["bracket_closed"] else " (open)")
            lines.append(f"| {w['width']} | {row['label']} | {by_rate or '—'} | {rate} | {','.join(row['seeds'])} | "
                         f"{_f(row['loss_mean'], '.4f')} | "
                         + " | ".join(statistics_cells(row["statistics"], result["stat_steps"])) + " |")
    lines += ["", "| width | centred modes − | per seed | mean | p (Holm over widths) |", "|---|---|---|---|---|"]
    for w in result["widths"]:
        for against, comparison in w["centred_minus"].items():
            per_seed, p_cell = _comparison_cells(comparison)
            lines.append(f"| {w['width']} | {against} | {per_seed} | {_f(comparison['mean'], '+.3f')} | {p_cell} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    results = os.path.join(REPO, "experiments", "results")
    parser.add_argument("--runs", default=os.path.join(results, "issue49", "v8000", "runs"))
    parser.add_argument("--baseline-runs", default=os.path.join(results, "issue42", "v8000", "runs"),
                        help="plain LEV at widths 64 and 256 (lev-w64-lr8e-3-s1..3, lev-w256-lr2e-3-s1..3)")
    parser.add_argument("--output", default=os.path.join(results, "issue49", "v8000"))
    args = parser.parse_args(argv)
    return write_results(args.output, "remedy_widths", build(args.runs, args.baseline_runs), markdown)


if __name__ == "__main__":
    main()
