"""v1's effective parameters: the size of dense model a LEV model is worth (issue 32).

    python -m megatron_lev.evaluation.scaling --runs RUNS.csv --dense untied --output DIR
    python -m megatron_lev.evaluation.scaling --evaluation eval/*/evaluation.json \
        --runs RUNS.csv --dense untied --output DIR         # writes RUNS.csv first, then fits

RUNS.csv has the columns `kind,params,seed,loss` (params: the total parameter count) and
optionally `nonembedding_params` (the second count: without the input side, the LEV generator
or the table, and without the output head). `--evaluation` builds it from
`megatron_lev.evaluate` outputs (every model of every file is a row: its kind from its name,
`--kind PATTERN=KIND` or the name without its `-wWIDTH`, `-lrLR` and `-sSEED` parts; its seed,
counts and loss from the evaluation), so no one types it by hand.

The fit (the v1 paper's measure). Over the dense kind's sizes N_i, with mean loss L_i over
seeds and standard error s_i:

    L(N) = E + A * N^-alpha        weighted least squares, weights 1 / s_i^2,
                                   A > 0, alpha > 0, 0 <= E < min L_i

s_i is sqrt(pooled seed variance / n_i) by default (`--weights pooled`: two seeds estimate a
size's own variance poorly, so the sizes share one), or each size's own (`per-size`), or 1
(`none`). Every other kind gets, from its mean loss L over its seeds,

    N_eff = (A / (L - E))^(1/alpha)     multiplier = N_eff / N

(infinite when L <= E). The 95% interval is a parametric bootstrap (`--bootstrap`, at least
2,000 draws): each draw takes every dense size's mean loss from N(L_i, s_i) and the model's
from N(L, s) (its own seeds' standard error, the pooled dense variance when it has one seed),
refits, and recomputes the multiplier; the interval is the draws' 2.5 and 97.5 percentiles.
Without seed spread to draw from (one seed per dense size under `--weights none`, or for the
model) there is no interval: `ci95` is null and `ci95_missing` says why.
Sensitivity: the fit with E = 0 (a pure power law), log-linear interpolation of log N between
the two dense sizes whose losses bracket L (none when no pair does), and the fit leaving out
each dense size in turn (its range). A loss outside the dense sizes' range [min L_i, max L_i]
is flagged `extrapolated`: the multiplier then rests on the fitted form alone. Fewer than 4
dense sizes are refused (3 parameters need a spare point).

Output (`--output`): scaling.json {"fit": {"E", "A", "alpha", ...}, "models": {KIND: {"params",
"loss_mean", "n_eff", "multiplier", "ci95", "extrapolated", ...}}} (and the same under
"nonembedding" when RUNS.csv has that column), scaling.md, scaling.png (loss against parameters,
log axis: the dense sizes with +-std bars, the fit, each model at N and at N_eff).
"""
from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np
from scipy import optimize

from megatron_lev.utils.files import atomic_path, write_json_atomic, write_text_atomic

COLUMNS = ("kind", "params", "seed", "loss")
OPTIONAL_COLUMNS = ("nonembedding_params",)
MIN_DENSE_SIZES = 4
MIN_BOOTSTRAP = 2000
PAPER_MULTIPLIERS = (1.47, 2.11)  # v1: Leviathan behaves like a dense model with 1.47-2.11x the parameters
_NAME_PARTS = re.compile(r"^(?P<kind>.+?)(-w\d+)?(-lr[0-9.]+(e[+-]?\d+)?)?(-s\d+)?$")


# --------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Run:
    kind: str
    params: int
    seed: int
    loss: float
    nonembedding_params: int | None = None


