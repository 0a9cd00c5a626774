"""The Leviathan decoder: a LLaMA-style transformer on megatron-core's tensor-parallel layers.

    embedding (LEV generator | vocab table)  ->  num_layers x DecoderLayer  ->  final_norm  ->  output_layer

Each DecoderLayer is pre-RMSNorm, RoPE self-attention (grouped-query optional) through
`F.scaled_dot_product_attention(is_causal=True)` and a SwiGLU MLP; no biases anywhere.
The input side is chosen by `embedding` (LEV_SPEC.md section 4):

    lev      LEV generator (lev.parallel.ParallelLEVEmbedding)   + untied head   (Leviathan, v2)
    tied     vocab-parallel table                                 = the head      (v2 baseline)
    untied   vocab-parallel table                                 + untied head   (v1 baseline)

Why not megatron-core's GPTModel: its RoPE and attention assume CUDA. Everything here runs on
CPU (gloo) and on GPU, where SDPA picks flash kernels. The config *is* megatron-core's
`TransformerConfig` (subclassed with the few fields it lacks), so flags keep Megatron's names.

Layout inside is Megatron's `[s, b, h]` (sequence first). Inputs and outputs are batch first.

Initialisation does not depend on the parallel layout: every module draws its *full* weights
from its own generator, seeded by `derive_seed(config.init_seed, <module name>)`, and keeps its
tensor-parallel slice (`use_cpu_initialization=True`). So TP=1, TP=2 and any pipeline split
built from one seed hold the same weights. Vocabulary padding rows (see below) are zero.

Vocabulary padding: the table and head have `padded_vocab_size` rows (vocab_size rounded up to
`make_vocab_size_divisible_by x TP`, Megatron's rule). Unlike Megatron, the padding logits are
set to -inf before the softmax and in returned logits, so padding never changes a loss: a
model's numbers do not depend on TP, and resharding to another TP only adds/drops zero rows.

Parameters (names are stable: checkpoints, the pipeline form and the HF export rely on them).
Shapes are global; "TP split" says how each rank's shard is cut from the global tensor.

| name                                   | global shape              | TP split                      |
| -------------------------------------- | ------------------------- | ----------------------------- |
| embedding.weight (tied, untied)        | [Vp, H]                   | dim 0, contiguous (vocab)     |
| embedding.generator.codebooks (lev)    | [k, b, d_s]               | replicated                    |
| embedding.generator.{w_seed, ln_gamma, | [h_lev, ...]              | dim 0 (LEV head), contiguous  |
|   ln_beta, delta, w_out} (lev)         |   (shapes: lev/generator.py)|                               |
| layers.{i}.input_norm.weight           | [H]                       | replicated                    |
| layers.{i}.attention.qkv.weight        | [(nh + 2 ng) dh, H]       | dim 0, contiguous (see below) |
| layers.{i}.attention.out_proj.weight   | [H, nh dh]                | dim 1, contiguous             |
| layers.{i}.mlp_norm.weight             | [H]                       | replicated                    |
| layers.{i}.mlp.gate_up.weight          | [2 F, H]                  | dim 0, stride 2 (see below)   |
| layers.{i}.mlp.down.weight             | [H, F]                    | dim 1, contiguous             |
| final_norm.weight                      | [H]                       | replicated                    |
| output_layer.weight (lev, untied)      | [Vp, H]                   | dim 0, contiguous (vocab)     |

- qkv rows are grouped by kv head (Megatron's layout): for each of the `ng` query groups,
  `nh/ng` query heads then one key head then one value head, each `dh` rows. A contiguous TP
  split therefore hands each rank whole groups. To HF: q/k/v = per group slices.
- gate_up is [gate; up] (F rows each). Rank r holds [gate rows r*F/tp:(r+1)*F/tp ; up rows the
  same] (megatron's stride-2 split, `partition_stride=2` on the parameter).
- For `tied` there is no output weight: `output_layer` is a weightless ColumnParallelLinear fed
  `embedding.weight` (Megatron's GPTModel does the same). megatron-core's linear layers add
  an `_extra_state` (None) entry to state dicts; exporters skip it.
- Every tensor-parallel parameter carries megatron-core's `tensor_model_parallel`,
  `partition_dim` and `partition_stride` attributes; the rest are replicated.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lev.distributed.rng import get_rng_tracker
from megatron_lev.lev.generator import LEVConfig
from megatron_lev.lev.parallel import ParallelLEVEmbedding

try:  # apex's fused RMSNorm kernel, used on CUDA when apex is installed
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine
except Exception:  # pragma: no cover - depends on the cluster's image
    fused_rms_norm_affine = None

EMBEDDING_KINDS = ("lev", "tied", "untied")


# --------------------------------------------------------------------------- config


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Megatron's rule: round up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def llama_ffn_hidden_size(hidden_size: int, multiple_of: int = 256) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4H (same MLP parameters as a 4H GELU MLP), rounded up."""
    return -(-int(8 * hidden_size / 3) // multiple_of) * multiple_of


@dataclass
class LeviathanConfig(TransformerConfig):
    """megatron-core's TransformerConfig with LLaMA defaults and the fields it lacks.

    Build it with `model_config_from_dict` from a YAML `model:` section; `to_dict()` gives
    that section back (what checkpoints and the HF export store).
    """

    embedding: str = "lev"  # lev | tied | untied
    vocab_size: int = 50304  # the tokenizer's vocabulary (50,304: GPT-NeoX/Pile; the papers: ~200k)
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 2048
    rotary_base: float = 10000.0
    lev: dict = field(default_factory=dict)  # LEVConfig fields but vocab_size/hidden_size
    init_seed: int = 1234  # Megatron's --seed: all weights derive from it
    padded_vocab_size: int = field(init=False, default=0)  # derived, TP-aware

    # TransformerConfig fields with LLaMA-style defaults.
    normalization: str = "RMSNorm"
    layernorm_epsilon: float = 1e-5
    add_bias_linear: bool = False
    gated_linear_unit: bool = True
    activation_func: Callable = F.silu
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    use_cpu_initialization: bool = True

    def __post_init__(self):
        self._validate()
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = llama_ffn_hidden_size(self.hidden_size)
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            self.pipeline_dtype = self.params_dtype
        super().__post_init__()
        if self.ffn_hidden_size % self.tensor_model_parallel_size:
            raise ValueError(f"ffn_hidden_size ({self.ffn_hidden_size}) must be divisible by "
                             f"--tensor-model-parallel-size ({self.tensor_model_parallel_size})")
        if self.kv_channels % 2:
            raise ValueError(f"kv_channels ({self.kv_channels}, the head size) must be even for RoPE")
        self.padded_vocab_size = pad_vocab_size(
            self.vocab_size, self.make_vocab_size_divisible_by, self.tensor_model_parallel_size)

    def _validate(self):
        """Clear one-line errors naming the field, before TransformerConfig's own checks."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if self.embedding not in EMBEDDING_KINDS:
            raise ValueError(f"embedding: unknown embedding kind {self.embedding!r} "
                             f"(expected one of {', '.join(EMBEDDING_KINDS)})")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                     "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        heads = self.num_attention_heads
        if heads % tp:
            raise ValueError(f"num_attention_heads ({heads}) must be divisible by "
                             f"--tensor-model-parallel-size ({tp})")
        groups = heads if self.num_query_groups is None else self.num_query_groups
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or heads % groups:
            raise ValueError(f"num_query_groups ({groups}, the kv heads) must divide "
                             f"num_attention_heads ({heads})")
        if groups % tp:
            raise ValueError(f"num_query_groups ({groups}, the kv heads) must be divisible by "
                             f"--tensor-model-parallel-size ({tp}): kv heads are split, not replicated")
        if self.kv_channels is None and self.hidden_size % heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                             f"({heads}), or set kv_channels")
        if self.num_layers < pp:
            raise ValueError(f"num_layers ({self.num_layers}) must be at least "
                             f"--pipeline-model-parallel-size ({pp}): every stage needs a layer")
        if self.sequence_parallel:
            raise ValueError("--sequence-parallel: not supported by megatron_lev.model yet (its "
                             "norm-gradient reduction under DeepSpeed is not written or tested)")
        if self.normalization != "RMSNorm" or not self.gated_linear_unit or self.add_bias_linear:
            raise ValueError("normalization/gated_linear_unit/add_bias_linear: the Leviathan decoder is "
                             "RMSNorm + SwiGLU without biases")
        if self.fp16:
            raise ValueError("fp16: not supported, use bf16")
        if not isinstance(self.lev, dict):
            raise ValueError(f"lev: must be a mapping of LEVConfig fields, got {self.lev!r}")
        if self.embedding == "lev":
            self.lev_config().validate(tp)

    def lev_config(self) -> LEVConfig:
        """The generator's config: the `lev:` fields plus the model's vocab and width."""
        for key in ("vocab_size", "hidden_size"):
            if key in self.lev:
                raise ValueError(f"lev.{key}: set the model's {key}, not the generator's")
        try:
            return LEVConfig.from_dict({**self.lev, "vocab_size": self.vocab_size,
                                        "hidden_size": self.hidden_size})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"lev: {exc}") from None

    def to_dict(self) -> dict:
        """The YAML `model:` section this config was built from (resolved)."""
        out = {name: getattr(self, name) for name in MODEL_FIELDS}
        if self.embedding == "lev":  # resolved generator fields, defaults included
            out["lev"] = {k: v for k, v in self.lev_config().to_dict().items()
                          if k not in ("vocab_size", "hidden_size")}
        else:
            out["lev"] = dict(self.lev)
        return out


# Fields of a YAML `model:` section (all LeviathanConfig / TransformerConfig names).
MODEL_FIELDS = (
    "embedding", "vocab_size", "make_vocab_size_divisible_by", "num_layers", "hidden_size",
    "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "seq_length",
    "rotary_base", "layernorm_epsilon", "init_method_std", "hidden_dropout", "attention_dropout",
    "init_seed", "lev",
)


def model_config_from_dict(model_section: dict, *, tensor_model_parallel_size: int = 1,
                           pipeline_model_parallel_size: int = 1, bf16: bool = False,
                           sequence_parallel: bool = False, recompute=False,
                           **overrides) -> LeviathanConfig:
    """A LeviathanConfig from a YAML `model:` section plus the run's parallel/precision flags.

    `recompute`: False, True or "full" (checkpoint every layer), "selective" (core attention
    only), or a dict of megatron's recompute_{granularity,method,num_layers}.
    `overrides` are model fields (e.g. init_seed=args.seed, num_layers=...) applied on top.
    """
    section = {**(model_section or {}), **overrides}
    unknown = sorted(set(section) - set(MODEL_FIELDS))
    if unknown:
        raise ValueError(f"model.{unknown[0]}: unknown model field (known: {', '.join(MODEL_FIELDS)})")
    section = {k: v for k, v in section.items() if v is not None}
    section["lev"] = dict(section.get("lev") or {})
    return LeviathanConfig(
        **section,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        sequence_parallel=sequence_parallel,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        **_recompute_fields(recompute),
    )


def _recompute_fields(recompute) -> dict:
    if recompute in (False, None):
        return {}
    if recompute is True or recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if isinstance(recompute, dict):
        return dict(recompute)
    raise ValueError(f"recompute: expected a bool, 'full', 'selective' or a dict, got {recompute!r}")


# --------------------------------------------------------------------------- helpers


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


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float):
    """RoPE tables for positions [b, s]: cos, sin as float32 [s, b, 1, head_dim]
    (halves layout, as Megatron's default and Hugging Face LLaMA)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                            dtype=torch.float32) / head_dim))
    angles = position_ids.t().to(torch.float32)[..., None] * inv_freq  # [s, b, dh/2]
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, n, dh] rotated in float32, returned in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def default_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)


