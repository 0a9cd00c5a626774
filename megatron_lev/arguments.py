"""Command-line flags of `python -m megatron_lev.train`, merged over a YAML config.

Precedence, highest first: a flag given on the command line, the YAML's `training:`
section, the defaults in `TRAINING_DEFAULTS`. Flag names and `args` attribute names
are Megatron-LM's (`--micro-batch-size` -> `args.micro_batch_size`), so the YAML's
`training:` keys are exactly the flags' dests.

`parse_args(argv)` only parses and merges; `validate_args(args, world_size)` checks
the combination against the job's size and fills in what follows from it
(data-parallel size, gradient-accumulation steps, train iterations from tokens, ...).
Every problem is a `ConfigError` with one line naming the flag(s).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import yaml

from megatron_lev.configs import config_path, load_config


class ConfigError(ValueError):
    """A bad flag, config value or combination; the message names the flag(s)."""


# Values used when neither a flag nor the YAML's `training:` section sets a key.
TRAINING_DEFAULTS = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "micro_batch_size": None,
    "global_batch_size": None,
    "seq_length": None,
    "train_iters": None,
    "train_tokens": None,
    "lr": None,
    "min_lr": 0.0,
    "lr_warmup_iters": 0,
    "lr_decay_iters": None,
    "lr_decay_style": "cosine",
    "weight_decay": 0.01,
    "clip_grad": 1.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_eps": 1e-8,
    "bf16": False,
    "recompute_activations": False,
    "sequence_parallel": False,
    "data_path": None,
    "split": "969,30,1",
    "train_data_path": None,
    "valid_data_path": None,
    "test_data_path": None,
    "data_cache_path": None,
    "tokenizer_type": None,
    "tokenizer_model": None,
    "num_workers": 0,
    "save": None,
    "load": None,
    "save_interval": None,
    "keep_last_checkpoints": None,
    "no_load_optim": False,
    "eval_interval": 1000,
    "eval_iters": 10,
    "seed": 1234,
    "deepspeed_config": None,
    "zero_stage": None,
    "log_interval": 100,
    "tensorboard_dir": None,
    "metrics_file": None,
    "wandb_project": None,
    "wandb_exp_name": None,
    "wandb_save_dir": None,
    "max_skipped_steps": 10,
    "gpu_type": None,
    "peak_tflops": None,
    "exit_signal_handler": True,
    "exit_interval": None,
    "exit_duration_in_mins": None,
}

# Model-section fields that flags may override (Megatron names on the command line).
MODEL_OVERRIDE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                        "num_query_groups", "rotary_base", "embedding")


def build_parser() -> argparse.ArgumentParser:
    """All flags default to SUPPRESS, so the namespace holds only what was typed."""
    p = argparse.ArgumentParser(
        prog="python -m megatron_lev.train", argument_default=argparse.SUPPRESS,
        description="Pre-train a Leviathan (LEV) or baseline model under DeepSpeed. Flags override "
                    "the --config YAML's training: section.")
    p.add_argument("--config", required=True, help="packaged config name (e.g. lev-200m) or a YAML path")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int)
    g.add_argument("--pipeline-model-parallel-size", type=int)
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction,
                   help="shard norms/dropout activations along the sequence (CUDA only)")
    g.add_argument("--deepspeed-config", help="DeepSpeed JSON (a path, or a name in deepspeed_configs/ such "
                   "as zero2); 'auto' values are filled from these flags")
    g.add_argument("--zero-stage", type=int, choices=(1, 2, 3),
                   help="shortcut for --deepspeed-config deepspeed_configs/zero{N}.json (default 1)")

    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int, help="sequences per optimizer step (all DP ranks)")
    g.add_argument("--seq-length", type=int)
    g.add_argument("--train-iters", type=int)
    g.add_argument("--train-tokens", type=float, help="train for ceil(tokens / (global batch x seq)) steps")
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float)
    g.add_argument("--lr-warmup-iters", type=int)
    g.add_argument("--lr-decay-iters", type=int, help="default: the number of training iterations")
    g.add_argument("--lr-decay-style", choices=("cosine", "linear", "constant"))
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--clip-grad", type=float, help="global grad-norm clip (0 disables)")
    g.add_argument("--adam-beta1", type=float)
    g.add_argument("--adam-beta2", type=float)
    g.add_argument("--adam-eps", type=float)
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction)
    g.add_argument("--recompute-activations", action=argparse.BooleanOptionalAction,
                   help="checkpoint every transformer layer's activations")
    g.add_argument("--seed", type=int)

    g = p.add_argument_group("model overrides (change the YAML's model: section)")
    for name in MODEL_OVERRIDE_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), type=str if name == "embedding" else int
                       if name != "rotary_base" else float)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", help="prefix, or a Megatron blend: 0.3 pathA 0.7 pathB")
    g.add_argument("--split", help="train,valid,test weights for --data-path (default 969,30,1)")
    g.add_argument("--train-data-path", nargs="+")
    g.add_argument("--valid-data-path", nargs="+")
    g.add_argument("--test-data-path", nargs="+")
    g.add_argument("--data-cache-path")
    g.add_argument("--tokenizer-type", choices=("SentencePieceTokenizer", "HuggingFaceTokenizer"))
    g.add_argument("--tokenizer-model")
    g.add_argument("--num-workers", type=int, help="data-loader worker processes per rank")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", help="checkpoint directory")
    g.add_argument("--load", help="resume from this directory's latest complete checkpoint "
                   "(an empty or missing directory starts fresh)")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--keep-last-checkpoints", type=int, metavar="K", help="delete all but the newest K")
    g.add_argument("--no-load-optim", action="store_true",
                   help="load weights only (fresh optimizer, schedule and counters)")

    g = p.add_argument_group("evaluation, logging, exit")
    g.add_argument("--eval-interval", type=int)
    g.add_argument("--eval-iters", type=int, help="global batches per evaluation")
    g.add_argument("--log-interval", type=int)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--metrics-file", help="JSON-lines log (default: <save>/metrics.jsonl, "
                   "else <tensorboard-dir>/metrics.jsonl)")
    g.add_argument("--wandb-project", help="log to Weights & Biases (offline unless WANDB_API_KEY is set)")
    g.add_argument("--wandb-exp-name")
    g.add_argument("--wandb-save-dir")
    g.add_argument("--gpu-type", choices=("a100", "h100", "h200"), help="peak bf16 FLOP/s for MFU")
    g.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device for MFU (overrides --gpu-type)")
    g.add_argument("--max-skipped-steps", type=int,
                   help="exit non-zero after this many non-finite steps in a row")
    g.add_argument("--exit-signal-handler", action=argparse.BooleanOptionalAction,
                   help="on SIGTERM/SIGUSR1: checkpoint at the next step and exit 0 (default on)")
    g.add_argument("--exit-interval", type=int, help="checkpoint and exit 0 when iteration %% N == 0")
    g.add_argument("--exit-duration-in-mins", type=float, help="checkpoint and exit 0 after this long")
    return p


def _dest_to_flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def parse_args(argv=None) -> argparse.Namespace:
    """Parse flags and merge them over the config's training: section.

    The result carries every key of TRAINING_DEFAULTS plus `config` (the path),
    `model` (the model: section with flag overrides applied), `given_flags` (the dests
    typed on the command line) and `argv`.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    given = vars(build_parser().parse_args(argv))
    try:
        path = config_path(given["config"])
        raw = load_config(path)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    training = dict(raw.get("training") or {})
    unknown = sorted(set(training) - set(TRAINING_DEFAULTS))
    if unknown:
        raise ConfigError(f"{path}: training.{unknown[0]} is not a flag of megatron_lev.train "
                          f"(known: {', '.join(sorted(TRAINING_DEFAULTS))})")
    # The run length is one setting: a flag for either form replaces the YAML's.
    if "train_iters" in given or "train_tokens" in given:
        training.pop("train_iters", None)
        training.pop("train_tokens", None)
    if "zero_stage" in given and "deepspeed_config" not in given:
        training.pop("deepspeed_config", None)

    merged = dict(TRAINING_DEFAULTS)
    merged.update(training)
    merged.update({k: v for k, v in given.items() if k in TRAINING_DEFAULTS})

    model = dict(raw["model"] or {})
    for name in MODEL_OVERRIDE_FLAGS:
        if name in given:
            model[name] = given[name]
    args = argparse.Namespace(**merged)
    args.config = str(path)
    args.model = model
    args.given_flags = sorted(k for k in given if k != "config")
    args.argv = argv
    return args


