"""AdamW with Megatron's weight-decay groups, and the learning-rate schedule.

Weight decay applies to the matrices of the transformer and the heads; it is off for
norms, biases and the LEV generator's codebooks and per-head LayerNorm (the codebooks
are the generator's "embedding table", and decaying them shrinks the seed toward 0;
LayerNorm gains/shifts are norms even though LEV stores them as [heads, d_s]).

The optimizer is handed to DeepSpeed, which wraps it (ZeRO) and owns clipping and
overflow skipping; the schedule is a `LambdaLR` that DeepSpeed steps after every
applied (non-skipped) optimizer step and saves in its checkpoints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# LEVGenerator parameter names (lev.py) that are exempt from weight decay.
LEV_NO_DECAY_NAMES = ("codebooks", "ln_gamma", "ln_beta")


def uses_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """False for norms/biases (1-D) and LEV codebooks/LayerNorm (matched by name)."""
    if param.ndim < 2:
        return False
    return name.rsplit(".", 1)[-1] not in LEV_NO_DECAY_NAMES


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed and not decayed. Frozen parameters are left out.

    Each group also lists its parameter names under "param_names" (DeepSpeed ignores
    the key; it makes the split inspectable).
    """
    decay, no_decay, decay_names, no_decay_names = [], [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if uses_weight_decay(name, param):
            decay.append(param)
            decay_names.append(name)
        else:
            no_decay.append(param)
            no_decay_names.append(name)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay, "param_names": decay_names})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "param_names": no_decay_names})
    return groups


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float, offload: bool = False) -> torch.optim.Optimizer:
    """AdamW over `param_groups`. On GPU: DeepSpeed's CPU Adam under ZeRO-Offload, else
    DeepSpeed's (then apex's) fused Adam when they build/import, else torch's fused AdamW.
    On CPU (no CUDA): torch's fused AdamW, offload or not (offloading to the CPU you already
    run on gains nothing, and JIT-building DeepSpeed's CPU Adam takes minutes there). The
    fused CPU kernel steps DeepSpeed's flat fp32 partitions in one vectorised pass; the
    unfused one allocated several partition-sized temporaries per step (about 10x slower
    at 125M).

    `param_names` is stripped before construction (optimizers keep unknown group keys,
    but DeepSpeed's fused kernels and checkpoints do not need them).
    """
    groups = [{k: v for k, v in g.items() if k != "param_names"} for g in param_groups(model, weight_decay)]
    kwargs = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if torch.cuda.is_available():
        candidates = (_deepspeed_cpu_adam,) if offload else (_deepspeed_fused_adam, _apex_fused_adam)
        for make in candidates:
            try:
                return make(groups, kwargs)
            except Exception:  # op not buildable / package missing: next candidate
                continue
    # torch's fused kernel exists for CUDA and CPU tensors alike (offloaded partitions too).
    return torch.optim.AdamW(groups, fused=True, **kwargs)


def _deepspeed_cpu_adam(groups, kwargs):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)


def _deepspeed_fused_adam(groups, kwargs):
    from deepspeed.ops.adam import FusedAdam

    return FusedAdam(groups, adam_w_mode=True, **kwargs)


def _apex_fused_adam(groups, kwargs):
    from apex.optimizers import FusedAdam

    return FusedAdam(groups, adam_w_mode=True, **kwargs)


@dataclass
class WarmupDecaySchedule:
    """LR multiplier (of the peak --lr) after `step` applied optimizer steps.

    Linear warmup over `warmup_iters` steps, reaching the peak at the end of warmup
    (step s < warmup uses (s + 1) / warmup, so the first step already moves, unlike
    Megatron's lr = 0 at step 0), then decay to `min_lr` at `decay_iters`:
      cosine: min + (max - min) * (1 + cos(pi * t)) / 2,  t = (s - warmup) / (decay - warmup)
      linear: min + (max - min) * (1 - t)
      constant: max
    and `min_lr` after `decay_iters`. A plain dataclass so LambdaLR's state_dict
    checkpoints its fields.
    """

    max_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str = "cosine"

    def lr(self, step: int) -> float:
        if self.warmup_iters > 0 and step < self.warmup_iters:
            return self.max_lr * (step + 1) / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if step >= self.decay_iters:
            return self.min_lr
        t = (step - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        if self.style == "linear":
            factor = 1.0 - t
        elif self.style == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * t))
        else:
            raise ValueError(f"--lr-decay-style {self.style!r} must be cosine, linear or constant")
        return self.min_lr + (self.max_lr - self.min_lr) * factor

    def __call__(self, step: int) -> float:
        return self.lr(step) / self.max_lr if self.max_lr > 0 else 0.0


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, lr: float, min_lr: float, warmup_iters: int,
                       decay_iters: int, style: str) -> torch.optim.lr_scheduler.LambdaLR:
    """The param groups' lr must be the peak `lr` (build_optimizer sets it)."""
    schedule = WarmupDecaySchedule(max_lr=lr, min_lr=min_lr, warmup_iters=warmup_iters,
                                   decay_iters=decay_iters, style=style)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
