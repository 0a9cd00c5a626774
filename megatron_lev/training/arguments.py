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

from megatron_lev.checkpointing.catalog import check_retention
from megatron_lev.configs import config_path, load_config, model_field_source
from megatron_lev.models.settings import ATTENTION_BACKENDS, TRAINER_SETTINGS
from megatron_lev.training.ds_config import build_deepspeed_config
from megatron_lev.training.megatron_flags import TRAIN_IGNORED, TRAIN_REFUSED
from megatron_lev.training.tokenizer_args import check_tokenizer_flags
from megatron_lev.utils.errors import ConfigError
from megatron_lev.utils.flags import MegatronArgumentParser, add_compat_flags, warn_ignored

# Values used when neither a flag nor the YAML's `training:` section sets a key.
TRAINING_DEFAULTS = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "micro_batch_size": None,
    "global_batch_size": None,
    "seq_length": None,
    "train_iters": None,
    "train_tokens": None,
    "train_samples": None,
    "lr": None,
    "min_lr": 0.0,
    "decoupled_lr": None,
    "decoupled_min_lr": None,
    "lev_lr_mult": 1.0,
    "lev_clip_grad": None,
    "lev_no_weight_decay": False,
    "lev_union_ids": False,
    "lr_warmup_iters": 0,
    "lr_warmup_samples": 0,
    "lr_warmup_fraction": None,
    "lr_warmup_init": 0.0,
    "lr_decay_iters": None,
    "lr_decay_samples": None,
    "lr_decay_style": "cosine",
    "lr_wsd_decay_style": "exponential",
    "lr_wsd_decay_iters": None,
    "lr_wsd_decay_samples": None,
    "override_opt_param_scheduler": False,
    "use_checkpoint_opt_param_scheduler": False,
    "weight_decay": 0.01,
    "start_weight_decay": None,
    "end_weight_decay": None,
    "weight_decay_incr_style": "constant",
    "clip_grad": 1.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_eps": 1e-8,
    "bf16": False,
    "recompute_activations": False,
    "recompute_granularity": None,
    "recompute_method": None,
    "recompute_num_layers": None,
    "sequence_parallel": False,
    "compile_layers": False,
    "attention_backend": "auto",
    "data_path": None,
    "split": "969,30,1",
    "train_data_path": None,
    "valid_data_path": None,
    "test_data_path": None,
    "data_cache_path": None,
    "eod_mask_loss": False,
    "reset_position_ids": False,
    "tokenizer_type": None,
    "tokenizer_model": None,
    "vocab_file": None,
    "merge_file": None,
    "num_workers": None,  # validate_args: 2 where CUDA is (Megatron-LM's default), 0 on CPU
    "save": None, "load": None, "save_interval": None, "keep_last_checkpoints": None, "keep_checkpoints_every": None,
    "no_load_optim": False,
    "ckpt_step": None,
    "override_checkpoint_args": False,
    "eval_interval": 1000,
    "eval_iters": 10,
    "seed": 1234,
    "distributed_timeout_minutes": 10,
    "deepspeed_config": None,
    "zero_stage": None,
    "log_interval": 100,
    "log_throughput": False,
    "timing_log_level": 0,
    "timing_log_option": "minmax",
    "logging_level": None,
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

# Model-section fields that flags may override, with Megatron-LM's names (models/settings.py's table).
MODEL_OVERRIDE_FLAGS = tuple(s.field for s in TRAINER_SETTINGS)


