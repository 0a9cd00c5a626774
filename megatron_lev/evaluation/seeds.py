"""Seeds and error bars: one comparison run with N seeds, summarised as mean +- std.

    python -m megatron_lev.evaluation.seeds \
        --seed-dir 1=eval/s1 --seed-dir 2=eval/s2 --seed-dir 3=eval/s3 \
        --pair lev:tied --pair lev-deeper:untied --output-dir eval/seeds

Each seed directory holds that seed's outputs, anywhere below it: an evaluation.json of
`megatron_lev.evaluate` scoring both models of every pair on the same tokens, and for
every pair a curves.json of `megatron_lev.evaluation.curves` whose baseline is the pair's
baseline. A pair MODEL:BASELINE is compared within each seed (both runs of a seed share
its data order and validation tokens), then over seeds:

  overall     perplexity change 100 * (ppl_model / ppl_baseline - 1) per cent, and the
              loss difference loss_model - loss_baseline (nats)
  buckets     the perplexity change in every bucket of every bucketing, for both
              stratifications (by the predicted token and by the input token)
  curves      MODEL's tokens to BASELINE's final validation loss, the speed-up
              (BASELINE's final tokens / those tokens) and the final-loss difference
  downstream  where a seed's downstream.json (megatron_lev.evaluation.downstream) scores both:
              every task / metric's score per model (mean +- std over seeds, and lm-eval's
              own standard error) and the difference MODEL - BASELINE with a paired t-test,
              Holm-adjusted over the pair's task / metric rows

Each is reported as the mean, the sample standard deviation (ddof = 1; none for a single
seed) and n, the number of seeds where it is defined: a bucket without evaluated tokens
or a target never reached leaves that seed out, and n says so. The overall loss difference
also gets a paired t-test over seeds (scipy's one-sample test of the per-seed differences
against 0: two-sided p), and the training curves a trend: per seed, the slope of the
validation-loss difference (MODEL - BASELINE, on the baseline's logged tokens) against
log(tokens), negative when MODEL's advantage grows with training, with the same test.

Output (`--output-dir`): seeds.json, seeds.md, changes_<stratum>_<bucketing>.png (bars
with +-std error bars, one per pair) and loss_<model>_vs_<baseline>.png (validation
curves of both, mean +- std band over seeds).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re

import numpy as np
from scipy import stats

from megatron_lev.evaluation.curves import read_curve
from megatron_lev.evaluation.report import parse_named, relative_change
from megatron_lev.utils.files import write_json_atomic, write_text_atomic

STRATUM_SECTIONS = {"predicted": "bucketings", "input": "input_bucketings"}  # evaluation.json frequency keys


def mean_std(values) -> dict:
    """Mean, sample std (ddof=1, None for fewer than 2 values) and n of the defined values."""
    defined = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not defined:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": float(np.mean(defined)), "std": float(np.std(defined, ddof=1)) if len(defined) > 1 else None,
            "n": len(defined)}


def _summary(per_seed: dict) -> dict:
    return {**mean_std(per_seed.values()), "per_seed": per_seed}


def paired_t_test(per_seed: dict) -> dict:
    """Two-sided t-test of the per-seed differences against 0 (a paired test of the two models
    over seeds): {"t", "p", "n"}; t and p are None for fewer than 2 seeds or identical ones."""
    values = [float(v) for v in per_seed.values() if v is not None and not math.isnan(v)]
    if len(values) < 2 or float(np.std(values)) == 0.0:
        return {"t": None, "p": None, "n": len(values)}
    result = stats.ttest_1samp(values, 0.0)
    return {"t": float(result.statistic), "p": float(result.pvalue), "n": len(values)}


def holm(p_values: dict) -> dict:
    """Holm's step-down adjustment of a family of p-values (None stays None): the k-th smallest
    of m is multiplied by m - k + 1, and each adjusted value is at least the one before it (capped
    at 1). A family-wise error of 5% holds for the hypotheses whose adjusted p is below 0.05."""
    defined = sorted(((p, name) for name, p in p_values.items() if p is not None), key=lambda item: item[0])
    adjusted, running = {name: None for name in p_values}, 0.0
    for k, (p, name) in enumerate(defined):
        running = max(running, min(1.0, (len(defined) - k) * p))
        adjusted[name] = running
    return adjusted


def difference_slope(model_path: str, baseline_path: str, metric: str = "valid_loss") -> float:
    """Slope of (MODEL - BASELINE) validation loss against ln(tokens), on the baseline's logged
    tokens (MODEL interpolated onto them), from the first logged point on."""
    model, base = read_curve(model_path, metric=metric), read_curve(baseline_path, metric=metric)
    keep = base.tokens > 0
    if keep.sum() < 2:
        raise ValueError(f"{baseline_path}: fewer than 2 logged {metric} points, no slope")
    difference = np.interp(base.tokens[keep], model.tokens, model.loss) - base.loss[keep]
    return float(np.polyfit(np.log(base.tokens[keep]), difference, 1)[0])


def parse_pair(spec: str) -> tuple[str, str]:
    model, sep, baseline = spec.partition(":")
    if not sep or not model or not baseline or model == baseline:
        raise ValueError(f"--pair {spec!r}: expected MODEL:BASELINE (two different model names)")
    return model, baseline


def _load_all(seed_dir: str, name: str) -> list[tuple[str, dict]]:
    found = []
    for path in sorted(glob.glob(os.path.join(seed_dir, "**", name), recursive=True)):
        with open(path, encoding="utf-8") as f:
            try:
                found.append((path, json.load(f)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not JSON ({exc.msg})") from exc
    return found


def seed_outputs(seed: str, seed_dir: str) -> dict:
    """The evaluation.json and curves.json files under one seed's directory."""
    if not os.path.isdir(seed_dir):
        raise FileNotFoundError(f"--seed-dir {seed}={seed_dir}: no such directory")
    return {"dir": seed_dir, "evaluations": _load_all(seed_dir, "evaluation.json"),
            "curves": _load_all(seed_dir, "curves.json"), "downstream": _load_all(seed_dir, "downstream.json")}


