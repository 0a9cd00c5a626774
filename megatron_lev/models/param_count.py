"""Parameter breakdowns of model configs, and the isoparametric planner.

Isoparametric (v1 paper): LEV replaces a V x D table by a ~1-2 M parameter generator; the
parameters it saves are spent on a deeper (or wider) backbone until the LEV model's total
matches the baseline's. `plan_isoparametric` picks the depth (or width) whose total is
closest to the baseline's, then, if that is still more than `tolerance` away, trims the MLP
width (ffn_hidden_size, in multiples of 64, else 32, 16, 8) to land within it.

The factorised input side's rank planner (`plan_embedding_rank`): the embedding_rank r that
brings a factorized model nearest to a target total (the total is linear in r), e.g. the
isoparametric LEV's at the same depth: the control of "depth bought" vs "the generator".

CLI: `python tools/param_count.py --config lev-1.2b` (see `main`);
`--config FACTORIZED.yaml --match-params TARGET.yaml` plans the rank.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import yaml

from megatron_lev.configs import load_config
from megatron_lev.models.config import EMBEDDING_KINDS, model_config_from_dict
from megatron_lev.models.shape import count_parameters, factorized_input_parameters  # noqa: F401 (re-exported)

FFN_MULTIPLES = (64, 32, 16, 8)


def _total(section: dict, tp: int) -> int:
    return count_parameters(model_config_from_dict(section, tensor_model_parallel_size=tp))["total"]


# Model fields that belong to one input side: dropped when a section is turned into another kind.
INPUT_SIDE_FIELDS = {"freeze_input_embedding": "untied", "embedding_rank": "factorized"}


def with_embedding(section: dict, kind: str) -> dict:
    """`section` with input side `kind`, without the fields of the other input sides."""
    return {**{k: v for k, v in section.items() if INPUT_SIDE_FIELDS.get(k, kind) == kind}, "embedding": kind}


def compare_embeddings(section: dict, tensor_model_parallel_size: int = 1) -> dict:
    """Total parameters of the same backbone with each input side: {kind: total} (factorized
    only when `section` gives its embedding_rank)."""
    kinds = [kind for kind in EMBEDDING_KINDS if kind != "factorized" or section.get("embedding_rank")]
    return {kind: _total(with_embedding(section, kind), tensor_model_parallel_size) for kind in kinds}


def plan_embedding_rank(section: dict, target_total: int, tolerance: float = 0.01,
                        tensor_model_parallel_size: int = 1) -> dict:
    """The embedding_rank r that brings the factorised model `section` (embedding: factorized; its
    backbone as given) nearest to `target_total` parameters. The total is linear in r, each unit
    of rank costing V_padded + H (a table column and a projection column), so r is the integer
    nearest to (target - the total without the input side) / (V_padded + H), at least 1."""
    tp = tensor_model_parallel_size
    if section.get("embedding") != "factorized":
        raise ValueError(f"--match-params: the --config model is embedding: {section.get('embedding')}; the rank "
                         "planner sets the embedding_rank of a factorized model (embedding: factorized)")
    config = model_config_from_dict({**section, "embedding_rank": 1}, tensor_model_parallel_size=tp)
    per_rank = factorized_input_parameters(config.padded_vocab_size, config.hidden_size, 1)
    without_input = count_parameters(config)["total"] - per_rank
    exact = (target_total - without_input) / per_rank
    rank = max(1, min((math.floor(exact), math.ceil(exact)),
                      key=lambda r: abs(without_input + r * per_rank - target_total)))
    plan = {**section, "embedding_rank": rank}
    total = _total(plan, tp)
    difference = (total - target_total) / target_total
    if abs(difference) > tolerance:
        raise ValueError(f"--match-params: no embedding_rank comes within {tolerance:.1%} (--tolerance) of the "
                         f"target's {target_total:,} parameters: the backbone without its input side already has "
                         f"{without_input:,}, and each unit of rank adds {per_rank:,} (closest: rank {rank}, "
                         f"{total:,}, {difference:+.2%})")
    return {"model": plan, "embedding_rank": rank, "exact_rank": exact, "total": total,
            "target_total": target_total, "relative_difference": difference, "parameters_per_rank": per_rank}


def plan_isoparametric(baseline: dict, lev: dict | None = None, vary: str = "depth", tolerance: float = 0.01,
                       tensor_model_parallel_size: int = 1) -> dict:
    """The LEV model (a `model:` section) whose total matches `baseline`'s within `tolerance`.

    baseline: the baseline's `model:` section (tied or untied). lev: LEV generator fields
    (default: the baseline's `lev:` section, else the spec's defaults). vary: "depth"
    (num_layers) or "width" (hidden_size, in steps of one attention head; the MLP
    keeps the baseline's ffn/hidden ratio): more heads of the same size).
    """
    tp = tensor_model_parallel_size
    if vary not in ("depth", "width"):
        raise ValueError(f"--vary {vary!r}: expected 'depth' or 'width'")
    base_config = model_config_from_dict(baseline, tensor_model_parallel_size=tp)
    target = count_parameters(base_config)["total"]
    start = {**with_embedding(baseline, "lev"), "lev": dict(lev if lev is not None else baseline.get("lev") or {}),
             "ffn_hidden_size": base_config.ffn_hidden_size}
    if vary == "depth":  # up to 16x the baseline's depth: v1's embedding-dominated pair is 6 vs 52 layers
        candidates = [{**start, "num_layers": n} for n in range(max(1, base_config.pipeline_model_parallel_size),
                                                                16 * base_config.num_layers + 1)]
    else:  # wider = more heads of the same size, the MLP keeping the baseline's ffn/hidden ratio
        head_dim, groups = base_config.kv_channels, base_config.num_query_groups
        mha = groups == base_config.num_attention_heads
        ratio = base_config.ffn_hidden_size / base_config.hidden_size
        candidates = []
        for heads in range(1, 2 * base_config.num_attention_heads + 1):
            if heads % tp or (not mha and heads % groups):
                continue
            hidden = heads * head_dim
            candidates.append({**start, "hidden_size": hidden, "num_attention_heads": heads,
                               "num_query_groups": heads if mha else groups, "kv_channels": head_dim,
                               "ffn_hidden_size": max(64 * tp, round(ratio * hidden / (64 * tp)) * 64 * tp)})
    best = min(candidates, key=lambda c: abs(_total(c, tp) - target))
    plan = dict(best)
    if abs(_total(plan, tp) - target) > tolerance * target:
        plan = _fit_ffn(plan, target, tolerance, tp) or plan
    total = _total(plan, tp)
    difference = (total - target) / target
    if abs(difference) > tolerance:
        raise ValueError(f"--match-baseline: no LEV {vary} comes within {tolerance:.1%} of the baseline's "
                         f"{target:,} parameters (closest: {total:,}, {difference:+.2%}); try --vary "
                         f"{'width' if vary == 'depth' else 'depth'}")
    return {"model": plan, "total": total, "baseline_total": target, "relative_difference": difference,
            "vary": vary, "ffn_adjusted": plan["ffn_hidden_size"] != best["ffn_hidden_size"]}


def _fit_ffn(plan: dict, target: int, tolerance: float, tp: int) -> dict | None:
    """Solve total(ffn) = target (the total is linear in ffn) on the coarsest multiple that fits."""
    config = model_config_from_dict(plan, tensor_model_parallel_size=tp)
    per_unit = 3 * config.hidden_size * config.num_layers  # parameters per unit of ffn width
    exact = config.ffn_hidden_size + (target - _total(plan, tp)) / per_unit
    for multiple in FFN_MULTIPLES:
        multiple = math.lcm(multiple, tp)
        candidate = {**plan, "ffn_hidden_size": max(multiple, round(exact / multiple) * multiple)}
        if abs(_total(candidate, tp) - target) <= tolerance * target:
            return candidate
    return None


# --------------------------------------------------------------------------- printing


def _fmt(n: int) -> str:
    return f"{n:,}"


def breakdown_table(name: str, section: dict, tensor_model_parallel_size: int = 1) -> str:
    config = model_config_from_dict(section, tensor_model_parallel_size=tensor_model_parallel_size)
    c = count_parameters(config)
    total = c["total"]
    input_name = {"lev": "embedding (LEV generator)", "tied": "embedding (table = head)",
                  "untied": "embedding (table)", "factorized": "embedding (factorised table)"}[config.embedding]
    if config.freeze_input_embedding:
        input_name = "embedding (table, frozen)"
    rows = [(input_name, c["embedding"])]
    if config.embedding == "factorized":
        rank = config.embedding_rank
        rows += [(f"  table ({config.padded_vocab_size:,} x {rank})", config.padded_vocab_size * rank),
                 (f"  projection ({rank} x {config.hidden_size})", rank * config.hidden_size)]
    rows += [
        ("output head" + (" (tied: the table)" if config.embedding == "tied" else ""), c["output_layer"]),
        ("per layer", c["per_layer"]),
        ("  attention (qkv + out)", c["attention"]),
        ("  mlp (gate_up + down)", c["mlp"]),
        ("  norms", c["norms"]),
        (f"layers ({config.num_layers} x)", c["layers"]),
        ("final norm", c["final_norm"]),
        ("total", total),
    ]
    lines = [
        f"{name}: embedding={config.embedding}{' (input table frozen)' * config.freeze_input_embedding}"
        f"{f' (rank {config.embedding_rank})' if config.embedding == 'factorized' else ''}, "
        f"vocab {config.vocab_size:,} (padded {config.padded_vocab_size:,} at TP={tensor_model_parallel_size}), "
        f"{config.num_layers} layers, hidden {config.hidden_size}, ffn {config.ffn_hidden_size}, "
        f"heads {config.num_attention_heads} ({config.num_query_groups} kv)",
        f"{'component':<32}{'parameters':>16}{'share':>9}",
    ]
    for label, n in rows:
        share = "" if label.startswith("  ") or label == "per layer" else f"{100 * n / total:8.2f}%"
        lines.append(f"{label:<32}{_fmt(n):>16}{share:>9}")
    if c["vocab_padding"]:
        lines.append(f"(of which vocabulary padding rows: {_fmt(c['vocab_padding'])})")
    if c["frozen"]:
        lines.append(f"frozen (never trained): {_fmt(c['frozen'])}; trainable: {_fmt(c['trainable'])}")
    totals = compare_embeddings(section, tensor_model_parallel_size)
    lines.append("")
    lines.append("same backbone, each input side:")
    for kind, n in totals.items():
        note = ""
        if kind != config.embedding:
            diff = total - n
            note = f"   {config.embedding} - {kind} = {diff:+,} ({100 * diff / n:+.2f}%)"
        lines.append(f"  {kind:<10}{_fmt(n):>14}{note}")
    return "\n".join(lines)


def plan_text(baseline_name: str, baseline: dict, plan: dict) -> str:
    model = plan["model"]
    changes = [f"num_layers {baseline.get('num_layers')} -> {model['num_layers']}",
               f"hidden_size {baseline.get('hidden_size')} -> {model['hidden_size']}",
               f"num_attention_heads {baseline.get('num_attention_heads')} -> {model['num_attention_heads']}",
               f"ffn_hidden_size {model['ffn_hidden_size']}" + (" (trimmed to fit)" if plan["ffn_adjusted"] else "")]
    return "\n".join([
        f"isoparametric LEV for {baseline_name} ({plan['baseline_total']:,} parameters), varying {plan['vary']}:",
        "  " + ", ".join(changes),
        f"  LEV total {plan['total']:,} ({plan['relative_difference']:+.3%} vs the baseline)",
        "",
        yaml.safe_dump({"model": model}, sort_keys=False).rstrip(),
    ])


def rank_plan_text(config_name: str, target_name: str, plan: dict) -> str:
    return "\n".join([
        f"embedding_rank for {config_name} matching {target_name} ({plan['target_total']:,} parameters):",
        f"  embedding_rank {plan['embedding_rank']} (exact {plan['exact_rank']:.2f}; each unit of rank is "
        f"{plan['parameters_per_rank']:,} parameters, a table column and a projection column)",
        f"  factorized total {plan['total']:,} ({plan['relative_difference']:+.3%} vs the target)",
        "",
        yaml.safe_dump({"model": plan["model"]}, sort_keys=False).rstrip(),
    ])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/param_count.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="packaged config name (e.g. lev-1.2b) or a YAML path")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="vocabulary padding depends on it (default 1)")
    p.add_argument("--match-baseline", metavar="CONFIG",
                   help="plan the LEV model whose total matches this baseline config's (isoparametric)")
    p.add_argument("--match-params", metavar="CONFIG",
                   help="set the embedding_rank of the factorized --config so its total matches this config's "
                        "(e.g. the isoparametric LEV: the same depth, the generator replaced by a V x r table)")
    p.add_argument("--vary", choices=("depth", "width"), default="depth", help="what the planner changes")
    p.add_argument("--tolerance", type=float, default=0.01, help="planner tolerance (default 0.01 = 1%%)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = p.parse_args(argv)
    if not args.config and not args.match_baseline:
        p.error("give --config and/or --match-baseline")
    if args.match_params and (args.match_baseline or not args.config):
        p.error("--match-params sets the embedding_rank of the factorized --config: give --config, and not "
                "--match-baseline (the LEV planner)")
    tp = args.tensor_model_parallel_size
    try:
        out = {}
        text = []
        if args.match_params:
            section = load_config(args.config)["model"]
            target = _total(load_config(args.match_params)["model"], tp)
            plan = plan_embedding_rank(section, target, args.tolerance, tp)
            out["rank_plan"] = {"config": args.config, "target": args.match_params, **plan}
            text.append(rank_plan_text(args.config, args.match_params, plan))
        if args.config:
            section = out["rank_plan"]["model"] if args.match_params else load_config(args.config)["model"]
            counts = count_parameters(model_config_from_dict(section, tensor_model_parallel_size=tp))
            out["config"] = {"name": args.config, "counts": counts, "by_embedding": compare_embeddings(section, tp)}
            name = f"{args.config} at embedding_rank {section['embedding_rank']}" if args.match_params else args.config
            text.append(breakdown_table(name, section, tp))
        if args.match_baseline:
            baseline = load_config(args.match_baseline)["model"]
            lev = load_config(args.config)["model"].get("lev") if args.config else None
            plan = plan_isoparametric(baseline, lev, vary=args.vary, tolerance=args.tolerance,
                                      tensor_model_parallel_size=tp)
            out["plan"] = plan
            text.append(plan_text(args.match_baseline, baseline, plan))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2) if args.json else "\n\n".join(text))
    return 0