def build_parser() -> argparse.ArgumentParser:
    """All flags default to SUPPRESS, so the namespace holds only what was typed."""
    p = MegatronArgumentParser(
        prog="python -m megatron_lev.train", argument_default=argparse.SUPPRESS,
        description="Pre-train a Leviathan (LEV) or baseline model under DeepSpeed. Flags override "
                    "the --config YAML's training: section.")
    p.add_argument("--config", required=True, help="packaged config name (e.g. lev-200m) or a YAML path")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int)
    g.add_argument("--pipeline-model-parallel-size", type=int)
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction,
                   help="shard norms/dropout activations along the sequence (CUDA only)")
    g.add_argument("--deepspeed-config", "--deepspeed_config", dest="deepspeed_config",
                   help="DeepSpeed JSON (a path, or a name in deepspeed_configs/ such as zero2); 'auto' values "
                   "are filled from these flags (--deepspeed_config: Megatron-DeepSpeed's spelling)")
    g.add_argument("--zero-stage", type=int, choices=(1, 2, 3),
                   help="shortcut for --deepspeed-config deepspeed_configs/zero{N}.json (default 1)")

    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int, help="sequences per optimizer step (all DP ranks)")
    g.add_argument("--seq-length", type=int)
    g.add_argument("--train-iters", type=int)
    g.add_argument("--train-tokens", type=float, help="train for ceil(tokens / (global batch x seq)) steps")
    g.add_argument("--train-samples", type=int, help="train for samples // global batch steps; the --lr-*-samples "
                   "flags then set the schedule")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--min-lr", type=float)
    g.add_argument("--decoupled-lr", type=float, help="peak learning rate of the input side (the LEV generator or "
                   "the embedding table) and the output layer; the rest keeps --lr (Megatron's flag)")
    g.add_argument("--decoupled-min-lr", type=float, help="minimum learning rate of the --decoupled-lr parameters "
                   "(default: --min-lr)")
    g.add_argument("--lev-lr-mult", type=float, help="learning-rate multiplier of the LEV generator alone (not the "
                   "output layer), on its schedule (docs/lev.md, Knobs)")
    g.add_argument("--lev-clip-grad", type=float, help="clip the LEV generator's gradient norm to this and the rest's "
                   "to --clip-grad, each by its own norm (default: one global norm, Megatron's; 0 leaves it unclipped)")
    g.add_argument("--lev-no-weight-decay", action=argparse.BooleanOptionalAction,
                   help="no weight decay on the LEV generator's parameters, as its author trains it (default: "
                        "--weight-decay on its matrices; docs/lev.md, The author's training)")
    g.add_argument("--lev-union-ids", action=argparse.BooleanOptionalAction, help="the LEV generator once per step, on "
                   "the union of its micro-batches' distinct ids (same losses and gradients to float32 rounding; no "
                   "change with one micro-batch per step; untimed on a GPU, default off; docs/training.md)")
    g.add_argument("--lr-warmup-iters", type=int)
    g.add_argument("--lr-warmup-samples", type=int)
    g.add_argument("--lr-warmup-fraction", type=float, help="warmup as a fraction of the decay length")
    g.add_argument("--lr-warmup-init", type=float, help="learning rate at the start of warmup (default 0)")
    g.add_argument("--lr-decay-iters", type=int, help="default: the number of training iterations")
    g.add_argument("--lr-decay-samples", type=int, help="default: --train-samples")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    g.add_argument("--lr-wsd-decay-style", choices=("exponential", "linear", "cosine", "minus_sqrt"))
    g.add_argument("--lr-wsd-decay-iters", type=int, help="length of WSD's final decay")
    g.add_argument("--lr-wsd-decay-samples", type=int)
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on resume, use these flags' schedule, not the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on resume, keep the checkpoint's schedule (lr, min-lr, warmup, decay length and style)")
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--start-weight-decay", type=float)
    g.add_argument("--end-weight-decay", type=float)
    g.add_argument("--weight-decay-incr-style", choices=("constant", "linear", "cosine"))
    g.add_argument("--clip-grad", type=float, help="global grad-norm clip (0 disables)")
    g.add_argument("--adam-beta1", type=float)
    g.add_argument("--adam-beta2", type=float)
    g.add_argument("--adam-eps", type=float)
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction)
    g.add_argument("--recompute-activations", action=argparse.BooleanOptionalAction,
                   help="selective recompute (core attention), as --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=("full", "selective"))
    g.add_argument("--recompute-method", choices=("uniform", "block"),
                   help="full: checkpoint chunks of --recompute-num-layers (uniform), or the first "
                   "--recompute-num-layers layers of each stage (block)")
    g.add_argument("--recompute-num-layers", type=int)
    g.add_argument("--compile-layers", action=argparse.BooleanOptionalAction,
                   help="torch.compile each decoder layer (fuses RoPE, SwiGLU, RMSNorm and residual adds; "
                   "as torchtitan does); the Slurm scripts turn it on for GPUs")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                   help="torch SDPA's backends (Megatron-LM's flag): auto prefers cuDNN's attention on Hopper and "
                   "later (torch's own order elsewhere), flash, fused (cuDNN's), unfused and local (the math backend)")
    g.add_argument("--seed", type=int)

    g = p.add_argument_group("model overrides (change the YAML's model: section)")
    for setting in TRAINER_SETTINGS:
        if setting.type is bool:
            g.add_argument(setting.flag, dest=setting.field, action=argparse.BooleanOptionalAction)
        else:
            g.add_argument(setting.flag, dest=setting.field, type=setting.type, choices=setting.choices)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", help="prefix, or a Megatron blend: 0.3 pathA 0.7 pathB")
    g.add_argument("--split", help="train,valid,test weights for --data-path (default 969,30,1)")
    g.add_argument("--train-data-path", nargs="+")
    g.add_argument("--valid-data-path", nargs="+")
    g.add_argument("--test-data-path", nargs="+")
    g.add_argument("--data-cache-path")
    g.add_argument("--tokenizer-type", choices=("GPT2BPETokenizer", "SentencePieceTokenizer",
                                                 "GPTSentencePieceTokenizer", "HuggingFaceTokenizer"))
    g.add_argument("--tokenizer-model", help="SentencePiece .model, or a Hugging Face tokenizer.json or folder")
    g.add_argument("--vocab-file", help="GPT2BPETokenizer: GPT-2's vocab.json (e.g. gpt2-vocab.json)")
    g.add_argument("--merge-file", help="GPT2BPETokenizer: GPT-2's merges.txt (e.g. gpt2-merges.txt)")
    g.add_argument("--num-workers", type=int, help="data-loader worker processes per rank (default 2 with CUDA, "
                   "0 on CPU)")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="position ids restart after each end-of-document token")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", help="checkpoint directory")
    g.add_argument("--load", help="resume from this directory's latest complete checkpoint "
                   "(an empty or missing directory starts fresh)")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--keep-last-checkpoints", type=int, metavar="K", help="delete all but the newest K")
    g.add_argument("--keep-checkpoints-every", type=int, metavar="N", help="and keep those of every N-th iteration")
    g.add_argument("--no-load-optim", action="store_true",
                   help="load weights only (fresh optimizer moments; iteration, consumed samples and the LR "
                        "schedule continue)")
    g.add_argument("--ckpt-step", type=int, metavar="N",
                   help="resume from --load's checkpoint of iteration N instead of the latest (refused if it is "
                        "incomplete or damaged)")
    g.add_argument("--override-checkpoint-args", action="store_true",
                   help="resume although the checkpoint's run used another tokenizer or --seed (refused "
                        "otherwise; docs/security.md)")

    g = p.add_argument_group("evaluation, logging, exit")
    g.add_argument("--eval-interval", type=int)
    g.add_argument("--eval-iters", type=int, help="global batches per evaluation")
    g.add_argument("--log-interval", type=int)
    g.add_argument("--log-throughput", action="store_true", help="add TFLOP/s per GPU (and MFU) to the log line")
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2),
                   help="0: the iteration time only; 1: also forward-backward, all-grads-sync, optimizer; 2: also "
                        "batch-generator, forward-compute, backward-compute (per iteration, after each log line)")
    g.add_argument("--timing-log-option", choices=("max", "minmax", "all"),
                   help="report the timers' max over ranks, their min and max (default) or every rank's")
    g.add_argument("--logging-level", type=int,
                   help="Python logging level (10 debug, 20 info; default: loggers' own, DeepSpeed's WARNING); 10 "
                   "also shows the third-party start-up chatter a run hides (DeepSpeed's memory dumps, megatron-core "
                   "warnings that do not apply)")
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
    g.add_argument("--distributed-timeout-minutes", type=int, help="collective timeout (default 10)")
    g.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int,
                   help="set by the deepspeed launcher; the rank comes from the environment")
    add_compat_flags(p, TRAIN_IGNORED, TRAIN_REFUSED)
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
    warn_ignored("megatron_lev.train", given.pop("ignored_flags", ()), TRAIN_IGNORED)
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
    # The run length, the warmup and the decay length are one setting each: a flag for any
    # of its forms replaces the YAML's.
    for forms in (("train_iters", "train_tokens", "train_samples"),
                  ("lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction"),
                  ("lr_decay_iters", "lr_decay_samples"), ("lr_wsd_decay_iters", "lr_wsd_decay_samples")):
        if any(k in given for k in forms):
            for k in forms:
                training.pop(k, None)
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
    # Who set model.vocab_size: a file of the user's (kept) or a packaged config (a default the
    # tokenizer replaces; derive_vocab_size).
    args.vocab_size_source = model_field_source(path, "vocab_size")
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

    # None stays None: the loader picks by the device (build_pretraining_data_loader), as the
    # flag check at submit imports no torch.
    if args.num_workers is not None and args.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0, got {args.num_workers}")

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

    if sum(getattr(args, k) is not None for k in ("train_iters", "train_tokens", "train_samples")) > 1:
        raise ConfigError(f"{args.config}: set one of training.train_iters, train_tokens, train_samples")
    if args.train_tokens is not None:
        if args.train_tokens <= 0:
            raise ConfigError(f"--train-tokens must be > 0, got {args.train_tokens}")
        args.train_iters = math.ceil(args.train_tokens / args.tokens_per_step)
    if args.train_samples is not None:
        args.train_iters = args.train_samples // args.global_batch_size  # Megatron's rule
        if args.train_iters < 1:
            raise ConfigError(f"--train-samples {args.train_samples} is less than one --global-batch-size "
                              f"{args.global_batch_size}")
    if args.train_iters is None:
        raise ConfigError(f"--train-iters, --train-samples or --train-tokens is required (or training.train_iters "
                          f"in {args.config})")
    if args.train_iters < 1:
        raise ConfigError(f"--train-iters must be >= 1, got {args.train_iters}")
    if not 0 <= args.min_lr <= args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} must lie in [0, --lr {args.lr}]")
    check_decoupled_lr(args)
    if not (math.isfinite(args.lev_lr_mult) and args.lev_lr_mult > 0):
        raise ConfigError(f"--lev-lr-mult must be a finite number > 0, got {args.lev_lr_mult}")
    if args.lev_clip_grad is not None and not (math.isfinite(args.lev_clip_grad) and args.lev_clip_grad >= 0):
        raise ConfigError(f"--lev-clip-grad must be a finite number >= 0, got {args.lev_clip_grad}")
    embedding = args.model.get("embedding")
    for flag, on in (("--lev-lr-mult", args.lev_lr_mult != 1.0), ("--lev-clip-grad", args.lev_clip_grad is not None),
                     ("--lev-no-weight-decay", args.lev_no_weight_decay), ("--lev-union-ids", args.lev_union_ids)):
        if on and embedding != "lev":
            raise ConfigError(f"{flag}: the model has no LEV generator (embedding: {embedding})")
    _schedule_in_samples(args)
    args.recompute = recompute_setting(args)
    if args.clip_grad < 0:
        raise ConfigError(f"--clip-grad must be >= 0, got {args.clip_grad}")

    if args.data_path and (args.train_data_path or args.valid_data_path or args.test_data_path):
        raise ConfigError("--data-path and --train-data-path/--valid-data-path/--test-data-path "
                          "are alternatives: give one form")
    if not args.data_path and not args.train_data_path:
        raise ConfigError("--data-path (or --train-data-path) is required")
    check_tokenizer_flags(args)
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


