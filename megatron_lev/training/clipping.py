"""`--lev-clip-grad`: the LEV generator's gradients clipped apart from the rest of the model.

What Megatron-LM (and DeepSpeed's `gradient_clipping`) do: one global L2 norm over every
gradient (TP-duplicated parameters counted once, shards summed over TP, PP and DP), and when it
exceeds `--clip-grad` every gradient is multiplied by clip / (norm + 1e-6). In a LEV model the
generator's gradient dominates that norm (issue 32 measured 2.84 of a global 3.43 at step 0, and
97% of LEV's steps clipped against about 20% for the table models), so the body's updates are
shrunk by the generator's gradient.

With `--lev-clip-grad C` the two families are clipped apart, each by its own norm: the
generator's parameters (their own optimizer groups, optim.LEV_GROUP_KEY) to C, everything else
to `--clip-grad` (0 leaves a family unclipped). The reported gradient norm stays the global one
before clipping, as Megatron reports it; `family_grad_norms` holds the two family norms.

DeepSpeed has no per-group clipping, so its own is turned off (`gradient_clipping` 0,
ds_config.py) and this module replaces the ZeRO-1/2 optimizer's `scaled_global_norm` on the
instance: it computes each group's norm with DeepSpeed's own TP/DP-aware `get_grad_norm_direct`
(the same numbers DeepSpeed clips with), scales each family's reduced gradient partitions in
place, and returns the global norm, which DeepSpeed then uses for its overflow check and the
log. Only where that optimizer runs: ZeRO stage 2, or stage 1 in fp32 (ZeRO-1 with bf16 uses
DeepSpeed's BF16_Optimizer), without CPU offload and without pipeline parallelism; the flag is
refused elsewhere (ds_config.py), and `install_family_clipping` refuses an optimizer without
the methods it relies on (another DeepSpeed version).
"""
from __future__ import annotations

import types

import torch

from megatron_lev.training.optim import LEV_GROUP_KEY
from megatron_lev.utils.errors import ConfigError

_REQUIRED = ("scaled_global_norm", "get_grad_norm_direct", "averaged_gradients", "params_in_partition",
             "bit16_groups", "optimizer")


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Megatron's clip factor: min(1, max_norm / (norm + 1e-6)); 1 when max_norm is 0 (no clipping)."""
    if max_norm <= 0:
        return torch.ones_like(norm)
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def _scale_group(zero_optimizer, index: int, factor: torch.Tensor) -> None:
    """Multiply group `index`'s reduced gradient partition by `factor`, in place. A pre-flattened
    partition is what the step reads (its per-parameter list holds views into it): scale that once."""
    grads = zero_optimizer.averaged_gradients[index]
    flat = getattr(grads, "flat_partition", None)
    for tensor in ([flat] if flat is not None else grads or []):
        tensor.mul_(factor.to(tensor.dtype))


def family_clipped_global_norm(zero_optimizer, lev_clip: float, body_clip: float, norm_type: int = 2):
    """The replacement of DeepSpeedZeroOptimizer.scaled_global_norm (module docstring)."""
    from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm

    assert norm_type == 2, "only the L2 norm"
    is_lev = [bool(group.get(LEV_GROUP_KEY)) for group in zero_optimizer.optimizer.param_groups]
    norms = [zero_optimizer.get_grad_norm_direct(zero_optimizer.averaged_gradients[i],
                                                  zero_optimizer.params_in_partition[i])
             for i in range(len(zero_optimizer.bit16_groups))]
    total = combine_grad_norm_groups(norms)
    families = {}
    for name, member, max_norm in (("lev", True, lev_clip), ("body", False, body_clip)):
        indices = [i for i, flag in enumerate(is_lev) if flag == member]
        if not indices:
            continue
        norm = combine_grad_norm_groups([norms[i] for i in indices])
        families[name] = norm
        if is_invalid_grad_norm(total):  # DeepSpeed skips the step: nothing to scale
            continue
        factor = clip_coefficient(norm, max_norm)
        for i in indices:
            _scale_group(zero_optimizer, i, factor)
    zero_optimizer.family_grad_norms = families
    return total


def install_family_clipping(zero_optimizer, lev_clip: float, body_clip: float) -> None:
    """Make this ZeRO-1/2 optimizer clip the LEV generator's groups to `lev_clip` and the rest to
    `body_clip`, each by its own norm. DeepSpeed's own clipping must be off."""
    missing = [name for name in _REQUIRED if not hasattr(zero_optimizer, name)]
    if missing:
        raise ConfigError(f"--lev-clip-grad: DeepSpeed's {type(zero_optimizer).__name__} lacks {missing}; it needs "
                          "the ZeRO-1/2 optimizer of DeepSpeed 0.19 (ZeRO stage 2, or stage 1 in fp32)")
    if getattr(zero_optimizer, "clip_grad", 0.0) != 0.0:
        raise ConfigError("--lev-clip-grad: DeepSpeed's own gradient_clipping must be 0 (the trainer clips)")
    if getattr(zero_optimizer, "cpu_offload", False):
        raise ConfigError("--lev-clip-grad: not with optimizer offload (its norms are computed elsewhere)")
    if not any(group.get(LEV_GROUP_KEY) for group in zero_optimizer.optimizer.param_groups):
        raise ConfigError("--lev-clip-grad: the optimizer has no LEV generator group (embedding: lev only)")
    zero_optimizer.scaled_global_norm = types.MethodType(
        lambda self, norm_type=2: family_clipped_global_norm(self, lev_clip, body_clip, norm_type), zero_optimizer)
