"""The decoder's building blocks on megatron-core's tensor-parallel layers: initialisation
that does not depend on the parallel layout, activation recomputation, RoPE, RMSNorm, the input
side (LEV generator or vocab-parallel table), the linear layers and the vocab-parallel head.

Initialisation does not depend on the parallel layout: every module draws its *full* weights
from its own generator, seeded by `derive_seed(config.init_seed, <module name>)`, and keeps its
tensor-parallel slice (`use_cpu_initialization=True`). So TP=1, TP=2 and any pipeline split
built from one seed hold the same weights. Vocabulary padding rows are zero.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

from megatron_lev.distributed.rng import get_rng_tracker
from megatron_lev.lev.generator import LEVConfig
from megatron_lev.lev.parallel import ParallelLEVEmbedding
from megatron_lev.models.config import LeviathanConfig
from megatron_lev.models.settings import LLAMA3_ROPE

try:  # apex's fused RMSNorm kernel, used on CUDA when apex is installed
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine
except Exception:  # pragma: no cover - depends on the cluster's image
    fused_rms_norm_affine = None


def derive_seed(seed: int, name: str) -> int:
    """A stable per-module seed (crc32, not hash(): that is salted per process)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@contextlib.contextmanager
def init_rng(seed: int, name: str):
    """Draw a module's initial weights from its own seed, leaving the global CPU stream as it was.

    This is what makes initialisation independent of TP and PP: a module's weights depend
    only on (seed, its name), not on which modules this rank built before it.
    """
    state = torch.get_rng_state()
    torch.default_generator.manual_seed(derive_seed(seed, name))
    try:
        yield
    finally:
        torch.set_rng_state(state)


def _vocab_init(init_method: Callable, vocab_size: int) -> Callable:
    """Initialise the real vocabulary rows as if there were no padding; padding rows are zero."""
    def init(weight: torch.Tensor) -> None:
        init_method(weight[:vocab_size])
        with torch.no_grad():
            weight[vocab_size:].zero_()
    return init


def checkpoint(function: Callable, *args):
    """Activation recomputation: run `function(*args)` now without keeping its activations,
    recompute them in backward. megatron-core's version on CUDA (it restores the CUDA and
    model-parallel RNG streams); on CPU torch's non-reentrant one, plus a replay of the
    model-parallel RNG tracker so dropout in TP regions draws the same masks on recompute."""
    if args[0].is_cuda:
        return tensor_parallel.checkpoint(function, False, *args)
    tracker = get_rng_tracker()
    forward_states = tracker.get_states()
    calls = []

    def run(*inputs):
        if not calls:  # the forward
            calls.append(1)
            return function(*inputs)
        current = tracker.get_states()  # the recomputation
        tracker.set_states(forward_states)
        try:
            return function(*inputs)
        finally:
            tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)


def rotary_inverse_frequencies(head_dim: int, base: float, rotary_percent: float = 1.0, rope_scaling: bool = False,
                               rope_scaling_factor: float = 8.0, device=None) -> torch.Tensor:
    """RoPE's float32 inverse frequencies [rotary_dim / 2], as megatron-core's RotaryEmbedding makes
    them: rotary_dim = int(head_dim x rotary_percent), and with `rope_scaling` LLaMA 3's scaling
    (low / high frequency factors 1 and 4, original context 8192: Megatron's, and transformers'
    `llama3` rope type)."""
    dim = int(head_dim * rotary_percent) if rotary_percent < 1.0 else head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if not rope_scaling:
        return inv_freq
    low, high, context = (LLAMA3_ROPE[k] for k in ("low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings"))
    low_freq_wavelen, high_freq_wavelen = context / low, context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope_scaling_factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / rope_scaling_factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float, rotary_percent: float = 1.0,
                   rope_scaling: bool = False, rope_scaling_factor: float = 8.0):
    """RoPE tables for positions [b, s]: cos, sin as float32 [s, b, 1, rotary_dim]
    (halves layout, as Megatron's default and Hugging Face LLaMA)."""
    inv_freq = rotary_inverse_frequencies(head_dim, base, rotary_percent, rope_scaling, rope_scaling_factor,
                                          device=position_ids.device)
    angles = position_ids.t().to(torch.float32)[..., None] * inv_freq  # [s, b, rotary_dim/2]
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(2)
    return angles.cos(), angles.sin()


