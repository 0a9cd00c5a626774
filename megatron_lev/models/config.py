"""The model's configuration: megatron-core's `TransformerConfig` with LLaMA defaults and
the fields it lacks (embedding kind, vocabulary, sequence length, RoPE base, LEV fields, init
seed), built from a YAML `model:` section by `model_config_from_dict`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lev.lev.generator import LEVConfig
from megatron_lev.models.settings import EMBEDDING_KINDS
from megatron_lev.models.shape import MODEL_FIELDS, llama_ffn_hidden_size, pad_vocab_size  # noqa: F401 (re-exported)
from megatron_lev.models.shape import lev_config_from_section


@dataclass
class LeviathanConfig(TransformerConfig):
    """megatron-core's TransformerConfig with LLaMA defaults and the fields it lacks.

    Build it with `model_config_from_dict` from a YAML `model:` section; `to_dict()` gives
    that section back (what checkpoints and the HF export store).
    """

    embedding: str = "lev"  # lev | tied | untied | factorized
    # factorized only: the rank r of the input side's V x r table (then an r -> hidden projection).
    embedding_rank: Optional[int] = None
    # untied only: the input table keeps its random initialisation and is never trained (no
    # gradient, no optimizer state, no weight decay); the body and the head learn. The floor
    # any learned input side should clear.
    freeze_input_embedding: bool = False
    vocab_size: int = 50304  # the tokenizer's vocabulary (50,304: GPT-NeoX/Pile; the papers: ~200k)
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 2048
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # RoPE on the first int(kv_channels x this) dims of each head (Megatron's)
    rope_scaling: bool = False  # LLaMA 3's RoPE frequency scaling (Megatron's --use-rope-scaling)
    rope_scaling_factor: float = 8.0  # its factor (low/high frequency factors 1/4, context 8192: Megatron's)
    lev: dict = field(default_factory=dict)  # LEVConfig fields but vocab_size/hidden_size
    init_seed: int = 1234  # Megatron's --seed: all weights derive from it
    # lev only: start the generator from a fitted one (evaluation/capacity.py --save) instead of
    # the spec's init; the body and head still draw theirs from init_seed.
    lev_init_from: Optional[str] = None
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
    # megatron-core's default, "full", is deprecated (it warns on every config); [] means the same.
    cuda_graph_scope: list = field(default_factory=list)

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
        rotary_dim = int(self.kv_channels * self.rotary_percent)
        if not 0 < self.rotary_percent <= 1 or rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"rotary_percent ({self.rotary_percent}): int(kv_channels {self.kv_channels} x it) = "
                             f"{rotary_dim} rotated dimensions per head, which must be even and >= 2")
        if not self.rope_scaling_factor > 0:
            raise ValueError(f"rope_scaling_factor ({self.rope_scaling_factor}) must be > 0")
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
            raise ValueError("--sequence-parallel: not supported by megatron_lev.models yet (its "
                             "norm-gradient reduction under DeepSpeed is not written or tested)")
        if self.normalization != "RMSNorm" or not self.gated_linear_unit or self.add_bias_linear:
            raise ValueError("normalization/gated_linear_unit/add_bias_linear: the Leviathan decoder is "
                             "RMSNorm + SwiGLU without biases")
        if self.fp16:
            raise ValueError("fp16: not supported, use bf16")
        if not isinstance(self.lev, dict):
            raise ValueError(f"lev: must be a mapping of LEVConfig fields, got {self.lev!r}")
        if not isinstance(self.freeze_input_embedding, bool):
            raise ValueError(f"freeze_input_embedding: must be true or false, got {self.freeze_input_embedding!r}")
        if self.freeze_input_embedding and self.embedding != "untied":
            raise ValueError(f"freeze_input_embedding: only for embedding: untied (this model's input side is "
                             f"{self.embedding}; a frozen tied table would freeze the output head too)")
        rank = self.embedding_rank
        if self.embedding == "factorized" and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise ValueError(f"embedding_rank: embedding: factorized needs the rank r of its V x r table, a positive "
                             f"integer (--embedding-rank), got {rank!r}")
        if self.embedding != "factorized" and rank is not None:
            raise ValueError(f"embedding_rank: only for embedding: factorized (this model's input side is "
                             f"{self.embedding})")
        if self.lev_init_from is not None and (self.embedding != "lev" or not isinstance(self.lev_init_from, str)):
            raise ValueError(f"lev_init_from: a fitted generator's file, only for embedding: lev (this model's input "
                             f"side is {self.embedding}, the value {self.lev_init_from!r})")
        if self.embedding == "lev":
            self.lev_config().validate(tp)

    def lev_config(self) -> LEVConfig:
        """The generator's config: the `lev:` fields plus the model's vocab and width."""
        return lev_config_from_section(self.lev, self.vocab_size, self.hidden_size)

    def to_dict(self) -> dict:
        """The YAML `model:` section this config was built from (resolved)."""
        out = {name: getattr(self, name) for name in MODEL_FIELDS}
        if self.embedding == "lev":  # resolved generator fields, defaults included
            out["lev"] = {k: v for k, v in self.lev_config().to_dict().items()
                          if k not in ("vocab_size", "hidden_size")}
        else:
            out["lev"] = dict(self.lev)
        return out


# What a model section written before a field existed was built with (checkpoints, exports).
FIELD_DEFAULTS = {"rotary_percent": 1.0, "rope_scaling": False, "rope_scaling_factor": 8.0, "qk_layernorm": False,
                  "freeze_input_embedding": False, "embedding_rank": None, "lev_init_from": None}


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