# --------------------------------------------------------------------------- modules


class RMSNorm(torch.nn.Module):
    """RMSNorm with a learned scale; apex's fused kernel on CUDA when apex imports, else
    torch's `F.rms_norm` (fused on CUDA in recent torch, plain ops on CPU)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_rms_norm_affine is not None and x.is_cuda:
            return fused_rms_norm_affine(x, self.weight, self.weight.shape, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class VocabEmbedding(VocabParallelEmbedding):
    """The vocab-parallel token table: input_ids [b, s] -> [s, b, H], all-reduced over TP."""

    def __init__(self, config: LeviathanConfig):
        with init_rng(config.init_seed, "embedding"):
            super().__init__(config.padded_vocab_size, config.hidden_size, config=config,
                             init_method=_vocab_init(config.init_method, config.vocab_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids.t())  # look up [s, b]: no transpose of the output


def lev_embedding_kwargs(config: LeviathanConfig) -> dict:
    """How the LEV embedding is built (shared by the plain and the pipeline forms)."""
    return {"config": config.lev_config(), "init_seed": derive_seed(config.init_seed, "embedding"),
            "sequence_parallel": config.sequence_parallel, "params_dtype": config.params_dtype,
            "transformer_config": config}


def build_embedding(config: LeviathanConfig) -> torch.nn.Module:
    """[b, s] ids -> [s, b, H] in params_dtype, all-reduced over TP: LEV or the vocab table."""
    if config.embedding == "lev":
        return ParallelLEVEmbedding(**lev_embedding_kwargs(config))
    return VocabEmbedding(config)


class _OneRankAsMatmul:
    """For megatron-core's parallel linear layers: with one tensor-parallel rank (and neither
    sequence parallelism nor fused weight-gradient accumulation) a layer is x @ W^T, so its
    matmul runs as `F.linear` (torch's C++ autograd) rather than megatron-core's Python
    autograd Function, whose backward costs about 0.2 ms a layer on CPU. The module is still
    called as usual, so DeepSpeed's hooks (ZeRO-3's parameter gathering) run."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.config
        self.one_rank_matmul = (parallel_state.get_tensor_model_parallel_world_size() == 1
                                and not config.sequence_parallel and not self.gradient_accumulation_fusion
                                and not config.defer_embedding_wgrad_compute)

    def _forward_impl(self, input, weight, *args, bias=None, **kwargs):
        if self.one_rank_matmul:
            return F.linear(input, weight, bias)
        return super()._forward_impl(input, weight, *args, bias=bias, **kwargs)


