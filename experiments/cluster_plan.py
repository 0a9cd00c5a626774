"""The cluster recipe of experiments/run.sh: the papers' two comparisons at 125M and 1.2B on
The Pile, at the papers' 200,064-entry vocabulary, 3 seeds each, every kind at its own learning
rate. It tunes before it spends:

  1. a learning-rate sweep at 125M, every kind at 0.5x, 1x and 2x its config's rate (seed 1,
     the full 125M token budget: 2% of the recipe's GPU-hours), ranked by
     `python -m megatron_lev.evaluation.lr_sweep`;
  2. the choice rule: per kind, the rate with the lowest final validation loss; a best rate at
     the grid's edge is not a choice yet: the next point out (x2 or /2) is run first. At 1.2B a
     kind trains at its 125M rate x (the 1.2B config's rate / the 125M config's rate), so each
     kind keeps its distance to the GPT-3 schedule the configs follow (6e-4 at 125M, 2e-4 at 1.2B);
  3. the 125M and 1.2B runs, 3 seeds, each kind at its own rate.

Prints the expected GPU-hours of every run from the FLOPs model (megatron_lev.training.flops, the
trainer's own formula), per planned layout the checkpoint disk, the data-parallel traffic and
the compute time of a step (with a warning where communication would dominate), and the
`sbatch` lines, evaluation and seed-summary commands.

    python experiments/cluster_plan.py                        # H100, 40% MFU (assumed)
    python experiments/cluster_plan.py --gpu-type a100 --mfu 0.35 --json
    python experiments/cluster_plan.py --sweep-json eval/sweep-125m/sweep.json   # the rates chosen
    python experiments/cluster_plan.py --lr-flags lev --size 1.2b --sweep-json eval/sweep-125m/sweep.json

GPU-hours = training FLOPs / (peak bf16 FLOP/s x MFU) / 3600. The FLOPs count the matrix
multiplications (6 x matmul parameters + attention, per token) and, for LEV, the generator
once per distinct token of each micro-batch, bounded here by once per token (an upper
bound; it is ~0.2% of the total at these sizes). MFU is an assumption, not a measurement:
pass what your cluster's `metrics.jsonl` shows (`mfu`) after the first log interval.

The layout arithmetic (the Slurm scripts' defaults: TP = PP = 1, ZeRO-2, bf16): one checkpoint
is 14 bytes a parameter (bf16 weights, fp32 master weights, Adam's two moments); every GPU
sends per step (DP - 1) / DP of the gradients in fp32 (the reduce-scatter: gradients are
reduced in fp32) and of the weights in bf16 (the all-gather after the step), over NVLink on one
node and over its share of the inter-node network otherwise, at nominal link rates (so the time
is a lower bound); the compute time is the step's FLOPs / (GPUs x peak x MFU).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

SIZES = ("125m", "1.2b")
# (run name, config pattern, slurm script): the v2 pair (iso-body) and the v1 pair (isoparametric).
RUNS = (("tied", "tied-{size}-200k", "slurm/train_tied_1b.sh"),
        ("lev", "lev-{size}-200k", "slurm/train_lev_1b.sh"),
        ("untied", "untied-{size}-200k", "slurm/train_tied_1b.sh"),
        ("lev-iso", "lev-{size}-200k-iso", "slurm/train_lev_1b.sh"))
SEEDS = (1, 2, 3)
NODES = {"125m": 1, "1.2b": 4}  # 8-GPU nodes per run
GPUS_PER_NODE = 8
SWEEP_SIZE, SWEEP_FACTORS, SWEEP_SEED = "125m", (0.5, 1.0, 2.0), 1
SWEEP_DIR, SWEEP_EVAL = "checkpoints/exp/sweep-125m", "eval/sweep-125m"
SAVE_INTERVAL, KEEP_CHECKPOINTS = 1000, 3  # the Slurm scripts' SAVE_INTERVAL; the newest K kept
CHECKPOINT_BYTES_PER_PARAMETER = 14  # bf16 weights 2 + fp32 master weights 4 + Adam's moments 8
# Nominal per-GPU link rates, Gbit/s, one direction: NVLink inside a node; the node's InfiniBand
# shared by its 8 GPUs (DGX: one 200 Gb/s HDR port per A100, one 400 Gb/s NDR port per H100/H200).
LINKS_GBPS = {"a100": {"intra_node": 2400.0, "inter_node": 200.0},
              "h100": {"intra_node": 3600.0, "inter_node": 400.0},
              "h200": {"intra_node": 3600.0, "inter_node": 400.0}}


def format_lr(lr: float) -> str:
    """A learning rate as the run folders name it: 3e-4, 1.2e-3."""
    mantissa, exponent = f"{lr:.6e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def load_training(config_name: str) -> tuple[object, dict]:
    """A packaged config's model sizes (torch-free: megatron_lev/models/shape.py) and training section."""
    from megatron_lev.configs import load_config
    from megatron_lev.models.shape import model_shape

    config = load_config(config_name)
    return model_shape(config["model"]), config["training"]