def _evaluation_for(outputs: dict, seed: str, model: str, baseline: str) -> dict:
    for _, report in outputs["evaluations"]:
        if model in report.get("models", {}) and baseline in report.get("models", {}):
            return report
    raise ValueError(f"--seed-dir {seed}={outputs['dir']}: no evaluation.json scores both {model!r} and "
                     f"{baseline!r} (megatron_lev.evaluate --model {model}=... --model {baseline}=...)")


def _curves_for(outputs: dict, seed: str, model: str, baseline: str) -> dict | None:
    for _, result in outputs["curves"]:
        if result.get("baseline") == baseline and model in result.get("runs", {}):
            return result
    return None


def pair_changes(model: str, baseline: str, seeds: dict[str, dict]) -> dict:
    """Per-seed changes of `model` vs `baseline` and their mean/std over seeds (module doc)."""
    overall_ppl, overall_loss = {}, {}
    buckets: dict[tuple[str, str], dict] = {}
    tokens, speedup, final_loss, curve_paths = {}, {}, {}, {}
    for seed, outputs in seeds.items():
        report = _evaluation_for(outputs, seed, model, baseline)
        m, b = report["models"][model], report["models"][baseline]
        overall_ppl[seed] = relative_change(m["ppl"], b["ppl"])
        overall_loss[seed] = m["loss"] - b["loss"]
        frequency = report.get("frequency") or {}
        for stratum, section in STRATUM_SECTIONS.items():
            for spec, data in (frequency.get(section) or {}).items():
                entry = buckets.setdefault((stratum, spec), {"labels": [r["label"] for r in data["buckets"]],
                                                             "buckets": data["buckets"], "per_seed": {}})
                if len(entry["labels"]) != len(data["buckets"]):
                    raise ValueError(f"--seed-dir {seed}: {stratum} {spec} has {len(data['buckets'])} buckets, "
                                     f"another seed {len(entry['labels'])} (count frequencies on the same data)")
                entry["per_seed"][seed] = [relative_change(rm["ppl"], rb["ppl"]) if rm["eval_tokens"] else None
                                           for rm, rb in zip(data["models"][model], data["models"][baseline])]
        result = _curves_for(outputs, seed, model, baseline)
        if result is not None:
            run, base = result["runs"][model], result["runs"][baseline]
            tokens[seed] = run["tokens_to_target"]
            speedup[seed] = run["speedup_vs_baseline"]
            final_loss[seed] = run["final_loss"] - base["final_loss"]
            if result.get("runs_paths"):
                curve_paths[seed] = {"metric": result.get("metric", "valid_loss"), **result["runs_paths"]}
    out = {"model": model, "baseline": baseline, "seeds": list(seeds), "ppl_change_pct": _summary(overall_ppl),
           "loss_difference": {**_summary(overall_loss), "paired_t_test": paired_t_test(overall_loss)},
           "buckets": {}}
    for (stratum, spec), entry in buckets.items():
        columns = list(zip(*entry["per_seed"].values()))
        out["buckets"].setdefault(stratum, {})[spec] = {
            "labels": entry["labels"],
            "num_types": [r["num_types"] for r in entry["buckets"]],
            "train_token_share": [r["train_token_share"] for r in entry["buckets"]],
            "ppl_change_pct": [_summary(dict(zip(entry["per_seed"], column))) for column in columns]}
    if tokens:
        out["curves"] = {"tokens_to_target": _summary(tokens), "speedup": _summary(speedup),
                         "final_loss_difference": _summary(final_loss), "metrics_files": curve_paths}
        slopes = {seed: difference_slope(p[model], p[baseline], p["metric"]) for seed, p in curve_paths.items()
                  if model in p and baseline in p}
        if slopes:
            out["curves"]["difference_slope"] = {**_summary(slopes), "paired_t_test": paired_t_test(slopes)}
    downstream = pair_downstream(model, baseline, seeds)
    if downstream is not None:
        out["downstream"] = downstream
    return out