def _schedule_in_samples(args: argparse.Namespace) -> None:
    """Megatron's schedule lengths, in samples (the unit megatron-core's
    OptimizerParamScheduler steps in): lr_warmup_steps, lr_decay_steps, wsd_decay_steps,
    wd_incr_steps; start/end_weight_decay default to --weight-decay.

    Iteration-based runs (--train-iters/--train-tokens) take --lr-*-iters (x global batch)
    or --lr-warmup-fraction; --train-samples runs take --lr-*-samples (an iteration count
    from the YAML is converted; one typed with --train-samples is refused, as in Megatron).
    """
    gbs = args.global_batch_size
    given = set(args.given_flags)
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are alternatives: give one")
    if args.train_samples is None:
        for dest in ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples"):
            if getattr(args, dest):
                raise ConfigError(f"{_dest_to_flag(dest)} needs --train-samples (use the -iters form with "
                                  f"--train-iters)")
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        decay = args.lr_decay_iters * gbs
        warmup = args.lr_warmup_iters * gbs
        wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
        args.wd_incr_steps = args.train_iters * gbs
    else:
        for dest in ("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters"):
            if dest in given:
                raise ConfigError(f"{_dest_to_flag(dest)} cannot be used with --train-samples (use the "
                                  f"-samples form)")
        decay = args.lr_decay_samples or (args.lr_decay_iters * gbs if args.lr_decay_iters else args.train_samples)
        warmup = args.lr_warmup_samples or args.lr_warmup_iters * gbs
        wsd = (args.lr_wsd_decay_samples if args.lr_wsd_decay_samples is not None else
               args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None)
        args.lr_decay_iters = math.ceil(decay / gbs)
        args.wd_incr_steps = args.train_samples
    if args.lr_warmup_fraction is not None:
        if not 0 <= args.lr_warmup_fraction < 1:
            raise ConfigError(f"--lr-warmup-fraction {args.lr_warmup_fraction} must lie in [0, 1)")
        warmup = args.lr_warmup_fraction * decay
    if decay <= 0 or not 0 <= warmup < decay:
        raise ConfigError(f"the warmup ({warmup} samples: --lr-warmup-*) must be shorter than the decay ({decay} "
                          f"samples: --lr-decay-iters/--lr-decay-samples, default the run length)")
    if args.lr_decay_style == "WSD" and wsd is None:
        raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
    if not 0 <= args.lr_warmup_init <= args.lr:
        raise ConfigError(f"--lr-warmup-init {args.lr_warmup_init} must lie in [0, --lr {args.lr}]")
    args.lr_warmup_steps, args.lr_decay_steps, args.wsd_decay_steps = warmup, decay, wsd
    for dest in ("start_weight_decay", "end_weight_decay"):
        if getattr(args, dest) is None:
            setattr(args, dest, args.weight_decay)
    if args.weight_decay_incr_style == "constant" and args.start_weight_decay != args.end_weight_decay:
        raise ConfigError(f"--start-weight-decay {args.start_weight_decay} and --end-weight-decay "
                          f"{args.end_weight_decay} differ: give --weight-decay-incr-style linear or cosine")
    if not 0 <= args.start_weight_decay <= args.end_weight_decay:
        raise ConfigError("--start-weight-decay must lie in [0, --end-weight-decay]")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other")