def model_rotary_cos_sin(position_ids: torch.Tensor, config: LeviathanConfig):
    """rotary_cos_sin with the model's RoPE settings."""
    return rotary_cos_sin(position_ids, config.kv_channels, config.rotary_base, config.rotary_percent,
                          config.rope_scaling, config.rope_scaling_factor)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, n, dh] rotated in float32 on its first rotary_dim = cos.shape[-1] dims (halves
    within them, as megatron-core), returned in x's dtype."""
    rotary_dim = cos.shape[-1]
    xf = x.float()
    if rotary_dim < x.shape[-1]:
        xf, passed = xf[..., :rotary_dim], xf[..., rotary_dim:]
    x1, x2 = xf.chunk(2, dim=-1)
    out = xf * cos + torch.cat((-x2, x1), dim=-1) * sin
    if rotary_dim < x.shape[-1]:
        out = torch.cat((out, passed), dim=-1)
    return out.to(x.dtype)


def default_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)


class RMSNorm(torch.nn.Module):
    """RMSNorm with a learned scale; apex's fused kernel on CUDA when apex imports (eager
    only), else torch's `F.rms_norm` (fused on CUDA in recent torch, plain ops on CPU)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Inside a compiled layer torch's op: inductor fuses it with the residual add, where
        # apex's kernel would be an opaque call (or, in older apex, a graph break).
        if fused_rms_norm_affine is not None and x.is_cuda and not torch.compiler.is_compiling():
            return fused_rms_norm_affine(x, self.weight, self.weight.shape, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class VocabEmbedding(VocabParallelEmbedding):
    """The vocab-parallel token table: input_ids [b, s] -> [s, b, H] (or [s, b, embedding_dim]),
    all-reduced over TP."""

    def __init__(self, config: LeviathanConfig, embedding_dim: Optional[int] = None):
        with init_rng(config.init_seed, "embedding"):
            super().__init__(config.padded_vocab_size, embedding_dim or config.hidden_size, config=config,
                             init_method=_vocab_init(config.init_method, config.vocab_size),
                             tp_group=parallel_state.get_tensor_model_parallel_group())
        if config.freeze_input_embedding:
            # No gradient is computed for it, so the optimizer (optim.param_groups keeps trainable
            # parameters only) holds no state for it and never decays it: it stays at its init.
            self.weight.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids.t())  # look up [s, b]: no transpose of the output


class FactorizedEmbedding(VocabEmbedding):
    """ALBERT's factorised input side: a vocab-parallel V x r table (r = embedding_rank), its
    [s, b, r] lookup all-reduced over TP like every table here, then a replicated r -> H
    projection without bias: input_ids [b, s] -> [s, b, H]. Reducing before projecting moves r
    numbers per token, not H; every TP rank then projects the same full lookup, so the
    projection's gradient is the same on every rank (like a norm's) and needs no reduction.

    Init: the table N(0, init_method_std), as a plain table; the projection N(0, 1/sqrt(r)).
    Each embedding entry is a sum of r products of variance init_method_std^2 / r, so the
    embeddings' RMS at init is init_method_std, a plain table's: the body starts from the input
    scale of the tied/untied baselines, and a comparison isolates the factorisation. (ALBERT's
    N(0, 0.02) for both would give an RMS sqrt(r) x 0.02 times a plain table's: 0.11x at r = 32.)
    """

    def __init__(self, config: LeviathanConfig):
        super().__init__(config, embedding_dim=config.embedding_rank)
        rank = config.embedding_rank
        # Built and drawn inside the seeded context: nn.Linear's own (discarded) init draws too.
        with init_rng(config.init_seed, "embedding.projection"), torch.no_grad():
            self.projection = torch.nn.Linear(rank, config.hidden_size, bias=False, dtype=config.params_dtype)
            self.projection.weight.copy_(torch.empty(config.hidden_size, rank).normal_(0.0, rank ** -0.5))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.projection(super().forward(input_ids))


def lev_embedding_kwargs(config: LeviathanConfig) -> dict:
    """How the LEV embedding is built (shared by the plain and the pipeline forms)."""
    return {"config": config.lev_config(), "init_seed": derive_seed(config.init_seed, "embedding"),
            "sequence_parallel": config.sequence_parallel, "params_dtype": config.params_dtype,
            "transformer_config": config}


# What evaluation/capacity.py --save writes and `model.lev_init_from` reads: {"format", "lev" (the
# LEVConfig as a dict), "parameters" (every head's tensors, LEVGenerator's names), ...}.
LEV_FIT_FORMAT = "megatron_lev.lev_fit/1"


def lev_fit_parameters(path: str, lev_config: LEVConfig) -> dict[str, torch.Tensor]:
    """The full generator parameters of a fitted-generator file, checked against the model's
    generator config (ValueError naming the file and what differs)."""
    where = f"model.lev_init_from {path}"
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except Exception as exc:  # truncated, not a torch file, not loadable without pickled code
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ValueError(f"{where}: not a fitted-generator file ({type(exc).__name__}: {first_line})") from None
    if not isinstance(saved, dict) or saved.get("format") != LEV_FIT_FORMAT:
        found = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{where}: format {found!r}, expected {LEV_FIT_FORMAT!r} (evaluation/capacity.py --save)")
    fitted = saved["lev"]
    differing = [f"{k} {fitted.get(k)!r} (model: {v!r})" for k, v in lev_config.to_dict().items() if fitted.get(k) != v]
    if differing:
        raise ValueError(f"{where}: fitted for another generator: {', '.join(differing)}")
    return saved["parameters"]


def start_lev_from_fit(module: torch.nn.Module, config: LeviathanConfig) -> int:
    """Load `config.lev_init_from` into every LEV embedding inside `module` (this rank's heads of
    it; none on a pipeline stage without the embedding); the number loaded. The trainer calls it on
    a run's fresh start only: a resumed run, an evaluation or an export reads the checkpoint's
    weights and never needs the file."""
    if config.lev_init_from is None:
        return 0
    full = lev_fit_parameters(config.lev_init_from, config.lev_config())
    embeddings = [m for m in module.modules() if isinstance(m, ParallelLEVEmbedding)]
    for embedding in embeddings:
        embedding.generator.load_full_parameters(full)
    return len(embeddings)


def build_embedding(config: LeviathanConfig) -> torch.nn.Module:
    """[b, s] ids -> [s, b, H] in params_dtype, all-reduced over TP: LEV, the factorised table or
    the vocab table."""
    if config.embedding == "lev":
        return ParallelLEVEmbedding(**lev_embedding_kwargs(config))
    if config.embedding == "factorized":
        return FactorizedEmbedding(config)
    return VocabEmbedding(config)


class _OneRankAsMatmul:
    """For megatron-core's parallel linear layers: with one tensor-parallel rank (and neither
    sequence parallelism nor fused weight-gradient accumulation) a layer is x @ W^T, so its
    matmul runs as `F.linear` (torch's C++ autograd) rather than megatron-core's Python
    autograd Function, whose backward costs about 0.2 ms a layer on CPU. The module is still
    called as usual, so DeepSpeed's hooks (ZeRO-3's parameter gathering) run.

    The tensor-parallel group is passed explicitly, at construction and on every call:
    megatron-core warns (on global rank 0 only) when it has to look it up itself, and inside a
    compiled layer each warning is a graph break on that rank alone, so ranks would compile
    different graphs around the same collectives (RowParallelLinear.forward passes None)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("tp_group", parallel_state.get_tensor_model_parallel_group())
        super().__init__(*args, **kwargs)
        config = self.config
        self.one_rank_matmul = (parallel_state.get_tensor_model_parallel_world_size() == 1
                                and not config.sequence_parallel and not self.gradient_accumulation_fusion
                                and not config.defer_embedding_wgrad_compute)

    def _forward_impl(self, input, weight, *args, bias=None, **kwargs):
        if self.one_rank_matmul:
            return F.linear(input, weight, bias)
        if kwargs.get("tp_group") is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, bias=bias, **kwargs)