def run_cost(config_name: str, gpu_type: str, mfu: float) -> dict:
    """Parameters, tokens, training FLOPs and GPU-hours of one packaged config's run."""
    from megatron_lev.models.shape import count_parameters
    from megatron_lev.training.flops import flops_model, peak_flops_per_device, training_flops

    model, training = load_training(config_name)
    tokens = float(training["train_tokens"])
    flops = training_flops(flops_model(model, training["seq_length"]), int(tokens), int(tokens))
    return {"config": config_name, "parameters": count_parameters(model)["total"], "tokens": tokens,
            "flops": flops, "gpu_hours": flops / (peak_flops_per_device(gpu_type, None) * mfu) / 3600,
            "lr": float(training["lr"]), "train_iters": math.ceil(tokens / (training["global_batch_size"]
                                                                              * training["seq_length"]))}


def plan(gpu_type: str = "h100", mfu: float = 0.4) -> list[dict]:
    rows = []
    for size in SIZES:
        for name, pattern, script in RUNS:
            rows.append({"size": size, "run": name, "script": script,
                         **run_cost(pattern.format(size=size), gpu_type, mfu)})
    return rows


# --------------------------------------------------------------------------- 1. the sweep

def sweep_runs(rows: list[dict]) -> list[dict]:
    """The 125M sweep: every kind at SWEEP_FACTORS x its config's rate, seed SWEEP_SEED."""
    return [{**row, "lr": row["lr"] * factor, "name": f"{row['run']}-lr{format_lr(row['lr'] * factor)}-s{SWEEP_SEED}"}
            for row in rows if row["size"] == SWEEP_SIZE for factor in SWEEP_FACTORS]


# --------------------------------------------------------------------------- 2. the choice rule

def choose_rates(sweep: dict, rows: list[dict]) -> dict:
    """kind -> {size: peak learning rate} from a sweep's summary (lr_sweep's sweep.json): the
    lowest final validation loss at 125M, scaled to each size by the configs' ratio. A kind whose
    best lies at its grid's edge (or that is missing) is refused, naming the run to add."""
    base = {r["run"]: r["lr"] for r in rows if r["size"] == SWEEP_SIZE}
    rates, problems = {}, []
    for kind in base:
        entry = sweep.get("kinds", {}).get(kind)
        if entry is None:
            problems.append(f"{kind}: not in the sweep")
            continue
        best = float(entry["best_lr"])
        grid = sorted(row["lr"] for row in entry["rows"])
        if len(grid) < 3 or best in (grid[0], grid[-1]):
            further = best * 2 if best == grid[-1] else best / 2
            problems.append(f"{kind}: best {format_lr(best)} at the edge of {[format_lr(x) for x in grid]}; run "
                            f"{kind}-lr{format_lr(further)}-s{SWEEP_SEED} and rank again")
            continue
        rates[kind] = {r["size"]: best * r["lr"] / base[kind] for r in rows if r["run"] == kind}
    if problems:
        raise ValueError("no rate chosen yet: " + "; ".join(problems))
    return rates


def lr_flags(lr: float) -> str:
    """A run's rate flags: the peak, and the configs' floor of a tenth of it."""
    return f"--lr {format_lr(lr)} --min-lr {format_lr(lr / 10)}"


# --------------------------------------------------------------------------- the layouts

