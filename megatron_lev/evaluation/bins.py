"""Loss differences by training-count bin, with their token mass and a paired bootstrap (issue 32).

    python -m megatron_lev.evaluation.bins --seed-dir 1=eval/s1 --seed-dir 2=eval/s2 --seed-dir 3=eval/s3 \
        --pair lev:untied --pair tied:untied --output-dir eval/bins

Each seed directory holds (anywhere below it) a token_nll.npz of `megatron_lev.evaluate
--save-token-nll --freq-dataset ...`: every scored position's input and label ids, each model's
NLL there, and the training counts of every token type. A seed may name several directories
(`--seed-dir 1=eval/s1,eval/s1-tied`), or hold several files, when its models were evaluated
apart: every file below them is read, and their models are joined once the files are shown to
score the same positions with the same counts. All seeds must have scored the same positions
(the same validation tokens) with the same counts.

A position goes to the bin of the training count of its *predicted* token (the label) or of its
*input* token (the one LEV embeds there), with the bins' lower edges `--edges` (default
1,10,100,1000: counts 0 | 1-9 | 10-99 | 100-999 | >= 1000). For a pair MODEL:BASELINE and each
bin:

  mass        the bin's types, their share of the training tokens, and its evaluated positions
              (count and share): what the bin's figure rests on
  difference  the mean over positions of delta_i = mean over seeds of (NLL_model - NLL_baseline)
              at position i, in nats (negative: MODEL better), and exp(difference) - 1 as a
              perplexity change
  interval    a paired bootstrap (`--bootstrap` draws, the same resampling for both models and
              every seed), the 2.5 and 97.5 percentiles of the resampled mean. With
              `--block-size N` (issue 42) it resamples blocks of N consecutive positions (the
              evaluator's sequences when N is the sequence length): a token that recurs within a
              document piece is one draw, not many, so the rare bins' intervals are not narrowed
              by that repetition; the bin's mean over a draw is its blocks' summed differences over
              their summed positions. `--block-size 1` is the token-level bootstrap (each position
              a draw), whose intervals are too narrow wherever positions are correlated. Either
              holds the sampling error of these validation tokens, not the seed-to-seed spread,
              which `per_seed` shows
  signs       per seed, the bin's mean difference, and how many seeds are below / above zero
  t-test      the per-seed differences against 0 (scipy's one-sample test, two-sided p, as in
              megatron_lev.evaluation.seeds): the seed-to-seed spread the bootstrap leaves out

Output (`--output-dir`): bins.json and bins.md.
"""
from __future__ import annotations

import argparse
import glob
import math
import os

import numpy as np

from megatron_lev.evaluation.report import parse_named
from megatron_lev.evaluation.seeds import paired_t_test
from megatron_lev.utils.files import write_json_atomic, write_text_atomic

STRATA = {"predicted": "label_ids", "input": "input_ids"}
DEFAULT_EDGES = (1, 10, 100, 1000)


def bin_labels(edges) -> list[str]:
    """Labels of the bins [0, e0), [e0, e1), ..., [e_last, inf) of integer counts."""
    bounds = [0, *edges]
    labels = []
    for lo, hi in zip(bounds, bounds[1:]):
        labels.append(str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}")
    return labels + [f">={bounds[-1]}"]


def bin_of_counts(counts: np.ndarray, edges) -> np.ndarray:
    """Bin index of each token type from its training count (bin 0: counts below edges[0])."""
    return np.searchsorted(np.asarray(edges), np.asarray(counts), side="right")


