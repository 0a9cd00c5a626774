"""Disk space for checkpoints: how big one is, how much a run needs, and the check before a save.

A checkpoint of ZeRO-1/2 holds the module's weights (bf16 under --bf16, else fp32: 2 or 4 bytes a
parameter, `mp_rank_*_model_states.pt`), and the fp32 master weights and both Adam moments split
over the DP ranks (12 bytes a parameter, `*_optim_states.pt`): 14 bytes a parameter under bf16,
16 in fp32, whatever the layout (tests/test_checkpoint_space.py holds a saved one to this). A save
is refused before it writes a byte when the filesystem has less free space than the newest
checkpoint's size (else the estimate) plus SPACE_MARGIN: `latest` and every complete checkpoint
stay as they are, and the run stops with one line naming the folder and the sizes.

Nothing here imports torch (the Slurm launcher prints these sizes at submit).
"""
from __future__ import annotations

import os
import shutil
from typing import Optional

from megatron_lev.checkpointing.universal import UNIVERSAL
from megatron_lev.utils.errors import ConfigError

OPTIMIZER_BYTES_PER_PARAMETER = 12  # fp32 master weights, Adam's exp_avg and exp_avg_sq
SPACE_MARGIN = 0.05  # of a checkpoint's size: RNG files, pickling, a layout with more TP-replicated weights


class CheckpointSpaceError(ConfigError):
    """A checkpoint that cannot fit on its filesystem; the message names the folder and the sizes."""


def estimated_checkpoint_bytes(parameters: int, bf16: bool) -> int:
    """One checkpoint of a model of `parameters` parameters (module weights + fp32 optimizer states)."""
    return parameters * ((2 if bf16 else 4) + OPTIMIZER_BYTES_PER_PARAMETER)


def folder_bytes(tag_dir: str) -> int:
    """The bytes of a saved checkpoint folder: every file but a universal conversion's (iter_N/universal*:
    the form a resume at another layout loads, not the checkpoint)."""
    total = 0
    for root, dirs, names in os.walk(tag_dir):
        if root == tag_dir:
            dirs[:] = [d for d in dirs if not d.startswith(UNIVERSAL)]
        total += sum(os.path.getsize(os.path.join(root, name)) for name in names)
    return total


def free_bytes(path: str) -> int:
    """Free bytes (for this user) on the filesystem of `path`, or of its nearest existing parent."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def format_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def space_problem(save_dir: str, tag: str, needed: int, measured_from: Optional[str]) -> Optional[str]:
    """Why checkpoint `tag` cannot be written into `save_dir` (None: it fits). `needed`: its expected
    bytes; `measured_from`: the checkpoint that size was measured on (None: estimated)."""
    required = int(needed * (1 + SPACE_MARGIN))
    free = free_bytes(save_dir)
    if free >= required:
        return None
    basis = f"the size of {measured_from}" if measured_from else "estimated from the parameter count"
    return (f"--save {save_dir}: not enough disk for checkpoint {tag}: it needs about {format_bytes(needed)} ({basis}; "
            f"{format_bytes(required)} with a {SPACE_MARGIN:.0%} margin) and {format_bytes(free)} is free; the "
            f"complete checkpoints and `latest` are untouched: free space (or keep fewer checkpoints: "
            f"--keep-last-checkpoints, KEEP_CHECKPOINTS in the Slurm scripts), then resume with --load {save_dir}")
