"""Where training metrics go: metrics.jsonl, TensorBoard and (optionally) W&B.

Only rank 0 writes (the trainer all-reduces what it logs first). Every record is one
JSON object per line with at least `iteration` and `consumed_tokens`; training lines
carry `loss`, evaluation lines `valid_loss`/`valid_ppl` (see train.py for the fields).
TensorBoard and W&B get the same numbers under Megatron-LM's tag names (`lm loss`,
`learning-rate`, `grad-norm`, `iteration-time`, `lm loss validation`, ... and the
`... vs samples` series; MEGATRON_TAGS), so Megatron dashboards read them.

metrics.jsonl is only ever appended to, never cut or rewritten: a resumed run adds its
lines after the interrupted run's, so iterations the interrupted run logged after its
last checkpoint appear twice, and the later line (the resumed run's) is the one that
counts (evaluation/curves.py reads it that way).
"""
from __future__ import annotations

import json
import math
import os
import uuid
import warnings
from typing import Optional

from megatron_lev.utils.files import atomic_path

# metrics.jsonl key -> Megatron-LM's TensorBoard/W&B tag (megatron/training/training.py);
# the rest are ours, spelled the same way.
MEGATRON_TAGS = {
    "loss": "lm loss", "lr": "learning-rate", "grad_norm": "grad-norm", "global_batch_size": "batch-size",
    "step_time_s": "iteration-time", "tflops_per_device": "throughput", "valid_loss": "lm loss validation",
    "valid_ppl": "lm loss validation ppl", "test_loss": "lm loss test", "test_ppl": "lm loss test ppl",
    "tokens_per_s": "tokens-per-sec", "mfu": "mfu", "memory_gb": "mem-max-gb", "skipped_steps": "skipped-iterations",
    # the straggler report (training/timers.py); the slowest host is in metrics.jsonl only (a string)
    "rank_time_min_s": "rank-time-min", "rank_time_max_s": "rank-time-max",
}
# The x-axes, not series: every record carries them.
AXES = ("iteration", "consumed_samples", "consumed_tokens")
# Tags also written against consumed samples ("... vs samples", as Megatron) and tokens.
VS_SAMPLES = ("lm loss", "learning-rate", "grad-norm", "batch-size", "lm loss validation", "lm loss validation ppl")
VS_TOKENS = ("lm loss", "lm loss validation")


def megatron_scalars(record: dict) -> dict:
    """A metrics.jsonl record's numbers under Megatron's tag names (iteration left out)."""
    return {MEGATRON_TAGS.get(k, k.replace("_", "-")): v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in AXES}


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan
    return value


class MetricsWriter:
    """Fan-out of scalar records. Inactive (all no-ops) on ranks other than 0."""

    def __init__(self, *, active: bool, jsonl_path: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                 wandb_project: Optional[str] = None, wandb_name: Optional[str] = None,
                 wandb_dir: Optional[str] = None, config: Optional[dict] = None, resume_iteration: int = 0):
        self.active = active
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not active:
            return
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self._jsonl = open(jsonl_path, "a", encoding="utf-8")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir, purge_step=resume_iteration + 1 if resume_iteration else None)
        if wandb_project:
            self._wandb = _init_wandb(wandb_project, wandb_name, wandb_dir, config)

    def write(self, record: dict, step: int) -> None:
        if not self.active:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({k: _json_safe(v) for k, v in record.items()}) + "\n")
            self._jsonl.flush()
        scalars = megatron_scalars(record)
        if self._tb is not None:
            samples, tokens = record.get("consumed_samples"), record.get("consumed_tokens")
            for tag, v in scalars.items():
                self._tb.add_scalar(tag, v, step)
                if samples is not None and tag in VS_SAMPLES:
                    self._tb.add_scalar(f"{tag} vs samples", v, int(samples))
                if tokens is not None and tag in VS_TOKENS:  # the paper's x-axis
                    self._tb.add_scalar(f"{tag} vs tokens", v, int(tokens))
            self._tb.flush()
        if self._wandb is not None:
            try:
                self._wandb.log(scalars, step=step)
            except Exception as exc:  # never let logging kill training
                warnings.warn(f"W&B logging failed, disabling it: {exc}")
                self._wandb = None

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception:
                pass
            self._wandb = None


def wandb_run_id(save_dir: str) -> str:
    """The run's W&B id, kept in <save_dir>/run_id: a requeued or resumed job continues the
    same W&B run instead of starting a new one."""
    path = os.path.join(save_dir, "run_id")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    os.makedirs(save_dir, exist_ok=True)
    run_id = uuid.uuid4().hex[:16]
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(run_id + "\n")
    return run_id


def _init_wandb(project, name, save_dir, config):
    """W&B run, offline unless WANDB_MODE says otherwise or an API key is set; None if
    wandb is missing or cannot start (a warning, never an error). Its files and its id
    (wandb_run_id) live in `save_dir` (default <save>/wandb, as Megatron)."""
    try:
        import wandb
    except ImportError:
        warnings.warn("--wandb-project given but wandb is not installed (pip install 'megatron_lev[wandb]'); "
                      "W&B logging is off")
        return None
    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    try:
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        run_id = wandb_run_id(save_dir) if save_dir else None
        return wandb.init(project=project, name=name, dir=save_dir, config=config, mode=mode, id=run_id,
                          resume="allow")
    except Exception as exc:
        warnings.warn(f"W&B could not start ({exc}); W&B logging is off")
        return None