def layout(row: dict, gpu_type: str, mfu: float, links: dict, keep: int = KEEP_CHECKPOINTS) -> dict:
    """One run's layout: checkpoint disk, data-parallel traffic and compute time per step."""
    from megatron_lev.training.flops import flops_model, peak_flops_per_device, training_flops

    model, training = load_training(row["config"])
    nodes = NODES[row["size"]]
    gpus = nodes * GPUS_PER_NODE
    dp = gpus  # TP = PP = 1
    tokens = training["global_batch_size"] * training["seq_length"]
    step_flops = training_flops(flops_model(model, training["seq_length"]), tokens, tokens)
    compute_s = step_flops / (gpus * peak_flops_per_device(gpu_type, None) * mfu)
    traffic = (dp - 1) / dp * row["parameters"] * (4 + 2)  # fp32 gradient reduce-scatter + bf16 weight all-gather
    gbps = links["inter_node" if nodes > 1 else "intra_node"]
    comm_s = traffic / (gbps * 1e9 / 8)
    checkpoint = CHECKPOINT_BYTES_PER_PARAMETER * row["parameters"]
    saves = math.ceil(row["train_iters"] / SAVE_INTERVAL)
    held = min(keep + 1, saves) if keep else saves  # K kept, and the next one while it is written
    return {"size": row["size"], "run": row["run"], "config": row["config"], "nodes": nodes, "gpus": gpus,
            "data_parallel": dp, "tokens_per_step": tokens, "checkpoint_bytes": checkpoint, "saves": saves,
            "checkpoints_held": held, "checkpoint_disk_bytes": held * checkpoint,
            "traffic_bytes_per_gpu_per_step": traffic, "link_gbps": gbps,
            "link": "inter-node" if nodes > 1 else "NVLink", "communication_s_per_step": comm_s,
            "compute_s_per_step": compute_s, "communication_over_compute": comm_s / compute_s}


def layout_warnings(layouts: list[dict]) -> list[str]:
    """One line per layout whose data-parallel traffic would take longer than its compute."""
    return [f"warning: {lay['config']} on {lay['nodes']} node(s): the data-parallel traffic ("
            f"{lay['traffic_bytes_per_gpu_per_step'] / 1e9:.2f} GB a GPU a step, {lay['communication_s_per_step']:.3f} s "
            f"at {lay['link_gbps']:g} Gb/s {lay['link']}) would take longer than the compute "
            f"({lay['compute_s_per_step']:.3f} s): communication would dominate unless overlap_comm hides it; "
            f"use fewer nodes or a larger global batch" for lay in layouts if lay["communication_over_compute"] > 1]


# --------------------------------------------------------------------------- output