def pair_downstream(model: str, baseline: str, seeds: dict[str, dict]) -> dict | None:
    """lm-eval's scores of `model` and `baseline` over the seeds whose downstream.json scores both
    (None when none does): per task and metric, each model's mean +- std over seeds and the mean
    of lm-eval's own standard errors (the spread of one seed's score over the task's examples),
    the per-seed difference MODEL - BASELINE with its mean +- std and paired t-test, and the t-tests'
    p-values Holm-adjusted over the pair's task/metric rows (the family a reader scans)."""
    per_row: dict[tuple[str, str], dict] = {}
    used = []
    for seed, outputs in seeds.items():
        report = next((r for _, r in outputs.get("downstream", ())
                       if model in r.get("models", {}) and baseline in r.get("models", {})), None)
        if report is None:
            continue
        used.append(seed)
        m_tasks, b_tasks = report["models"][model]["tasks"], report["models"][baseline]["tasks"]
        for task, metrics in b_tasks.items():
            for metric, value in metrics.items():
                other = m_tasks.get(task, {}).get(metric)
                if metric.endswith("_stderr") or metric == "num_examples" or other is None:
                    continue
                entry = per_row.setdefault((task, metric), {"model": {}, "baseline": {}, "stderr_model": {},
                                                            "stderr_baseline": {}, "examples": {}})
                entry["model"][seed], entry["baseline"][seed] = other, value
                entry["stderr_model"][seed] = m_tasks[task].get(f"{metric}_stderr")
                entry["stderr_baseline"][seed] = metrics.get(f"{metric}_stderr")
                entry["examples"][seed] = metrics.get("num_examples")
    if not used:
        return None
    rows = []
    for (task, metric), entry in per_row.items():
        difference = {s: entry["model"][s] - entry["baseline"][s] for s in entry["model"]}
        rows.append({"task": task, "metric": metric, "examples": entry["examples"],
                     model: _summary(entry["model"]), baseline: _summary(entry["baseline"]),
                     f"{model}_stderr": mean_std(entry["stderr_model"].values()),
                     f"{baseline}_stderr": mean_std(entry["stderr_baseline"].values()),
                     "difference": {**_summary(difference), "paired_t_test": paired_t_test(difference)}})
    adjusted = holm({i: r["difference"]["paired_t_test"]["p"] for i, r in enumerate(rows)})
    for i, r in enumerate(rows):
        r["difference"]["p_holm"] = adjusted[i]
    return {"seeds": used, "rows": rows}


