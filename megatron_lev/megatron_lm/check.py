"""Check a Megatron-LM run's LEV model on a CPU, before queueing it (tools/megatron_lm/check_lev_gpt.py):
the flags through the table (megatron_lm/flags.py), LEV's vocabulary from the tokenizer, the model
built as pretrain_lev_gpt.py builds it (one process; local layers: the same function), its
parameters counted against this project's count of the same model, and what the Hugging Face
export will say.

    text = check_lev_gpt(args)    # Megatron-LM's parsed and validated arguments; ValueError in one line
"""
from __future__ import annotations

import copy

from megatron_lev.megatron_lm.arguments import lev_config_from_args, model_section_from_args
from megatron_lev.megatron_lm.flags import check_megatron_args
from megatron_lev.megatron_lm.provider import lev_gpt_builder, tokenizer_vocab_size
from megatron_lev.models.config import model_config_from_dict, pad_vocab_size
from megatron_lev.models.param_count import count_parameters
from megatron_lev.models.settings import hf_config_fields


def check_lev_gpt(args) -> str:
    """The report of the model `args` describe (megatron-core's model-parallel state initialised with
    one rank). Settings that do not change the model are set for a CPU build: CPU initialisation,
    local layers without fused kernels, tensor parallelism 1 (the LEV heads are checked against the
    run's TP)."""
    check_megatron_args(args)
    vocab = tokenizer_vocab_size(args)
    config = model_config_from_dict(model_section_from_args(args, vocab))
    lev = lev_config_from_args(args, vocab)
    lev.validate(args.tensor_model_parallel_size)
    cpu = copy.copy(args)
    cpu.use_cpu_initialization, cpu.transformer_impl, cpu.tensor_model_parallel_size = True, "local", 1
    cpu.perform_initialization, cpu.padded_vocab_size, cpu.sequence_parallel = False, None, False
    cpu.apply_rope_fusion = cpu.gradient_accumulation_fusion = False  # fused kernels of TransformerEngine / apex
    cpu.no_persist_layer_norm = True
    model = lev_gpt_builder(cpu)
    built = sum(p.numel() for p in model.parameters())
    counted = count_parameters(config)["total"]
    if built != counted:
        raise ValueError(f"the built GPTModel has {built:,} parameters, this project's count of the model {counted:,}")
    hf = hf_config_fields(config)
    padded = pad_vocab_size(vocab, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    return "\n".join([
        f"model: {config.num_layers} layers x {config.hidden_size}, {config.num_attention_heads} heads "
        f"({config.num_query_groups} kv heads) of {config.kv_channels}, MLP {config.ffn_hidden_size}, "
        f"{built:,} parameters (with the output layer's padding at TP 1)",
        f"LEV: vocabulary {vocab:,} ({args.tokenizer_type}; the output layer pads it to {padded:,} at TP "
        f"{args.tensor_model_parallel_size}), {lev.num_heads} heads, {lev.num_parameters():,} parameters",
        f"RoPE: base {config.rotary_base:g}, on {int(config.kv_channels * config.rotary_percent)} of "
        f"{config.kv_channels} dims per head" + (", LLaMA 3 scaling" if config.rope_scaling else "")
        + (", q/k layernorm" if config.qk_layernorm else ""),
        f"Hugging Face export: LevForCausalLM, rope_parameters {hf['rope_parameters']}",
        "flags: every model-changing Megatron-LM argument is supported (docs/megatron-lm.md)",
    ])
