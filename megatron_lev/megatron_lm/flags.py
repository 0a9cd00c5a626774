"""Every Megatron-LM argument (core_v0.16.1) that can change GPTModel's structure or numerics, and
what pretrain_lev_gpt.py, the checkpoint converter and the export do with it.

In scope: each TransformerConfig field that Megatron-LM's parser defines (core_transformer_config_from_args
copies them all into the model's config) and each argument gpt_builder, its layer-spec choice and
model_provider read (GPT_BUILDER_ARGS). tests/test_megatron_flags_table.py checks that the table
covers them, from the namespace, parser and sources recorded from Megatron-LM itself.

    carried    a model setting (models/settings.py): into the model: section, the conversion and
               the export, tested for equal logits
    precision  the training precision only: the function the weights define is the same (the
               export computes in its --dtype)
    no effect  the parallel layout, kernels, recompute, CUDA graphs of the decoder layers, start-up
               initialisation, logging, or a setting used only by a refused feature
    refused    accepted only at the value(s) the Leviathan decoder has; any other value stops the
               run at start (and the conversion) with one line naming the flag

`check_megatron_args(args)` applies the table (and refuses ModelOpt's builder, which would replace
LEV's); `megatron_flag_table()` renders it for docs/megatron-lm.md:

    python -m megatron_lev.megatron_lm.flags docs/megatron-lm.md     # after changing the table
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Optional, Union

CARRIED, PRECISION, NO_EFFECT, REFUSED = "carried", "precision", "no effect", "refused"

# Megatron-LM flags whose spelling is not "--" + dest with "-" (from its parser; the test checks all).
_FLAG_NAMES = {
    "add_bias_linear": "--disable-bias-linear", "apply_rope_fusion": "--no-rope-fusion",
    "async_tensor_model_parallel_allreduce": "--no-async-tensor-model-parallel-allreduce",
    "barrier_with_L1_time": "--no-barrier-with-level-1-timing", "bias_dropout_fusion": "--no-bias-dropout-fusion",
    "bias_gelu_fusion": "--no-bias-gelu-fusion", "bias_swiglu_fusion": "--no-bias-swiglu-fusion",
    "clone_scatter_output_in_embedding": "--no-clone-scatter-output-in-embedding",
    "fp4": "--fp4-format", "fp4_param": "--fp4-param-gather", "fp8": "--fp8-format", "fp8_wgrad": "--no-fp8-wgrad",
    "gradient_accumulation_fusion": "--no-gradient-accumulation-fusion", "layernorm_epsilon": "--norm-epsilon",
    "layernorm_zero_centered_gamma": "--apply-layernorm-1p", "masked_softmax_fusion": "--no-masked-softmax-fusion",
    "microbatch_group_size_per_vp_stage": "--microbatch-group-size-per-virtual-pipeline-stage",
    "overlap_p2p_comm": "--no-overlap-p2p-communication",
    "overlap_p2p_comm_warmup_flush": "--overlap-p2p-communication-warmup-flush",
    "perform_initialization": "--no-initialization", "tp_comm_bulk_dgrad": "--no-tp-comm-bulk-dgrad",
    "tp_comm_bulk_wgrad": "--no-tp-comm-bulk-wgrad", "tp_comm_overlap_ag": "--no-tp-comm-overlap-ag",
    "tp_comm_overlap_rs": "--no-tp-comm-overlap-rs", "tp_comm_split_ag": "--no-tp-comm-split-ag",
    "tp_comm_split_rs": "--no-tp-comm-split-rs", "use_mamba_mem_eff_path": "--disable-mamba-mem-eff-path",
    "add_position_embedding": "--no-position-embedding", "no_persist_layer_norm": "--no-persist-layer-norm",
    "seed": "--seed", "vocab_size": "--vocab-size",
}
# Namespace entries Megatron-LM derives from other flags (no flag of their own).
_DERIVED = {"params_dtype": "--bf16 / --fp16", "variable_seq_lengths": "the data",
            "virtual_pipeline_model_parallel_size": "--num-layers-per-virtual-pipeline-stage"}

# Arguments outside TransformerConfig that gpt_builders.gpt_builder, its _get_transformer_layer_spec,
# model_provider.model_provider and core_transformer_config_from_args read at core_v0.16.1.
GPT_BUILDER_ARGS = (
    "yaml_cfg", "use_legacy_models", "spec", "transformer_impl", "experimental_attention_variant", "num_experts",
    "heterogeneous_layers_config_path", "mtp_num_layers", "padded_vocab_size", "max_position_embeddings",
    "fp16_lm_cross_entropy", "untie_embeddings_and_output_weights", "position_embedding_type", "rotary_percent",
    "rotary_base", "use_rope_scaling", "moe_grouped_gemm", "qk_layernorm", "multi_latent_attention",
    "moe_use_legacy_grouped_gemm", "qk_l2_norm", "normalization", "swiglu", "squared_relu", "quick_geglu",
    "init_method_xavier_uniform", "group_query_attention", "rope_type", "te_precision_config_file",
    "fp8_param_gather", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "overlap_p2p_comm",
    "rotary_interleaved", "no_persist_layer_norm", "bias_swiglu_fusion", "bias_gelu_fusion", "config_logger_dir",
    "cp_comm_type", "is_hybrid_model", "seed", "moe_latent_size", "heterogeneous_layers_config_encoded_json",
    "record_memory_history", "memory_snapshot_path", "params_dtype", "kitchen_config_file", "kitchen_recipe_number",
    # what LEV's builder reads besides: the vocabulary (Megatron's tokenizer rule) and RoPE's other flags
    "vocab_size", "tokenizer_type", "make_vocab_size_divisible_by", "seq_length", "rope_scaling_factor",
    "rotary_seq_len_interpolation_factor", "add_position_embedding", "use_rotary_position_embeddings",
)

Accepted = Union[tuple, Callable[[object], bool]]


@dataclass(frozen=True)
class MegatronArg:
    """One Megatron-LM argument: `kind` (see the module docstring), why (`note`), and for a refused
    one (or a carried one with a constraint) the accepted values or a predicate. `required`: the
    accepted value is the flag's presence (e.g. --swiglu), so the refusal says it is required."""

    dest: str
    kind: str
    note: str
    accepted: Optional[Accepted] = None
    required: bool = False

    @property
    def flag(self) -> str:
        if self.dest in _DERIVED:
            return f"{self.dest} (from {_DERIVED[self.dest]})"
        return _FLAG_NAMES.get(self.dest, "--" + self.dest.replace("_", "-"))

    def allows(self, value) -> bool:
        if self.accepted is None:
            return True
        return self.accepted(value) if callable(self.accepted) else value in self.accepted

    def refusal(self, value) -> str:
        if self.required:
            return f"{self.flag} is required: {self.note}"
        if isinstance(value, bool):
            return f"{self.flag}: not supported with the LEV embedding: {self.note}"
        return f"{self.flag} {_show(value)}: not supported with the LEV embedding: {self.note}"