def _require(args, dest: str) -> None:
    if getattr(args, dest) is None:
        raise ConfigError(f"{_dest_to_flag(dest)} is required (give the flag or set training.{dest} "
                          f"in {args.config})")


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check the merged flags against the job size and derive the dependent values.

    Adds: data_parallel_size, gradient_accumulation_steps, tokens_per_step,
    train_iters (from --train-tokens when given), lr_decay_iters (default train_iters).
    """
    for dest in ("micro_batch_size", "seq_length", "lr"):
        _require(args, dest)
    for dest in ("micro_batch_size", "seq_length", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "eval_iters", "log_interval"):
        if getattr(args, dest) < 1:
            raise ConfigError(f"{_dest_to_flag(dest)} must be >= 1, got {getattr(args, dest)}")
    for dest in ("eval_interval", "save_interval", "keep_last_checkpoints", "exit_interval", "max_skipped_steps"):
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise ConfigError(f"{_dest_to_flag(dest)} must be >= 1, got {value}")

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp) != 0:
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = {tp * pp} "
            f"does not divide the world size {world_size}")
    dp = world_size // (tp * pp)
    args.data_parallel_size = dp
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    per_step = args.micro_batch_size * dp
    if args.global_batch_size % per_step != 0:
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp} (= world {world_size} / "
            f"(--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp})) = {per_step}")
    args.gradient_accumulation_steps = args.global_batch_size // per_step
    args.tokens_per_step = args.global_batch_size * args.seq_length

    if args.train_iters is not None and args.train_tokens is not None:
        raise ConfigError(f"{args.config}: set training.train_iters or training.train_tokens, not both")
    if args.train_tokens is not None:
        if args.train_tokens <= 0:
            raise ConfigError(f"--train-tokens must be > 0, got {args.train_tokens}")
        args.train_iters = math.ceil(args.train_tokens / args.tokens_per_step)
    if args.train_iters is None:
        raise ConfigError(f"--train-iters or --train-tokens is required (or training.train_iters in {args.config})")
    if args.train_iters < 1:
        raise ConfigError(f"--train-iters must be >= 1, got {args.train_iters}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters < 0 or args.lr_warmup_iters > args.lr_decay_iters:
        raise ConfigError(f"--lr-warmup-iters {args.lr_warmup_iters} must lie in [0, --lr-decay-iters "
                          f"{args.lr_decay_iters}]")
    if not 0 <= args.min_lr <= args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} must lie in [0, --lr {args.lr}]")
    if args.clip_grad < 0:
        raise ConfigError(f"--clip-grad must be >= 0, got {args.clip_grad}")

    if args.data_path and (args.train_data_path or args.valid_data_path or args.test_data_path):
        raise ConfigError("--data-path and --train-data-path/--valid-data-path/--test-data-path "
                          "are alternatives: give one form")
    if not args.data_path and not args.train_data_path:
        raise ConfigError("--data-path (or --train-data-path) is required")
    if args.tokenizer_type is None or args.tokenizer_model is None:
        raise ConfigError("--tokenizer-type and --tokenizer-model are required")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # nothing to shard, as in Megatron
    if args.metrics_file is None:
        base = args.save or args.tensorboard_dir
        args.metrics_file = f"{base}/metrics.jsonl" if base else None
    if args.data_cache_path is None and args.save:
        # The checkpoint folder is one every node sees and can write, unlike a data folder
        # (read-only, or a node-local copy): rank 0 builds the index cache there, all read it.
        args.data_cache_path = os.path.join(args.save, "data_cache")
    return args


def effective_config(args: argparse.Namespace, model: dict | None = None) -> dict:
    """The run's full configuration: what is printed at start and saved with checkpoints.

    `model` is the resolved model section (`LeviathanConfig.to_dict()`: defaults and
    derived sizes filled in, so it rebuilds the model exactly); default: the YAML's
    section with flag overrides.
    """
    training = {k: getattr(args, k) for k in TRAINING_DEFAULTS}
    for k in ("data_parallel_size", "gradient_accumulation_steps", "tokens_per_step"):
        if hasattr(args, k):
            training[k] = getattr(args, k)
    return {"config": args.config, "argv": list(args.argv), "model": dict(model if model is not None else args.model),
            "training": training}


def format_config(cfg: dict) -> str:
    return yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None, width=100)