def check_decoupled_lr(args: argparse.Namespace) -> None:
    """--decoupled-lr / --decoupled-min-lr: the same warmup and decay as --lr, to other end points."""
    if args.decoupled_lr is None:
        if args.decoupled_min_lr is not None:
            raise ConfigError(f"--decoupled-min-lr {args.decoupled_min_lr} needs --decoupled-lr")
        return
    if not args.decoupled_lr > 0 or args.decoupled_lr < args.lr_warmup_init:
        raise ConfigError(f"--decoupled-lr {args.decoupled_lr} must be > 0 and >= --lr-warmup-init "
                          f"{args.lr_warmup_init}")
    low = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
    if not 0 <= low <= args.decoupled_lr:
        raise ConfigError(f"--decoupled-min-lr {low} (default: --min-lr) must lie in [0, --decoupled-lr "
                          f"{args.decoupled_lr}]")


def recompute_setting(args: argparse.Namespace):
    """The model's `recompute` (model_config_from_dict) from Megatron's flags:
    --recompute-activations is selective recompute (core attention), as in Megatron;
    --recompute-granularity full needs --recompute-method and --recompute-num-layers."""
    granularity = args.recompute_granularity or ("selective" if args.recompute_activations else None)
    if granularity is None:
        if args.recompute_method is not None or args.recompute_num_layers is not None:
            raise ConfigError("--recompute-method/--recompute-num-layers need --recompute-granularity full")
        return False
    if granularity == "selective":
        if args.recompute_method is not None:
            raise ConfigError("--recompute-method applies to --recompute-granularity full only (as in Megatron)")
        return "selective"
    if args.recompute_method is None or args.recompute_num_layers is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method (uniform or block) and "
                          "--recompute-num-layers")
    if args.recompute_num_layers < 1:
        raise ConfigError(f"--recompute-num-layers must be >= 1, got {args.recompute_num_layers}")
    return {"recompute_granularity": "full", "recompute_method": args.recompute_method,
            "recompute_num_layers": args.recompute_num_layers}


