"""Saving a training checkpoint: DeepSpeed's engine state plus our bookkeeping (RNG streams,
the effective config, the completion marker with every file's size), fsynced, then `latest`.
The folder layout and the completeness rule are in catalog.py."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from typing import Optional

import torch
import torch.distributed as dist
import yaml

from megatron_lev.checkpointing.catalog import (COMPLETE_MARKER, CONFIG_FILE, LATEST, checkpoint_file_sizes,
                                                checkpoint_tag, complete_checkpoints, is_complete, retained,
                                                tag_iteration)
from megatron_lev.checkpointing.space import (CheckpointSpaceError, estimated_checkpoint_bytes, folder_bytes,
                                              space_problem)
from megatron_lev.checkpointing.universal import UNIVERSAL_INFO_KEY, universal_checkpoint_info
from megatron_lev.distributed.launch import default_device
from megatron_lev.distributed.rng import rng_state_dict
from megatron_lev.utils.files import atomic_path, fsync_dir, fsync_file, write_text_atomic


def _atomic_torch_save(obj, path: str) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
        fsync_file(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def _fsync_engine_saves(engine):
    """Every file DeepSpeed's checkpoint engine writes on this rank is fsynced right after
    (each rank flushes its own files: another node's fsync would not reach them), and so
    are the folders holding them."""
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if checkpoint_engine is None:
        yield
        return
    save = checkpoint_engine.save
    own = "save" in vars(checkpoint_engine)  # already set on the instance: put it back after
    folders = set()

    def save_and_fsync(state_dict, path, *args, **kwargs):
        result = save(state_dict, path, *args, **kwargs)
        if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
            fsync_file(path)
            folders.add(os.path.dirname(os.path.abspath(path)))
        return result

    checkpoint_engine.save = save_and_fsync  # this instance only, for this save
    try:
        yield
    finally:
        if own:
            checkpoint_engine.save = save
        else:
            del checkpoint_engine.save
        for folder in sorted(folders):
            fsync_dir(folder)


def write_run_config(save_dir: str, config: dict) -> None:
    """DIR/config.yaml: the effective configuration of the current run (rank 0)."""
    os.makedirs(save_dir, exist_ok=True)
    write_text_atomic(os.path.join(save_dir, "config.yaml"),
                      yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=100), durable=True)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def expected_checkpoint_bytes(save_dir: str, config: dict) -> tuple[int, Optional[str]]:
    """The bytes the next checkpoint of this run will take, and the tag they were measured on: the
    newest complete checkpoint's (its universal conversion left out), else (None) the estimate from
    the model's parameter count (space.py)."""
    complete = complete_checkpoints(save_dir)
    if complete:
        tag = complete[-1][1]
        return folder_bytes(os.path.join(save_dir, tag)), tag
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.param_count import count_parameters

    parameters = count_parameters(model_config_from_dict(config["model"]))["total"]
    return estimated_checkpoint_bytes(parameters, bool(config["training"].get("bf16"))), None


def check_space(save_dir: str, tag: str, config: dict) -> None:
    """Collective: refuse to save `tag` (CheckpointSpaceError on every rank, rank 0's message naming
    the folder and the sizes) when rank 0 finds less free space than the checkpoint needs. Nothing is
    written before: `latest` and the complete checkpoints stay as they are. (The folder is shared
    by every rank: rank 0's filesystem is the one all ranks write to.)"""
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = None
    if rank == 0:
        problem = space_problem(save_dir, tag, *expected_checkpoint_bytes(save_dir, config))
    if dist.is_initialized():
        refused = torch.tensor([float(problem is not None)], device=default_device())
        dist.all_reduce(refused)
        if problem is None and refused.item():
            problem = f"--save {save_dir}: rank 0 found no room for checkpoint {tag}"
    if problem is not None:
        raise CheckpointSpaceError(problem)


def save_checkpoint(engine, save_dir: str, iteration: int, client_state: dict, config: dict,
                    keep_last: Optional[int] = None) -> str:
    """Collective: every rank calls it. Returns the tag written. A checkpoint that cannot fit on the
    disk is refused before anything is written (check_space: CheckpointSpaceError)."""
    started = time.perf_counter()
    tag = checkpoint_tag(iteration)
    tag_dir = os.path.join(save_dir, tag)
    rank = dist.get_rank() if dist.is_initialized() else 0
    check_space(save_dir, tag, config)
    if rank == 0:
        os.makedirs(tag_dir, exist_ok=True)
        # Re-saving a tag: it stops counting as complete before any file changes.
        if os.path.exists(os.path.join(tag_dir, COMPLETE_MARKER)):
            os.remove(os.path.join(tag_dir, COMPLETE_MARKER))
    _barrier()
    # Every checkpoint can be resumed at another scale (DeepSpeed's ds_to_universal reads this).
    client_state = {**client_state, UNIVERSAL_INFO_KEY: universal_checkpoint_info(config)}
    with _fsync_engine_saves(engine):
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    os.makedirs(os.path.join(tag_dir, "rng"), exist_ok=True)
    _atomic_torch_save(rng_state_dict(), os.path.join(tag_dir, "rng", f"rank_{rank:05d}.pt"))
    if rank == 0:
        write_text_atomic(os.path.join(tag_dir, CONFIG_FILE), json.dumps(config, indent=1, default=str), durable=True)
    _barrier()  # every rank's files are written and fsynced
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        sizes = checkpoint_file_sizes(tag_dir)
        for rel in sizes:  # files DeepSpeed wrote outside its checkpoint engine (its recovery script)
            fsync_file(os.path.join(tag_dir, rel))
        for root, _, _ in os.walk(tag_dir):
            fsync_dir(root)
        # The marker lists every file with its size: a later truncation is found before loading.
        # save_seconds: this save's wall time up to the marker (every rank's files written and fsynced);
        # the Slurm launcher weighs SAVE_INTERVAL with it (launcher/disk.py).
        marker = {"iteration": iteration, "world_size": world, "consumed_samples": client_state.get("consumed_samples"),
                  "save_seconds": round(time.perf_counter() - started, 3), "files": sizes}
        write_text_atomic(os.path.join(tag_dir, COMPLETE_MARKER), json.dumps(marker), durable=True)
        write_text_atomic(os.path.join(save_dir, LATEST), tag, durable=True)
        if keep_last:  # --keep-checkpoints-every: the effective config's (the trainer passes only keep_last)
            prune_checkpoints(save_dir, keep_last, (config.get("training") or {}).get("keep_checkpoints_every"))
    _barrier()
    return tag


def prune_checkpoints(save_dir: str, keep_last: int, keep_every: Optional[int] = None) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints (and those whose iteration is a
    multiple of `keep_every`, when given), and incomplete leftovers older than the newest complete
    one. Returns the deleted tags."""
    complete = complete_checkpoints(save_dir)
    if not complete:
        return []
    newest = complete[-1][0]
    kept = set(retained([it for it, _ in complete], keep_last, keep_every))
    doomed = [tag for it, tag in complete if it not in kept]
    for name in os.listdir(save_dir):
        it = tag_iteration(name)
        if it is not None and it < newest and not is_complete(save_dir, name):
            doomed.append(name)
    for tag in doomed:
        shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)
    return doomed
