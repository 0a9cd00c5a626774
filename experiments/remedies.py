"""Issue 49's screen of remedies for the modes' shared direction (docs/lev.md, "The modes' shared
direction"; plan experiments/plans/issue49-remedies.plan, whose reading this applies): each
option's seed-1 loss at every rate it ran, its rate (the best), the difference to plain LEV of
this session at seed 1, whether it is ahead, the paired test over seeds for the options that got
them (Holm over those), and the input embedding's statistics at its rate.

    python experiments/remedies.py        # writes experiments/results/issue49/v8000/remedies.{json,md}

Every run is 8k, width 128, 4 layers, 1,200 steps, scored alone on the experiment's evaluator
(experiments/collect.sh runs). Plain LEV's seed 1 is this session's run (lev-lr2e-3-s1 in
--runs); its seeds 2 and 3 are issue 42's (--baseline-runs): other sessions' runs drift by up to
0.036, which the seed-1 comparison, the one that decides "ahead", avoids. Nothing is typed in: a
run not collected yet is absent, and an option whose bracket is open (its best rate at an end
without the next rate out) is marked so.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from screen import (STAT_STEPS, _f, difference_cells, embedding_statistics, evaluator_loss,  # noqa: E402
                    mean_statistics, statistics_cells)

from megatron_lev.evaluation.seeds import holm, paired_t_test  # noqa: E402
from megatron_lev.utils.files import write_json_atomic, write_text_atomic  # noqa: E402

# label, run name without "-lr<rate>-s<seed>", what it is
OPTIONS = (
    ("plain LEV", "lev", "the spec's generator"),
    ("centred modes", "lev-center", "center_modes: true (learned per-mode offset from the mean mode)"),
    ("geometric mean", "lev-geomean", "mode_product: geometric_mean"),
    ("8 groups", "lev-groups8", "mode_groups: 8 (products of 8 coordinates, averaged)"),
    ("geometric mean, centred", "lev-geomean-center", "mode_product: geometric_mean, center_modes: true"),
    ("8 groups, centred", "lev-groups8-center", "mode_groups: 8, center_modes: true"),
    ("output RMS norm", "lev-norm", "output_norm: true (gain from 0.02)"),
)
BASELINE = "lev"
RATES = ("5e-4", "1e-3", "2e-3", "4e-3", "8e-3")  # the bracket's order; the plan runs 1e-3, 2e-3, 4e-3 first
AHEAD_BY = 0.017  # plain LEV's seed spread (the plan's rule)


def collect(runs_dirs: list[str], rates: tuple = RATES) -> dict:
    """{(name, rate): {seed: {"loss", "at", ...}}} of every collected run in the folders at one of
    `rates`, the first folder winning for a name it holds."""
    found = {}
    for runs in runs_dirs:
        for entry in sorted(os.listdir(runs)):
            stem, _, seed = entry.rpartition("-s")
            name, _, rate = stem.rpartition("-lr")
            path = os.path.join(runs, entry)
            if rate in rates and os.path.isfile(os.path.join(path, "evaluation.json")):
                found.setdefault((name, rate), {}).setdefault(
                    seed, {"loss": evaluator_loss(path), **embedding_statistics(path), "path": path})
    return found


def best_rate(found: dict, name: str, rates: tuple = RATES) -> tuple:
    """(rate, closed): the rate of the lowest seed-1 loss; `closed` when both its neighbours in
    `rates` (ascending) ran."""
    ran = {rate: found[(name, rate)]["1"]["loss"] for rate in rates if "1" in found.get((name, rate), {})}
    if not ran:
        return None, False
    rate = min(ran, key=ran.get)
    i = rates.index(rate)
    closed = all(rates[j] in ran for j in (i - 1, i + 1) if 0 <= j < len(rates)) and 0 < i < len(rates) - 1
    return rate, closed


def build(runs: str, baseline_runs: str) -> dict:
    found = collect([runs])
    baseline = collect([runs, baseline_runs]).get((BASELINE, "2e-3"), {})
    plain = {seed: r["loss"] for seed, r in baseline.items()}
    rows = []
    for label, name, what in OPTIONS:
        rate, closed = (("2e-3", True) if name == BASELINE else best_rate(found, name))
        if rate is None:
            continue
        seeds = baseline if name == BASELINE else found[(name, rate)]
        by_rate = {r: found[(name, r)]["1"]["loss"] for r in RATES if "1" in found.get((name, r), {})}
        diffs = {s: seeds[s]["loss"] - plain[s] for s in seeds if s in plain} if name != BASELINE else {}
        row = {"label": label, "run": f"{name}-lr{rate}", "what": what, "rate": rate, "bracket_closed": closed,
               "seed1_by_rate": by_rate, "seeds": sorted(seeds), "loss": {s: r["loss"] for s, r in seeds.items()},
               "loss_mean": float(np.mean([r["loss"] for r in seeds.values()])),
               "minus_plain_lev": diffs or None,
               "ahead": (diffs.get("1", 0.0) < -AHEAD_BY) if name != BASELINE and "1" in diffs else None,
               "minus_plain_lev_mean": float(np.mean(list(diffs.values()))) if diffs else None,
               "test": paired_t_test(diffs) if len(diffs) > 1 else None, "statistics": mean_statistics(seeds)}
        rows.append(row)
    adjusted = holm({r["run"]: r["test"]["p"] for r in rows if r["test"]})
    for row in rows:
        row["p_holm"] = adjusted.get(row["run"])
    return {"runs": runs, "baseline_runs": baseline_runs, "ahead_by": AHEAD_BY, "stat_steps": list(STAT_STEPS),
            "rows": rows}


def markdown(result: dict) -> str:
    lines = ["| option | seed 1 by rate | rate | seeds | − plain LEV (per seed) | mean | p (Holm) | "
             + " | ".join(f"step {s}: RMS / cosine / eff. rank" for s in result["stat_steps"]) + " |",
             "|---" * (7 + len(result["stat_steps"])) + "|"]
    for row in result["rows"]:
        by_rate = ", ".join(f"{r}: {v:.4f}" for r, v in row["seed1_by_rate"].items())
        per_seed, p_cell = difference_cells(row)
        stats = statistics_cells(row["statistics"], result["stat_steps"])
        rate = row["rate"] + ("" if row["bracket_closed"] else " (open)")
        lines.append(f"| {row['label']} | {by_rate or '—'} | {rate} | {','.join(row['seeds'])} | {per_seed or '—'} | "
                     f"{_f(row['minus_plain_lev_mean'], '+.3f')} | {p_cell} | " + " | ".join(stats) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    results = os.path.join(REPO, "experiments", "results")
    parser.add_argument("--runs", default=os.path.join(results, "issue49", "v8000", "runs"))
    parser.add_argument("--baseline-runs", default=os.path.join(results, "issue42", "v8000", "runs"),
                        help="plain LEV's other seeds (lev-lr2e-3-s2, -s3)")
    parser.add_argument("--output", default=os.path.join(results, "issue49", "v8000"))
    args = parser.parse_args(argv)
    return write_results(args.output, "remedies", build(args.runs, args.baseline_runs), markdown)


def write_results(output: str, stem: str, result: dict, to_markdown) -> dict:
    """OUTPUT/STEM.json and OUTPUT/STEM.md (its table, also printed), each written atomically."""
    write_json_atomic(os.path.join(output, f"{stem}.json"), result)
    table = to_markdown(result)
    write_text_atomic(os.path.join(output, f"{stem}.md"), table)
    print(table)
    return result


if __name__ == "__main__":
    main()