class ColumnLinear(_OneRankAsMatmul, ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear (output dimension split over TP)."""


class RowLinear(_OneRankAsMatmul, RowParallelLinear):
    """megatron-core's RowParallelLinear (input dimension split over TP, output all-reduced)."""


class SelfAttention(torch.nn.Module):
    """Causal self-attention with RoPE and grouped-query attention; this rank's heads only."""

    def __init__(self, config: LeviathanConfig):
        super().__init__()
        self.config = config
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.head_dim = config.kv_channels
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = config.num_query_groups // tp
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.qkv = ColumnLinear(
            config.hidden_size, (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim,
            config=config, init_method=config.init_method, bias=False, gather_output=False)
        self.out_proj = RowLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True)
        self.recompute_core_attention = (config.recompute_granularity == "selective"
                                         and "core_attn" in (config.recompute_modules or []))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        qkv, _ = self.qkv(x)
        qkv = qkv.view(s, b, self.num_groups, self.heads_per_group + 2, self.head_dim)
        # Views, no copies: RoPE runs once on the q and k heads together; `split`'s backward
        # is one concatenation where slicing q, k and v apart costs three zero-fills + copies.
        qk, v = qkv.split((self.heads_per_group + 1, 1), dim=3)
        qk = apply_rotary(qk, cos.unsqueeze(2), sin.unsqueeze(2))  # [s, b, groups, hpg + 1, dh]
        q = qk[:, :, :, :self.heads_per_group].reshape(s, b, self.num_heads, self.head_dim)  # a view at MHA
        k, v = qk[:, :, :, -1], v.squeeze(3)  # [s, b, groups, dh]
        if self.recompute_core_attention:
            out = checkpoint(self.core_attention, q, k, v)
        else:
            out = self.core_attention(q, k, v)
        out, _ = self.out_proj(out)
        return out

    def core_attention(self, q, k, v):
        """[s, b, n, dh] q and [s, b, g, dh] k/v -> [s, b, n * dh]."""
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, dh]
        p = self.config.attention_dropout if self.training else 0.0
        # Dropout draws from the model-parallel stream: each TP rank holds different heads.
        rng = get_rng_tracker().fork() if p > 0 else contextlib.nullcontext()
        with rng:
            # GQA inside the kernel (query head i uses kv head i // heads_per_group, our
            # grouping): no repeat_interleave copies of k and v.
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                 enable_gqa=self.heads_per_group > 1)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)


