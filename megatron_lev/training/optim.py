"""AdamW with Megatron's weight-decay groups, and the learning-rate schedule.

Weight decay applies to the matrices of the transformer and the heads; it is off for
norms, biases and the LEV generator's codebooks and per-head LayerNorm (the codebooks
are the generator's "embedding table", and decaying them shrinks the seed toward 0;
LayerNorm gains/shifts are norms even though LEV stores them as [heads, d_s]).

The optimizer is handed to DeepSpeed, which wraps it (ZeRO) and owns clipping and
overflow skipping; the schedule is megatron-core's OptimizerParamScheduler, which
DeepSpeed steps after every applied (non-skipped) optimizer step and saves in its
checkpoints.

`--decoupled-lr` (Megatron's flag) gives the input side and the output layer their own peak
(and `--decoupled-min-lr` their own floor) on the same warmup and decay: Megatron applies it
to the embedding table and the output layer; here the input side is the LEV generator (or the
table, for tied/untied). Their weight decay follows the same rules as everywhere.

`--lev-lr-mult` (ours) multiplies the learning rate of the LEV generator alone (not the output
layer), on top of whichever schedule its groups follow; with it, or with `--lev-clip-grad`
(training/clipping.py), the generator's parameters get groups of their own (`LEV_GROUP_KEY`).
`--lev-no-weight-decay` (ours) moves every generator parameter into the groups without weight
decay, as the author's own separable layer (KHRONOS) trains: weight decay pulls `delta` toward 0,
S = 1 + delta toward 1, where every mode is the same.
"""
from __future__ import annotations

import warnings

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_lev.lev.parallel import ParallelLEVEmbedding
from megatron_lev.models.layers import OutputLayer, VocabEmbedding

# LEVGenerator parameter names (lev/generator.py) that are exempt from weight decay.
LEV_NO_DECAY_NAMES = ("codebooks", "ln_gamma", "ln_beta")
# The param-group key that marks the --decoupled-lr groups (LRScheduler.get_lr reads it).
DECOUPLED_LR_KEY = "decoupled_lr"
# The param-group key that marks the LEV generator's own groups (--lev-lr-mult, --lev-clip-grad).
LEV_GROUP_KEY = "lev_generator"


def uses_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """False for norms/biases (1-D) and LEV codebooks/LayerNorm (matched by name)."""
    if param.ndim < 2:
        return False
    return name.rsplit(".", 1)[-1] not in LEV_NO_DECAY_NAMES


def embedding_or_output_parameters(model: torch.nn.Module) -> set[int]:
    """ids of the parameters --decoupled-lr applies to (Megatron's
    `is_embedding_or_output_parameter`): the input side (the LEV generator or the embedding
    table) and the output layer, found by module type, so the plain and pipeline forms agree."""
    found = set()
    for module in model.modules():
        if isinstance(module, (ParallelLEVEmbedding, VocabEmbedding, OutputLayer)):
            found.update(id(p) for p in module.parameters())
    return found


def lev_generator_parameters(model: torch.nn.Module) -> set[int]:
    """ids of the LEV generator's parameters (inside a ParallelLEVEmbedding)."""
    return {id(p) for module in model.modules() if isinstance(module, ParallelLEVEmbedding)
            for p in module.parameters()}


