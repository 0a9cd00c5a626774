"""Issue 42's v1 regime: untied, tied, LEV at v1's isoparametric depth and the factorised control
at 16k, width 64 (the tables 91% of untied), read from the committed result files.

    python experiments/v1regime.py        # writes experiments/results/issue42/v16000/v1regime.{json,md}

1. The rate brackets (seed 1): every run KIND-lrLR-s1 of each kind, its trainer's validation loss
   at step 1,200 (8 batches) and the evaluator's (the first 65,536 validation tokens,
   experiments/collect.sh runs). The chosen rate is the one with the lowest trainer's loss: the
   rule written before the runs (experiments/plans/issue42.plan). Where that rate's seeds split
   (the edge of stability), the plan runs the stable neighbour's seeds too and the better 3-seed
   whole-split mean decides (switch_to_stable_neighbour).
2. The seeds at the chosen rates, scored together on the whole validation split, one group per
   seed (experiments/collect.sh group --name v1-sN untied=... tied=... lev=... fact=...).
3. The readings fixed before the runs, tested on the whole split, paired by seed (a two-sided
   t-test of the per-seed differences, megatron_lev.evaluation.seeds): LEV-iso - untied and
   LEV-iso - factorised form the family (Holm). "Ahead"/"behind" is a Holm-adjusted p below 0.05
   with that sign, otherwise "level". LEV-iso ahead of untied and level with the factorised
   control is depth, not LEV; ahead of both is v1 reproduced in its regime at this size. The other
   pairs are described, each tested alone.
4. v1's multiplier (N_eff / N over the 16k untied ladder, megatron_lev.evaluation.scaling) from
   scaling/scaling.json, when it has been fitted.

Nothing is typed in: a run not collected yet is absent.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_lev.evaluation.lr_sweep import final_valid_loss, parse_run_name  # noqa: E402
from megatron_lev.evaluation.seeds import holm, mean_std, paired_t_test  # noqa: E402
from megatron_lev.utils.files import write_json_atomic, write_text_atomic  # noqa: E402
from screen import embedding_statistics, evaluator_loss  # noqa: E402

STEPS = 1200
# label, run kind (the name without -lrLR-sSEED), name in the whole-split groups, scaling kind
KINDS = (
    ("untied, 4 layers", "untied16k-w64", "untied", "untied16k"),
    ("tied, 4 layers", "tied16k-w64", "tied", "tied16k"),
    ("LEV-iso, 22 layers", "lev16k-iso", "lev", "lev16k-iso"),
    ("factorised, 22 layers, rank 10", "fact16k-iso", "fact", "fact16k-iso"),
)
# The dense untied ladder of v1's multiplier (4 layers, 16k; width 64 is the baseline above).
LADDER = tuple(f"untied16k-w{w}" for w in (32, 48, 64, 96, 128))
FAMILY = (("lev", "untied"), ("lev", "fact"))
DESCRIBED = (("lev", "tied"), ("fact", "untied"), ("untied", "tied"))
ALPHA = 0.05


def rate(lr: float) -> str:
    """2e-3, 1.6e-2: the plan's spelling."""
    mantissa, exponent = f"{lr:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def brackets(runs: str, kinds: tuple[str, ...]) -> dict:
    """{kind: {"rates": {lr: {"trainer", "evaluator"}}, "chosen": lr, "edge": bool}} at seed 1."""
    out = {}
    for kind in kinds:
        rates = {}
        for entry in sorted(os.listdir(runs)):
            parsed = parse_run_name(entry)
            if parsed is None or parsed[0] != kind or parsed[2] != 1:
                continue
            run = os.path.join(runs, entry)
            if not os.path.isfile(os.path.join(run, "evaluation.json")):
                continue
            rates[parsed[1]] = {"run": entry, "trainer": final_valid_loss(run, STEPS),
                                "evaluator": evaluator_loss(run)}
        if rates:
            chosen = min(rates, key=lambda lr: rates[lr]["trainer"])
            out[kind] = {"rates": {rate(lr): v for lr, v in sorted(rates.items())}, "chosen": rate(chosen), "seed1_chosen": rate(chosen),
                         "chosen_run": rates[chosen]["run"][:-len("-s1")],
                         "edge": len(rates) > 1 and chosen in (min(rates), max(rates))}
    return out