def read_runs(path: str) -> list[Run]:
    """RUNS.csv -> runs; one line naming the file, line and column for anything wrong."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--runs {path}: no such file")
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing} (want {','.join(COLUMNS)}[,nonembedding_params])")
        runs, seen = [], set()
        for line, row in enumerate(reader, start=2):
            try:
                nonemb = row.get("nonembedding_params")
                run = Run(row["kind"].strip(), int(row["params"]), int(row["seed"]), float(row["loss"]),
                          int(nonemb) if nonemb not in (None, "") else None)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path} line {line}: {exc} ({dict(row)})") from None
            if not run.kind or run.params <= 0 or not math.isfinite(run.loss) or run.loss <= 0:
                raise ValueError(f"{path} line {line}: want a kind, params > 0 and a finite loss > 0, got {dict(row)}")
            key = (run.kind, run.params, run.seed)
            if key in seen:
                raise ValueError(f"{path} line {line}: kind {run.kind!r}, params {run.params}, seed {run.seed} "
                                 "appears twice")
            seen.add(key)
            runs.append(run)
    if not runs:
        raise ValueError(f"{path}: no runs")
    return runs


def write_runs(path: str, runs: list[Run]) -> None:
    with_nonemb = any(r.nonembedding_params is not None for r in runs)
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS + (OPTIONAL_COLUMNS if with_nonemb else ()))
            for r in sorted(runs, key=lambda r: (r.kind, r.params, r.seed)):
                row = [r.kind, r.params, r.seed, repr(r.loss)]
                writer.writerow(row + ([r.nonembedding_params] if with_nonemb else []))


def kind_of(name: str, patterns: list[tuple[str, str]]) -> str:
    """A model name's kind: the first --kind PATTERN=KIND whose glob matches, else the name
    without its -wWIDTH, -lrLR and -sSEED parts (untied-w64-lr4e-3-s2 -> untied)."""
    for pattern, kind in patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return kind
    return _NAME_PARTS.match(name).group("kind")


def runs_from_evaluations(paths: list[str], patterns: list[tuple[str, str]]) -> list[Run]:
    """One run per model of each `megatron_lev.evaluate` evaluation.json (its loss over the
    evaluated tokens; seed and counts as the evaluation recorded them from the checkpoint).
    The same checkpoint scored twice must give the same loss; all files must score the same
    number of tokens."""
    runs, by_checkpoint, tokens = {}, {}, {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        for name, model in report.get("models", {}).items():
            where = f"{path}: model {name!r}"
            if model.get("kind") != "checkpoint" or "seed" not in model or "parameter_counts" not in model:
                raise ValueError(f"{where}: not a checkpoint evaluated with its seed and parameter counts "
                                 "(re-run megatron_lev.evaluate on the run folder)")
            tokens[path] = model["tokens"]
            counts = model["parameter_counts"]
            run = Run(kind_of(name, patterns), int(counts["total"]), int(model["seed"]), float(model["loss"]),
                      int(counts["nonembedding"]))
            checkpoint = model.get("checkpoint", model["path"])
            if checkpoint in by_checkpoint and abs(by_checkpoint[checkpoint].loss - run.loss) > 1e-9:
                raise ValueError(f"{where}: {checkpoint} scored {run.loss} here and {by_checkpoint[checkpoint].loss} "
                                 "elsewhere (not the same tokens?)")
            by_checkpoint[checkpoint] = run
            key = (run.kind, run.params, run.seed)
            if key in runs and runs[key] != run:
                raise ValueError(f"{where}: a second run of kind {run.kind!r}, params {run.params}, seed {run.seed} "
                                 "(give it another kind with --kind PATTERN=KIND)")
            runs[key] = run
    if len(set(tokens.values())) > 1:
        raise ValueError(f"the evaluations scored different numbers of tokens: {tokens}")
    return list(runs.values())


# --------------------------------------------------------------------------- fit


@dataclass(frozen=True)
class SizeStats:
    params: np.ndarray  # [S] sizes, ascending
    loss: np.ndarray  # [S] mean loss over seeds
    std: np.ndarray  # [S] sample std (nan for one seed)
    n: np.ndarray  # [S] seeds
    sigma: np.ndarray  # [S] the fit's weights are 1 / sigma^2
    se: np.ndarray  # [S] standard error of the mean: the bootstrap's noise


def pooled_variance(groups: list[np.ndarray]) -> float | None:
    """Sum (n_i - 1) s_i^2 / sum (n_i - 1) over groups of losses; None without any repeat."""
    dof = sum(len(g) - 1 for g in groups)
    if dof == 0:
        return None
    return float(sum(((g - g.mean()) ** 2).sum() for g in groups) / dof)


def size_stats(losses_by_size: dict[int, list[float]], weights: str) -> tuple[SizeStats, float | None]:
    sizes = sorted(losses_by_size)
    groups = [np.asarray(losses_by_size[s], dtype=np.float64) for s in sizes]
    pooled = pooled_variance(groups)
    n = np.array([len(g) for g in groups])
    std = np.array([g.std(ddof=1) if len(g) > 1 else np.nan for g in groups])
    se = np.sqrt((pooled or 0.0) / n)
    if weights == "none":
        sigma = np.ones(len(sizes))
    elif pooled is None or pooled == 0:
        raise ValueError(f"--weights {weights}: the dense kind needs a size with 2 or more seeds that differ "
                         "(or --weights none)")
    elif weights == "pooled":
        sigma = np.sqrt(pooled / n)
    else:
        if (n < 2).any() or (std == 0).any():
            raise ValueError("--weights per-size: every dense size needs 2 or more seeds that differ")
        sigma = se = std / np.sqrt(n)
    return SizeStats(np.array(sizes, dtype=np.float64), np.array([g.mean() for g in groups]), std, n, sigma,
                     se), pooled


@dataclass(frozen=True)
class PowerLaw:
    E: float
    A: float
    alpha: float

    def loss(self, n) -> np.ndarray:
        return self.E + self.A * np.asarray(n, dtype=np.float64) ** -self.alpha

    def n_eff(self, loss: float) -> float:
        """The dense size with this loss; infinite at or below the irreducible loss E."""
        gap = loss - self.E
        if gap <= 0:
            return math.inf
        log_n = (math.log(self.A) - math.log(gap)) / self.alpha
        return math.exp(log_n) if log_n < 700 else math.inf


def fit_power_law(params: np.ndarray, loss: np.ndarray, sigma: np.ndarray, fix_e: float | None = None,
                  start: PowerLaw | None = None) -> PowerLaw:
    """Weighted least squares of L = E + A N^-alpha with A > 0, alpha > 0, 0 <= E < min L (or E fixed).
    Sizes are scaled by their geometric mean inside, so A and alpha stay well conditioned."""
    scale = math.exp(float(np.mean(np.log(params))))
    x = params / scale
    e_max = float(loss.min()) * (1 - 1e-9)
    if e_max <= 0:
        raise ValueError(f"the dense losses must be positive to fit L = E + A N^-alpha, got {loss.tolist()}")

    def residuals(theta):
        e = fix_e if fix_e is not None else theta[2]
        return (e + np.exp(theta[0]) * x ** -theta[1] - loss) / sigma

    if start is not None:  # a warm start (the bootstrap's and leave-one-out's refits near the fit)
        starts = [(math.log(start.A * scale ** -start.alpha), start.alpha, start.E if fix_e is None else fix_e)]
    else:  # a log-log line through L - E for each trial E; the best of the local fits wins
        starts = []
        for e0 in [fix_e] if fix_e is not None else [f * e_max for f in (0.0, 0.5, 0.8, 0.9, 0.95, 0.99)]:
            slope, intercept = np.polyfit(np.log(x), np.log(loss - e0), 1)
            starts.append((intercept, min(max(-slope, 1e-3), 5.0), e0))
    best = None
    for log_a, alpha, e0 in starts:
        theta0 = [log_a, alpha] + ([] if fix_e is not None else [min(max(e0, 0.0), e_max * (1 - 1e-9))])
        lower = [-np.inf, 1e-6] + ([] if fix_e is not None else [0.0])
        upper = [np.inf, 20.0] + ([] if fix_e is not None else [e_max])
        theta0[1] = min(max(theta0[1], 1e-5), 19.0)
        result = optimize.least_squares(residuals, theta0, bounds=(lower, upper), method="trf", x_scale="jac")
        if best is None or result.cost < best.cost:
            best = result
    log_a, alpha = best.x[0], best.x[1]
    e = fix_e if fix_e is not None else float(best.x[2])
    return PowerLaw(E=float(e), A=float(math.exp(log_a) * scale ** alpha), alpha=float(alpha))


def interpolated_n_eff(stats: SizeStats, loss: float) -> float | None:
    """log N interpolated linearly in the loss between the first pair of adjacent dense sizes
    whose mean losses bracket `loss`; None when no pair does."""
    for i in range(len(stats.params) - 1):
        l0, l1 = stats.loss[i], stats.loss[i + 1]
        if min(l0, l1) <= loss <= max(l0, l1) and l0 != l1:
            t = (loss - l0) / (l1 - l0)
            return float(math.exp(math.log(stats.params[i]) + t * (math.log(stats.params[i + 1])
                                                                    - math.log(stats.params[i]))))
    return None


def _ratio(n_eff: float | None, n: float) -> float | None:
    return None if n_eff is None else n_eff / n


def analyse(runs: list[Run], dense: str, count: str = "params", weights: str = "pooled",
            bootstrap: int = 4000, seed: int = 0) -> dict:
    """The fit over the dense kind and every other kind's effective parameters (module docstring)."""
    if weights not in ("pooled", "per-size", "none"):
        raise ValueError(f"--weights {weights!r}: one of pooled, per-size, none")
    if count == "nonembedding_params" and any(r.nonembedding_params is None for r in runs):
        raise ValueError("nonembedding_params is missing for some runs")
    size = (lambda r: r.params) if count == "params" else (lambda r: r.nonembedding_params)
    dense_runs = [r for r in runs if r.kind == dense]
    if not dense_runs:
        raise ValueError(f"--dense {dense!r}: no runs of that kind (kinds: {sorted({r.kind for r in runs})})")
    by_size: dict[int, list[float]] = {}
    for r in dense_runs:
        by_size.setdefault(size(r), []).append(r.loss)
    if len(by_size) < MIN_DENSE_SIZES:
        raise ValueError(f"--dense {dense}: {len(by_size)} sizes, the fit needs at least {MIN_DENSE_SIZES}")
    stats, pooled = size_stats(by_size, weights)
    law = fit_power_law(stats.params, stats.loss, stats.sigma)
    e_zero = fit_power_law(stats.params, stats.loss, stats.sigma, fix_e=0.0)
    leave_one_out = {}
    for i in range(len(stats.params)):
        keep = np.arange(len(stats.params)) != i
        leave_one_out[int(stats.params[i])] = fit_power_law(stats.params[keep], stats.loss[keep], stats.sigma[keep],
                                                            start=law)
    chi2 = float((((law.loss(stats.params) - stats.loss) / stats.sigma) ** 2).sum())
    fit = {"E": law.E, "A": law.A, "alpha": law.alpha, "dense": dense, "count": count, "weights": weights,
           "chi2": chi2, "dof": len(stats.params) - 3, "pooled_seed_std": None if pooled is None else math.sqrt(pooled),
           "E_zero_fit": {"A": e_zero.A, "alpha": e_zero.alpha},
           "sizes": [{"params": int(p), "loss_mean": float(m), "loss_std": None if math.isnan(s) else float(s),
                      "seeds": int(k), "sigma": float(g), "fitted": float(law.loss(p))}
                     for p, m, s, k, g in zip(stats.params, stats.loss, stats.std, stats.n, stats.sigma)]}

    rng = np.random.default_rng(seed)
    dense_noise = bool((stats.se > 0).any())
    draws = []  # the dense refits of the bootstrap, shared by every model
    for _ in range(bootstrap if dense_noise else 0):
        noisy = stats.loss + rng.standard_normal(len(stats.loss)) * stats.se
        draws.append(fit_power_law(stats.params, noisy, stats.sigma, start=law))

    models = {}
    for kind in sorted({r.kind for r in runs} - {dense}):
        mine = [r for r in runs if r.kind == kind]
        sizes = {size(r) for r in mine}
        if len(sizes) > 1:
            raise ValueError(f"kind {kind!r} has runs of {len(sizes)} sizes ({sorted(sizes)}); give each its own kind")
        n = float(sizes.pop())
        losses = np.array([r.loss for r in mine])
        mean = float(losses.mean())
        own_var = float(losses.var(ddof=1)) if len(losses) > 1 else None
        se = math.sqrt((own_var if own_var else (pooled or 0.0)) / len(losses))
        n_eff = law.n_eff(mean)
        # The bootstrap draws the seed noise of the dense means and of this model's mean: with one
        # seed everywhere (--weights none) there is none, and its "interval" would be one point.
        missing = [what for what, noise in (("the dense sizes", dense_noise), (kind, se > 0)) if not noise]
        boot = np.array([d.n_eff(mean + se * rng.standard_normal()) / n for d in draws] if not missing else [])
        lo, hi = (np.quantile(boot, [0.025, 0.975], method="inverted_cdf") if len(boot) else (math.nan, math.nan))
        loo = [f.n_eff(mean) / n for f in leave_one_out.values()]
        models[kind] = {
            "params": int(n), "seeds": len(losses), "loss_mean": mean,
            "loss_std": math.sqrt(own_var) if own_var is not None else None, "loss_se": se,
            "n_eff": n_eff, "multiplier": n_eff / n, "ci95": None if missing else [float(lo), float(hi)],
            "ci95_missing": (f"no seed spread for {' or '.join(missing)} (one seed each): no interval"
                             if missing else None),
            "bootstrap_draws": int(len(boot)), "bootstrap_infinite": int(np.isinf(boot).sum()),
            "extrapolated": not (stats.loss.min() <= mean <= stats.loss.max()),
            "sensitivity": {
                "E_zero": e_zero.n_eff(mean) / n,
                "interpolated": _ratio(interpolated_n_eff(stats, mean), n),
                "leave_one_out": {str(p): v for p, v in zip(leave_one_out, loo)},
                "leave_one_out_range": [min(loo), max(loo)]},
            "per_seed": {str(r.seed): r.loss for r in mine}}
    return {"fit": fit, "models": models, "law": law}


