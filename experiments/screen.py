"""Issue 42's generator screen and frozen table: the evaluator's loss of every option over its
seeds, each option against plain LEV of the same session (paired by seed), and the input
embedding's statistics that explain the collapse (RMS, mean pairwise cosine and effective rank
over 512 fixed ids, and the fraction of steps clipped), read from the committed result files.

    python experiments/screen.py          # writes experiments/results/issue42/v8000/screen.{json,md}

Every run is 8k, width 128, 4 layers, 1,200 steps (2.46M tokens), scored alone on the
experiment's evaluator (the first 65,536 validation tokens: experiments/collect.sh runs). An
option's difference to plain LEV is taken per seed, then over seeds (mean, sample std, a two-
sided one-sample t-test of the per-seed differences: megatron_lev.evaluation.seeds); with one
seed there is no test. The author's options that got seeds 2 and 3 (those ahead of plain LEV at
seed 1 by more than its seed spread) form one family for Holm's adjustment; the run clipping each
family alone, a later question about the mechanism, is tested on its own. Nothing is typed in: a run not collected yet is absent from the table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_lev.evaluation.seeds import holm, paired_t_test  # noqa: E402
from megatron_lev.utils.files import write_json_atomic, write_text_atomic  # noqa: E402

# label, run name without "-s<seed>", what it is
ROWS = (
    ("plain LEV", "lev-lr2e-3", "the spec's generator (kappa 16, weight decay, normalised basis, fixed knot scale)"),
    ("no weight decay", "lev-nowd-lr2e-3", "--lev-no-weight-decay"),
    ("learnable knot scale", "lev-kscale-lr2e-3", "knot_scale_learnable: true (from kappa - 1)"),
    ("unnormalised basis", "lev-unnorm-lr2e-3", "basis_normalize: false"),
    ("kappa 32", "lev-k32-lr2e-3", "num_knots: 32"),
    ("all four", "lev-author-lr2e-3", "the four together: the author's training"),
    ("each family clipped alone", "lev-clipsep-lr2e-3", "--lev-clip-grad 1.0: the generator and the rest each "
     "clipped to 1.0 by its own norm (not an author's option: the clipping that every LEV step met)"),
    ("frozen random table", "frozen-lr4e-3", "untied, its input table left at its init (4e-3, bracketed)"),
    ("tied", "tied-lr4e-3", "tied tables (4e-3, issue 32's rate)"),
    ("untied", "untied-lr4e-3", "untied tables (4e-3, issue 32's rate)"),
)
BASELINE = "lev-lr2e-3"
AUTHOR_OPTIONS = ("lev-nowd-lr2e-3", "lev-kscale-lr2e-3", "lev-unnorm-lr2e-3", "lev-k32-lr2e-3", "lev-author-lr2e-3")
STAT_STEPS = (0, 50, 1200)
STATS = ("embedding_rms", "embedding_mean_cosine", "embedding_effective_rank")


def evaluator_loss(run_dir: str) -> float:
    with open(os.path.join(run_dir, "evaluation.json")) as f:
        data = json.load(f)
    (model,) = data["models"].values()
    return float(model["loss"])


def embedding_statistics(run_dir: str) -> dict:
    """{step: {stat: value}} at STAT_STEPS, and the run's mean clipped fraction, from metrics.jsonl
    (runs started before the statistics were logged have none)."""
    at, clipped = {}, []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record.get("iteration") in STAT_STEPS and STATS[0] in record:
                at[record["iteration"]] = {s: float(record[s]) for s in STATS}
            if "clipped_fraction" in record:
                clipped.append(float(record["clipped_fraction"]))
    return {"at": at, "clipped_fraction": float(np.mean(clipped)) if clipped else None}


def mean_statistics(seeds: dict) -> dict:
    """{step: {stat: mean over the seeds that logged it, "seeds": how many}} at STAT_STEPS, from
    {seed: embedding_statistics(...)}."""
    out = {}
    for step in STAT_STEPS:
        per_seed = [r["at"][step] for r in seeds.values() if step in r["at"]]
        if per_seed:
            out[step] = {s: float(np.mean([p[s] for p in per_seed])) for s in STATS}
            out[step]["seeds"] = len(per_seed)
    return out


def statistics_cells(statistics: dict, steps) -> list[str]:
    """The table's "RMS / cosine / eff. rank" cell of each step ("—" where none was logged)."""
    cells = []
    for step in steps:
        s = statistics.get(step)
        cells.append("—" if s is None else f"{s['embedding_rms']:.3f} / {s['embedding_mean_cosine']:.3f} / "
                     f"{s['embedding_effective_rank']:.1f}")
    return cells


