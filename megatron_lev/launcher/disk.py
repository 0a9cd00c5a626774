"""The checkpoint disk of a Slurm run, said at submit (dry run) and in the job's first lines: the
size of one checkpoint, how many the run holds at most, and what that needs in CHECKPOINT_DIR.

KEEP_CHECKPOINTS=K (the trainer's --keep-last-checkpoints) keeps the newest K: the run then holds
K + 1 while the next one is written (the oldest is deleted once the new one is complete). K=0
keeps all of them: one per SAVE_INTERVAL over the run, and the last. KEEP_EVERY=N (the trainer's
--keep-checkpoints-every) keeps besides those every checkpoint of an iteration that is a multiple
of N: up to train_iters // N more (counted in full, an upper bound). A resume at another layout
converts the newest checkpoint next to it (iter_N/universal, about one checkpoint more).

What saving costs in time is said from what an earlier start of the run measured in
CHECKPOINT_DIR: the step time (metrics.jsonl's step_time_s, the median of the last 20 logged) and
the save time (the newest checkpoint's complete.json, save_seconds): the share of the run spent
saving at SAVE_INTERVAL, the training a crash can lose, and the interval that costs 1%.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from typing import Optional

from megatron_lev.checkpointing.catalog import complete_checkpoints
from megatron_lev.checkpointing.space import estimated_checkpoint_bytes, folder_bytes, format_bytes, free_bytes
from megatron_lev.models.shape import count_parameters, model_shape

KEEP_CHECKPOINTS_DEFAULT = 3


@dataclass(frozen=True)
class CheckpointDisk:
    parameters: Optional[int]  # None: unknown (see `unknown`)
    bytes_per_parameter: int
    checkpoint_bytes: Optional[int]  # one checkpoint: the newest one's size, else the estimate
    newest: Optional[str]  # the newest checkpoint already there, whose size is measured
    keep: int  # 0: every checkpoint is kept
    held: int  # checkpoints in the folder at most
    train_iters: int
    save_interval: int
    free: Optional[int]  # free bytes on CHECKPOINT_DIR's filesystem now
    present: int  # bytes the complete checkpoints there take now (counted in `needed`)
    unknown: str = ""  # why the parameters could not be counted
    keep_every: Optional[int] = None  # KEEP_EVERY: the checkpoints of its multiples are kept too
    step_seconds: Optional[float] = None  # measured by an earlier start (None: not yet)
    save_seconds: Optional[float] = None

    def timing(self) -> str:
        """What saving every SAVE_INTERVAL iterations costs, from the measured times."""
        if self.step_seconds is None or self.save_seconds is None:
            return ("step and save times not measured yet (a start of the run records them: metrics.jsonl's "
                    "step_time_s, each checkpoint's complete.json save_seconds)")
        between = self.save_interval * self.step_seconds
        share = 100 * self.save_seconds / (between + self.save_seconds)
        one_percent = max(1, math.ceil(99 * self.save_seconds / self.step_seconds))  # save / (n step + save) = 1%
        return (f"a step took {self.step_seconds:.3g} s and a save {self.save_seconds:.3g} s (measured in "
                f"CHECKPOINT_DIR): SAVE_INTERVAL={self.save_interval} spends {share:.2g}% of the time saving, and a "
                f"crash loses up to {_duration(between)} of training (SAVE_INTERVAL={one_percent} would spend 1%)")

    @property
    def needed(self) -> Optional[int]:
        return None if self.checkpoint_bytes is None else self.held * self.checkpoint_bytes

    def summary(self) -> str:
        if self.checkpoint_bytes is None:
            return f"checkpoint size unknown ({self.unknown}); KEEP_CHECKPOINTS={self.keep}"
        size = format_bytes(self.checkpoint_bytes)
        if self.newest:
            basis = f"the size of {self.newest}"
        else:
            precision = "bf16 weights" if self.bytes_per_parameter == 14 else "fp32 weights"
            basis = (f"{self.parameters:,} parameters x {self.bytes_per_parameter} bytes: {precision}, fp32 master "
                     f"weights and Adam moments")
        every = (f" and every {self.keep_every}-th iteration's (KEEP_EVERY={self.keep_every}, "
                 f"{self.train_iters // self.keep_every} over the run)" if self.keep_every and self.keep else "")
        kept = (f"the newest {self.keep}{every} kept (KEEP_CHECKPOINTS={self.keep}): {self.held} at most, while the "
                f"next is written" if self.keep else
                f"every one kept (KEEP_CHECKPOINTS=0): {self.held} over the run's {self.train_iters} iterations "
                f"(SAVE_INTERVAL={self.save_interval})")
        line = (f"one checkpoint is about {size} ({basis}); {kept}; the run needs about {format_bytes(self.needed)} in "
                f"CHECKPOINT_DIR, and {size} more while a resume at another layout converts one")
        if self.free is not None:
            line += f"; {format_bytes(self.free)} free there now"
        return line + "; " + self.timing()

    def shortfall(self) -> Optional[str]:
        """A warning when the filesystem cannot hold what the run needs (free + what its checkpoints
        already take < needed), else None."""
        if self.needed is None or self.free is None or self.free + self.present >= self.needed:
            return None
        return (f"warning: CHECKPOINT_DIR has {format_bytes(self.free)} free and its checkpoints take "
                f"{format_bytes(self.present)}, but the run needs about {format_bytes(self.needed)}: a save that "
                "cannot fit stops the run (lower KEEP_CHECKPOINTS or free space)")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"


def measured_times(checkpoint_dir: str, newest: Optional[str]) -> tuple[Optional[float], Optional[float]]:
    """(step seconds, save seconds) an earlier start of the run measured, each None when absent."""
    steps = []
    try:
        with open(os.path.join(checkpoint_dir, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    value = json.loads(line).get("step_time_s")
                except (json.JSONDecodeError, AttributeError):
                    continue  # the line being written, or not a record
                if isinstance(value, (int, float)) and value > 0:
                    steps.append(float(value))
    except OSError:
        pass
    save = None
    if newest:
        try:
            with open(os.path.join(checkpoint_dir, newest, "complete.json"), encoding="utf-8") as f:
                value = json.load(f).get("save_seconds")
            save = float(value) if isinstance(value, (int, float)) else None
        except (OSError, json.JSONDecodeError, AttributeError):
            pass
    return (statistics.median(steps[-20:]) if steps else None), save


def plan_checkpoint_disk(args, *, keep: int, checkpoint_dir: str, bf16: bool,
                         keep_every: Optional[int] = None) -> CheckpointDisk:
    """The disk of the run whose trainer arguments are `args` (validate_flags's). The parameter count
    is models/shape.py's analytic one, without torch (a login node may lack it; importing torch and
    megatron-core cost 4-5 s of every submit); tests/test_cluster_plan.py holds it equal to the
    model code's on every packaged config."""
    parameters, unknown = None, ""
    try:
        parameters = count_parameters(model_shape(
            args.model, tensor_model_parallel_size=args.tensor_model_parallel_size))["total"]
    except (TypeError, ValueError) as exc:
        unknown = f"the config's model cannot be counted: {exc}"
    per_parameter = estimated_checkpoint_bytes(1, bf16)
    complete = [tag for _, tag in complete_checkpoints(checkpoint_dir)]
    present = sum(folder_bytes(os.path.join(checkpoint_dir, tag)) for tag in complete)
    newest = complete[-1] if complete else None
    size = folder_bytes(os.path.join(checkpoint_dir, newest)) if newest else (
        None if parameters is None else parameters * per_parameter)
    saves = math.ceil(args.train_iters / args.save_interval)  # every SAVE_INTERVAL, and the last iteration
    free = free_bytes(checkpoint_dir) if checkpoint_dir else None
    step_seconds, save_seconds = measured_times(checkpoint_dir, newest) if checkpoint_dir else (None, None)
    return CheckpointDisk(parameters=parameters, bytes_per_parameter=per_parameter, checkpoint_bytes=size,
                          newest=newest, keep=keep, keep_every=keep_every,
                          held=min(keep + 1 + (args.train_iters // keep_every if keep_every else 0), saves) if keep
                          else saves,
                          train_iters=args.train_iters, save_interval=args.save_interval, free=free, present=present,
                          unknown=unknown, step_seconds=step_seconds, save_seconds=save_seconds)
