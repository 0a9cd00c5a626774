"""Checkpoints: DeepSpeed's engine state plus our own bookkeeping, safe under preemption.

Layout of `--save DIR`:

    DIR/config.yaml                  the run's effective configuration (rewritten at start)
    DIR/latest                       "iter_0001000": the newest COMPLETE checkpoint
    DIR/iter_0001000/                DeepSpeed's files (model, optimizer, LR schedule;
                                     client state = iteration, consumed samples/tokens,
                                     skipped-step counters, the effective config)
    DIR/iter_0001000/config.json     the effective config, readable before any model work
    DIR/iter_0001000/rng/rank_00003.pt   every RNG stream of global rank 3
    DIR/iter_0001000/complete.json   written last, by rank 0, after every rank finished

A checkpoint is complete only when `complete.json` exists. It is written after a
barrier that follows every rank's writes, and `latest` is replaced atomically (tmp +
os.replace) only after it, so a job killed mid-save leaves `latest` on the previous
checkpoint. `find_latest` never returns an incomplete directory, even if `latest` was
tampered with or a crash hit between the marker and `latest`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import yaml

from megatron_lev import parallel
from megatron_lev.arguments import ConfigError
from megatron_lev.data.corpus import atomic_path
from megatron_lev.safe_load import check_checkpoint_files, safe_torch_load, use_safe_checkpoint_engine

LATEST = "latest"
COMPLETE_MARKER = "complete.json"
CONFIG_FILE = "config.json"
_TAG_RE = re.compile(r"^iter_(\d{7,})$")


def checkpoint_tag(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def tag_iteration(tag: str) -> Optional[int]:
    match = _TAG_RE.match(tag)
    return int(match.group(1)) if match else None


def _atomic_write_text(path: str, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def _atomic_torch_save(obj, path: str) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def is_complete(ckpt_dir: str, tag: str) -> bool:
    return os.path.isfile(os.path.join(ckpt_dir, tag, COMPLETE_MARKER))


def complete_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """(iteration, tag) of every complete checkpoint, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = []
    for name in os.listdir(ckpt_dir):
        it = tag_iteration(name)
        if it is not None and is_complete(ckpt_dir, name):
            found.append((it, name))
    return sorted(found)