def bootstrap_mean_interval(values: np.ndarray, draws: int, rng: np.random.Generator,
                            chunk_elements: int = 10_000_000) -> tuple[float, float]:
    """2.5 / 97.5 percentiles of the mean of `values` resampled with replacement `draws` times."""
    n = values.size
    if n == 0:
        return math.nan, math.nan
    means = np.empty(draws)
    per_chunk = max(1, chunk_elements // n)
    for start in range(0, draws, per_chunk):
        stop = min(draws, start + per_chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = values[idx].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return float(lo), float(hi)


def block_bootstrap_mean_interval(values: np.ndarray, members: np.ndarray, block_size: int, draws: int,
                                  rng: np.random.Generator, chunk_elements: int = 10_000_000) -> tuple[float, float]:
    """2.5 / 97.5 percentiles of the mean of values[members] when the blocks of `block_size`
    consecutive positions (all of them, a block with no member included) are resampled with
    replacement: each draw's mean is its blocks' summed member values over their member count."""
    if not members.any():
        return math.nan, math.nan
    blocks = -(-values.size // block_size)
    pad = blocks * block_size - values.size
    sums = np.pad(np.where(members, values, 0.0), (0, pad)).reshape(blocks, block_size).sum(axis=1)
    counts = np.pad(members.astype(np.int64), (0, pad)).reshape(blocks, block_size).sum(axis=1)
    means = np.empty(draws)
    per_chunk = max(1, chunk_elements // blocks)
    for start in range(0, draws, per_chunk):
        stop = min(draws, start + per_chunk)
        idx = rng.integers(0, blocks, size=(stop - start, blocks))
        n = counts[idx].sum(axis=1)
        # A draw of blocks without a member has no mean; with thin bins it can happen: leave it out.
        with np.errstate(invalid="ignore", divide="ignore"):
            means[start:stop] = np.where(n > 0, sums[idx].sum(axis=1) / np.maximum(n, 1), np.nan)
    lo, hi = np.nanquantile(means, [0.025, 0.975])
    return float(lo), float(hi)


SHARED_KEYS = ("input_ids", "label_ids", "train_counts")  # what every file of every seed must agree on


def first_difference(a: dict, b: dict) -> str | None:
    """The first of SHARED_KEYS on which two token_nll files differ (None: the same tokens and counts)."""
    for key in SHARED_KEYS:
        if a[key].shape != b[key].shape or not np.array_equal(a[key], b[key]):
            return key
    return None


def load_seed(seed: str, seed_dirs: str) -> dict:
    """The token_nll.npz files below one seed's directories (comma-separated), joined by model."""
    found = []
    for seed_dir in seed_dirs.split(","):
        if not os.path.isdir(seed_dir):
            raise ValueError(f"--seed-dir {seed}={seed_dirs}: {seed_dir}: no such directory")
        found += sorted(glob.glob(os.path.join(seed_dir, "**", "token_nll.npz"), recursive=True))
    if not found:
        raise ValueError(f"--seed-dir {seed}={seed_dirs}: no token_nll.npz below it "
                         "(megatron_lev.evaluate --save-token-nll)")
    joined: dict = {}
    for path in found:
        with np.load(path) as data:
            arrays = {k: data[k] for k in data.files}
        if "train_counts" not in arrays:
            raise ValueError(f"{path}: no train_counts (evaluate with --freq-dataset as well)")
        if not joined:
            joined = {"path": path, **arrays}
            continue
        key = first_difference(arrays, joined)
        if key:
            raise ValueError(f"--seed-dir {seed}: {path} and {joined['path']} differ in {key}: "
                             "a seed's files must score the same validation tokens with the same counts")
        for key, value in arrays.items():
            if key.startswith("nll/"):
                if key in joined:
                    raise ValueError(f"--seed-dir {seed}: model {key[4:]!r} is in both {path} and {joined['path']}")
                joined[key] = value
    return joined


def compare(seeds: dict[str, dict], pairs: list[tuple[str, str]], edges=DEFAULT_EDGES, draws: int = 2000,
            rng_seed: int = 0, block_size: int = 1) -> dict:
    first_seed, first = next(iter(seeds.items()))
    for seed, data in seeds.items():
        key = first_difference(data, first)
        if key:
            raise ValueError(f"seed {seed} ({data['path']}) and seed {first_seed} ({first['path']}) differ in "
                             f"{key}: they must score the same validation tokens with the same counts")
        for model, baseline in pairs:
            for name in (model, baseline):
                if f"nll/{name}" not in data:
                    models = sorted(k.split("/", 1)[1] for k in data if k.startswith("nll/"))
                    raise ValueError(f"{data['path']}: no model {name!r} (it has {models})")
    counts = first["train_counts"].astype(np.int64)
    type_bin = bin_of_counts(counts, edges)
    labels = bin_labels(edges)
    total_train, positions = max(int(counts.sum()), 1), first["input_ids"].size
    rng = np.random.default_rng(rng_seed)
    result = {"edges": list(edges), "bins": labels, "positions": int(positions), "seeds": list(seeds),
              "bootstrap_draws": draws, "bootstrap_block_size": block_size, "pairs": {}}
    for model, baseline in pairs:
        delta_by_seed = np.stack([data[f"nll/{model}"].astype(np.float64) - data[f"nll/{baseline}"].astype(np.float64)
                                  for data in seeds.values()])
        delta = delta_by_seed.mean(axis=0)
        strata = {}
        for stratum, key in STRATA.items():
            position_bin = type_bin[first[key].astype(np.int64)]
            rows = []
            for b, label in enumerate([*labels, "all"]):
                members = np.ones(positions, dtype=bool) if label == "all" else position_bin == b
                type_members = np.ones(counts.size, dtype=bool) if label == "all" else type_bin == b
                n = int(members.sum())
                per_seed = {s: (float(delta_by_seed[i, members].mean()) if n else None)
                            for i, s in enumerate(seeds)}
                diff = float(delta[members].mean()) if n else None
                lo, hi = (bootstrap_mean_interval(delta[members], draws, rng) if block_size == 1 else
                          block_bootstrap_mean_interval(delta, members, block_size, draws, rng))
                signs = [v for v in per_seed.values() if v is not None]
                rows.append({
                    "bin": label, "types": int(type_members.sum()),
                    "train_token_share": float(counts[type_members].sum() / total_train),
                    "eval_tokens": n, "eval_token_share": n / positions,
                    "difference": diff, "ci95": [lo, hi] if n else [None, None],
                    "ppl_change_pct": None if diff is None else 100 * math.expm1(diff),
                    "per_seed": per_seed,
                    "seeds_below_zero": sum(v < 0 for v in signs), "seeds_above_zero": sum(v > 0 for v in signs),
                    "t_test": paired_t_test(per_seed)})
            strata[stratum] = rows
        result["pairs"][f"{model}:{baseline}"] = {"model": model, "baseline": baseline, **strata}
    return result


def _fmt(value, digits=4, signed=True) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _p(test: dict) -> str:
    return "n/a" if test["p"] is None else f"{test['p']:.3f}"


def bins_markdown(result: dict) -> str:
    block = result.get("bootstrap_block_size", 1)
    kind = "token-level" if block == 1 else f"block ({block} consecutive positions a block)"
    lines = [f"Positions: {result['positions']:,} per seed; seeds {', '.join(result['seeds'])}; paired {kind} "
             f"bootstrap of {result['bootstrap_draws']:,} draws.", ""]
    for pair in result["pairs"].values():
        for stratum in STRATA:
            lines += [f"### {pair['model']} vs {pair['baseline']}, by training count of the {stratum} token", "",
                      "| training count | types | train share | eval tokens (share) | loss difference (nats) | "
                      "95% interval | perplexity change | per seed | seeds < 0 / > 0 | p (t over seeds) |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            for r in pair[stratum]:
                seeds = ", ".join(_fmt(v) for v in r["per_seed"].values())
                change = "n/a" if r["ppl_change_pct"] is None else f"{r['ppl_change_pct']:+.1f}%"
                lines.append(f"| {r['bin']} | {r['types']:,} | {r['train_token_share']:.4f} | {r['eval_tokens']:,} "
                             f"({100 * r['eval_token_share']:.2f}%) | {_fmt(r['difference'])} | "
                             f"[{_fmt(r['ci95'][0])}, {_fmt(r['ci95'][1])}] | {change} | {seeds} | "
                             f"{r['seeds_below_zero']} / {r['seeds_above_zero']} | {_p(r['t_test'])} |")
            lines.append("")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_lev.evaluation.bins",
                                description="Loss differences by training-count bin of the predicted and input "
                                            "token, with token mass, a paired bootstrap interval and signs over seeds.")
    p.add_argument("--seed-dir", action="append", required=True, metavar="SEED=DIR[,DIR...]",
                   help="one seed's token_nll.npz files (anywhere below each DIR); repeat per seed")
    p.add_argument("--pair", action="append", required=True, metavar="MODEL:BASELINE")
    p.add_argument("--edges", default=",".join(map(str, DEFAULT_EDGES)),
                   help="lower edges of the bins after the first, ascending integers (default 1,10,100,1000)")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap draws (default 2000)")
    p.add_argument("--block-size", type=int, default=1,
                   help="positions per bootstrap block (default 1: each position a draw; the evaluator's "
                        "sequence length resamples whole sequences)")
    p.add_argument("--rng-seed", type=int, default=0)
    p.add_argument("--output-dir", required=True)
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        edges = [int(e) for e in args.edges.split(",")]
        if not edges or edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError
    except ValueError:
        raise SystemExit(f"megatron_lev.evaluation.bins: error: --edges {args.edges!r}: want ascending positive "
                         "integers like 1,10,100,1000") from None
    try:
        if args.bootstrap < 100:
            raise ValueError(f"--bootstrap {args.bootstrap}: at least 100 draws")
        if args.block_size < 1:
            raise ValueError(f"--block-size {args.block_size}: at least 1 position")
        pairs = []
        for spec in args.pair:
            model, sep, baseline = spec.partition(":")
            if not sep or not model or not baseline:
                raise ValueError(f"--pair {spec!r}: want MODEL:BASELINE")
            pairs.append((model, baseline))
        seeds = {s: load_seed(s, d) for s, d in parse_named(args.seed_dir, "--seed-dir", allow_bare=False).items()}
        result = compare(seeds, pairs, edges, args.bootstrap, args.rng_seed, args.block_size)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"megatron_lev.evaluation.bins: error: {exc}") from None
    markdown = bins_markdown(result)
    write_json_atomic(os.path.join(args.output_dir, "bins.json"), result)
    write_text_atomic(os.path.join(args.output_dir, "bins.md"), markdown)
    print(markdown)
    return result


if __name__ == "__main__":
    main()