# --------------------------------------------------------------------------- report


def _num(value, digits=3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}"


def _params(value) -> str:
    if value is None or math.isinf(value):
        return "inf"
    return f"{value / 1e6:.3f}M"


def scaling_markdown(result: dict, title: str) -> str:
    fit = result["fit"]
    lines = [f"## {title}", "",
             f"Fit over `{fit['dense']}` ({len(fit['sizes'])} sizes, {fit['count']}, weights {fit['weights']}): "
             f"L(N) = {fit['E']:.4f} + {fit['A']:.4g} * N^-{fit['alpha']:.4f} "
             f"(chi2 = {fit['chi2']:.2f} on {fit['dof']} degrees of freedom; with E = 0: "
             f"A = {fit['E_zero_fit']['A']:.4g}, alpha = {fit['E_zero_fit']['alpha']:.4f})", "",
             "| size | seeds | loss (mean ± std) | fitted | residual / sigma |", "|---|---|---|---|---|"]
    for s in fit["sizes"]:
        std = "" if s["loss_std"] is None else f" ± {s['loss_std']:.4f}"
        lines.append(f"| {_params(s['params'])} | {s['seeds']} | {s['loss_mean']:.4f}{std} | {s['fitted']:.4f} | "
                     f"{(s['loss_mean'] - s['fitted']) / s['sigma']:+.2f} |")
    lo, hi = PAPER_MULTIPLIERS
    lines += ["", f"| kind | params | seeds | loss (mean ± std) | N_eff | multiplier | 95% interval | E = 0 | "
                  f"interpolated | leave one size out | extrapolated |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for kind, m in result["models"].items():
        std = "" if m["loss_std"] is None else f" ± {m['loss_std']:.4f}"
        s = m["sensitivity"]
        lines.append(f"| {kind} | {_params(m['params'])} | {m['seeds']} | {m['loss_mean']:.4f}{std} | "
                     f"{_params(m['n_eff'])} | {_num(m['multiplier'])}x | {_interval(m['ci95'])} | "
                     f"{_num(s['E_zero'])}x | {_num(s['interpolated'])}{'x' if s['interpolated'] else ''} | "
                     f"{_num(s['leave_one_out_range'][0])}-{_num(s['leave_one_out_range'][1])}x | "
                     f"{'yes' if m['extrapolated'] else 'no'} |")
    lines += [f"\n{kind}: {m['ci95_missing']}." for kind, m in result["models"].items() if m["ci95_missing"]]
    lines += ["", f"The v1 paper reports {lo}-{hi}x for Leviathan at 60M-725M parameters. The interval is a "
                  f"parametric bootstrap of {next(iter(result['models'].values()))['bootstrap_draws'] if result['models'] else 0} "
                  "draws (the dense means and the model's own mean drawn from their standard errors, refitted)."]
    return "\n".join(lines) + "\n"


def _interval(ci95) -> str:
    return "none (1 seed)" if ci95 is None else f"[{_num(ci95[0])}, {_num(ci95[1])}]"


def plot_scaling(result: dict, path: str, title: str, xlabel: str) -> str:
    from megatron_lev.evaluation.plots import DEFAULT_DPI, DEFAULT_SIZE_PX, _figure, _finish_single_axes

    fit, law = result["fit"], result["law"]
    fig, axes = _figure(DEFAULT_SIZE_PX, DEFAULT_DPI)
    ax = axes[0][0]
    sizes = np.array([s["params"] for s in fit["sizes"]], dtype=np.float64)
    means = np.array([s["loss_mean"] for s in fit["sizes"]])
    stds = np.array([0.0 if s["loss_std"] is None else s["loss_std"] for s in fit["sizes"]])
    points = list(sizes) + [m["params"] for m in result["models"].values()] + \
        [m["n_eff"] for m in result["models"].values() if math.isfinite(m["n_eff"])]
    grid = np.geomspace(min(points) / 1.2, max(points) * 1.2, 200)
    ax.plot(grid, law.loss(grid), color="0.3", label=f"fit: {fit['E']:.3f} + {fit['A']:.3g} N^-{fit['alpha']:.3f}")
    ax.errorbar(sizes, means, yerr=stds, fmt="o", color="black", capsize=3, label=f"{fit['dense']} (mean ± std)")
    for i, (kind, m) in enumerate(result["models"].items()):
        color = f"C{i}"
        ax.errorbar([m["params"]], [m["loss_mean"]], yerr=[m["loss_std"] or 0.0], fmt="s", color=color, capsize=3,
                    label=f"{kind} at its N ({_params(m['params'])})")
        if math.isfinite(m["n_eff"]):
            ax.plot([m["n_eff"]], [m["loss_mean"]], marker="s", mfc="none", color=color, linestyle="none",
                    label=f"{kind} at N_eff ({_params(m['n_eff'])}, {m['multiplier']:.2f}x)")
            ax.annotate("", xy=(m["n_eff"], m["loss_mean"]), xytext=(m["params"], m["loss_mean"]),
                        arrowprops={"arrowstyle": "->", "color": color})
    ax.set_xscale("log")
    return _finish_single_axes(fig, ax, path, DEFAULT_DPI, xlabel, "validation loss", title)


def _json_ready(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items() if k != "law"}
    if isinstance(value, list):
        return [_json_ready(v) for v in value]
    return value


# --------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_lev.evaluation.scaling",
                                description="v1's effective parameters: fit L(N) = E + A N^-alpha over a dense "
                                            "kind's sizes and give every other kind N_eff and N_eff / N.")
    p.add_argument("--runs", required=True, help="RUNS.csv (kind,params,seed,loss[,nonembedding_params]); "
                                                 "written first when --evaluation is given")
    p.add_argument("--evaluation", nargs="+", metavar="EVALUATION_JSON",
                   help="megatron_lev.evaluate outputs to build RUNS.csv from")
    p.add_argument("--kind", action="append", default=[], metavar="PATTERN=KIND",
                   help="model names matching the glob PATTERN are of KIND (default: the name without -wW, "
                        "-lrLR, -sS)")
    p.add_argument("--dense", required=True, help="the kind the fit is made over (e.g. untied)")
    p.add_argument("--output", required=True, help="folder for scaling.json, scaling.md, scaling.png")
    p.add_argument("--weights", default="pooled", choices=("pooled", "per-size", "none"))
    p.add_argument("--bootstrap", type=int, default=4000, help=f"parametric bootstrap draws (>= {MIN_BOOTSTRAP})")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's random seed")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"megatron_lev.evaluation.scaling: error: {exc}") from None