def param_groups(model: torch.nn.Module, weight_decay: float, decoupled: bool = False,
                 lev_separate: bool = False, lev_no_decay: bool = False) -> list[dict]:
    """AdamW groups: decayed and not decayed; with `decoupled`, the same split again for the
    --decoupled-lr parameters, and with `lev_separate` for the LEV generator's, after the
    others (so group 0 carries --lr, the rate the log line shows, as Megatron logs its
    default group). With `lev_no_decay` no generator parameter is decayed. Frozen parameters
    are left out.

    Each group also lists its parameter names under "param_names" (DeepSpeed ignores
    the key; it makes the split inspectable).
    """
    special = embedding_or_output_parameters(model) if decoupled else set()
    generator = lev_generator_parameters(model) if lev_separate or lev_no_decay else set()
    buckets = {}  # (decoupled, LEV generator, decayed) -> (params, names)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        in_generator = id(param) in generator
        decayed = uses_weight_decay(name, param) and not (lev_no_decay and in_generator)
        key = (id(param) in special, in_generator and lev_separate, decayed)
        params, names = buckets.setdefault(key, ([], []))
        params.append(param)
        names.append(name)
    groups = []
    for key in sorted(buckets, key=lambda k: (k[1], k[0], not k[2])):
        (params, names), (is_decoupled, is_generator, decayed) = buckets[key], key
        group = {"params": params, "weight_decay": weight_decay if decayed else 0.0, "param_names": names}
        if is_decoupled:
            group[DECOUPLED_LR_KEY] = True
        if is_generator:
            group[LEV_GROUP_KEY] = True
        groups.append(group)
    return groups


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float, offload: bool = False, decoupled_lr: float | None = None,
                    lev_separate: bool = False, lev_no_decay: bool = False) -> torch.optim.Optimizer:
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
    groups = [{k: v for k, v in g.items() if k != "param_names"}
              for g in param_groups(model, weight_decay, decoupled=decoupled_lr is not None,
                                    lev_separate=lev_separate, lev_no_decay=lev_no_decay)]
    kwargs = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if torch.cuda.is_available():
        candidates = ((("DeepSpeed's CPUAdam", _deepspeed_cpu_adam),) if offload else
                      (("DeepSpeed's FusedAdam", _deepspeed_fused_adam), ("apex's FusedAdam", _apex_fused_adam)))
        failed = []
        for name, make in candidates:
            try:
                optimizer = make(groups, kwargs)
            except Exception as exc:  # noqa: BLE001 - op not buildable / package missing: next candidate
                first_line = (str(exc).strip().splitlines() or [""])[0][:200]
                failed.append(f"{name}: {type(exc).__name__}: {first_line}")
                continue
            _record_fallbacks(failed, type(optimizer).__name__)
            return optimizer
        _record_fallbacks(failed, "torch's fused AdamW")
    # torch's fused kernel exists for CUDA and CPU tensors alike (offloaded partitions too).
    return torch.optim.AdamW(groups, fused=True, **kwargs)


# Every optimizer that build_optimizer tried and could not use in this process, with why (one
# line each), in order: the GPU check reads it, and the first one is warned about.
optimizer_fallbacks: list[str] = []


def _record_fallbacks(failed: list[str], used: str) -> None:
    if failed and not optimizer_fallbacks:
        warnings.warn(f"AdamW: {failed[0]}; using {used} instead (same update, another kernel)")
    optimizer_fallbacks.extend(failed)


def _deepspeed_cpu_adam(groups, kwargs):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)


def _deepspeed_fused_adam(groups, kwargs):
    from deepspeed.ops.adam import FusedAdam

    return FusedAdam(groups, adam_w_mode=True, **kwargs)


def _apex_fused_adam(groups, kwargs):
    from apex.optimizers import FusedAdam

    return FusedAdam(groups, adam_w_mode=True, **kwargs)