def commands(rows: list[dict], gpu_type: str, rates: dict | None = None, sweep_json: str | None = None) -> list[str]:
    """1. the sweep's sbatch lines and its ranking; 2. every run x seed at its kind's rate (the
    numbers when `rates` is given, else a call of this script that reads them from the sweep),
    then per size and seed the evaluation and curves, then the summary over seeds. The tokenizer's
    conversion comes first; data and tokenizer reach the jobs through the environment (docs/cluster.md)."""
    lines = ["# once: the 200k tokenizer.json from o200k_base's ranks (docs/cluster.md, \"3. The tokenizer\"),",
             "python tools/tiktoken_to_hf.py --encoding /data/tok/o200k_base.tiktoken --like o200k_base "
             "--output /data/tok/o200k --check /data/pile/val.jsonl.zst",
             "# DATA_PATH, VALID_DATA_PATH (The Pile, tokenized with it: slurm/preprocess_pile.sh) and",
             "export TOKENIZER_TYPE=HuggingFaceTokenizer TOKENIZER_MODEL=/data/tok/o200k/tokenizer.json",
             f"# 1. the learning-rate sweep at {SWEEP_SIZE} (seed {SWEEP_SEED}, the full token budget)"]
    sweep = sweep_runs(rows)
    for run in sweep:
        lines.append(f"CONFIG={run['config']} GPU_TYPE={gpu_type} CHECKPOINT_DIR={SWEEP_DIR}/{run['name']} "
                     f"EXTRA_ARGS=\"--seed {SWEEP_SEED} {lr_flags(run['lr'])} --eval-interval 500\" sbatch "
                     f"--nodes={NODES[run['size']]} {run['script']}")
    sweep_json = sweep_json or f"{SWEEP_EVAL}/sweep.json"
    lines += [f"python -m megatron_lev.evaluation.lr_sweep --sweep-dir {SWEEP_DIR} --steps {sweep[0]['train_iters']} "
              f"--output-dir {SWEEP_EVAL}",
              "# 2. each kind at its own rate: the best (not at its grid's edge: run the next point out first), "
              "scaled to the size by the configs' ratio"]
    for row in rows:
        flags = (lr_flags(rates[row["run"]][row["size"]]) if rates else
                 f"$(python experiments/cluster_plan.py --lr-flags {row['run']} --size {row['size']} "
                 f"--sweep-json {sweep_json})")
        for seed in SEEDS:
            save = f"checkpoints/exp/{row['config']}-s{seed}"
            lines.append(f"CONFIG={row['config']} GPU_TYPE={gpu_type} CHECKPOINT_DIR={save} "
                         f"EXTRA_ARGS=\"--seed {seed} {flags} --eval-interval 500\" sbatch --nodes="
                         f"{NODES[row['size']]} {row['script']}")
    for size in SIZES:
        names = {r["run"]: r["config"] for r in rows if r["size"] == size}
        for seed in SEEDS:
            models = " ".join(f"--model {run}=checkpoints/exp/{config}-s{seed}" for run, config in names.items())
            out = f"eval/exp-{size}/s{seed}"
            lines.append(f"python -m megatron_lev.evaluate {models} --baseline tied --data-path $VALID_DATA_PATH "
                         f"--eval-tokens 10000000 --freq-dataset $DATA_PATH --buckets quantile:5 --buckets types:5 "
                         f"--buckets log:10 --bf16 --output-dir {out}/ppl")
            for base, other in (("tied", "lev"), ("untied", "lev-iso")):
                lines.append(f"python -m megatron_lev.evaluation.curves --run {base}=checkpoints/exp/{names[base]}-s{seed} "
                             f"--run {other}=checkpoints/exp/{names[other]}-s{seed} --baseline {base} "
                             f"--output-dir {out}/curves-{other}")
        seed_dirs = " ".join(f"--seed-dir {s}=eval/exp-{size}/s{s}" for s in SEEDS)
        lines.append(f"python -m megatron_lev.evaluation.seeds {seed_dirs} --pair lev:tied --pair lev-iso:untied "
                     f"--output-dir eval/exp-{size}/seeds")
    return lines


def markdown(rows: list[dict], gpu_type: str, mfu: float, rates: dict | None = None) -> str:
    sweep = sweep_runs(rows)
    sweep_hours = sum(r["gpu_hours"] for r in sweep)
    out = [f"| size | run | config | parameters | tokens | training FLOPs | peak lr | estimated {gpu_type.upper()} "
           f"GPU-hours at {mfu:.0%} MFU | x {len(SEEDS)} seeds |", "|---|---|---|---|---|---|---|---|---|"]
    out.append(f"| {SWEEP_SIZE} | sweep | every kind at {' / '.join(f'{f:g}x' for f in SWEEP_FACTORS)} its rate | | "
               f"{sweep[0]['tokens'] / 1e9:g}B each | | | {sweep_hours:,.0f} ({len(sweep)} runs) | |")
    base = {r["run"]: r["lr"] for r in rows if r["size"] == SWEEP_SIZE}
    for r in rows:
        ratio = r["lr"] / base[r["run"]]
        lr = format_lr(rates[r["run"]][r["size"]]) if rates else "the sweep's" + ("" if ratio == 1 else f" x {ratio:.3g}")
        out.append(f"| {r['size']} | {r['run']} | `{r['config']}` | {r['parameters'] / 1e6:,.1f}M | "
                   f"{r['tokens'] / 1e9:g}B | {r['flops']:.3g} | {lr} | {r['gpu_hours']:,.0f} | "
                   f"{len(SEEDS) * r['gpu_hours']:,.0f} |")
    total = len(SEEDS) * sum(r["gpu_hours"] for r in rows) + sweep_hours
    out.append(f"| all | | | | | | | | {total:,.0f} |")
    return "\n".join(out) + "\n"