def effective_config(args: argparse.Namespace, model: dict | None = None) -> dict:
    """The run's full configuration: what is printed at start and saved with checkpoints.

    `model` is the resolved model section (`LeviathanConfig.to_dict()`: defaults and
    derived sizes filled in, so it rebuilds the model exactly); default: the YAML's
    section with flag overrides.
    """
    training = {k: getattr(args, k) for k in TRAINING_DEFAULTS}
    for k in ("data_parallel_size", "gradient_accumulation_steps", "tokens_per_step", "lr_warmup_steps",
              "lr_decay_steps", "wsd_decay_steps", "wd_incr_steps"):
        if hasattr(args, k):
            training[k] = getattr(args, k)
    return {"config": args.config, "argv": list(args.argv), "model": dict(model if model is not None else args.model),
            "training": training}


def validate_flags(argv, world_size: int) -> tuple[argparse.Namespace, dict]:
    """The checks that read only the command line, the YAML and the DeepSpeed JSON: parse,
    validate against the job size, build the DeepSpeed config. The first steps of the trainer's
    start-up validation (validation.py), and what the Slurm scripts run at submit time."""
    args = validate_args(parse_args(argv), world_size)
    check_retention(args.keep_last_checkpoints, args.keep_checkpoints_every, args.save_interval)
    return args, build_deepspeed_config(args)


def main(argv=None) -> int:
    """`python -m megatron_lev.training.arguments --world-size N <training flags>`: check the
    flags of a job of N processes without reading data or importing torch (the Slurm scripts'
    submit-time check); exit 0 silently, or print the one-line error and exit 2."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--world-size", type=int, default=1)
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        validate_flags(rest, known.world_size)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"megatron_lev.train: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
