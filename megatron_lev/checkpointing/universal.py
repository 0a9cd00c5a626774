"""Resuming at another scale: a checkpoint saved under one parallel layout (TP, PP, DP size,
ZeRO stage) loads under another through DeepSpeed's universal checkpoint. Every checkpoint
records how each parameter is split (`universal_checkpoint_info`, Megatron-DeepSpeed's
UNIVERSAL_CHECKPOINT_INFO); `convert_to_universal` runs DeepSpeed's ds_to_universal on it.

The conversion runs before the trainers start, where no collective waits on it: the Slurm
scripts run it as a step of the job when the layout changed (megatron_lev/launcher/), and by hand

    python -m megatron_lev.checkpointing.universal --load DIR --pipeline-model-parallel-size PP

converts DIR's newest checkpoint for a run of that PP size (its TP and DP sizes do not matter: the
universal form has one file per parameter). It uses one worker per core (memory allowing:
`conversion_workers`). Its output is written to DIR/iter_N/universal.tmp and renamed when
complete, so an interrupted conversion is never loaded: the next one removes its leftovers and
starts again. A trainer that finds no conversion converts itself (rank 0, while the other ranks wait
in a collective under --distributed-timeout-minutes: keep that for small checkpoints).

Nothing here imports torch at import time (the launcher reads `layout_changes`)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time

from megatron_lev.checkpointing.catalog import COMPLETE_MARKER
from megatron_lev.utils.errors import ConfigError
from megatron_lev.utils.files import write_text_atomic

# Settings a checkpoint's tensor files are laid out by: resuming under other values goes
# through DeepSpeed's universal checkpoint (see `layout_changes`).
_LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")


UNIVERSAL = "universal"  # DIR/iter_N/universal/: DeepSpeed's universal form of DIR/iter_N


UNIVERSAL_INFO_KEY = "universal_checkpoint_info"  # deepspeed.checkpoint.constants.UNIVERSAL_CHECKPOINT_INFO


def zero_stage(config: dict):
    return config.get("deepspeed", {}).get("zero_optimization", {}).get("stage")


def convertible(saved: dict, config: dict) -> bool:
    """Whether DeepSpeed's universal checkpoint converts between these layouts: not between ZeRO-3 and
    stages 1/2 (the trainer refuses that change, saying why: validation.check_layout_change)."""
    return (zero_stage(saved) == 3) == (zero_stage(config) == 3)


def layout_changes(saved: dict, config: dict) -> list[str]:
    """How this run's parallel layout (TP, PP, DP size, ZeRO stage, in `config`) differs from
    the checkpoint's (`saved`, its config.json), one "key: then -> now" string each; empty
    when DeepSpeed can load the checkpoint's files as they are."""
    changes = [f"{key}: {saved['training'].get(key)} -> {config['training'].get(key)}" for key in _LAYOUT_KEYS
               if saved.get("training", {}).get(key) != config["training"].get(key)]
    if zero_stage(saved) != zero_stage(config):
        changes.append(f"zero stage: {zero_stage(saved)} -> {zero_stage(config)}")
    return changes


def universal_checkpoint_info(config: dict) -> dict:
    """The `universal_checkpoint_info` client state DeepSpeed's ds_to_universal needs, for
    the run whose effective config is `config`: how every parameter of the whole model (all
    pipeline stages) is split over TP ranks, as regexes on DeepSpeed's parameter names
    (Megatron-DeepSpeed's UNIVERSAL_CHECKPOINT_INFO). The partitions come from
    convert.partition_of (the table of models/decoder.py)."""
    from deepspeed.checkpoint import constants as ds

    from megatron_lev.checkpointing.layout import expected_parameter_names, partition_of
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.pipeline import model_to_pipeline_key

    model_config = model_config_from_dict(config["model"])
    pipeline = config["training"].get("pipeline_model_parallel_size", 1) > 1
    tied = model_config.embedding == "tied"
    info = {ds.UNIVERSAL_CHECKPOINT_VERSION_KEY: ds.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            "original_vocab_size": model_config.vocab_size,  # padding rows are dropped, re-added for the new TP
            ds.TP_REPLICATED_PARAMETER_PATTERNS: [], ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [],
            ds.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: [], ds.VOCABULARY_PARAMETER_PATTERNS: [],
            ds.PIPELINE_REPLICATED_PARAMETER_PATTERNS: []}
    for name in expected_parameter_names(model_config):
        part = partition_of(name, model_config.embedding)
        ds_name = model_to_pipeline_key(name, model_config.num_layers, tied) if pipeline else name
        pattern = re.escape(ds_name) + "$"
        if part.dim is None:
            info[ds.TP_REPLICATED_PARAMETER_PATTERNS].append(pattern)
        elif part.dim == 1:
            info[ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS].append(pattern)
        elif part.stride == 2:  # [gate; up]: rank r holds [gate_r; up_r]
            info[ds.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0].append(pattern)
        # else: contiguous along dim 0, ds_to_universal's default
        if part.vocab:
            info[ds.VOCABULARY_PARAMETER_PATTERNS].append(pattern)
        if pipeline and tied and name.startswith("embedding."):  # on the first and the last stage
            info[ds.PIPELINE_REPLICATED_PARAMETER_PATTERNS].append(pattern)
    return info


def _is_pipeline_name(name: str) -> bool:
    return name.split(".", 1)[0].isdigit() or name.startswith("tied_modules.")