def layout_markdown(layouts: list[dict]) -> str:
    out = ["| config | nodes x GPUs | one checkpoint | checkpoints held (of saves) | checkpoint disk | "
           "data-parallel traffic a GPU a step | its time (link) | compute a step | traffic / compute |",
           "|---|---|---|---|---|---|---|---|---|"]
    for lay in layouts:
        out.append(f"| `{lay['config']}` | {lay['nodes']} x {GPUS_PER_NODE} | {lay['checkpoint_bytes'] / 1e9:.1f} GB | "
                   f"{lay['checkpoints_held']} (of {lay['saves']}) | {lay['checkpoint_disk_bytes'] / 1e9:.0f} GB | "
                   f"{lay['traffic_bytes_per_gpu_per_step'] / 1e9:.2f} GB | {1000 * lay['communication_s_per_step']:.1f} "
                   f"ms ({lay['link_gbps']:g} Gb/s {lay['link']}) | {1000 * lay['compute_s_per_step']:.1f} ms | "
                   f"{lay['communication_over_compute']:.2f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    from megatron_lev.training.flops import PEAK_TFLOPS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-type", choices=sorted(PEAK_TFLOPS), default="h100")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (default 0.4)")
    parser.add_argument("--inter-node-gbps", type=float, help="network per GPU between nodes, Gbit/s "
                        "(default per --gpu-type: a100 200, h100/h200 400)")
    parser.add_argument("--intra-node-gbps", type=float, help="NVLink per GPU, Gbit/s (default a100 2400, h100 3600)")
    parser.add_argument("--keep-checkpoints", type=int, default=KEEP_CHECKPOINTS,
                        help=f"the newest K kept, as the Slurm scripts' KEEP_CHECKPOINTS (default {KEEP_CHECKPOINTS}; 0: all)")
    parser.add_argument("--sweep-json", help="the sweep's ranking (lr_sweep's sweep.json): the chosen rates")
    parser.add_argument("--lr-flags", metavar="KIND", help="print only KIND's --lr/--min-lr at --size (needs --sweep-json)")
    parser.add_argument("--size", choices=SIZES, default="1.2b")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 0 < args.mfu <= 1 or math.isnan(args.mfu):
        parser.error(f"--mfu {args.mfu}: must lie in (0, 1]")
    for name in ("inter_node_gbps", "intra_node_gbps"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{name.replace('_', '-')} {value}: must be a number > 0")
    if args.keep_checkpoints < 0:
        parser.error(f"--keep-checkpoints {args.keep_checkpoints}: must be >= 0")
    if args.lr_flags and not args.sweep_json:
        parser.error("--lr-flags: needs --sweep-json (the sweep's ranking)")
    rows = plan(args.gpu_type, args.mfu)
    rates = None
    if args.sweep_json:
        try:
            with open(args.sweep_json, encoding="utf-8") as f:
                rates = choose_rates(json.load(f), rows)
        except (OSError, ValueError) as exc:
            print(f"cluster_plan.py: error: --sweep-json {args.sweep_json}: {exc}", file=sys.stderr)
            return 2
    if args.lr_flags:
        if args.lr_flags not in rates:
            parser.error(f"--lr-flags {args.lr_flags}: not a run (one of: {', '.join(rates)})")
        print(lr_flags(rates[args.lr_flags][args.size]))
        return 0
    links = {**LINKS_GBPS[args.gpu_type]}
    links.update({k: v for k, v in (("inter_node", args.inter_node_gbps), ("intra_node", args.intra_node_gbps)) if v})
    layouts = [layout(row, args.gpu_type, args.mfu, links, args.keep_checkpoints) for row in rows]
    warnings = layout_warnings(layouts)
    if args.json:
        print(json.dumps({"gpu_type": args.gpu_type, "mfu": args.mfu, "runs": rows, "sweep": sweep_runs(rows),
                          "rates": rates, "layouts": layouts, "warnings": warnings,
                          "commands": commands(rows, args.gpu_type, rates, args.sweep_json)}, indent=2))
    else:
        print(markdown(rows, args.gpu_type, args.mfu, rates))
        print(layout_markdown(layouts))
        print("\n".join(warnings + commands(rows, args.gpu_type, rates, args.sweep_json)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
