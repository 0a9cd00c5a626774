"""The DeepSpeed config of a run: a JSON from `megatron_lev/deepspeed_configs/` (package data,
also reachable as `deepspeed_configs/` in a checkout) completed from our flags.

The JSONs hold only what is DeepSpeed's business (ZeRO stage, buckets, offload,
fp32 gradient accumulation). The keys that our flags own are written "auto" there and
filled in here, so one JSON serves every model size and batch:

    train_batch_size                 <- --global-batch-size
    train_micro_batch_size_per_gpu   <- --micro-batch-size
    gradient_accumulation_steps      <- global / (micro x data-parallel size)
    gradient_clipping                <- --clip-grad (0 with --lev-clip-grad: training/clipping.py clips)
    bf16.enabled                     <- --bf16

A JSON may also give a number for any of them; it must then equal the flag (a silent
disagreement between the two is how batch-size bugs happen). The optimizer and LR
schedule are built by the trainer (optim.py), so `optimizer`/`scheduler` sections are
refused, as is fp16 (bf16 or fp32 only).

Gradients are reduced across data-parallel ranks in fp32 (`communication_data_type`,
set in every shipped JSON and defaulted here), whatever the model dtype. What each
engine does with it in DeepSpeed 0.19 (read from its source):

    ZeRO-1 + bf16   BF16_Optimizer: fp32 gradient buffers, one all-reduce after the last
                    micro-batch's backward (engine.allreduce_bucket casts to the
                    communication dtype; no overlap, bucket/overlap settings unused)
    ZeRO-1 fp32     DeepSpeedZeroOptimizer, fp32 throughout; zero1.json turns contiguous_gradients
                    off: with it on, every gradient is copied into a bucket and again into
                    the optimizer's partition each step (measured on CPU: 3% of a demo step,
                    8% at 125M; same losses), which ZeRO-1 does not need
    ZeRO-2          DeepSpeedZeroOptimizer: fp32 `grad_accum` per parameter, reduced in
                    buckets during backward (overlap_comm) in the communication dtype
    ZeRO-3          reduce-scatter of each bucket in the communication dtype, fp32 partitions
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

from megatron_lev.utils.errors import ConfigError

DS_CONFIG_DIR = Path(__file__).resolve().parent.parent / "deepspeed_configs"
DEFAULT_ZERO_STAGE = 1
AUTO = "auto"


def resolve_deepspeed_config(name_or_path: str | None, zero_stage: int | None) -> Path:
    """`--deepspeed-config` as a path or a name in deepspeed_configs/; else zero{--zero-stage}.json."""
    if name_or_path is None:
        name_or_path = f"zero{zero_stage or DEFAULT_ZERO_STAGE}"
    path = Path(name_or_path)
    if path.is_file():
        return path
    # A name, or a checkout-relative `deepspeed_configs/zero2.json` given outside the checkout
    # (scripts written for the repo keep working with an installed package).
    name = path.name if path.parent.name == "deepspeed_configs" else name_or_path
    packaged = DS_CONFIG_DIR / (name if name.endswith(".json") else f"{name}.json")
    if packaged.is_file():
        return packaged
    available = ", ".join(sorted(p.stem for p in DS_CONFIG_DIR.glob("*.json"))) or "none found"
    raise ConfigError(f"--deepspeed-config {name_or_path}: no such file, and not one of {DS_CONFIG_DIR} "
                      f"({available})")


def _fill(section: dict, key: str, value, flag: str, source: Path) -> None:
    current = section.get(key, AUTO)
    if current == AUTO:
        section[key] = value
    elif current != value:
        raise ConfigError(f"{source}: {key} is {current!r} but {flag} gives {value!r}; set it to \"auto\" "
                          f"or make them agree")


def build_deepspeed_config(args) -> dict:
    """Load the run's DeepSpeed JSON and complete it from `args` (after validate_args)."""
    path = resolve_deepspeed_config(args.deepspeed_config, args.zero_stage)
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from exc
    cfg = copy.deepcopy(cfg)
    for section in ("optimizer", "scheduler"):
        if section in cfg:
            raise ConfigError(f"{path}: remove the '{section}' section: the trainer builds AdamW and the LR "
                              f"schedule from --lr/--min-lr/--lr-warmup-iters/--weight-decay/--adam-*")
    if cfg.get("fp16", {}).get("enabled") not in (None, False, AUTO):
        raise ConfigError(f"{path}: fp16 is not supported; use --bf16 (bf16.enabled \"auto\")")
    cfg.pop("fp16", None)

    zero = cfg.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if args.zero_stage is not None and args.deepspeed_config is not None and stage != args.zero_stage:
        raise ConfigError(f"--zero-stage {args.zero_stage} disagrees with {path} (zero_optimization.stage "
                          f"{stage}); drop one of them")
    if stage not in (1, 2, 3):
        raise ConfigError(
            f"{path}: zero_optimization.stage {stage} is not supported: use 1 (it shards only optimizer "
            f"state, at the communication cost of plain data parallelism), 2 or 3; stage 0 has no fp32 "
            f"gradient accumulation under bf16 and no overflow-skipping optimizer in fp32")
    if args.pipeline_model_parallel_size > 1 and stage > 1:
        raise ConfigError(
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} needs ZeRO stage <= 1, got "
            f"stage {stage} ({path}): ZeRO-2/3 partition gradients/parameters across data-parallel ranks "
            f"inside every backward pass, while DeepSpeed's pipeline engine accumulates each stage's "
            f"gradients over all micro-batches before reducing them; use --zero-stage 1")
    args.zero_stage = stage

    _fill(cfg, "train_batch_size", args.global_batch_size, "--global-batch-size", path)
    _fill(cfg, "train_micro_batch_size_per_gpu", args.micro_batch_size, "--micro-batch-size", path)
    _fill(cfg, "gradient_accumulation_steps", args.gradient_accumulation_steps,
          "--global-batch-size / (--micro-batch-size x data-parallel size)", path)
    if getattr(args, "lev_clip_grad", None) is None:
        _fill(cfg, "gradient_clipping", float(args.clip_grad), "--clip-grad", path)
    else:
        check_lev_clip_grad(args, cfg, stage, path)
        # The trainer clips the LEV generator and the rest apart (training/clipping.py): DeepSpeed must not.
        _fill(cfg, "gradient_clipping", 0.0, "--lev-clip-grad (the trainer clips each family itself)", path)
    check_lev_union_ids(args, stage)
    bf16 = cfg.setdefault("bf16", {})
    _fill(bf16, "enabled", bool(args.bf16), "--bf16", path)
    # DeepSpeed reduces gradients in the model dtype unless told otherwise: bf16 all-reduces would
    # round the fp32-accumulated gradients to 8 bits of mantissa (Megatron reduces in fp32).
    cfg.setdefault("communication_data_type", "fp32")
    cfg.setdefault("steps_per_print", 10**9)  # we log ourselves
    cfg.setdefault("wall_clock_breakdown", False)
    args.deepspeed_config_path = str(path)
    return cfg


