"""The model settings, in one table: what `python -m megatron_lev.train`'s model flags override,
how a Megatron-LM argument namespace (pretrain_lev_gpt.py, and the `args` saved in its
checkpoints) becomes this project's `model:` section, and which Hugging Face config key each
setting is exported as. No other module maps a model setting.

    SETTINGS                      field <-> Megatron-LM flag <-> Hugging Face key, one row each
    model_section_from_megatron_args(args, vocab_size, lev)   the model: section of a Megatron-LM run
    hf_config_fields(config) / model_fields_from_hf_config(hf)   the export's and the import's keys

Which Megatron-LM arguments change the model, and what happens to each (carried by a row here,
or refused), is megatron_lm/flags.py's table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

# Torch-free, and imported by models/config.py (for EMBEDDING_KINDS): `config` parameters below
# are megatron_lev.models.config.LeviathanConfig, named as a string, not imported (no cycle).

# The input sides (`embedding`; docs/model.md, "Input sides"; models/decoder.py builds them).
EMBEDDING_KINDS = ("lev", "tied", "untied", "factorized")

# Megatron-LM's --attention-backend values (models/transformer.py maps them onto torch SDPA's
# backends). A kernel choice of the run, not a model setting: no row below, nothing exported.
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")

# LLaMA 3's RoPE scaling as Megatron-LM's RotaryEmbedding applies it (the factor is the setting).
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Setting:
    """One model setting.

    field: the `model:` section's name (LeviathanConfig); flag: Megatron-LM's flag for it, which
    `python -m megatron_lev.train` takes too when `trainer`; dest: Megatron-LM's namespace
    attribute; from_args: how the value is read from that namespace (default: the attribute);
    hf: the Hugging Face config key it is exported as (None: not a transformers key, see
    hf_config_fields); choices: the values the flag accepts (None: any of its type)."""

    field: str
    flag: Optional[str]
    type: type
    dest: Optional[str] = None
    trainer: bool = True
    hf: Optional[str] = None
    from_args: Optional[Callable] = None
    choices: Optional[tuple] = None

    def megatron_value(self, args):
        if self.from_args is not None:
            return self.from_args(args)
        return getattr(args, self.dest or self.field)


def _query_groups(args):
    return args.num_query_groups if args.group_query_attention else None


SETTINGS = (
    Setting("embedding", "--embedding", str, from_args=lambda args: "lev", choices=EMBEDDING_KINDS),
    # Ours alone (Megatron-LM's GPTModel+LEV has one input side, trained): keep the untied input
    # table at its random initialisation; the rank r of the factorised input side's V x r table.
    Setting("freeze_input_embedding", "--freeze-input-embedding", bool, from_args=lambda args: False),
    Setting("embedding_rank", "--embedding-rank", int, from_args=lambda args: None),
    # Ours alone: the LEV generator starts from a fitted one (python -m megatron_lev.evaluation.capacity --save).
    Setting("lev_init_from", "--lev-init-from", str, from_args=lambda args: None),
    Setting("num_layers", "--num-layers", int, hf="num_hidden_layers"),
    Setting("hidden_size", "--hidden-size", int, hf="hidden_size"),
    Setting("ffn_hidden_size", "--ffn-hidden-size", int, hf="intermediate_size"),
    Setting("num_attention_heads", "--num-attention-heads", int, hf="num_attention_heads"),
    Setting("num_query_groups", "--num-query-groups", int, hf="num_key_value_heads", from_args=_query_groups),
    Setting("kv_channels", "--kv-channels", int, hf="head_dim"),
    Setting("seq_length", "--seq-length", int, trainer=False, hf="max_position_embeddings"),  # a training flag
    Setting("rotary_base", "--rotary-base", float, from_args=lambda args: float(args.rotary_base)),
    Setting("rotary_percent", "--rotary-percent", float),
    Setting("rope_scaling", "--use-rope-scaling", bool, dest="use_rope_scaling"),
    Setting("rope_scaling_factor", "--rope-scaling-factor", float),
    Setting("qk_layernorm", "--qk-layernorm", bool),
    Setting("layernorm_epsilon", "--norm-epsilon", float, hf="rms_norm_eps"),
    Setting("init_method_std", "--init-method-std", float, hf="initializer_range"),
    Setting("hidden_dropout", "--hidden-dropout", float),
    Setting("attention_dropout", "--attention-dropout", float),
    Setting("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by", int),
    Setting("init_seed", "--seed", int, dest="seed", trainer=False),  # the trainer's --seed is a training flag
    # The tokenizer's vocabulary (Megatron-LM's rule, megatron_lm/provider.py), not a flag's value.
    Setting("vocab_size", None, int, hf="vocab_size"),
)
SETTING_BY_FIELD = {s.field: s for s in SETTINGS}
TRAINER_SETTINGS = tuple(s for s in SETTINGS if s.trainer and s.flag)


def model_section_from_megatron_args(args, vocab_size: int, lev: dict) -> dict:
    """This project's `model:` section for the GPTModel+LEV that Megatron-LM's namespace `args`
    builds (check_megatron_args first): every setting read from `args`, LEV's vocabulary
    `vocab_size` and generator fields `lev`."""
    section = {s.field: s.megatron_value(args) for s in SETTINGS if s.field != "vocab_size"}
    section.update(vocab_size=vocab_size, lev=dict(lev))
    return section


def hf_rope_parameters(config: "LeviathanConfig") -> dict:
    """transformers' `rope_parameters`: rope_theta, LLaMA 3 scaling, and partial_rotary_factor (RoPE
    on the first head dims only, the halves layout within them: what vLLM and GPT-NeoX mean)."""
    rope = {"rope_type": "default", "rope_theta": float(config.rotary_base)}
    if config.rope_scaling:
        rope.update(rope_type="llama3", factor=float(config.rope_scaling_factor), **LLAMA3_ROPE)
    if config.rotary_percent < 1.0:
        rope["partial_rotary_factor"] = float(config.rotary_percent)
    return rope


def hf_config_fields(config: "LeviathanConfig") -> dict:
    """The transformers config keys of a model's settings (plus what has no setting:
    hidden_act silu, no biases, inference dropout 0, tying by the embedding kind)."""
    fields = {s.hf: getattr(config, s.field) for s in SETTINGS if s.hf}
    fields.update(rope_parameters=hf_rope_parameters(config), hidden_act="silu", attention_bias=False,
                  mlp_bias=False, attention_dropout=0.0, tie_word_embeddings=config.embedding == "tied")
    return fields


def model_fields_from_hf_config(hf: dict, source: str) -> dict:
    """The inverse of hf_config_fields for any LLaMA-layout config.json (ValueError naming what is
    not a Leviathan decoder)."""
    rope = dict(hf.get("rope_parameters") or {})
    if hf.get("rope_scaling") and not rope:  # transformers 4.x
        rope = {**hf["rope_scaling"], "rope_theta": hf.get("rope_theta", 10000.0)}
        rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
    kind = rope.get("rope_type", "default")
    unsupported = [f"{k}={hf.get(k)!r}" for k, ok in (
        ("hidden_act", hf.get("hidden_act", "silu") == "silu"),
        ("attention_bias", not hf.get("attention_bias", False)),
        ("mlp_bias", not hf.get("mlp_bias", False)),
    ) if not ok]
    if kind not in ("default", "llama3") or (kind == "llama3" and any(
            float(rope.get(k, v)) != v for k, v in LLAMA3_ROPE.items())):
        unsupported.append(f"rope_parameters={rope!r}")
    if unsupported:
        raise ValueError(f"{source}: {', '.join(unsupported)} is not a Leviathan decoder (SwiGLU, no biases, "
                         "RoPE with at most LLaMA 3's scaling)")
    heads = hf["num_attention_heads"]
    fields = {s.field: hf[s.hf] for s in SETTINGS if s.hf and hf.get(s.hf) is not None}
    fields.setdefault("num_query_groups", heads)
    fields.setdefault("kv_channels", hf["hidden_size"] // heads)
    fields.setdefault("layernorm_epsilon", 1e-6)
    fields.update(rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                  rotary_percent=float(rope.get("partial_rotary_factor", 1.0)),
                  rope_scaling=kind == "llama3", qk_layernorm=bool(hf.get("qk_layernorm", False)))
    if kind == "llama3":
        fields["rope_scaling_factor"] = float(rope["factor"])
    return fields
