"""A learning-rate sweep's table: each kind ranked by its final validation loss.

    python -m megatron_lev.evaluation.lr_sweep --sweep-dir experiments/out/sweep --steps 1200 \
        --output-dir experiments/out/sweep

Every run directory under --sweep-dir is named KIND-lrLR-sSEED (experiments/lr_sweep.sh
writes them: `lev-lr2e-3-s1` is kind `lev` at peak learning rate 2e-3, seed 1) and holds
the trainer's metrics.jsonl. A run's score is its validation loss at its last logged
validation iteration, which must be --steps: an unfinished run is an error, not a row.
Several seeds of one (kind, lr) are averaged. Per kind, the best learning rate is the one
with the lowest mean; when it lies at the edge of that kind's grid the optimum may lie
outside it, and the table says so ("edge").

Output (--output-dir): sweep.json (every run, the mean per (kind, lr), the best per kind)
and sweep.md (one table per kind, best first).
"""
from __future__ import annotations

import argparse
import math
import os
import re

from megatron_lev.evaluation.curves import read_curve
from megatron_lev.utils.files import write_json_atomic, write_text_atomic

RUN_NAME = re.compile(r"^(?P<kind>.+)-lr(?P<lr>[0-9.]+(?:e-?[0-9]+)?)-s(?P<seed>[0-9]+)$")


def parse_run_name(name: str) -> tuple[str, float, int] | None:
    """(kind, lr, seed) of a run directory named KIND-lrLR-sSEED, else None."""
    match = RUN_NAME.match(name)
    if match is None:
        return None
    lr = float(match["lr"])
    if not math.isfinite(lr) or lr <= 0:
        return None
    return match["kind"], lr, int(match["seed"])


def final_valid_loss(run_dir: str, steps: int) -> float:
    curve = read_curve(run_dir)
    last = int(curve.iterations[-1])
    if last != steps:
        raise ValueError(f"{run_dir}: last validation at iteration {last}, not --steps {steps} "
                         "(unfinished, or trained to another length)")
    return float(curve.loss[-1])


def collect(sweep_dir: str, steps: int) -> list[dict]:
    """One record per run directory under sweep_dir: kind, lr, seed, final validation loss."""
    if not os.path.isdir(sweep_dir):
        raise FileNotFoundError(f"--sweep-dir {sweep_dir}: no such directory")
    runs = []
    for name in sorted(os.listdir(sweep_dir)):
        parsed = parse_run_name(name)
        path = os.path.join(sweep_dir, name)
        if parsed is None or not os.path.isdir(path):
            continue
        kind, lr, seed = parsed
        runs.append({"kind": kind, "lr": lr, "seed": seed, "run": path,
                     "valid_loss": final_valid_loss(path, steps)})
    if not runs:
        raise ValueError(f"--sweep-dir {sweep_dir}: no run directory named KIND-lrLR-sSEED")
    return runs


def rank(runs: list[dict]) -> dict:
    """Per kind: every lr's mean final validation loss over seeds, best first, and the best lr."""
    by_kind: dict[str, dict[float, list[float]]] = {}
    for r in runs:
        by_kind.setdefault(r["kind"], {}).setdefault(r["lr"], []).append(r["valid_loss"])
    table = {}
    for kind, by_lr in by_kind.items():
        rows = sorted(({"lr": lr, "valid_loss": sum(v) / len(v), "seeds": len(v)} for lr, v in by_lr.items()),
                      key=lambda row: row["valid_loss"])
        grid = sorted(by_lr)
        best = rows[0]["lr"]
        table[kind] = {"rows": rows, "best_lr": best,
                       "best_at_edge": len(grid) > 1 and best in (grid[0], grid[-1])}
    return table


def sweep_markdown(table: dict, steps: int) -> str:
    lines = []
    for kind, entry in table.items():
        best = entry["rows"][0]["valid_loss"]
        edge = " (best at the grid's edge: the optimum may lie outside it)" if entry["best_at_edge"] else ""
        lines += [f"**{kind}**: best peak learning rate {entry['best_lr']:g}{edge}", "",
                  f"| peak lr | validation loss at step {steps} | vs best | seeds |", "|---|---|---|---|"]
        lines += [f"| {row['lr']:g} | {row['valid_loss']:.4f} | {row['valid_loss'] - best:+.4f} | {row['seeds']} |"
                  for row in entry["rows"]]
        lines.append("")
    return "\n".join(lines)


def summarise(sweep_dir: str, steps: int, output_dir: str | None = None) -> dict:
    runs = collect(sweep_dir, steps)
    table = rank(runs)
    summary = {"steps": steps, "runs": runs, "kinds": table}
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        write_json_atomic(os.path.join(output_dir, "sweep.json"), summary)
        write_text_atomic(os.path.join(output_dir, "sweep.md"), sweep_markdown(table, steps))
    return summary


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m megatron_lev.evaluation.lr_sweep",
                                     description="Rank a learning-rate sweep's runs (KIND-lrLR-sSEED folders) "
                                                 "by final validation loss, per kind.")
    parser.add_argument("--sweep-dir", required=True, help="the folder holding the KIND-lrLR-sSEED run folders")
    parser.add_argument("--steps", type=int, required=True, help="every run's training iterations")
    parser.add_argument("--output-dir", help="write sweep.json and sweep.md here")
    args = parser.parse_args(argv)
    try:
        summary = summarise(args.sweep_dir, args.steps, args.output_dir)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"megatron_lev.evaluation.lr_sweep: error: {exc}") from exc
    print(sweep_markdown(summary["kinds"], args.steps))
    for kind, entry in summary["kinds"].items():
        print(f"best {kind} {entry['best_lr']:g}")
    return summary


if __name__ == "__main__":
    main()