def build(runs: str) -> dict:
    found = {name: {} for _, name, _ in ROWS}
    for entry in sorted(os.listdir(runs)):
        name, _, seed = entry.rpartition("-s")
        if name in found and os.path.isfile(os.path.join(runs, entry, "evaluation.json")):
            found[name][seed] = {"loss": evaluator_loss(os.path.join(runs, entry)),
                                 **embedding_statistics(os.path.join(runs, entry))}
    base = {s: r["loss"] for s, r in found[BASELINE].items()}
    rows = []
    for label, name, what in ROWS:
        seeds = found[name]
        if not seeds:
            continue
        losses = [r["loss"] for r in seeds.values()]
        diffs = {s: r["loss"] - base[s] for s, r in seeds.items() if s in base}
        row = {"label": label, "run": name, "what": what, "seeds": sorted(seeds),
               "loss": {s: r["loss"] for s, r in seeds.items()}, "loss_mean": float(np.mean(losses)),
               "loss_std": float(np.std(losses, ddof=1)) if len(losses) > 1 else None,
               "minus_plain_lev": diffs if name != BASELINE else None,
               "minus_plain_lev_mean": float(np.mean(list(diffs.values()))) if diffs and name != BASELINE else None,
               "test": paired_t_test(diffs) if len(diffs) > 1 and name != BASELINE else None}
        row["statistics"] = mean_statistics(seeds)
        clipped = [r["clipped_fraction"] for r in seeds.values() if r["clipped_fraction"] is not None]
        row["clipped_fraction"] = float(np.mean(clipped)) if clipped else None
        rows.append(row)
    # Holm's family: the author's options that got seeds (decided before the screen). The clipping
    # run is a later, separate question about the mechanism, tested on its own.
    tested = {r["run"]: r["test"]["p"] for r in rows if r["test"] and r["run"] in AUTHOR_OPTIONS}
    adjusted = holm(tested)
    for row in rows:
        row["p_holm"] = adjusted.get(row["run"])
    return {"runs": runs, "baseline": BASELINE, "stat_steps": list(STAT_STEPS), "rows": rows}


def _f(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def difference_cells(row: dict) -> tuple[str, str]:
    """The table's "− plain LEV (per seed)" and "p (Holm)" cells of a row."""
    per_seed = ", ".join(f"{v:+.3f}" for _, v in sorted((row["minus_plain_lev"] or {}).items()))
    p = row["test"]["p"] if row["test"] else None
    return per_seed, _f(p, ".3f") + (f" ({row['p_holm']:.3f})" if row.get("p_holm") is not None else "")


def markdown(result: dict) -> str:
    lines = ["| option | seeds | loss (mean ± std) | − plain LEV (per seed) | mean | p (Holm) | "
             + " | ".join(f"step {s}: RMS / cosine / eff. rank" for s in result["stat_steps"]) + " | clipped |",
             "|---" * (7 + len(result["stat_steps"])) + "|"]
    for row in result["rows"]:
        per_seed, p_cell = difference_cells(row)
        stats = statistics_cells(row["statistics"], result["stat_steps"])
        spread = f" ± {row['loss_std']:.3f}" if row["loss_std"] is not None else ""
        lines.append(f"| {row['label']} | {','.join(row['seeds'])} | {row['loss_mean']:.4f}{spread} | "
                     f"{per_seed or '—'} | {_f(row['minus_plain_lev_mean'], '+.3f')} | {p_cell} | "
                     + " | ".join(stats) + f" | {_f(row['clipped_fraction'], '.2f')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=os.path.join(REPO, "experiments", "results", "issue42", "v8000", "runs"))
    parser.add_argument("--output", default=os.path.join(REPO, "experiments", "results", "issue42", "v8000"))
    args = parser.parse_args(argv)
    result = build(args.runs)
    write_json_atomic(os.path.join(args.output, "screen.json"), result)
    write_text_atomic(os.path.join(args.output, "screen.md"), markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