class ColumnLinear(_OneRankAsMatmul, ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear (output dimension split over TP)."""


class RowLinear(_OneRankAsMatmul, RowParallelLinear):
    """megatron-core's RowParallelLinear (input dimension split over TP, output all-reduced)."""


class OutputLayer(ColumnLinear):
    """The vocab-parallel head: [s, b, H] -> logits [s, b, Vp/TP], padding columns at -inf.
    Weightless when tied (the caller passes the embedding table)."""

    def __init__(self, config: LeviathanConfig):
        tied = config.embedding == "tied"
        with init_rng(config.init_seed, "output_layer"):
            super().__init__(config.hidden_size, config.padded_vocab_size, config=config,
                             init_method=_vocab_init(config.init_method, config.vocab_size),
                             bias=False, gather_output=False, skip_weight_param_allocation=tied)
        self.vocab_size = config.vocab_size
        self.vocab_start = parallel_state.get_tensor_model_parallel_rank() * self.output_size_per_partition

    def forward(self, hidden: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits, _ = super().forward(hidden, weight)
        first_pad = self.vocab_size - self.vocab_start  # local index of the first padding column
        if first_pad < logits.shape[-1]:
            # Outside autograd: recorded, the fill would cost a logits-sized copy of the gradient
            # in backward (CopySlices). Nothing is lost: whatever consumes the logits gives a -inf
            # column a zero gradient (the cross entropy's softmax is 0 there; gather_logits drops it).
            with torch.no_grad():
                logits[..., max(first_pad, 0):] = float("-inf")
        return logits