def _stage_for_universal(src: str, staged: str) -> None:
    """ds_to_universal's input: links to DIR/tag's DeepSpeed files, except the model-state
    files, copied without megatron-core's `_extra_state` entries (None; DeepSpeed 0.19's
    converter calls .float() on every module entry)."""
    import torch

    from megatron_lev.checkpointing.safe_load import safe_torch_load

    os.makedirs(staged)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if not name.endswith(".pt") or not os.path.isfile(path):
            continue
        if name.startswith("mp_rank_") or (name.startswith("zero_pp_rank_") and name.endswith("model_states.pt")):
            state = safe_torch_load(path)
            if isinstance(state.get("module"), dict):
                state["module"] = {k: v for k, v in state["module"].items() if v is not None}
            torch.save(state, os.path.join(staged, name))
        else:
            os.symlink(os.path.abspath(path), os.path.join(staged, name))


def conversion_workers(src: str, cores: int | None = None, available: int | None = None) -> int:
    """ds_to_universal's workers for checkpoint folder `src`: one per core this process may use, as
    many as the memory holds: each extraction worker holds one rank's optimizer file (the largest
    here), and a worker's copies and merges about double it."""
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    if available is None:
        available = _memory_available()
    largest = max((os.path.getsize(os.path.join(src, name)) for name in os.listdir(src)
                   if name.endswith("optim_states.pt")), default=0)
    by_memory = available // (3 * largest) if largest and available else cores
    return max(1, min(cores, by_memory))


def _memory_available() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 when unknown: the cores decide)."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def convert_to_universal(ckpt_dir: str, tag: str, *, pipeline: bool, num_layers: int, tied: bool,
                         workers: int = 1) -> str:
    """DeepSpeed's ds_to_universal on DIR/tag with `workers` extraction and merge workers, written
    to DIR/tag/universal (reused when complete), with parameter directories named as this run's
    module names them (pipeline or plain form). One process only. Returns the universal folder."""
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    from megatron_lev.models.pipeline import model_to_pipeline_key, pipeline_to_model_key

    src = os.path.join(ckpt_dir, tag)
    out = os.path.join(src, UNIVERSAL)
    if os.path.isfile(os.path.join(out, COMPLETE_MARKER)):
        return out
    tmp, staged = out + ".tmp", out + ".input"
    leftovers = [path for path in (tmp, staged, out) if os.path.exists(path)]
    if leftovers:  # an interrupted conversion: never loaded (no marker), started again
        print(f"removing the leftovers of an interrupted conversion: {', '.join(leftovers)}", flush=True)
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)
    _stage_for_universal(src, staged)
    try:
        ds_to_universal.main(Namespace(input_folder=staged, output_folder=tmp, num_extract_workers=workers,
                                       num_merge_workers=workers, keep_temp_folder=False, strict=True,
                                       inject_missing_state=False))
    except AssertionError as exc:
        if "universal_checkpoint_info" in str(exc):
            raise ConfigError(f"--load {ckpt_dir}: checkpoint {tag} predates universal checkpoint support (no "
                              f"universal_checkpoint_info): resume it with the layout it was saved with, let it "
                              f"save once, then change the layout") from exc
        raise
    finally:
        shutil.rmtree(staged, ignore_errors=True)
        # ds_to_universal points DIR/tag/latest_universal at its output; we pass the tag instead.
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(src, "latest_universal"))
    zero = os.path.join(tmp, "zero")
    for name in os.listdir(zero):
        if not os.path.isdir(os.path.join(zero, name)) or _is_pipeline_name(name) == pipeline:
            continue
        new = (model_to_pipeline_key(name, num_layers, tied) if pipeline
               else pipeline_to_model_key(name, num_layers))
        os.rename(os.path.join(zero, name), os.path.join(zero, new))
    write_text_atomic(os.path.join(tmp, COMPLETE_MARKER), json.dumps({"source": tag}), durable=True)
    os.replace(tmp, out)
    return out


def main(argv=None) -> int:
    """`python -m megatron_lev.checkpointing.universal --load DIR --pipeline-model-parallel-size PP`:
    convert DIR's newest checkpoint (or --tag's) to the universal form a run of PP stages loads."""
    import argparse

    from megatron_lev.checkpointing.catalog import find_latest, read_checkpoint_config

    parser = argparse.ArgumentParser(prog="python -m megatron_lev.checkpointing.universal", description=main.__doc__)
    parser.add_argument("--load", required=True, help="the checkpoint folder (--save of the run)")
    parser.add_argument("--tag", help="the checkpoint to convert (default: the newest complete one)")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                        help="the PP size of the run that will load it (names the parameters)")
    parser.add_argument("--workers", type=int, help="extraction and merge workers (default: conversion_workers)")
    args = parser.parse_args(argv)
    tag = args.tag or find_latest(args.load)
    if tag is None or not os.path.isfile(os.path.join(args.load, tag, COMPLETE_MARKER)):
        print(f"{parser.prog}: error: --load {args.load}: no complete checkpoint{f' {tag}' if tag else ''} to convert",
              file=sys.stderr)
        return 2
    model = read_checkpoint_config(args.load, tag).get("model") or {}
    src = os.path.join(args.load, tag)
    workers = args.workers or conversion_workers(src)
    print(f"converting {src} to DeepSpeed's universal checkpoint in {os.path.join(src, UNIVERSAL)} "
          f"({workers} workers)", flush=True)
    start = time.perf_counter()
    try:
        convert_to_universal(args.load, tag, pipeline=args.pipeline_model_parallel_size > 1,
                             num_layers=model["num_layers"], tied=model.get("embedding") == "tied", workers=workers)
    except (ConfigError, OSError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"converted {src} in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