def _show(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(_show(v) for v in value)
    return getattr(value, "name", None) or str(value)


def _no_full_iteration(scope) -> bool:
    return not any(_show(s) in ("full_iteration", "full_iteration_inference") for s in (scope or []))


_CARRIED = {  # dest -> note (models/settings.py has the field)
    "num_layers": "num_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads", "num_query_groups": "num_query_groups (with --group-query-attention)",
    "group_query_attention": "num_query_groups (without it: one kv head per query head)",
    "kv_channels": "kv_channels (Megatron-LM's default hidden / heads)", "seq_length": "seq_length (the export's "
    "max_position_embeddings)", "rotary_base": "rotary_base", "rotary_percent": "rotary_percent (RoPE on the first "
    "int(kv_channels x it) dims of each head)", "use_rope_scaling": "rope_scaling (LLaMA 3's, factor 8)",
    "qk_layernorm": "qk_layernorm (RMSNorm of each query and key head)", "layernorm_epsilon": "layernorm_epsilon",
    "init_method_std": "init_method_std", "hidden_dropout": "hidden_dropout", "attention_dropout": "attention_dropout",
    "make_vocab_size_divisible_by": "make_vocab_size_divisible_by (the output layer's padding)",
    "seed": "init_seed (the LEV generator's initial weights)",
    "vocab_size": "vocab_size through the tokenizer: NullTokenizer's --vocab-size ids plus its EOD",
    "tokenizer_type": "vocab_size: LEV generates for the tokenizer's vocabulary (Megatron-LM's rule)",
    "padded_vocab_size": "the output layer's rows (Megatron-LM pads the tokenizer's vocabulary, LEV does not)",
}
_PRECISION = (
    "bf16", "fp16", "fp8", "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo",
    "fp8_wgrad", "fp8_param_gather", "fp8_quantizer_factory", "fp4", "fp4_recipe", "fp4_param", "fp4_quantizer_factory",
    "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "fp32_residual_connection",
    "attention_softmax_in_fp32", "apply_query_key_layer_scaling", "disable_bf16_reduced_precision_matmul",
    "fp16_lm_cross_entropy", "te_precision_config_file", "params_dtype",
)
_NO_EFFECT = {
    "the parallel layout: the function is the same at any layout (torch_dist checkpoints hold whole tensors)": (
        "tensor_model_parallel_size pipeline_model_parallel_size context_parallel_size cp_comm_type "
        "hierarchical_context_parallel_sizes hybrid_context_parallel expert_model_parallel_size "
        "expert_tensor_parallel_size sequence_parallel pipeline_model_parallel_layout "
        "pipeline_model_parallel_comm_backend account_for_embedding_in_pipeline_split "
        "account_for_loss_in_pipeline_split microbatch_group_size_per_vp_stage max_seqlen_per_dp_cp_rank "
        "decoder_first_pipeline_num_layers decoder_last_pipeline_num_layers virtual_pipeline_model_parallel_size"),
    "communication and its overlap with compute": (
        "overlap_p2p_comm overlap_p2p_comm_warmup_flush use_ring_exchange_p2p async_tensor_model_parallel_allreduce "
        "tp_comm_overlap tp_comm_overlap_ag tp_comm_overlap_rs tp_comm_overlap_rs_dgrad tp_comm_split_ag "
        "tp_comm_split_rs tp_comm_bulk_dgrad tp_comm_bulk_wgrad tp_comm_bootstrap_backend symmetric_ar_type "
        "inference_fuse_tp_communication defer_embedding_wgrad_compute wgrad_deferral_limit delay_wgrad_compute "
        "ep_overlap_early_attn_memory_release overlap_moe_expert_parallel_comm barrier_with_L1_time "
        "gradient_accumulation_fusion"),
    "kernels: the same function, fused or not": (
        "bias_dropout_fusion masked_softmax_fusion apply_rope_fusion bias_gelu_fusion bias_swiglu_fusion "
        "cross_entropy_loss_fusion cross_entropy_fusion_impl attention_backend use_te_activation_func "
        "no_persist_layer_norm batch_invariant_mode deterministic_mode clone_scatter_output_in_embedding"),
    "recompute and offloading of activations": (
        "recompute_granularity recompute_method recompute_num_layers recompute_modules distribute_saved_activations "
        "moe_layer_recompute cpu_offloading_num_layers fine_grained_activation_offloading offload_modules "
        "min_offloaded_tensor_size"),
    "CUDA graphs of the decoder layers: the LEV embedding runs outside them (--cuda-graph-scope full_iteration "
    "is refused)": "cuda_graph_impl cuda_graph_warmup_steps enable_cuda_graph external_cuda_graph",
    "start-up initialisation and memory bookkeeping: the trained weights are the checkpoint's": (
        "perform_initialization use_cpu_initialization init_model_with_meta_device init_method_xavier_uniform "
        "record_memory_history memory_snapshot_path"),
    "inference only": "flash_decode inference_rng_tracker mlp_chunks_for_prefill",
    "the training loss or optimizer, logging, self-tests: not the model": (
        "calculate_per_token_loss qk_clip qk_clip_alpha qk_clip_threshold log_max_attention_logit config_logger_dir "
        "test_mode variable_seq_lengths"),
    "RoPE has no position table; GPTModel sizes its learned one (not built) from it": "max_position_embeddings",
    "deprecated spellings of --position-embedding-type, which decides": (
        "add_position_embedding use_rotary_position_embeddings"),
    "used only with --num-experts (refused)": (
        "moe_apply_probs_on_input moe_aux_loss_coeff moe_deepep_num_sms moe_enable_deepep moe_enable_routing_replay "
        "moe_expert_capacity_factor moe_extended_tp moe_ffn_hidden_size moe_flex_dispatcher_backend moe_grouped_gemm "
        "moe_hybridep_num_sms moe_input_jitter_eps moe_latent_size moe_layer_freq moe_pad_expert_input_to_capacity "
        "moe_per_layer_logging moe_permute_fusion moe_router_bias_update_rate moe_router_dtype "
        "moe_router_enable_expert_bias moe_router_force_load_balancing moe_router_fusion moe_router_group_topk "
        "moe_router_load_balancing_type moe_router_num_groups moe_router_padding_for_fp8 "
        "moe_router_padding_for_quantization moe_router_pre_softmax moe_router_score_function moe_router_topk "
        "moe_router_topk_scaling_factor moe_shared_expert_gate moe_shared_expert_intermediate_size "
        "moe_shared_expert_overlap moe_token_dispatcher_type moe_token_drop_policy moe_use_legacy_grouped_gemm "
        "moe_z_loss_coeff use_fused_weighted_squared_relu"),
    "used only with --multi-latent-attention (refused)": (
        "q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim rotary_scaling_factor mscale "
        "mscale_all_dim cache_mla_latents rope_type"),
    "used only with --mtp-num-layers (refused)": "mtp_loss_scaling_factor mtp_standalone",
    "used only by Mamba hybrid models (refused)": (
        "mamba_head_dim mamba_num_groups mamba_num_heads mamba_state_dim use_mamba_mem_eff_path"),
    "used only with --experimental-attention-variant (refused)": (
        "dsa_indexer_head_dim dsa_indexer_loss_coeff dsa_indexer_n_heads dsa_indexer_topk dsa_indexer_use_sparse_loss "
        "linear_conv_kernel_dim linear_key_head_dim linear_num_key_heads linear_num_value_heads linear_value_head_dim"),
    "used only with Kitchen quantization (refused)": "kitchen_attention_backend",
}
_DECODER = "the Leviathan decoder (and its Hugging Face export)"
_REFUSED = (  # dest, accepted, note[, required]
    ("position_embedding_type", ("rope",), "a LEV model needs rope (the LEV embedding has no position table)"),
    ("untie_embeddings_and_output_weights", (True,), "LEV replaces the input table only, the output layer keeps "
     "its own weights", True),
    ("swiglu", (True,), f"the MLP of {_DECODER} is SwiGLU (a GeLU model would not convert)", True),
    ("add_bias_linear", (False,), f"{_DECODER} has no biases", True),
    ("normalization", ("RMSNorm",), f"{_DECODER} is RMSNorm"),
    ("add_qkv_bias", (False,), f"{_DECODER} has no biases"),
    ("squared_relu", (False,), f"the MLP of {_DECODER} is SwiGLU"),
    ("quick_geglu", (False,), f"the MLP of {_DECODER} is SwiGLU"),
    ("glu_linear_offset", (0.0,), f"the MLP of {_DECODER} is SwiGLU"),
    ("activation_func_clamp_value", (None,), f"the MLP of {_DECODER} is unclamped SwiGLU"),
    ("apply_residual_connection_post_layernorm", (False,), f"{_DECODER} adds the residual before the norm"),
    ("layernorm_zero_centered_gamma", (False,), f"{_DECODER} has plain RMSNorm scales"),
    ("rotary_interleaved", (False,), f"{_DECODER} rotates the two halves of each head"),
    ("rotary_seq_len_interpolation_factor", (None,), "Megatron-LM's gpt_builder does not pass it to GPTModel "
     "(pretrain_gpt.py ignores it)"),
    ("rope_scaling_factor", (8.0,), "Megatron-LM's gpt_builder does not pass it to GPTModel (pretrain_gpt.py "
     "always scales by 8 with --use-rope-scaling)"),
    ("no_rope_freq", (None,), f"{_DECODER} applies RoPE in every layer"),
    ("mrope_section", (None,), "multimodal RoPE is not a text decoder's"),
    ("qk_l2_norm", (False,), "L2-normed queries and keys have no Hugging Face counterpart here (--qk-layernorm is "
     "supported)"),
    ("attention_output_gate", (False,), f"{_DECODER} has no attention output gate"),
    ("softmax_type", ("vanilla",), f"{_DECODER} uses the plain softmax"),
    ("window_size", (None,), f"{_DECODER} attends to the whole context"),
    ("window_attn_skip_freq", (None,), f"{_DECODER} attends to the whole context"),
    ("embedding_init_method_std", (None,), "LEV has no embedding table to initialise (--lev-init-std sets LEV's "
     "initialisation)"),
    ("multi_latent_attention", (False,), "multi-latent attention is not exported"),
    ("num_experts", (None, 0), "mixture-of-experts decoders are not exported"),
    ("moe_use_upcycling", (False,), "mixture-of-experts decoders are not exported"),
    ("mtp_num_layers", (None, 0), "multi-token prediction builds a second embedding (dense GPT layer specs only)"),
    ("experimental_attention_variant", (None,), "dense GPT layer specs only"),
    ("linear_attention_freq", (None,), "dense GPT layer specs only"),
    ("is_hybrid_model", (False,), "dense GPT layer specs only"),
    ("heterogeneous_layers_config_path", (None,), "dense GPT layer specs only"),
    ("heterogeneous_layers_config_encoded_json", (None,), "dense GPT layer specs only"),
    ("spec", (None,), "the LEV builder uses megatron-core's dense GPT layer spec (local or TransformerEngine)"),
    ("transformer_impl", ("local", "transformer_engine"), "the LEV builder uses megatron-core's local or "
     "TransformerEngine GPT layer spec"),
    ("use_kitchen_attention", (False,), "Kitchen quantization is not supported with the LEV builder"),
    ("use_legacy_models", (False,), "the LEV embedding is for megatron-core's GPTModel"),
    ("yaml_cfg", (None,), "the LEV builder reads Megatron-LM's flags (core_transformer_config_from_args)"),
    ("cuda_graph_scope", _no_full_iteration, "a full-iteration CUDA graph would capture the LEV embedding, which "
     "has not been captured on a GPU here (per-layer scopes are fine: the embedding runs outside them)"),
)
# Only present when NVIDIA Kitchen imports; refused when set.
_OPTIONAL_REFUSED = (("kitchen_config_file", (None,), "Kitchen quantization is not supported with the LEV builder"),
                     ("kitchen_recipe_number", (None,), "Kitchen quantization is not supported with the LEV builder"))


def _table() -> dict[str, MegatronArg]:
    table = {}

    def add(arg: MegatronArg) -> None:
        assert arg.dest not in table, arg.dest
        table[arg.dest] = arg

    for dest, note in _CARRIED.items():
        add(MegatronArg(dest, CARRIED, note))
    for dest in _PRECISION:
        add(MegatronArg(dest, PRECISION, "training precision only"))
    for note, dests in _NO_EFFECT.items():
        for dest in dests.split():
            add(MegatronArg(dest, NO_EFFECT, note))
    for entry in (*_REFUSED, *_OPTIONAL_REFUSED):
        dest, accepted, note, *required = entry
        if dest in table:  # a carried setting with a constraint (rope_scaling_factor)
            note = table.pop(dest).note + "; " + note
        add(MegatronArg(dest, REFUSED, note, accepted, bool(required and required[0])))
    return table


MEGATRON_ARGS = _table()
OPTIONAL_ARGS = tuple(dest for dest, *_ in _OPTIONAL_REFUSED)


def check_megatron_args(args) -> None:
    """ValueError in one line naming the first refused Megatron-LM flag of namespace `args`
    (arguments this Megatron-LM does not define are skipped), or ModelOpt's builder."""
    for arg in MEGATRON_ARGS.values():
        if arg.kind == REFUSED and hasattr(args, arg.dest) and not arg.allows(getattr(args, arg.dest)):
            raise ValueError(arg.refusal(getattr(args, arg.dest)))
    if getattr(args, "modelopt_enabled", False):
        raise ValueError("ModelOpt (a ModelOpt checkpoint in --load, or --export-kd-teacher-load): its model "
                         "builder would replace the LEV builder; not supported with the LEV embedding")


def megatron_flag_table() -> str:
    """docs/megatron-lm.md's table: counts, then one row per argument (no-effect ones grouped)."""
    by_kind = {kind: [a for a in MEGATRON_ARGS.values() if a.kind == kind]
               for kind in (CARRIED, PRECISION, REFUSED, NO_EFFECT)}
    lines = [f"{len(by_kind[CARRIED])} carried, {len(by_kind[PRECISION])} precision only, {len(by_kind[REFUSED])} "
             f"refused unless at the decoder's value, {len(by_kind[NO_EFFECT])} without effect on the model "
             f"({len(MEGATRON_ARGS)} Megatron-LM arguments, core_v0.16.1)", "",
             "| Megatron-LM flag | here | why |", "| --- | --- | --- |"]
    for arg in sorted(by_kind[CARRIED], key=lambda a: a.flag):
        lines.append(f"| {_code(arg)} | carried: {arg.note.split(' (')[0]} | {_why(arg.note)} |")
    for arg in sorted(by_kind[REFUSED], key=lambda a: a.flag):
        lines.append(f"| {_code(arg)} | refused unless {_accepted(arg)} | {arg.note} |")
    lines.append(f"| {_flags(by_kind[PRECISION])} | precision only | the function the weights define is the "
                 "same; the export computes in its `--dtype` |")
    groups: dict[str, list] = {}
    for arg in by_kind[NO_EFFECT]:
        groups.setdefault(arg.note, []).append(arg)
    for note, args in groups.items():
        lines.append(f"| {_flags(args)} | no effect | {note} |")
    return "\n".join(lines)


def _why(note: str) -> str:
    return note[note.index(" (") + 2:-1] if " (" in note and note.endswith(")") else ""


def _code(arg: MegatronArg) -> str:
    """The flag as the docs quote it (one Megatron-LM defines only where an optional package imports:
    unquoted, with that said)."""
    return f"{arg.flag} (where NVIDIA Kitchen imports)" if arg.dest in OPTIONAL_ARGS else f"`{arg.flag}`"


def _flags(args) -> str:
    return " ".join(_code(a) for a in sorted(args, key=lambda a: a.flag))


def _accepted(arg: MegatronArg) -> str:
    if callable(arg.accepted):
        return "no `full_iteration` scope"
    if arg.required:
        return "given"
    return " or ".join(f"`{_show(v)}`" if not isinstance(v, bool) else ("given" if v else "not given")
                       for v in arg.accepted)


TABLE_HEADING = "## Megatron-LM's flags that change the model"

if __name__ == "__main__":
    from megatron_lev.utils.files import replace_generated_table

    replace_generated_table(sys.argv[1], TABLE_HEADING, " carried, ", megatron_flag_table())
