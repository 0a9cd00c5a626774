"""The model's sizes without torch: the padded vocabulary, the LLaMA MLP width, the YAML
`model:` fields, the analytic parameter count, and `ModelShape`, the sizes of a `model:`
section that `count_parameters` and `training/flops.py` `flops_model` read, for the tools that
plan runs on a machine without torch (experiments/cluster_plan.py). `LeviathanConfig`
(config.py) is the model's own config and validates; `ModelShape` only measures: it holds the
same derived sizes (tests/test_cluster_plan.py checks both agree on every packaged config). The
generator's sizes are LEVConfig's own (lev/lev_config.py, torch-free), built by both from the
`lev:` section in `lev_config_from_section`, so that section is validated here as in training."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_lev.lev.lev_config import LEVConfig


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Megatron's rule: round up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def llama_ffn_hidden_size(hidden_size: int, multiple_of: int = 256) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4H (same MLP parameters as a 4H GELU MLP), rounded up."""
    return -(-int(8 * hidden_size / 3) // multiple_of) * multiple_of


# Fields of a YAML `model:` section (all LeviathanConfig / TransformerConfig names).
MODEL_FIELDS = (
    "embedding", "freeze_input_embedding", "embedding_rank", "vocab_size", "make_vocab_size_divisible_by",
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "seq_length", "rotary_base", "rotary_percent", "rope_scaling", "rope_scaling_factor", "qk_layernorm",
    "layernorm_epsilon", "init_method_std", "hidden_dropout", "attention_dropout", "init_seed", "lev", "lev_init_from",
)
@dataclass
class ModelShape:
    """A `model:` section's sizes, derived as LeviathanConfig derives them (TP-aware padding)."""

    embedding: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    embedding_rank: Optional[int] = None
    freeze_input_embedding: bool = False
    qk_layernorm: bool = False
    lev: dict = field(default_factory=dict)
    tensor_model_parallel_size: int = 1
    padded_vocab_size: int = field(init=False, default=0)

    def __post_init__(self):
        self.num_query_groups = self.num_query_groups or self.num_attention_heads
        self.kv_channels = self.kv_channels or self.hidden_size // self.num_attention_heads
        self.ffn_hidden_size = self.ffn_hidden_size or llama_ffn_hidden_size(self.hidden_size)
        self.padded_vocab_size = pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by,
                                                self.tensor_model_parallel_size)

    def lev_config(self) -> LEVConfig:
        return lev_config_from_section(self.lev, self.vocab_size, self.hidden_size)


def lev_config_from_section(lev: dict, vocab_size: int, hidden_size: int) -> LEVConfig:
    """The generator's config: a `model.lev` section plus the model's vocabulary and width
    (LeviathanConfig and ModelShape both build it here; lev/lev_config.py needs no torch)."""
    for key in ("vocab_size", "hidden_size"):
        if key in lev:
            raise ValueError(f"lev.{key}: set the model's {key}, not the generator's")
    try:
        return LEVConfig.from_dict({**lev, "vocab_size": vocab_size, "hidden_size": hidden_size})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"lev: {exc}") from None


SHAPE_FIELDS = {"embedding", "vocab_size", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                "num_query_groups", "kv_channels", "ffn_hidden_size", "make_vocab_size_divisible_by",
                "embedding_rank", "freeze_input_embedding", "qk_layernorm", "lev"}


def model_shape(model_section: dict, *, tensor_model_parallel_size: int = 1) -> ModelShape:
    """The sizes of a YAML `model:` section (the fields that do not change them are read past)."""
    section = {k: v for k, v in (model_section or {}).items() if v is not None}
    unknown = sorted(set(section) - set(MODEL_FIELDS))
    if unknown:
        raise ValueError(f"model.{unknown[0]}: unknown model field (known: {', '.join(MODEL_FIELDS)})")
    return ModelShape(**{k: v for k, v in section.items() if k in SHAPE_FIELDS},
                      tensor_model_parallel_size=tensor_model_parallel_size)


def count_parameters(config) -> dict:
    """Analytic parameter counts of the whole model (all TP ranks together, padding rows
    included, as allocated). Keys: embedding (the LEV generator or the table), output_layer,
    attention / mlp / norms / per_layer (one layer), layers (all), final_norm, total,
    vocab_padding (rows counted in embedding/output_layer that are padding), frozen (of the
    total, what is never trained: the input table under freeze_input_embedding) and trainable.
    `config`: a LeviathanConfig, or a ModelShape where torch is absent."""
    h, nh, ng, dh = config.hidden_size, config.num_attention_heads, config.num_query_groups, config.kv_channels
    attention = h * (nh + 2 * ng) * dh + nh * dh * h
    mlp = 3 * h * config.ffn_hidden_size
    norms = 2 * h + (2 * dh if config.qk_layernorm else 0)  # qk_layernorm: a query and a key scale
    per_layer = attention + mlp + norms
    table = config.padded_vocab_size * h
    if config.embedding == "lev":
        embedding, output_layer = config.lev_config().num_parameters(), table
    elif config.embedding == "tied":
        embedding, output_layer = table, 0
    elif config.embedding == "factorized":  # V x r table + r x H projection
        embedding, output_layer = factorized_input_parameters(config.padded_vocab_size, h, config.embedding_rank), table
    else:
        embedding, output_layer = table, table
    # Padding rows: of the input table (width H, or r when factorised; LEV has none) and of the head.
    input_width = {"lev": 0, "factorized": config.embedding_rank}.get(config.embedding, h)
    padding = (config.padded_vocab_size - config.vocab_size) * (input_width + (config.embedding != "tied") * h)
    counts = {
        "embedding": embedding,
        "output_layer": output_layer,
        "attention": attention,
        "mlp": mlp,
        "norms": norms,
        "per_layer": per_layer,
        "layers": per_layer * config.num_layers,
        "final_norm": h,
        "vocab_padding": padding,
    }
    counts["total"] = embedding + output_layer + counts["layers"] + h
    # Counted in the total (they are the model's), and reported apart: never trained.
    counts["frozen"] = embedding if config.freeze_input_embedding else 0
    counts["trainable"] = counts["total"] - counts["frozen"]
    return counts


def factorized_input_parameters(padded_vocab_size: int, hidden_size: int, rank: int) -> int:
    """The factorised input side: the V_padded x r table and the r x H projection."""
    return rank * (padded_vocab_size + hidden_size)