def run(args) -> dict:
    if args.bootstrap < MIN_BOOTSTRAP:
        raise ValueError(f"--bootstrap {args.bootstrap}: at least {MIN_BOOTSTRAP} draws")
    patterns = []
    for spec in args.kind:
        if "=" not in spec or not spec.split("=", 1)[1]:
            raise ValueError(f"--kind {spec!r}: want PATTERN=KIND")
        patterns.append(tuple(spec.split("=", 1)))
    if args.evaluation:
        missing = [p for p in args.evaluation if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"--evaluation {missing[0]}: no such file")
        write_runs(args.runs, runs_from_evaluations(args.evaluation, patterns))
    runs = read_runs(args.runs)
    output = {}
    sections = [("params", "Effective parameters (total parameters)", "total parameters")]
    if all(r.nonembedding_params is not None for r in runs):
        sections.append(("nonembedding_params", "Effective parameters (non-embedding parameters)",
                         "non-embedding parameters (without the input side and the output head)"))
    markdown = []
    for count, title, xlabel in sections:
        result = analyse(runs, args.dense, count, args.weights, args.bootstrap, args.seed)
        suffix = "" if count == "params" else "_nonembedding"
        result["plot"] = plot_scaling(result, os.path.join(args.output, f"scaling{suffix}.png"), title, xlabel)
        markdown.append(scaling_markdown(result, title))
        output[count] = result
    report = _json_ready(output["params"])
    if "nonembedding_params" in output:
        report["nonembedding"] = _json_ready(output["nonembedding_params"])
    report["runs"] = os.path.abspath(args.runs)
    write_json_atomic(os.path.join(args.output, "scaling.json"), report)
    write_text_atomic(os.path.join(args.output, "scaling.md"), "\n".join(markdown))
    print("\n".join(markdown))
    return report


if __name__ == "__main__":
    main()