def check_lev_clip_grad(args, cfg: dict, stage: int, path) -> None:
    """--lev-clip-grad works where DeepSpeed's ZeRO-1/2 optimizer steps (training/clipping.py)."""
    reason = None
    if stage == 3:
        reason = "ZeRO-3 (its optimizer has no per-group gradient partitions to clip apart); use --zero-stage 2"
    elif stage == 1 and args.bf16:
        reason = "ZeRO-1 with bf16 (DeepSpeed's BF16_Optimizer clips in one piece); use --zero-stage 2"
    elif args.pipeline_model_parallel_size > 1:
        reason = "pipeline parallelism (the per-family norms are not reduced over stages)"
    elif offloads_optimizer(cfg):
        reason = f"optimizer offload ({path})"
    if reason:
        raise ConfigError(f"--lev-clip-grad {args.lev_clip_grad}: not supported with {reason}")


def check_lev_union_ids(args, stage: int) -> None:
    """--lev-union-ids works where the trainer runs the micro-batches itself, on the whole batch's
    rows (training/union_ids.py)."""
    if not getattr(args, "lev_union_ids", False):
        return
    reason = None
    if args.pipeline_model_parallel_size > 1:
        reason = (f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} (DeepSpeed's pipeline "
                  f"schedule runs the micro-batches)")
    elif stage == 3:
        reason = ("ZeRO-3 (its parameter gathering around each module call gave other gradients from the "
                  "second step on, on CPU); use --zero-stage 1 or 2")
    elif args.sequence_parallel:
        reason = "--sequence-parallel (the generator's rows are reduce-scattered per micro-batch's positions)"
    elif (args.model.get("lev") or {}).get("unique_ids", True) is False:
        reason = "model.lev.unique_ids false (the generator evaluated per position)"
    if reason:
        raise ConfigError(f"--lev-union-ids: not supported with {reason}")


def offloads_optimizer(ds_config: dict) -> bool:
    device = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return device in ("cpu", "nvme")
