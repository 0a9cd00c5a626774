"""Resuming a training checkpoint into a DeepSpeed engine: every file checked weights_only
first, DeepSpeed's own loads made safe, another layout loaded through the universal form,
and this rank's RNG streams restored."""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from megatron_lev.checkpointing.safe_load import check_checkpoint_files, safe_torch_load, use_safe_checkpoint_engine
from megatron_lev.checkpointing.universal import UNIVERSAL, convert_to_universal
from megatron_lev.distributed.launch import default_device
from megatron_lev.distributed.rng import load_rng_state_dict
from megatron_lev.utils.errors import ConfigError


def load_checkpoint(engine, load_dir: str, tag: str, *, load_optimizer: bool = True,
                    universal: Optional[dict] = None, files_checked: bool = False) -> dict:
    """Collective: restore the engine (and, unless `load_optimizer` is False, optimizer,
    LR schedule and counters) and this rank's RNG streams. Returns the client state.
    Every file is loaded weights_only first (safe_load: a hostile pickle is refused on every
    rank, never run), and DeepSpeed's own loads go through the same safe loader.

    `universal` (convert_to_universal's keyword arguments): the checkpoint was saved under
    another layout; rank 0 converts it to DeepSpeed's universal form, which every rank then
    loads (the engine was built with `checkpoint.load_universal`). `files_checked`: the
    caller chose `tag` with `select_readable_checkpoint`, which ran the same check."""
    # Before anything unpickles the files (DeepSpeed's ds_to_universal loads them weights_only=False).
    if not files_checked:
        check_checkpoint_files(os.path.join(load_dir, tag))
    ds_dir, ds_tag = load_dir, tag
    if universal is not None:
        error = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                convert_to_universal(load_dir, tag, **universal)
            except (ConfigError, OSError) as exc:
                error = exc
        failed = torch.tensor([float(error is not None)], device=default_device())
        if dist.is_initialized():
            dist.all_reduce(failed)
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError(f"--load {load_dir}: rank 0 could not convert {tag} to a universal checkpoint")
        ds_dir, ds_tag = os.path.join(load_dir, tag), UNIVERSAL
        check_checkpoint_files(os.path.join(ds_dir, ds_tag))  # DeepSpeed's universal loader: weights_only=False
    use_safe_checkpoint_engine(engine)
    path, client_state = engine.load_checkpoint(
        ds_dir, tag=ds_tag, load_optimizer_states=load_optimizer, load_lr_scheduler_states=load_optimizer,
        load_module_only=not load_optimizer)
    if path is None:
        raise RuntimeError(f"--load {load_dir}: DeepSpeed could not load checkpoint {tag}")
    if load_optimizer and engine.lr_scheduler is not None:
        # DeepSpeed restores the schedule first and the (ZeRO) optimizer after it, whose saved
        # param groups carry the rates of the checkpoint's last step: re-apply the schedule at
        # its restored step, so the first resumed step runs at its rate (a schedule changed with
        # --override-opt_param-scheduler included), as in Megatron-LM.
        engine.lr_scheduler.step(0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_path = os.path.join(load_dir, tag, "rng", f"rank_{rank:05d}.pt")
    if load_optimizer:
        if os.path.isfile(rng_path):
            load_rng_state_dict(safe_torch_load(rng_path))
        else:
            warnings.warn(f"{rng_path} is missing (saved by a job of another size?): RNG streams start from "
                          f"--seed, so the run will not continue bit-identically")
    return client_state or {}