def find_latest(ckpt_dir: Optional[str]) -> Optional[str]:
    """The tag to resume from: `latest` if it names a complete checkpoint, else the
    newest complete one, else None (an empty or missing directory starts fresh)."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return None
    latest_path = os.path.join(ckpt_dir, LATEST)
    if os.path.isfile(latest_path):
        with open(latest_path, encoding="utf-8") as f:
            tag = f.read().strip()
        if is_complete(ckpt_dir, tag):
            return tag
        warnings.warn(f"{latest_path} names {tag!r}, which is not a complete checkpoint; "
                      f"using the newest complete one instead")
    complete = complete_checkpoints(ckpt_dir)
    return complete[-1][1] if complete else None


def read_checkpoint_config(ckpt_dir: str, tag: str) -> dict:
    with open(os.path.join(ckpt_dir, tag, CONFIG_FILE), encoding="utf-8") as f:
        return json.load(f)


# Settings a checkpoint's tensors depend on, besides the model section.
_LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
# Model fields that only matter before the first step (the weights come from the checkpoint).
_INIT_ONLY_KEYS = ("init_seed", "init_method_std")


def check_resume_compatible(ckpt_dir: str, tag: str, config: dict) -> None:
    """Refuse a checkpoint whose model (or TP/PP layout) differs from this run's, naming
    every differing field. `config` is `arguments.effective_config(...)`."""
    saved = read_checkpoint_config(ckpt_dir, tag)
    saved_model, model = saved.get("model", {}), config["model"]
    diffs = [f"{key}: {saved_model.get(key, '<unset>')!r} in the checkpoint, {model.get(key, '<unset>')!r} now"
             for key in sorted(set(saved_model) | set(model))
             if key not in _INIT_ONLY_KEYS and saved_model.get(key) != model.get(key)]
    for key in _LAYOUT_KEYS:
        then, now = saved.get("training", {}).get(key), config["training"].get(key)
        if then != now:
            diffs.append(f"{key}: {then!r} in the checkpoint, {now!r} now")
    if diffs:
        raise ConfigError(f"--load {ckpt_dir}: checkpoint {tag} was saved with a different model config ("
                          + "; ".join(diffs) + "); resume with the checkpoint's settings or use a new --save "
                          "directory")


def write_run_config(save_dir: str, config: dict) -> None:
    """DIR/config.yaml: the effective configuration of the current run (rank 0)."""
    os.makedirs(save_dir, exist_ok=True)
    _atomic_write_text(os.path.join(save_dir, "config.yaml"),
                       yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=100))


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(engine, save_dir: str, iteration: int, client_state: dict, config: dict,
                    keep_last: Optional[int] = None) -> str:
    """Collective: every rank calls it. Returns the tag written."""
    tag = checkpoint_tag(iteration)
    tag_dir = os.path.join(save_dir, tag)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        os.makedirs(tag_dir, exist_ok=True)
        # Re-saving a tag: it stops counting as complete before any file changes.
        if os.path.exists(os.path.join(tag_dir, COMPLETE_MARKER)):
            os.remove(os.path.join(tag_dir, COMPLETE_MARKER))
    _barrier()
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    os.makedirs(os.path.join(tag_dir, "rng"), exist_ok=True)
    _atomic_torch_save(parallel.rng_state_dict(), os.path.join(tag_dir, "rng", f"rank_{rank:05d}.pt"))
    if rank == 0:
        _atomic_write_text(os.path.join(tag_dir, CONFIG_FILE), json.dumps(config, indent=1, default=str))
    _barrier()  # every rank's files are on disk
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        _atomic_write_text(os.path.join(tag_dir, COMPLETE_MARKER),
                           json.dumps({"iteration": iteration, "world_size": world,
                                       "consumed_samples": client_state.get("consumed_samples")}))
        _atomic_write_text(os.path.join(save_dir, LATEST), tag)
        if keep_last:
            prune_checkpoints(save_dir, keep_last)
    _barrier()
    return tag


def prune_checkpoints(save_dir: str, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints, and incomplete
    leftovers older than the newest complete one. Returns the deleted tags."""
    complete = complete_checkpoints(save_dir)
    if not complete:
        return []
    newest = complete[-1][0]
    doomed = [tag for _, tag in complete[:-keep_last]]
    for name in os.listdir(save_dir):
        it = tag_iteration(name)
        if it is not None and it < newest and not is_complete(save_dir, name):
            doomed.append(name)
    for tag in doomed:
        shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)
    return doomed


def load_checkpoint(engine, load_dir: str, tag: str, *, load_optimizer: bool = True) -> dict:
    """Collective: restore the engine (and, unless `load_optimizer` is False, optimizer,
    LR schedule and counters) and this rank's RNG streams. Returns the client state.
    Every file is loaded weights_only first (safe_load: a hostile pickle is refused on every
    rank, never run), and DeepSpeed's own loads go through the same safe loader."""
    check_checkpoint_files(os.path.join(load_dir, tag))
    use_safe_checkpoint_engine(engine)
    path, client_state = engine.load_checkpoint(
        load_dir, tag=tag, load_optimizer_states=load_optimizer, load_lr_scheduler_states=load_optimizer,
        load_module_only=not load_optimizer)
    if path is None:
        raise RuntimeError(f"--load {load_dir}: DeepSpeed could not load checkpoint {tag}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_path = os.path.join(load_dir, tag, "rng", f"rank_{rank:05d}.pt")
    if load_optimizer:
        if os.path.isfile(rng_path):
            parallel.load_rng_state_dict(safe_torch_load(rng_path))
        else:
            warnings.warn(f"{rng_path} is missing (saved by a job of another size?): RNG streams start from "
                          f"--seed, so the run will not continue bit-identically")
    return client_state or {}