def downstream_markdown(p: dict) -> list[str]:
    """pair_changes' downstream rows as a table (model names from the pair)."""
    d, model, baseline = p["downstream"], p["model"], p["baseline"]

    def score(stat, error):
        spread = "" if stat["std"] is None else f" ± {stat['std']:.4f}"
        stderr = "" if error["mean"] is None else f" (stderr {error['mean']:.4f})"
        return f"{stat['mean']:.4f}{spread}{stderr}"

    lines = [f"**Downstream tasks, {model} vs {baseline}** (lm-eval; mean ± std over seeds {', '.join(d['seeds'])}, "
             "lm-eval's standard error of one seed in brackets)", "",
             f"| task / metric | examples | {baseline} | {model} | {model} - {baseline}, per seed | "
             "paired t-test (Holm) |", "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        diff, test = r["difference"], r["difference"]["paired_t_test"]
        examples = sorted({v for v in r["examples"].values() if v is not None})
        p_cell = "n/a" if test["p"] is None else f"p = {test['p']:.3f} ({diff['p_holm']:.3f})"
        lines.append(f"| {r['task']} / {r['metric']} | {', '.join(map(str, examples)) or 'n/a'} | "
                     f"{score(r[baseline], r[f'{baseline}_stderr'])} | {score(r[model], r[f'{model}_stderr'])} | "
                     f"{_cell(diff, '', 4)}: {', '.join(f'{v:+.4f}' for v in diff['per_seed'].values())} | {p_cell} |")
    return lines + [""]


def mean_curves(paths_by_seed: dict[str, dict], names: list[str]) -> dict[str, tuple]:
    """Per run name: (tokens, mean, std) of its metric over seeds, on the first seed's logged
    tokens (other seeds interpolated onto them; exact when they log at the same steps)."""
    bands = {}
    for name in names:
        curves = [read_curve(p[name], name, p["metric"]) for p in paths_by_seed.values() if name in p]
        if not curves:
            continue
        grid = curves[0].tokens
        stacked = np.stack([np.interp(grid, c.tokens, c.loss) for c in curves])
        std = stacked.std(axis=0, ddof=1) if len(curves) > 1 else np.zeros_like(grid)
        bands[name] = (grid.tolist(), stacked.mean(axis=0).tolist(), std.tolist())
    return bands


def _cell(stat: dict, unit: str = "%", digits: int = 1, signed: bool = True) -> str:
    if stat["mean"] is None:
        return "n/a"
    std = "" if stat["std"] is None else f" ± {stat['std']:.{digits}f}"
    return f"{stat['mean']:{'+' if signed else ''}.{digits}f}{std}{unit} (n={stat['n']})"


def _p_value(stat: dict) -> str:
    test = stat["paired_t_test"]
    return "n/a" if test["p"] is None else f"t = {test['t']:+.2f}, p = {test['p']:.3f} (n={test['n']})"


def run_seed_and_final_loss(run_dir: str) -> tuple[int, float]:
    """(seed, the trainer's last logged validation loss) of one training run (--save folder)."""
    import yaml

    config_file = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{config_file}: no such file (is {run_dir} a training run's --save folder?)")
    with open(config_file, encoding="utf-8") as f:
        seed = int(yaml.safe_load(f)["training"]["seed"])
    return seed, float(read_curve(run_dir).loss[-1])


def final_loss_by_seed(pairs: list[tuple[str, str]], model: str, baseline: str) -> dict:
    """MODEL vs BASELINE from (model run, baseline run) pairs, one pair per seed: each run's
    final validation loss (the trainer's, on that seed's validation batches), the per-seed
    difference MODEL - BASELINE and perplexity change, their mean +- std over seeds and a
    paired t-test of the differences."""
    per_seed = {}
    for model_run, baseline_run in pairs:
        (seed, loss), (baseline_seed, baseline_loss) = run_seed_and_final_loss(model_run), \
            run_seed_and_final_loss(baseline_run)
        if seed != baseline_seed:
            raise ValueError(f"{model_run} (seed {seed}) and {baseline_run} (seed {baseline_seed}) are not a pair")
        if str(seed) in per_seed:
            raise ValueError(f"{model_run}: seed {seed} appears twice")
        per_seed[str(seed)] = {model: loss, baseline: baseline_loss, "difference": loss - baseline_loss,
                               "ppl_change_pct": 100 * math.expm1(loss - baseline_loss)}
    columns = {key: {s: r[key] for s, r in per_seed.items()} for key in (model, baseline, "difference",
                                                                         "ppl_change_pct")}
    return {"model": model, "baseline": baseline, "per_seed": per_seed,
            **{key: mean_std(values.values()) for key, values in columns.items()},
            "paired_t_test": paired_t_test(columns["difference"])}


def final_loss_markdown(result: dict) -> str:
    """final_loss_by_seed's table: one row per seed, then mean +- std, then the t-test."""
    model, baseline = result["model"], result["baseline"]

    def cell(stat, digits=4, sign=""):
        std = "" if stat["std"] is None else f" ± {stat['std']:.{digits}f}"
        return f"{stat['mean']:{sign}.{digits}f}{std}"

    lines = [f"| seed | {model} | {baseline} | {model} - {baseline} (nats) | perplexity change |",
             "|---|---|---|---|---|"]
    lines += [f"| {s} | {r[model]:.4f} | {r[baseline]:.4f} | {r['difference']:+.4f} | {r['ppl_change_pct']:+.1f}% |"
              for s, r in result["per_seed"].items()]
    lines.append(f"| mean ± std | {cell(result[model])} | {cell(result[baseline])} | "
                 f"{cell(result['difference'], 4, '+')} | {cell(result['ppl_change_pct'], 1, '+')}% |")
    test = result["paired_t_test"]
    if test["p"] is not None:
        lines += ["", f"Paired t-test of {model} - {baseline} over seeds: t = {test['t']:+.2f}, p = {test['p']:.3f} "
                      f"(n = {test['n']})."]
    return "\n".join(lines) + "\n"


def summary_markdown(pairs: list[dict]) -> str:
    lines = []
    for p in pairs:
        name = f"{p['model']} vs {p['baseline']}"
        lines += [f"**{name}**: mean ± std over seeds {', '.join(p['seeds'])} (per seed in brackets)", "",
                  "| measure | mean ± std | per seed | paired t-test over seeds |", "|---|---|---|---|"]

        def row(label, stat, unit="%", digits=1, fmt="{:+.2f}"):
            per_seed = ", ".join("n/a" if v is None else fmt.format(v) for v in stat["per_seed"].values())
            test = _p_value(stat) if "paired_t_test" in stat else ""
            lines.append(f"| {label} | {_cell(stat, unit, digits, signed=fmt.startswith('{:+'))} | {per_seed} | {test} |")

        row("validation perplexity change", p["ppl_change_pct"])
        row("validation loss difference (nats)", p["loss_difference"], "", 4, "{:+.4f}")
        if "curves" in p:
            c = p["curves"]
            if "difference_slope" in c:
                row("slope of the loss difference vs ln(tokens) (nats per e-fold)", c["difference_slope"], "", 4,
                    "{:+.4f}")
            row(f"tokens to {p['baseline']}'s final validation loss", c["tokens_to_target"], "", 0, "{:.4g}")
            row(f"speed-up ({p['baseline']} tokens / {p['model']} tokens)", c["speedup"], "x", 2, "{:.2f}x")
            row("final validation loss difference (training curve, nats)", c["final_loss_difference"], "", 4,
                "{:+.4f}")
        lines.append("")
        if "downstream" in p:
            lines += downstream_markdown(p)
    specs = [(stratum, spec) for stratum in STRATUM_SECTIONS for spec in (pairs[0]["buckets"].get(stratum) or {})]
    for stratum, spec in specs:
        first = pairs[0]["buckets"][stratum][spec]
        names = [f"{p['model']} vs {p['baseline']}" for p in pairs]
        lines += [f"**Perplexity change by training-frequency bucket of the {stratum} token ({spec})**, "
                  "per cent, mean ± std over seeds", "",
                  "| bucket | types | train share | " + " | ".join(names) + " |",
                  "|---|---|---|" + "---|" * len(names)]
        for i, label in enumerate(first["labels"]):
            cells = [_cell(p["buckets"][stratum][spec]["ppl_change_pct"][i]) for p in pairs]
            lines.append(f"| {label} | {first['num_types'][i]:,} | {first['train_token_share'][i]:.3f} | "
                         + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def summarise(seed_dirs: dict[str, str], pairs: list[tuple[str, str]], output_dir: str,
              plot_size: tuple[int, int] = (1200, 800)) -> dict:
    from megatron_lev.evaluation.plots import plot_changes_with_error_bars, plot_loss_bands

    seeds = {seed: seed_outputs(seed, path) for seed, path in seed_dirs.items()}
    results = [pair_changes(model, baseline, seeds) for model, baseline in pairs]
    os.makedirs(output_dir, exist_ok=True)
    plots = {}
    for stratum in STRATUM_SECTIONS:
        for spec in results[0]["buckets"].get(stratum) or {}:
            slug = re.sub(r"[^A-Za-z0-9]+", "_", f"{stratum}_{spec}").strip("_")
            series = {}
            for r in results:
                stats = (r["buckets"].get(stratum) or {}).get(spec)
                if stats is not None:
                    series[f"{r['model']} vs {r['baseline']}"] = ([s["mean"] for s in stats["ppl_change_pct"]],
                                                                  [s["std"] for s in stats["ppl_change_pct"]])
            labels = results[0]["buckets"][stratum][spec]["labels"]
            plots[f"{stratum} {spec}"] = plot_changes_with_error_bars(
                labels, series, os.path.join(output_dir, f"changes_{slug}.png"),
                title=f"Perplexity change by frequency of the {stratum} token ({spec}), mean ± std over "
                      f"{len(seeds)} seeds", xlabel=f"frequency bucket of the {stratum} token (rarest first)",
                size_px=plot_size)
    for r in results:
        if r.get("curves", {}).get("metrics_files"):
            bands = mean_curves(r["curves"]["metrics_files"], [r["baseline"], r["model"]])
            slug = re.sub(r"[^A-Za-z0-9]+", "_", f"{r['model']}_vs_{r['baseline']}")
            plots[f"loss {r['model']} vs {r['baseline']}"] = plot_loss_bands(
                bands, os.path.join(output_dir, f"loss_{slug}.png"),
                title=f"Validation loss vs training tokens, mean ± std over {len(seeds)} seeds", size_px=plot_size)
    summary = {"seeds": {s: o["dir"] for s, o in seeds.items()}, "pairs": results, "plots": plots}
    markdown = summary_markdown(results)
    write_json_atomic(os.path.join(output_dir, "seeds.json"), summary)
    write_text_atomic(os.path.join(output_dir, "seeds.md"), markdown)
    return summary


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m megatron_lev.evaluation.seeds",
                                     description="Mean +- std over seeds of perplexity changes (overall and per "
                                                 "frequency bucket) and tokens-to-target.")
    parser.add_argument("--seed-dir", action="append", required=True, metavar="SEED=DIR",
                        help="one seed's evaluation.json, curves.json and downstream.json files (anywhere below DIR); repeat")
    parser.add_argument("--pair", action="append", required=True, metavar="MODEL:BASELINE",
                        help="a comparison, e.g. lev:tied; repeat")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--plot-width", type=int, default=1200)
    parser.add_argument("--plot-height", type=int, default=800)
    args = parser.parse_args(argv)
    try:
        seed_dirs = parse_named(args.seed_dir, "--seed-dir", allow_bare=False)
        summary = summarise(seed_dirs, [parse_pair(p) for p in args.pair], args.output_dir,
                            (args.plot_width, args.plot_height))
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"megatron_lev.evaluation.seeds: error: {exc}") from exc
    print(summary_markdown(summary["pairs"]))
    return summary


if __name__ == "__main__":
    main()
