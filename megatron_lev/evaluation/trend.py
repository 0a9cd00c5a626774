"""The gap between two kinds against model width, seed by seed (issue 42: v2's axis).

    python -m megatron_lev.evaluation.trend --model lev --baseline tied \\
        --point 64:1=eval/w64-s1 --point 64:2=eval/w64-s2 ... --point 256:3=eval/w256-s3 --output-dir eval/trend

Each --point WIDTH:SEED=DIR[,DIR...] names the evaluation.json files (anywhere below the DIRs) of
`megatron_lev.evaluate` runs that scored MODEL and BASELINE of that width and seed on the same
tokens. The gap is loss(MODEL) - loss(BASELINE) in nats (negative: MODEL better).

  per seed   the least-squares slope of the gap against log2(width) (nats per doubling) and
             its intercept, over the seed's widths (at least 2);
  slope      the mean of the seeds' slopes, their std, the 95% t-interval and the two-sided
             t-test against 0 (n - 1 degrees of freedom: the seeds are the replicates);
  crossing   where the mean line (mean intercept, mean slope) reaches a gap of 0, as a width and
             as MODEL's parameter count there (log-linear in width between the measured points,
             extrapolated beyond them): an extrapolation, and "nowhere" when the mean slope is
             not negative; when the slope's interval holds 0 the crossing has no upper bound;
  reading    the rule stated before the runs (issue 42): "narrowing" when the gap at the widest
             width is <= 0.10 nats and every seed's slope is negative; "flat" when the mean
             slope lies within +-0.02 nats per doubling; "growing" when it is above +0.02 with
             its interval above 0; otherwise "undecided";
  confound   tokens per MODEL parameter at each width (every width trains on the same tokens,
             so the wider models see fewer per parameter).

Output: trend.json, trend.md and trend.png (each seed's gaps and line, the mean line, zero).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os

import numpy as np
from scipy import stats

from megatron_lev.evaluation.plots import _figure, _finish_single_axes
from megatron_lev.evaluation.report import parse_named
from megatron_lev.utils.files import write_json_atomic, write_text_atomic

NARROW_GAP, FLAT_SLOPE = 0.10, 0.02


def read_point(spec: str, dirs: str, model: str, baseline: str) -> dict:
    """MODEL's and BASELINE's loss, parameters and tokens from the evaluation.json files below DIRS."""
    found = {}
    for directory in dirs.split(","):
        if not os.path.isdir(directory):
            raise ValueError(f"--point {spec}={dirs}: {directory}: no such directory")
        for path in sorted(glob.glob(os.path.join(directory, "**", "evaluation.json"), recursive=True)):
            with open(path) as f:
                for name, entry in json.load(f)["models"].items():
                    if name in (model, baseline):
                        if name in found:
                            raise ValueError(f"--point {spec}: model {name!r} is in {path} and {found[name]['path']}")
                        found[name] = {"path": path, **entry}
    missing = [n for n in (model, baseline) if n not in found]
    if missing:
        raise ValueError(f"--point {spec}={dirs}: no evaluation.json below it scores {missing}")
    if found[model]["tokens"] != found[baseline]["tokens"]:
        raise ValueError(f"--point {spec}: {model} and {baseline} scored different tokens "
                         f"({found[model]['tokens']} vs {found[baseline]['tokens']})")
    return {"gap": found[model]["loss"] - found[baseline]["loss"], "model_loss": found[model]["loss"],
            "baseline_loss": found[baseline]["loss"], "model_parameters": found[model]["parameters"],
            "eval_tokens": found[model]["tokens"]}


def slope_fit(widths: list[int], gaps: list[float]) -> tuple[float, float]:
    """(slope per doubling, intercept at width 1) of gap ~ a + b log2(width)."""
    slope, intercept = np.polyfit(np.log2(widths), gaps, 1)
    return float(slope), float(intercept)


def analyse(points: dict[tuple[int, str], dict], train_tokens: float | None = None) -> dict:
    seeds = sorted({s for _, s in points})
    widths = sorted({w for w, _ in points})
    per_seed = {}
    for seed in seeds:
        ws = [w for w in widths if (w, seed) in points]
        if len(ws) < 2:
            raise ValueError(f"seed {seed}: gaps at {ws} only; a slope needs at least 2 widths")
        slope, intercept = slope_fit(ws, [points[(w, seed)]["gap"] for w in ws])
        per_seed[seed] = {"slope": slope, "intercept": intercept, "widths": ws}
    slopes = np.array([v["slope"] for v in per_seed.values()])
    n = slopes.size
    mean, std = float(slopes.mean()), float(slopes.std(ddof=1)) if n > 1 else None
    half = float(stats.t.ppf(0.975, n - 1) * std / math.sqrt(n)) if n > 1 else None
    test = stats.ttest_1samp(slopes, 0.0) if n > 1 and std > 0 else None
    slope = {"mean": mean, "std": std, "ci95": [mean - half, mean + half] if half is not None else None,
             "t": float(test.statistic) if test else None, "p": float(test.pvalue) if test else None, "n": n}
    intercept = float(np.mean([v["intercept"] for v in per_seed.values()]))
    by_width = {}
    for w in widths:
        gaps = [points[(w, s)]["gap"] for s in seeds if (w, s) in points]
        params = points[next((w, s) for s in seeds if (w, s) in points)]["model_parameters"]
        by_width[w] = {"gaps": gaps, "mean": float(np.mean(gaps)), "std": float(np.std(gaps, ddof=1)) if len(gaps) > 1
                       else None, "model_parameters": params,
                       "tokens_per_parameter": None if train_tokens is None else train_tokens / params}
    crossing = crossing_point(intercept, slope, by_width)
    return {"seeds": seeds, "widths": widths, "per_seed": per_seed, "slope": slope, "intercept": intercept,
            "by_width": by_width, "crossing": crossing, "reading": reading(slope, per_seed, by_width[widths[-1]]),
            "points": {f"{w}:{s}": v for (w, s), v in sorted(points.items())}}


def crossing_point(intercept: float, slope: dict, by_width: dict) -> dict:
    if slope["mean"] >= 0:
        return {"width": None, "model_parameters": None, "note": "nowhere: the mean slope is not negative"}
    width = 2.0 ** (-intercept / slope["mean"])
    widths = sorted(by_width)
    logp = np.log([by_width[w]["model_parameters"] for w in widths])
    # log(parameters) linear in log(width) through the measured points (its least-squares line).
    b, a = np.polyfit(np.log(widths), logp, 1)
    note = "extrapolated beyond the measured widths" if width > widths[-1] else "inside the measured widths"
    if slope["ci95"] is not None and slope["ci95"][1] >= 0:
        note += "; the slope's 95% interval holds 0, so the crossing has no upper bound"
    return {"width": width, "model_parameters": float(math.exp(a + b * math.log(width))), "note": note}


def reading(slope: dict, per_seed: dict, widest: dict) -> str:
    if widest["mean"] <= NARROW_GAP and all(v["slope"] < 0 for v in per_seed.values()):
        return "narrowing with width"
    if abs(slope["mean"]) <= FLAT_SLOPE:
        return "flat: scale gives no support in range"
    if slope["mean"] > FLAT_SLOPE and slope["ci95"] is not None and slope["ci95"][0] > 0:
        return "growing: evidence against the mechanism in range"
    return "undecided"


def markdown(result: dict, model: str, baseline: str) -> str:
    lines = [f"{model} - {baseline} (nats) by width; per seed, then the mean and std.", "",
             "| width | " + " | ".join(f"seed {s}" for s in result["seeds"]) + f" | mean ± std | {model} parameters | "
             "training tokens per parameter |", "|---|" + "---|" * (len(result["seeds"]) + 3)]
    for w in result["widths"]:
        row = result["by_width"][w]
        cells = [f"{result['points'][f'{w}:{s}']['gap']:+.4f}" if f"{w}:{s}" in result["points"] else "" for s in
                 result["seeds"]]
        tpp = "n/a" if row["tokens_per_parameter"] is None else f"{row['tokens_per_parameter']:.2f}"
        std = "" if row["std"] is None else f" ± {row['std']:.4f}"
        lines.append(f"| {w} | " + " | ".join(cells) + f" | {row['mean']:+.4f}{std} | {row['model_parameters']:,} | {tpp} |")
    s = result["slope"]
    per = ", ".join(f"{v['slope']:+.4f}" for v in result["per_seed"].values())
    ci = "n/a" if s["ci95"] is None else f"[{s['ci95'][0]:+.4f}, {s['ci95'][1]:+.4f}]"
    p = "n/a" if s["p"] is None else f"{s['p']:.3f}"
    c = result["crossing"]
    where = c["note"] if c["width"] is None else (f"width {c['width']:,.0f}, about {c['model_parameters'] / 1e6:,.1f}M "
                                                  f"{model} parameters ({c['note']})")
    lines += ["", f"Slope per doubling of width, per seed: {per}; mean {s['mean']:+.4f} ± {s['std'] or 0:.4f}, "
              f"95% t-interval {ci}, p = {p} (n = {s['n']}).", f"Reading: {result['reading']}.",
              f"Zero crossing of the mean line (extrapolation): {where}."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str, model: str, baseline: str) -> str:
    fig, axes = _figure((1000, 700), 100)
    ax = axes[0][0]
    xs = np.array(result["widths"], dtype=float)
    for seed, fit in result["per_seed"].items():
        ws = fit["widths"]
        (points,) = ax.plot(ws, [result["points"][f"{w}:{seed}"]["gap"] for w in ws], "o", label=f"seed {seed}")
        # the seed's own line in its points' colour, so each line reads with its points
        ax.plot(xs, fit["intercept"] + fit["slope"] * np.log2(xs), "-", alpha=0.4, color=points.get_color())
    ax.plot(xs, result["intercept"] + result["slope"]["mean"] * np.log2(xs), "k-", label="mean line")
    ax.axhline(0.0, color="grey", lw=1)
    ax.set_xscale("log", base=2)
    return _finish_single_axes(fig, ax, path, 100, "model width (log2)", f"{model} - {baseline} loss (nats)",
                               f"{model} - {baseline} against width")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m megatron_lev.evaluation.trend", description=__doc__.split("\n")[0])
    p.add_argument("--point", action="append", required=True, metavar="WIDTH:SEED=DIR[,DIR...]")
    p.add_argument("--model", required=True)
    p.add_argument("--baseline", required=True)
    p.add_argument("--train-tokens", type=float, help="tokens each run trained on (for tokens per parameter)")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    try:
        points = {}
        for spec, dirs in parse_named(args.point, "--point", allow_bare=False).items():
            width, sep, seed = spec.partition(":")
            if not sep or not width.isdigit() or int(width) < 1 or not seed:
                raise ValueError(f"--point {spec}={dirs}: want WIDTH:SEED=DIR with a positive integer width")
            points[(int(width), seed)] = read_point(spec, dirs, args.model, args.baseline)
        result = analyse(points, args.train_tokens)
    except (ValueError, KeyError) as exc:
        raise SystemExit(f"megatron_lev.evaluation.trend: error: {exc}") from None
    result.update(model=args.model, baseline=args.baseline)
    text = markdown(result, args.model, args.baseline)
    write_json_atomic(os.path.join(args.output_dir, "trend.json"), result)
    write_text_atomic(os.path.join(args.output_dir, "trend.md"), text)
    plot(result, os.path.join(args.output_dir, "trend.png"), args.model, args.baseline)
    print(text)
    return result


if __name__ == "__main__":
    main()
