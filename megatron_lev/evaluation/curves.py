"""Training-curve comparison from the `metrics.jsonl` that `megatron_lev.train` writes.

    python -m megatron_lev.evaluation.curves --run tied=runs/tied --run lev=runs/lev \
        --baseline tied --metric valid_loss --output-dir eval/curves

Each run is `NAME=PATH` (PATH: a metrics.jsonl or the run directory holding one).
Lines are JSON objects with `iteration`, `consumed_tokens` and the metric
(`valid_loss` by default, or the training `loss`); lines without the metric are
skipped. A resumed run may log an iteration twice: the last line wins.

Tokens to target. The target is the baseline's final loss (its last logged value).
A run's tokens-to-target is where its curve first reaches the target: the first
logged point `i` with `loss[i] <= target`, linearly interpolated in (tokens, loss)
between points `i-1` and `i`:
`tokens = t[i-1] + (loss[i-1] - target) / (loss[i-1] - loss[i]) * (t[i] - t[i-1])`
(the point itself when `i` is the first one). The baseline's own value is its
final token count (it reaches its final loss when it ends), and a run's speed-up
is `baseline tokens / run tokens` -- the papers' "2.1x fewer tokens". A run that
never reaches the target reports null. With `--ema A` the curves are smoothed
first (`s[i] = A * s[i-1] + (1 - A) * loss[i]`), useful for the noisy training loss.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import numpy as np

from megatron_lev.evaluation.report import parse_named
from megatron_lev.utils.files import write_json_atomic, write_text_atomic


@dataclass
class Curve:
    name: str
    tokens: np.ndarray  # float64, increasing
    loss: np.ndarray  # float64
    iterations: np.ndarray  # int64

    @property
    def final_loss(self) -> float:
        return float(self.loss[-1])

    @property
    def final_tokens(self) -> float:
        return float(self.tokens[-1])


def metrics_path(path: str) -> str:
    return os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path


def read_curve(path: str, name: str | None = None, metric: str = "valid_loss") -> Curve:
    """The (tokens, metric) points of one run's metrics.jsonl, in token order."""
    path = metrics_path(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no metrics.jsonl here")
    by_iteration: dict[int, tuple[float, float]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({exc.msg})") from exc
            if record.get(metric) is None:
                continue
            if "consumed_tokens" not in record or "iteration" not in record:
                raise ValueError(f"{path}:{lineno}: a {metric} line needs 'iteration' and 'consumed_tokens'")
            by_iteration[int(record["iteration"])] = (float(record["consumed_tokens"]), float(record[metric]))
    if not by_iteration:
        raise ValueError(f"{path}: no line has {metric!r} (use --metric loss for training loss)")
    iterations = np.array(sorted(by_iteration), dtype=np.int64)
    tokens = np.array([by_iteration[i][0] for i in iterations])
    loss = np.array([by_iteration[i][1] for i in iterations])
    return Curve(name or os.path.basename(os.path.dirname(os.path.abspath(path))), tokens, loss, iterations)


def ema(values: np.ndarray, alpha: float) -> np.ndarray:
    """Exponential moving average `s[i] = alpha * s[i-1] + (1 - alpha) * x[i]`, `s[0] = x[0]`."""
    if not 0 <= alpha < 1:
        raise ValueError(f"--ema must be in [0, 1), got {alpha}")
    out = np.empty(len(values), dtype=np.float64)
    acc = None
    for i, v in enumerate(values):
        acc = v if acc is None else alpha * acc + (1 - alpha) * v
        out[i] = acc
    return out


def tokens_to_target(tokens, loss, target: float) -> float | None:
    """Tokens at which the curve first reaches `target` (linear interpolation; module doc)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    loss = np.asarray(loss, dtype=np.float64)
    hits = np.flatnonzero(loss <= target)
    if hits.size == 0:
        return None
    i = int(hits[0])
    if i == 0:
        return float(tokens[0])
    t0, t1, l0, l1 = tokens[i - 1], tokens[i], loss[i - 1], loss[i]
    return float(t0 + (l0 - target) / (l0 - l1) * (t1 - t0))  # l0 > target >= l1, so l0 != l1


def compare_curves(curves: dict[str, Curve], baseline: str) -> dict:
    """Final loss, tokens to the baseline's final loss and the speed-up of every run."""
    if baseline not in curves:
        raise ValueError(f"--baseline {baseline!r} is not one of the runs: {', '.join(curves)}")
    base = curves[baseline]
    target = base.final_loss
    runs = {}
    for name, curve in curves.items():
        reached = base.final_tokens if name == baseline else tokens_to_target(curve.tokens, curve.loss, target)
        runs[name] = {
            "final_loss": curve.final_loss,
            "final_tokens": curve.final_tokens,
            "points": int(len(curve.tokens)),
            "tokens_to_target": reached,
            "speedup_vs_baseline": None if reached is None or reached <= 0 else base.final_tokens / reached,
        }
    return {"baseline": baseline, "target_loss": target, "runs": runs}


def comparison_markdown(result: dict, metric: str) -> str:
    lines = [f"**Tokens to reach {result['baseline']}'s final {metric} = {result['target_loss']:.4f}**", "",
             f"| run | final {metric} | final tokens | tokens to target | speed-up |", "|---|---|---|---|---|"]
    for name, row in result["runs"].items():
        reached = "not reached" if row["tokens_to_target"] is None else f"{row['tokens_to_target']:.4g}"
        speed = "n/a" if row["speedup_vs_baseline"] is None else f"{row['speedup_vs_baseline']:.2f}x"
        lines.append(f"| {name} | {row['final_loss']:.4f} | {row['final_tokens']:.4g} | {reached} | {speed} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="Compare training curves: loss vs tokens, tokens to target.")
    parser.add_argument("--run", action="append", required=True, metavar="NAME=PATH",
                        help="a run's metrics.jsonl or run directory; repeat per run")
    parser.add_argument("--baseline", help="run whose final loss is the target (default: the first --run)")
    parser.add_argument("--metric", default="valid_loss", help="metrics.jsonl key to compare (valid_loss | loss)")
    parser.add_argument("--ema", type=float, default=0.0, help="EMA smoothing factor in [0, 1) (0: none)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--plot-width", type=int, default=1200)
    parser.add_argument("--plot-height", type=int, default=800)
    parser.add_argument("--log-x", action="store_true", help="log-scale token axis")
    args = parser.parse_args(argv)

    paths = parse_named(args.run, "--run")
    curves = {name: read_curve(path, name, args.metric) for name, path in paths.items()}
    if args.ema:
        for curve in curves.values():
            curve.loss = ema(curve.loss, args.ema)
    baseline = args.baseline or next(iter(curves))
    result = compare_curves(curves, baseline)
    result.update({"metric": args.metric, "ema": args.ema, "runs_paths": {n: metrics_path(p) for n, p in paths.items()}})

    from megatron_lev.evaluation.plots import plot_loss_curves

    os.makedirs(args.output_dir, exist_ok=True)
    plot = plot_loss_curves({n: (c.tokens, c.loss) for n, c in curves.items()},
                            os.path.join(args.output_dir, "loss_vs_tokens.png"), target=result["target_loss"],
                            crossings={n: r["tokens_to_target"] for n, r in result["runs"].items()},
                            ylabel=args.metric, log_x=args.log_x, size_px=(args.plot_width, args.plot_height))
    result["plot"] = plot
    write_json_atomic(os.path.join(args.output_dir, "curves.json"), result)
    markdown = comparison_markdown(result, args.metric)
    write_text_atomic(os.path.join(args.output_dir, "curves.md"), markdown)
    print(markdown)
    return result


if __name__ == "__main__":
    main()