def parameters(run_dir: str) -> int:
    with open(os.path.join(run_dir, "evaluation.json")) as f:
        (model,) = json.load(f)["models"].values()
    return int(model["parameters"])


def seed_runs(runs: str, name: str) -> dict:
    """{seed: run folder} of NAME-sSEED runs that have been collected (evaluation.json)."""
    return {e.rpartition("-s")[2]: os.path.join(runs, e) for e in sorted(os.listdir(runs))
            if e.startswith(name + "-s") and os.path.isfile(os.path.join(runs, e, "evaluation.json"))}


def whole_split(eval_dir: str) -> tuple[dict, set]:
    """{group name: {seed: loss}} from eval/v1-sN[-...]/evaluation.json, and the set of position
    counts the groups scored (one, when they all scored the same split)."""
    found: dict = {}
    positions: set = set()
    if not os.path.isdir(eval_dir):
        return found, positions
    for entry in sorted(os.listdir(eval_dir)):
        path = os.path.join(eval_dir, entry, "evaluation.json")
        if not (entry.startswith("v1-s") and os.path.isfile(path)):
            continue
        seed = entry[len("v1-s"):].partition("-")[0]  # v1-s1, and v1-s1-more for models scored later
        with open(path) as f:
            models = json.load(f)["models"]
        for name, model in models.items():
            found.setdefault(name, {})[seed] = float(model["loss"])
            positions.add(int(model["tokens"]))
    return found, positions


def comparison(losses: dict, model: str, baseline: str) -> dict | None:
    a, b = losses.get(model, {}), losses.get(baseline, {})
    diffs = {s: a[s] - b[s] for s in sorted(set(a) & set(b))}
    if not diffs:
        return None
    stat = mean_std(diffs.values())
    return {"pair": f"{model} - {baseline}", "per_seed": diffs, **stat, "test": paired_t_test(diffs)}


def direction(row: dict | None) -> str | None:
    if row is None or row.get("p_holm") is None:
        return None
    if row["p_holm"] >= ALPHA:
        return "level"
    return "ahead" if row["mean"] < 0 else "behind"


def reading(vs_untied: str | None, vs_fact: str | None) -> str | None:
    if vs_untied is None or vs_fact is None:
        return None
    if vs_untied == "ahead":
        return {"ahead": "ahead of both: v1 reproduced in its regime at this size",
                "level": "ahead of untied, level with the factorised control: depth, not LEV",
                "behind": "ahead of untied, behind the factorised control: depth, and the generator costs"}[vs_fact]
    if vs_untied == "level":
        return "level with untied: undecided"
    return "behind untied: not reproduced by this reconstruction at 2.3M parameters, 2.46M tokens"


def switch_to_stable_neighbour(row: dict, losses: dict) -> None:
    """Where seed 1's rate proved at the edge of stability (seeds split), the plan runs the
    neighbour on the stable side at every seed too, scored as GROUP-lrRATE, and the kind takes the
    rate with the better mean over the same seeds on the whole split (tied at 8k width 64, issue
    32's width 48). `losses` then holds the chosen rate's scores under GROUP."""
    group, seed1 = row["group"], losses.get(row["group"], {})
    row["alternatives"] = {}
    for name in [n for n in losses if n.startswith(group + "-lr")]:
        other = losses.pop(name)
        if not seed1 or set(other) != set(seed1) or len(other) < 3:
            continue  # not every seed yet: the seed-1 choice stands
        lr = name[len(group + "-lr"):]
        row["scores_by_rate"] = {lr: other, row["chosen"]: seed1}
        row["alternatives"] = {r: float(np.mean(list(s.values()))) for r, s in row["scores_by_rate"].items()}
        if row["alternatives"][lr] < row["alternatives"][row["chosen"]]:
            row["chosen"], row["chosen_run"] = lr, f"{row['kind']}-lr{lr}"
            row["chosen_by"] = "the better 3-seed mean on the whole split (seeds split at seed 1's rate)"
            losses[group] = other