class LRScheduler(OptimizerParamScheduler):
    """megatron-core's OptimizerParamScheduler (Megatron-LM's schedule: linear warmup from
    --lr-warmup-init, then constant / linear / cosine / inverse-square-root / WSD decay to
    --min-lr; weight decay from --start- to --end-weight-decay), counted in samples.

    DeepSpeed calls `step()` after every applied optimizer step and saves `state_dict()` in
    its checkpoints; each step is one global batch of samples, as Megatron's
    `opt_param_scheduler.step(increment=global_batch_size)`. Megatron's meaning of the
    steps: step 0 runs at --lr-warmup-init (0) during warmup, --lr at the end of warmup.
    Groups built with weight_decay 0 (norms, biases, LEV codebooks) get wd_mult 0, so the
    scheduler's decay never reaches them.
    """

    def __init__(self, optimizer, *, samples_per_step: int, decoupled_lr: float | None = None,
                 decoupled_min_lr: float | None = None, lev_lr_mult: float = 1.0, **kwargs):
        self.samples_per_step = samples_per_step
        # Kept here, not in the groups, so that a checkpoint's saved optimizer groups (loaded
        # after the schedule under ZeRO) cannot bring back an old decoupled rate.
        self.decoupled_lr, self.decoupled_min_lr = decoupled_lr, decoupled_min_lr
        self.lev_lr_mult = lev_lr_mult
        for group in optimizer.param_groups:
            group.setdefault("wd_mult", 1.0 if group.get("weight_decay", 0.0) > 0 else 0.0)
        super().__init__(optimizer, **kwargs)

    def get_lr(self, param_group: dict) -> float:
        """megatron-core's schedule; the --decoupled-lr groups run it between their own end points,
        and the LEV generator's groups at --lev-lr-mult times their schedule."""
        mult = self.lev_lr_mult if param_group.get(LEV_GROUP_KEY) else 1.0
        if param_group.get(DECOUPLED_LR_KEY) and self.decoupled_lr is not None:
            ends = {"max_lr": self.decoupled_lr}
            if self.decoupled_min_lr is not None:
                ends["min_lr"] = self.decoupled_min_lr
            return mult * super().get_lr(ends)
        return mult * super().get_lr(param_group)

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.decoupled_lr is not None:
            state.update(decoupled_lr=self.decoupled_lr, decoupled_min_lr=self.decoupled_min_lr)
        if self.lev_lr_mult != 1.0:
            state.update(lev_lr_mult=self.lev_lr_mult)
        return state

    def step(self, increment: int | None = None) -> None:
        super().step(self.samples_per_step if increment is None else increment)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def load_state_dict(self, state_dict: dict) -> None:
        """A schedule that differs from the checkpoint's is refused unless
        --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler says which one
        wins (train.py checks this before building anything; here it is megatron-core's assert)."""
        self.num_steps = 0
        super().load_state_dict(state_dict)
        if self.decoupled_lr is not None or state_dict.get("decoupled_lr") is not None:
            self.decoupled_lr = self._check_and_set(self.decoupled_lr, state_dict.get("decoupled_lr"),
                                                    "decoupled learning rate")
            self.decoupled_min_lr = self._check_and_set(self.decoupled_min_lr, state_dict.get("decoupled_min_lr"),
                                                        "decoupled minimum learning rate")
        self.lev_lr_mult = self._check_and_set(self.lev_lr_mult, state_dict.get("lev_lr_mult", 1.0),
                                               "LEV generator learning-rate multiplier")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, args) -> LRScheduler:
    """The run's schedule from its validated args (arguments._schedule_in_samples)."""
    return LRScheduler(
        optimizer, samples_per_step=args.global_batch_size, init_lr=args.lr_warmup_init, max_lr=args.lr,
        min_lr=args.min_lr, decoupled_lr=getattr(args, "decoupled_lr", None),
        decoupled_min_lr=getattr(args, "decoupled_min_lr", None), lev_lr_mult=getattr(args, "lev_lr_mult", 1.0),
        lr_warmup_steps=args.lr_warmup_steps, lr_decay_steps=args.lr_decay_steps,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
        wd_incr_steps=args.wd_incr_steps, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler, wsd_decay_steps=args.wsd_decay_steps,
        lr_wsd_decay_style=args.lr_wsd_decay_style)


# The schedule fields a checkpoint stores (OptimizerParamScheduler.state_dict) -> the flags that set them.
SCHEDULE_FIELDS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-*",
                   "lr_decay_steps": "--lr-decay-* / the run length", "lr_decay_style": "--lr-decay-style",
                   "start_wd": "--start-weight-decay", "end_wd": "--end-weight-decay",
                   "wd_incr_steps": "the run length (weight-decay increment)",
                   "wd_incr_style": "--weight-decay-incr-style", "decoupled_lr": "--decoupled-lr",
                   "decoupled_min_lr": "--decoupled-min-lr", "lev_lr_mult": "--lev-lr-mult"}


def schedule_state(training: dict) -> dict:
    """What OptimizerParamScheduler.state_dict() holds for a run's effective `training:` config."""
    return {"max_lr": float(training["lr"]), "min_lr": training["min_lr"], "lr_warmup_steps": training["lr_warmup_steps"],
            "lr_decay_steps": training["lr_decay_steps"], "lr_decay_style": training["lr_decay_style"],
            "start_wd": training["start_weight_decay"], "end_wd": training["end_weight_decay"],
            "wd_incr_steps": training["wd_incr_steps"], "wd_incr_style": training["weight_decay_incr_style"],
            # absent from checkpoints that predate the flags: no decoupled rate
            "decoupled_lr": training.get("decoupled_lr"), "decoupled_min_lr": training.get("decoupled_min_lr"),
            "lev_lr_mult": training.get("lev_lr_mult", 1.0)}


def schedule_mismatch(saved_training: dict, training: dict) -> list[str]:
    """'field: checkpoint X, now Y (flag)' for every schedule field that changed (empty when
    the checkpoint predates these fields)."""
    try:
        old = schedule_state(saved_training)
    except KeyError:
        return []
    new = schedule_state(training)
    return [f"{k} {old[k]} -> {new[k]} ({flag})" for k, flag in SCHEDULE_FIELDS.items() if old[k] != new[k]]