class SwiGLUMLP(torch.nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up fused in one column-parallel matmul."""

    def __init__(self, config: LeviathanConfig):
        super().__init__()
        # stride=2: rank r's shard is [gate_r; up_r], so chunk(2) below works for any TP.
        self.gate_up = ColumnLinear(
            config.hidden_size, 2 * config.ffn_hidden_size, config=config, init_method=config.init_method,
            bias=False, gather_output=False, stride=2)
        self.down = RowLinear(
            config.ffn_hidden_size, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up(x)
        gate, up = gate_up.chunk(2, dim=-1)
        out, _ = self.down(F.silu(gate) * up)
        return out


class DecoderLayer(torch.nn.Module):
    """x + attention(norm(x)), then + mlp(norm(x)). `layer_number` is 0-based."""

    def __init__(self, config: LeviathanConfig, layer_number: int):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        with init_rng(config.init_seed, f"layers.{layer_number}"):
            self.input_norm = RMSNorm(config.hidden_size, config.layernorm_epsilon, config.params_dtype)
            self.attention = SelfAttention(config)
            self.mlp_norm = RMSNorm(config.hidden_size, config.layernorm_epsilon, config.params_dtype)
            self.mlp = SwiGLUMLP(config)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self._dropout(self.attention(self.input_norm(hidden), cos, sin))
        return hidden + self._dropout(self.mlp(self.mlp_norm(hidden)))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.config.hidden_dropout
        # The residual stream is replicated over TP: the default stream (same seed on all TP
        # ranks) gives every rank the same mask.
        return F.dropout(x, p, training=True) if p > 0 and self.training else x


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


# Tokens per chunk of the cross entropy: at most this many bytes of float32 logits at a time.
CROSS_ENTROPY_CHUNK_BYTES = 1 << 29


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross entropy, float32 math without a float32 copy of the logits.

    Megatron's version upcasts the whole [tokens, V/TP] logits and saves their softmax (two
    float32 tensors of the logits' size: 6.6 GB at 16k tokens, V = 50k). Here:

    - TP = 1: torch's fused row-wise kernels (`log_softmax` / `softmax` with dtype=float32,
      which upcast inside the kernel). Float32 logits: their log-softmax replaces them as the
      saved tensor (same size) and backward is exp, scatter, scale. Other dtypes: one chunk
      of tokens at a time (CROSS_ENTROPY_CHUNK_BYTES of float32), saving only the logits in
      their own dtype; backward recomputes the softmax chunk by chunk.
    - TP > 1: Megatron's three all-reduces (max, sum of exponentials, target logit), chunked
      the same way; a float32 log-sum-exp per token is saved with the logits.

    The gradient is written in the logits' dtype.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        n, v = logits.shape
        ctx.chunk = chunk = max(1, CROSS_ENTROPY_CHUNK_BYTES // (4 * v))
        chunks = range(0, n, chunk)
        if group is None:  # the whole vocabulary is here: target ids are local, in range
            target = target.unsqueeze(-1)
            if logits.dtype == torch.float32:
                ctx.saved = "log_probs"
                log_probs = torch.log_softmax(logits, -1)
                ctx.save_for_backward(log_probs, target)
                return log_probs.gather(-1, target).squeeze(-1).neg_()
            ctx.saved = "logits"
            ctx.save_for_backward(logits, target)
            return _cat([torch.log_softmax(logits[i:i + chunk], -1, dtype=torch.float32)
                         .gather(-1, target[i:i + chunk]).squeeze(-1).neg_() for i in chunks])
        local = target - vocab_start
        in_range = (local >= 0) & (local < v)
        local = local.clamp(0, v - 1).unsqueeze(-1)
        maxima = _cat([logits[i:i + chunk].float().amax(-1) for i in chunks])
        torch.distributed.all_reduce(maxima, torch.distributed.ReduceOp.MAX, group=group)
        sums = _cat([(logits[i:i + chunk].float() - maxima[i:i + chunk, None]).exp_().sum(-1) for i in chunks])
        target_logits = logits.gather(-1, local).squeeze(-1).float() * in_range
        torch.distributed.all_reduce(sums, group=group)
        torch.distributed.all_reduce(target_logits, group=group)
        lse = sums.log_().add_(maxima)
        ctx.saved = "logits_and_lse"
        ctx.save_for_backward(logits, local, in_range, lse)
        return lse - target_logits

    @staticmethod
    def backward(ctx, grad_loss):
        grad_loss = grad_loss.unsqueeze(-1)
        saved = ctx.saved_tensors
        if ctx.saved == "log_probs":  # TP = 1, float32: softmax = exp(log-softmax)
            log_probs, target = saved
            # In place: a fresh logits-sized tensor costs its page faults on CPU. A second
            # backward through this graph fails loudly (autograd's saved-tensor version check).
            return _subtract_one_hot(log_probs.exp_(), target).mul_(grad_loss), None, None, None
        if ctx.saved == "logits":  # TP = 1, other dtypes
            logits, target = saved
            in_range = None

            def softmax(rows):
                return torch.softmax(logits[rows], -1, dtype=torch.float32)
        else:
            logits, target, in_range, lse = saved
            in_range = in_range.unsqueeze(-1).to(torch.float32)

            def softmax(rows):
                return (logits[rows].float() - lse[rows, None]).exp_()
        grad = None if logits.shape[0] <= ctx.chunk else torch.empty_like(logits)
        for i in range(0, logits.shape[0], ctx.chunk):
            j = slice(i, i + ctx.chunk)
            chunk_grad = _subtract_one_hot(softmax(j), target[j], None if in_range is None else in_range[j])
            chunk_grad.mul_(grad_loss[j])
            if grad is None:  # one chunk: no copy into a gradient buffer
                return chunk_grad.to(logits.dtype), None, None, None
            grad[j] = chunk_grad
        return grad, None, None, None


def _subtract_one_hot(probs: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None):
    """probs[t, target[t]] -= weight[t] (1 when None), in place: softmax - one_hot, the
    cross entropy's gradient. target and weight are [n, 1]."""
    minus = torch.full(target.shape, -1.0, dtype=probs.dtype, device=probs.device) if weight is None else -weight
    return probs.scatter_add_(-1, target, minus)


def _cat(chunks: list) -> torch.Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def vocab_parallel_cross_entropy_float32(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """logits [..., Vp/TP] (any float dtype), target [...] -> float32 losses [...]."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    vocab_start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    losses = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                              vocab_start, group)
    return losses.view(target.shape)


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor,
                        loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Masked mean of the float32 vocab-parallel cross entropy (Megatron's per-micro-batch mean).

    logits [s, b, Vp/TP], labels and loss_mask [b, s]. Returns a float32 scalar.
    """
    losses = vocab_parallel_cross_entropy_float32(logits, labels.t()).t()  # [b, s]
    if loss_mask is None:
        return losses.mean()
    loss_mask = loss_mask.to(losses.dtype)
    # clamp: a micro-batch with every token masked contributes 0, not NaN.
    return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


class LeviathanModel(MegatronModule):
    """The full decoder (one pipeline stage holds all of it; see pipeline.py for PP>1).

    forward(input_ids [b, s], position_ids [b, s] = arange, labels [b, s], loss_mask [b, s],
            lev_ids [n], lev_inverse [b, s]: LEV's distinct ids from the data loader):
      with labels: the float32 scalar loss (masked mean over this micro-batch's tokens);
      without: vocab-parallel logits [b, s, padded_vocab_size / TP] (padding at -inf);
      `gather_logits` turns those into full [b, s, vocab_size].
    """

    def __init__(self, config: LeviathanConfig):
        super().__init__(config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp != config.tensor_model_parallel_size:
            raise ValueError(f"config is for --tensor-model-parallel-size {config.tensor_model_parallel_size} "
                             f"but megatron-core's TP group has {tp} ranks "
                             "(call megatron_lev.distributed.state.initialize_model_parallel first)")
        self.embedding = build_embedding(config)
        self.layers = torch.nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.layernorm_epsilon, config.params_dtype)
        self.output_layer = OutputLayer(config)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None,
                lev_ids: Optional[torch.Tensor] = None, lev_inverse: Optional[torch.Tensor] = None):
        cfg = self.config
        if cfg.embedding == "lev":  # the loader's distinct ids, if it sent them (no sync)
            hidden = self.embedding(input_ids, lev_ids, lev_inverse)  # [s, b, H]
        else:
            hidden = self.embedding(input_ids)
        if position_ids is None:
            position_ids = default_position_ids(input_ids)
        cos, sin = rotary_cos_sin(position_ids, cfg.kv_channels, cfg.rotary_base)
        hidden = self._run_layers(hidden, cos, sin)
        logits = self.output_layer(self.final_norm(hidden), self.tied_head_weight())
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return language_model_loss(logits, labels, loss_mask)

    def tied_head_weight(self) -> Optional[torch.Tensor]:
        return self.embedding.weight if self.config.embedding == "tied" else None

    def _run_layers(self, hidden, cos, sin):
        cfg = self.config
        if cfg.recompute_granularity != "full" or not self.training:
            for layer in self.layers:
                hidden = layer(hidden, cos, sin)
            return hidden
        n = cfg.recompute_num_layers
        if cfg.recompute_method == "uniform":  # checkpoint chunks of n layers
            for start in range(0, len(self.layers), n):
                hidden = checkpoint(_LayerChunk(self.layers[start:start + n]), hidden, cos, sin)
        else:  # "block": checkpoint the first n layers one by one, run the rest normally
            for i, layer in enumerate(self.layers):
                hidden = checkpoint(layer, hidden, cos, sin) if i < n else layer(hidden, cos, sin)
        return hidden


class _LayerChunk:
    def __init__(self, layers):
        self.layers = layers

    def __call__(self, hidden, cos, sin):
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return hidden


def gather_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vocab-parallel logits [..., Vp/TP] -> full logits [..., vocab_size] on every TP rank
    (differentiable). torch's all_gather: megatron-core's gather allocates on CUDA only."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        shards = dist_nn.all_gather(logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(shards, dim=-1)
    return logits[..., :vocab_size]


def build_model(config: LeviathanConfig) -> LeviathanModel:
    return LeviathanModel(config)


def compile_decoder_layers(module: torch.nn.Module) -> int:
    """torch.compile every DecoderLayer of `module` in place (torchtitan's per-block
    compilation: one graph per layer, reused by all layers of the same shape; parameter
    names unchanged). Inductor fuses RoPE, SwiGLU, RMSNorm and the residual adds into a
    few kernels around the matmuls and attention. Returns how many layers it compiled."""
    layers = [m for m in module.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.compile(dynamic=False)
    return len(layers)


def merge_tensor_parallel_shards(shards: list, partition_dim: int, stride: int = 1) -> torch.Tensor:
    """The global tensor from its TP shards (rank order), for `partition_dim`/`partition_stride`
    as megatron-core marks them: stride s means each shard is s chunks, chunk j of every
    rank forming the j-th block of the global tensor (gate_up: [gate; up])."""
    if stride == 1:
        return torch.cat(shards, dim=partition_dim)
    chunks = [shard.chunk(stride, dim=partition_dim) for shard in shards]
    return torch.cat([c[j] for j in range(stride) for c in chunks], dim=partition_dim)


def gather_tensor_parallel(tensor: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """`tensor` (a parameter, or its gradient) made global over the TP group, following the
    parameter's partition attributes; replicated tensors come back as they are."""
    world = parallel_state.get_tensor_model_parallel_world_size()
    if world == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(world)]
    torch.distributed.all_gather(shards, tensor.contiguous(),
                                 group=parallel_state.get_tensor_model_parallel_group())
    return merge_tensor_parallel_shards(shards, param.partition_dim, getattr(param, "partition_stride", 1))


# --------------------------------------------------------------------------- counting


def count_parameters(config: LeviathanConfig) -> dict:
    """Analytic parameter counts of the whole model (all TP ranks together, padding rows
    included, as allocated). Keys: embedding (the LEV generator or the table), output_layer,
    attention / mlp / norms / per_layer (one layer), layers (all), final_norm, total,
    and vocab_padding (rows counted in embedding/output_layer that are padding)."""
    h, nh, ng, dh = config.hidden_size, config.num_attention_heads, config.num_query_groups, config.kv_channels
    attention = h * (nh + 2 * ng) * dh + nh * dh * h
    mlp = 3 * h * config.ffn_hidden_size
    norms = 2 * h
    per_layer = attention + mlp + norms
    table = config.padded_vocab_size * h
    if config.embedding == "lev":
        embedding, output_layer = config.lev_config().num_parameters(), table
    elif config.embedding == "tied":
        embedding, output_layer = table, 0
    else:
        embedding, output_layer = table, table
    padding = (config.padded_vocab_size - config.vocab_size) * h
    counts = {
        "embedding": embedding,
        "output_layer": output_layer,
        "attention": attention,
        "mlp": mlp,
        "norms": norms,
        "per_layer": per_layer,
        "layers": per_layer * config.num_layers,
        "final_norm": h,
        "vocab_padding": padding * ((config.embedding != "lev") + (config.embedding != "tied")),
    }
    counts["total"] = embedding + output_layer + counts["layers"] + h
    return counts
