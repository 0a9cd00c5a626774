"""The model builder Megatron-LM's pretrain_gpt.py calls, with LEV as the input side.

At core_v0.16.1 pretrain_gpt.py passes `partial(model_provider, gpt_builder)` to `pretrain()`;
`model_provider(model_builder, pre_process, post_process, vp_stage, config, pg_collection)`
calls `model_builder(args, pre_process, post_process, vp_stage, config=, pg_collection=)`.
`lev_gpt_builder` has gpt_builder's signature, so a Megatron-LM script passes
`partial(model_provider, lev_gpt_builder)` (tools/megatron_lm/pretrain_lev_gpt.py does).
`model_provider` below is the same thing for scripts that call it directly, reading
`megatron.training.get_args()` unless an argument namespace is passed.

What the builder requires of Megatron-LM's flags: --position-embedding-type rope (LEV has no
position table) and --untie-embeddings-and-output-weights (LEV replaces the input table only).
--spec, --num-experts and --heterogeneous-layers-config-path are refused: the builder uses
megatron-core's dense GPT layer spec (TransformerEngine with --transformer-impl
transformer_engine, else local).
"""
from __future__ import annotations

import os
from typing import Optional

from megatron.core.models.gpt import GPTModel

from megatron_lev.checkpointing.mcore import MODEL_SECTION_FILE
from megatron_lev.megatron_lm.arguments import lev_config_from_args, model_section_from_args, transformer_config_from_args
from megatron_lev.models.config import pad_vocab_size
from megatron_lev.models.gpt_lev import build_lev_gpt_model
from megatron_lev.models.layers import derive_seed
from megatron_lev.utils.files import write_text_atomic



def _check_args(args) -> None:
    if args.position_embedding_type != "rope":
        raise ValueError(f"--position-embedding-type {args.position_embedding_type}: a LEV model needs rope "
                         "(the LEV embedding has no position table)")
    if not args.untie_embeddings_and_output_weights:
        raise ValueError("--untie-embeddings-and-output-weights is required: LEV replaces the input table only, "
                         "the output layer keeps its own weights")
    for flag, value in (("--spec", args.spec), ("--num-experts", args.num_experts),
                        ("--heterogeneous-layers-config-path", getattr(args, "heterogeneous_layers_config_path", None)),
                        ("--mtp-num-layers", getattr(args, "mtp_num_layers", None))):
        if value:
            raise ValueError(f"{flag}: not supported with the LEV embedding (dense GPT layer specs only)")
    if getattr(args, "use_legacy_models", False):
        raise ValueError("--use-legacy-models: the LEV embedding is for megatron-core's GPTModel")


def tokenizer_vocab_size(args) -> int:
    """The unpadded vocabulary LEV generates for: --vocab-size, else Megatron-LM's tokenizer."""
    if getattr(args, "vocab_size", None):
        return args.vocab_size
    from megatron.training import get_tokenizer  # a Megatron-LM run: its tokenizer is built by now

    return get_tokenizer().vocab_size


def lev_gpt_builder(args, pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                    config=None, pg_collection=None) -> GPTModel:
    """gpt_builders.gpt_builder with LEV as the input side (same signature)."""
    _check_args(args)
    config = config if config is not None else transformer_config_from_args(args)
    vocab_size = tokenizer_vocab_size(args)
    padded = getattr(args, "padded_vocab_size", None) or pad_vocab_size(
        vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    use_te = getattr(args, "transformer_impl", "local") == "transformer_engine"
    model = build_lev_gpt_model(
        config, lev_config_from_args(args, vocab_size), padded, args.max_position_embeddings,
        layer_spec="transformer_engine" if use_te else "local", rotary_base=args.rotary_base,
        init_seed=derive_seed(args.seed, "embedding"), pre_process=pre_process, post_process=post_process,
        vp_stage=vp_stage, pg_collection=pg_collection, rotary_percent=args.rotary_percent,
        rope_scaling=args.use_rope_scaling, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy)
    _write_model_section(args, vocab_size)
    return model


def _write_model_section(args, vocab_size: int) -> None:
    """--save/megatron_lev_model.yaml on global rank 0, once: the converter's --config."""
    import torch.distributed as dist
    import yaml

    save = getattr(args, "save", None)
    if not save or (dist.is_initialized() and dist.get_rank() != 0):
        return
    os.makedirs(save, exist_ok=True)
    text = yaml.safe_dump({"model": model_section_from_args(args, vocab_size)}, sort_keys=False)
    write_text_atomic(os.path.join(save, MODEL_SECTION_FILE), text)


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                   config=None, pg_collection=None, *, args=None) -> GPTModel:
    """Megatron-LM's model_provider without the builder argument: Megatron-LM's parsed arguments
    (megatron.training.get_args()) unless `args` is given."""
    if args is None:
        from megatron.training import get_args

        args = get_args()
    return lev_gpt_builder(args, pre_process, post_process, vp_stage, config=config, pg_collection=pg_collection)
