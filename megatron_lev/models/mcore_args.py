"""Between this project's model and megatron-core's `GPTModel`: the TransformerConfig a GPTModel
gets from a `LeviathanConfig`, and the parameter names of the two.

Names (per layer i; the qkv row layout and fc1's [gate; up] are the same on both sides, so
weights copy by name at any TP):

    this project                        GPTModel (local spec)                            GPTModel (TransformerEngine spec)
    embedding.generator.<p>             embedding.generator.<p>                          same
    layers.i.input_norm.weight          decoder.layers.i.input_layernorm.weight          decoder.layers.i.self_attention.linear_qkv.layer_norm_weight
    layers.i.attention.qkv.weight       decoder.layers.i.self_attention.linear_qkv.weight  same
    layers.i.attention.out_proj.weight  decoder.layers.i.self_attention.linear_proj.weight same
    layers.i.mlp_norm.weight            decoder.layers.i.pre_mlp_layernorm.weight        decoder.layers.i.mlp.linear_fc1.layer_norm_weight
    layers.i.mlp.gate_up.weight         decoder.layers.i.mlp.linear_fc1.weight           same
    layers.i.mlp.down.weight            decoder.layers.i.mlp.linear_fc2.weight           same
    layers.i.attention.q_norm.weight    decoder.layers.i.self_attention.q_layernorm.weight same  (qk_layernorm;
    layers.i.attention.k_norm.weight    decoder.layers.i.self_attention.k_layernorm.weight same   k likewise)
    final_norm.weight                   decoder.final_layernorm.weight                   same
    output_layer.weight                 output_layer.weight                              same
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lev.models.config import LeviathanConfig

_LOCAL_LAYER_NAMES = {  # our per-layer suffix -> GPTModel's (local spec)
    "input_norm.weight": "input_layernorm.weight",
    "attention.qkv.weight": "self_attention.linear_qkv.weight",
    "attention.out_proj.weight": "self_attention.linear_proj.weight",
    "mlp_norm.weight": "pre_mlp_layernorm.weight",
    "mlp.gate_up.weight": "mlp.linear_fc1.weight",
    "mlp.down.weight": "mlp.linear_fc2.weight",
    "attention.q_norm.weight": "self_attention.q_layernorm.weight",  # qk_layernorm (both specs)
    "attention.k_norm.weight": "self_attention.k_layernorm.weight",
}
_TE_LAYER_NAMES = {**_LOCAL_LAYER_NAMES,  # TransformerEngine fuses the norms into the next linear
                   "input_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
                   "mlp_norm.weight": "mlp.linear_fc1.layer_norm_weight"}
_FROM_MCORE_LAYER = {v: k for k, v in _LOCAL_LAYER_NAMES.items()} | {v: k for k, v in _TE_LAYER_NAMES.items()}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_MCORE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_TOP_LEVEL = {"final_norm.weight": "decoder.final_layernorm.weight", "output_layer.weight": "output_layer.weight"}


def to_mcore_name(name: str, transformer_engine: bool = False) -> str:
    """This project's parameter name -> GPTModel's (KeyError for a name GPTModel+LEV lacks)."""
    if name.startswith("embedding.generator."):
        return name
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _OURS_LAYER.match(name)
    if match:
        table = _TE_LAYER_NAMES if transformer_engine else _LOCAL_LAYER_NAMES
        return f"decoder.layers.{match.group(1)}.{table[match.group(2)]}"
    raise KeyError(f"{name}: no GPTModel counterpart")


def from_mcore_name(name: str) -> Optional[str]:
    """GPTModel+LEV's parameter name (local or TransformerEngine spec) -> this project's; None for
    entries that are not weights (`_extra_state`), KeyError for one that has no counterpart."""
    if name.endswith("_extra_state"):
        return None
    if name.startswith("embedding.generator."):
        return name
    reverse_top = {v: k for k, v in _TOP_LEVEL.items()}
    if name in reverse_top:
        return reverse_top[name]
    match = _MCORE_LAYER.match(name)
    if match and match.group(2) in _FROM_MCORE_LAYER:
        return f"layers.{match.group(1)}.{_FROM_MCORE_LAYER[match.group(2)]}"
    raise KeyError(f"{name}: not a parameter of a GPTModel with the LEV embedding (dense RMSNorm + SwiGLU "
                   "decoder without biases)")


def transformer_config_from_model_config(config: LeviathanConfig, **overrides) -> TransformerConfig:
    """A plain megatron-core TransformerConfig with every TransformerConfig field of `config`
    (LeviathanConfig's own fields dropped), `overrides` applied (e.g. sequence_parallel=True,
    which LeviathanConfig refuses for this project's decoder but GPTModel supports)."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(TransformerConfig) if f.init}
    unknown = sorted(set(overrides) - set(values))
    if unknown:
        raise ValueError(f"{unknown[0]}: not a TransformerConfig field")
    values.update(overrides)
    return TransformerConfig(**values)