def build(results: str) -> dict:
    runs = os.path.join(results, "runs")
    bracket = brackets(runs, tuple(k[1] for k in KINDS))
    losses, positions = whole_split(os.path.join(results, "eval"))
    ladder = []
    for kind, row in brackets(runs, LADDER).items():
        scores = {seed: evaluator_loss(run) for seed, run in seed_runs(runs, row["chosen_run"]).items()}
        ladder.append({"kind": kind, **row, "parameters": parameters(os.path.join(runs, row["chosen_run"] + "-s1")),
                       "evaluator_by_seed": scores})
    if len(positions) > 1:
        raise ValueError(f"the whole-split groups scored different numbers of positions: {sorted(positions)}")
    scaling_path = os.path.join(results, "scaling", "scaling.json")
    scaling = None
    if os.path.isfile(scaling_path):
        with open(scaling_path) as f:
            scaling = json.load(f)
    kinds = []
    for label, kind, group, scaling_kind in KINDS:
        row = {"label": label, "kind": kind, "group": group, **bracket.get(kind, {}), "chosen_by": "seed 1's trainer"}
        switch_to_stable_neighbour(row, losses)
        chosen = row.get("chosen_run")
        seeds = {seed: {"evaluator": evaluator_loss(run), **embedding_statistics(run)}
                 for seed, run in (seed_runs(runs, chosen) if chosen else {}).items()}
        row["seeds"] = seeds
        row["evaluator"] = mean_std(s["evaluator"] for s in seeds.values())
        row["whole_split"] = {**mean_std(losses.get(group, {}).values()), "per_seed": losses.get(group, {})}
        row["parameters"] = parameters(os.path.join(runs, f"{chosen}-s1")) if chosen else None
        model = (scaling or {}).get("models", {}).get(scaling_kind)
        row["scaling"] = None if model is None else {k: model[k] for k in ("n_eff", "multiplier", "ci95", "extrapolated")}
        kinds.append(row)
    family = {f"{m} - {b}": comparison(losses, m, b) for m, b in FAMILY}
    adjusted = holm({k: (v["test"]["p"] if v else None) for k, v in family.items()})
    for name, row in family.items():
        if row:
            row["p_holm"] = adjusted[name]
            row["direction"] = direction(row)
    described = {f"{m} - {b}": comparison(losses, m, b) for m, b in DESCRIBED}
    # The rate not chosen where a split rate met its stable neighbour: the reading's pair at it.
    for k in kinds:
        for lr, scores in k.get("scores_by_rate", {}).items():
            if lr != k["chosen"]:
                described[f"lev - {k['group']} at {lr}"] = comparison({**losses, "other": scores}, "lev", "other")
    lev_untied, lev_fact = (family[f"{m} - {b}"] for m, b in FAMILY)
    return {"kinds": kinds, "ladder": ladder, "family": family, "described": described, "positions": next(iter(positions), None),
            "reading": reading(direction(lev_untied), direction(lev_fact)),
            "fit": None if scaling is None else {k: scaling["fit"][k] for k in ("E", "A", "alpha", "chi2", "dof")}}


