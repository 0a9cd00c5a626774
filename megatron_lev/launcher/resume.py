"""A resume at another layout, prepared before the trainers start. When the checkpoint the job will
resume from was saved under another TP, PP or DP size (or ZeRO stage), the batch shell converts it
to DeepSpeed's universal form first (`python -m megatron_lev.checkpointing.universal`), as a step
of the job where no collective waits on it, with one worker per core of the node; the trainers then
find the conversion done. (Converted by rank 0 inside the trainers, the other ranks would wait in a
collective under --distributed-timeout-minutes: a 1.2B checkpoint can take longer than that, and the
timeout, the requeue and the conversion would start over and over.)

An interrupted conversion (the time limit, a requeue) leaves no complete universal folder: the next
job start converts again, from a clean folder (universal.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from megatron_lev.checkpointing.catalog import COMPLETE_MARKER, read_checkpoint_config, select_checkpoint
from megatron_lev.checkpointing.universal import UNIVERSAL, convertible, layout_changes
from megatron_lev.utils.errors import ConfigError

_LAYOUT_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")


@dataclass(frozen=True)
class Conversion:
    tag: str  # the checkpoint the job resumes from
    changes: list[str] = field(default_factory=list)  # "data_parallel_size: 1 -> 2", ...
    done: bool = False  # its universal folder is complete already
    cmd: list[str] = field(default_factory=list)  # the conversion step (empty when done)

    def summary(self) -> str:
        what = f"checkpoint {self.tag} was saved under another layout ({'; '.join(self.changes)})"
        if self.done:
            return f"{what}; its universal conversion is there already"
        return f"{what}; the job converts it before the trainers start: {' '.join(self.cmd)}"


def plan_conversion(args, ds_config: dict, checkpoint_dir: str) -> Optional[Conversion]:
    """The conversion the run of trainer arguments `args` (validate_flags's) needs before it starts,
    or None: nothing to resume, the same layout, or a change the trainer refuses (it says why)."""
    try:
        tag = select_checkpoint(checkpoint_dir, args.ckpt_step)
        saved = read_checkpoint_config(checkpoint_dir, tag) if tag else None
    except (ConfigError, OSError, ValueError):  # the trainer refuses it, naming it
        return None
    if saved is None:
        return None
    config = {"training": {key: getattr(args, key) for key in _LAYOUT_FLAGS}, "deepspeed": ds_config}
    changes = layout_changes(saved, config)
    if not changes or not convertible(saved, config):
        return None
    if os.path.isfile(os.path.join(checkpoint_dir, tag, UNIVERSAL, COMPLETE_MARKER)):
        return Conversion(tag, changes, done=True)
    return Conversion(tag, changes, cmd=[
        "python", "-m", "megatron_lev.checkpointing.universal",
        "--load", checkpoint_dir, "--tag", tag, "--pipeline-model-parallel-size",
        str(args.pipeline_model_parallel_size)])
