"""The cluster recipe of experiments/run.sh: the papers' two comparisons at 125M and 1.2B on
The Pile, at the papers' 200,064-entry vocabulary, 3 seeds each. Prints the expected
GPU-hours of every run from the FLOPs model (megatron_lev.training.flops, the trainer's own
formula) and the `sbatch` lines, evaluation and seed-summary commands that run it.

    python experiments/cluster_plan.py                        # H100, 40% MFU (assumed)
    python experiments/cluster_plan.py --gpu-type a100 --mfu 0.35 --json

GPU-hours = training FLOPs / (peak bf16 FLOP/s x MFU) / 3600. The FLOPs count the matrix
multiplications (6 x matmul parameters + attention, per token) and, for LEV, the generator
once per distinct token of each micro-batch, bounded here by once per token (an upper
bound; it is ~0.2% of the total at these sizes). MFU is an assumption, not a measurement:
pass what your cluster's `metrics.jsonl` shows (`mfu`) after the first log interval.
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


def run_cost(config_name: str, gpu_type: str, mfu: float) -> dict:
    """Parameters, tokens, training FLOPs and GPU-hours of one packaged config's run."""
    from megatron_lev.configs import load_config
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.param_count import count_parameters
    from megatron_lev.training.flops import flops_model, peak_flops_per_device, training_flops

    config = load_config(config_name)
    model = model_config_from_dict(config["model"])
    training = config["training"]
    tokens = float(training["train_tokens"])
    flops = training_flops(flops_model(model, training["seq_length"]), int(tokens), int(tokens))
    return {"config": config_name, "parameters": count_parameters(model)["total"], "tokens": tokens,
            "flops": flops, "gpu_hours": flops / (peak_flops_per_device(gpu_type, None) * mfu) / 3600}


def plan(gpu_type: str = "h100", mfu: float = 0.4) -> list[dict]:
    rows = []
    for size in SIZES:
        for name, pattern, script in RUNS:
            rows.append({"size": size, "run": name, "script": script,
                         **run_cost(pattern.format(size=size), gpu_type, mfu)})
    return rows


def commands(rows: list[dict], gpu_type: str) -> list[str]:
    """sbatch lines (every run x seed), then per size and seed the evaluation and curves, then
    the summary over seeds. Data and tokenizer come from the environment (docs/slurm.md)."""
    lines = ["# once: DATA_PATH, VALID_DATA_PATH (The Pile, tokenized with the 200k tokenizer.json: "
             "slurm/preprocess_pile.sh) and", "export TOKENIZER_TYPE=HuggingFaceTokenizer "
             "TOKENIZER_MODEL=/data/tok/o200k/tokenizer.json"]
    for row in rows:
        for seed in SEEDS:
            save = f"checkpoints/exp/{row['config']}-s{seed}"
            lines.append(f"CONFIG={row['config']} GPU_TYPE={gpu_type} CHECKPOINT_DIR={save} "
                         f"EXTRA_ARGS=\"--seed {seed} --eval-interval 500\" sbatch --nodes="
                         f"{1 if row['size'] == '125m' else 4} {row['script']}")
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


def markdown(rows: list[dict], gpu_type: str, mfu: float) -> str:
    out = [f"| size | run | config | parameters | tokens | training FLOPs | estimated {gpu_type.upper()} GPU-hours "
           f"at {mfu:.0%} MFU | x {len(SEEDS)} seeds |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['size']} | {r['run']} | `{r['config']}` | {r['parameters'] / 1e6:,.1f}M | "
                   f"{r['tokens'] / 1e9:g}B | {r['flops']:.3g} | {r['gpu_hours']:,.0f} | "
                   f"{len(SEEDS) * r['gpu_hours']:,.0f} |")
    total = len(SEEDS) * sum(r["gpu_hours"] for r in rows)
    out.append(f"| all | | | | | | | {total:,.0f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    from megatron_lev.training.flops import PEAK_TFLOPS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-type", choices=sorted(PEAK_TFLOPS), default="h100")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (default 0.4)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 0 < args.mfu <= 1 or math.isnan(args.mfu):
        parser.error(f"--mfu {args.mfu}: must lie in (0, 1]")
    rows = plan(args.gpu_type, args.mfu)
    if args.json:
        print(json.dumps({"gpu_type": args.gpu_type, "mfu": args.mfu, "runs": rows,
                          "commands": commands(rows, args.gpu_type)}, indent=2))
    else:
        print(markdown(rows, args.gpu_type, args.mfu))
        print("\n".join(commands(rows, args.gpu_type)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