def _f(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def markdown(result: dict) -> str:
    rates = sorted({lr for k in result["kinds"] for lr in k.get("rates", {})}, key=float)
    lines = ["Seed 1's brackets: trainer's validation at step 1,200 (the evaluator's 65,536 tokens)", "",
             "| kind (parameters) | " + " | ".join(rates) + " | chosen |", "|---" * (len(rates) + 2) + "|"]
    for k in result["kinds"]:
        cells = [f"{k['rates'][lr]['trainer']:.4f} ({k['rates'][lr]['evaluator']:.4f})" if lr in k.get("rates", {})
                 else "" for lr in rates]
        edge = " (edge)" if k.get("edge") else ""
        chosen = k.get("seed1_chosen", "—") + edge
        if k.get("chosen", "—") != k.get("seed1_chosen", "—"):
            chosen += f", then {k['chosen']} (its seeds split: see below)"
        lines.append(f"| {k['label']} ({_f(k['parameters'], ',')}) | " + " | ".join(cells) + f" | {chosen} |")
    ladder_rates = sorted({lr for k in result["ladder"] for lr in k["rates"]}, key=float)
    lines += ["", "The untied ladder (4 layers), seed 1's brackets as above; the evaluator at the chosen rate by seed", "",
              "| width (parameters) | " + " | ".join(ladder_rates) + " | chosen | evaluator by seed |",
              "|---" * (len(ladder_rates) + 3) + "|"]
    for k in result["ladder"]:
        cells = [f"{k['rates'][lr]['trainer']:.4f}" if lr in k["rates"] else "" for lr in ladder_rates]
        scores = " / ".join(f"{v:.4f}" for _, v in sorted(k["evaluator_by_seed"].items()))
        lines.append(f"| {k['kind'].rpartition('-w')[2]} ({k['parameters']:,}) | " + " | ".join(cells)
                     + f" | {k['chosen']}{' (edge)' if k['edge'] else ''} | {scores} |")
    lines += ["", f"The chosen rates on the whole validation split ({_f(result['positions'], ',')} positions), per seed; "
              "v1's multiplier over the 16k untied ladder", "",
              "| kind | rate | whole split, per seed | mean ± std | step 1,200: cosine / eff. rank | N_eff | multiplier [95%] |",
              "|---|---|---|---|---|---|---|"]
    for k in result["kinds"]:
        ws = k["whole_split"]
        per_seed = " / ".join(f"{v:.4f}" for _, v in sorted(ws["per_seed"].items())) or "—"
        spread = f" ± {ws['std']:.4f}" if ws["std"] is not None else ""
        at = [s["at"][STEPS] for s in k["seeds"].values() if STEPS in s["at"]]
        stats = (f"{np.mean([a['embedding_mean_cosine'] for a in at]):.3f} / "
                 f"{np.mean([a['embedding_effective_rank'] for a in at]):.1f}") if at else "—"
        sc = k["scaling"]
        mult = "—" if sc is None else f"{sc['multiplier']:.3f}x [{sc['ci95'][0]:.3f}, {sc['ci95'][1]:.3f}]"
        alternatives = ", ".join(f"{lr} {m:.5f}" for lr, m in k.get("alternatives", {}).items())
        chosen = k.get("chosen", "—") + (f" (3-seed means: {alternatives})" if alternatives else "")
        lines.append(f"| {k['label']} | {chosen} | {per_seed} | {_f(ws['mean'], '.4f')}{spread} | "
                     f"{stats} | {'—' if sc is None else format(sc['n_eff'] / 1e6, '.2f') + 'M'} | {mult} |")
    lines += ["", "| difference (whole split) | per seed | mean ± std | p | Holm | direction |", "|---|---|---|---|---|---|"]
    for group, rows in (("family", result["family"]), ("described", result["described"])):
        for name, row in rows.items():
            if row is None:
                continue
            per_seed = ", ".join(f"{v:+.4f}" for _, v in sorted(row["per_seed"].items()))
            spread = f" ± {row['std']:.4f}" if row["std"] is not None else ""
            lines.append(f"| {name} | {per_seed} | {row['mean']:+.4f}{spread} | {_f(row['test']['p'], '.3f')} | "
                         f"{_f(row.get('p_holm'), '.3f') if group == 'family' else 'alone'} | {row.get('direction') or '—'} |")
    lines += ["", f"Reading (fixed before the runs): {result['reading'] or 'not yet: seeds missing'}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=os.path.join(REPO, "experiments", "results", "issue42", "v16000"))
    args = parser.parse_args(argv)
    result = build(args.results)
    write_json_atomic(os.path.join(args.results, "v1regime.json"), result)
    write_text_atomic(os.path.join(args.results, "v1regime.md"), markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
