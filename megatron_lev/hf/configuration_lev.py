"""Hugging Face configuration of a Leviathan model (LEV input embeddings, LLaMA decoder).

This file is copied into every exported `embedding: lev` model folder, beside
`modeling_lev.py` and `lev.py`, and registered through `auto_map`, so

    AutoConfig.from_pretrained(folder, trust_remote_code=True)

returns a `LevConfig`. It is a `LlamaConfig` plus two fields: `lev`, the LEV
generator's hyper-parameters (the fields of `lev.LEVConfig` other than
`vocab_size` and `hidden_size`, which are the model's own), and `qk_layernorm`
(an RMSNorm of each query and key head before RoPE, as Megatron-LM's --qk-layernorm).
RoPE on part of each head is `rope_parameters["partial_rotary_factor"]` (the first
dims, as vLLM and GPT-NeoX read it).
"""
from transformers import LlamaConfig


class LevConfig(LlamaConfig):
    model_type = "leviathan"

    # LEVConfig fields except vocab_size / hidden_size (num_coordinates, seed_dim,
    # num_heads, num_knots, num_modes, digit_order, digit_base, ...).
    lev: dict | None = None
    qk_layernorm: bool = False

    def __post_init__(self, **kwargs):
        self.lev = dict(self.lev or {})
        for key in ("vocab_size", "hidden_size"):
            if key in self.lev:
                raise ValueError(f"LevConfig.lev.{key}: the generator uses the model's {key}; remove it from lev")
        super().__post_init__(**kwargs)

    def lev_generator_fields(self) -> dict:
        """Keyword arguments of `lev.LEVConfig` for this model."""
        return {**self.lev, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size}


__all__ = ["LevConfig"]
