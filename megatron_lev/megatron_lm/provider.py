"""The model builder Megatron-LM's pretrain_gpt.py calls, with LEV as the input side.

At core_v0.16.1 pretrain_gpt.py passes `partial(model_provider, gpt_builder)` to `pretrain()`;
`model_provider(model_builder, pre_process, post_process, vp_stage, config, pg_collection)`
calls `model_builder(args, pre_process, post_process, vp_stage, config=, pg_collection=)`.
`lev_gpt_builder` has gpt_builder's signature; tools/megatron_lm/pretrain_lev_gpt.py passes
`partial(model_provider, lev_gpt_builder)` with `model_provider` below, which refuses ModelOpt's
builder (Megatron-LM's model_provider would put it in LEV's place) and then is Megatron-LM's.

The builder first applies the flag table (megatron_lm/flags.py): every Megatron-LM argument that
would make GPTModel other than this project's decoder stops the run here, in one line naming the
flag. LEV's vocabulary is the tokenizer's (Megatron-LM's rule: NullTokenizer has --vocab-size
ids plus its EOD), the output layer Megatron-LM's padded one; the builder records the former in
`args.lev_vocab_size`, which Megatron-LM saves with every checkpoint, so the converter reads the
whole model from the checkpoint (no other file).
"""
from __future__ import annotations

from typing import Optional

from megatron.core.models.gpt import GPTModel

from megatron_lev.megatron_lm.arguments import (lev_config_from_args, model_section_from_args,
                                                transformer_config_from_args)
from megatron_lev.megatron_lm.flags import check_megatron_args
from megatron_lev.models.config import model_config_from_dict, pad_vocab_size
from megatron_lev.models.gpt_lev import build_lev_gpt_model
from megatron_lev.models.layers import derive_seed


def tokenizer_vocab_size(args) -> int:
    """The vocabulary LEV generates for: Megatron-LM's tokenizer's (built by `pretrain()` before
    the model). Without megatron.training (megatron-core alone: the tests), the tokenizers that
    need no file, by Megatron-LM's rule: NullTokenizer has --vocab-size ids plus its EOD."""
    try:
        from megatron.training import get_tokenizer
    except ImportError:
        if args.tokenizer_type == "NullTokenizer":
            return args.vocab_size + 1
        raise ValueError(f"--tokenizer-type {args.tokenizer_type}: its vocabulary needs Megatron-LM's tokenizer "
                         "(megatron.training), which does not import here") from None
    return get_tokenizer().vocab_size


def lev_gpt_builder(args, pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                    config=None, pg_collection=None) -> GPTModel:
    """gpt_builders.gpt_builder with LEV as the input side (same signature)."""
    check_megatron_args(args)
    vocab_size = tokenizer_vocab_size(args)
    padded = pad_vocab_size(vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    if getattr(args, "padded_vocab_size", None) not in (None, padded):
        raise ValueError(f"--vocab-size/--tokenizer-type: Megatron-LM padded the vocabulary to {args.padded_vocab_size} "
                         f"rows, but the tokenizer's {vocab_size} ids pad to {padded} (--make-vocab-size-divisible-by "
                         f"{args.make_vocab_size_divisible_by} x --tensor-model-parallel-size "
                         f"{args.tensor_model_parallel_size})")
    # The model's settings as this project reads them: its own checks (head sizes, RoPE dims, LEV heads
    # against TP) run before anything is built, and the converter reads the same from the saved args.
    model_config_from_dict(model_section_from_args(args, vocab_size))  # (TP: GPTModel's checks, which allow more)
    args.lev_vocab_size = vocab_size
    config = config if config is not None else transformer_config_from_args(args)
    use_te = getattr(args, "transformer_impl", "local") == "transformer_engine"
    return build_lev_gpt_model(
        config, lev_config_from_args(args, vocab_size), padded, args.max_position_embeddings,
        layer_spec="transformer_engine" if use_te else "local", rotary_base=args.rotary_base,
        init_seed=derive_seed(args.seed, "embedding"), pre_process=pre_process, post_process=post_process,
        vp_stage=vp_stage, pg_collection=pg_collection, rotary_percent=args.rotary_percent,
        rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy)


def model_provider(model_builder=lev_gpt_builder, pre_process: bool = True, post_process: bool = True,
                   vp_stage: Optional[int] = None, config=None, pg_collection=None) -> GPTModel:
    """Megatron-LM's model_provider.model_provider (same signature), refusing ModelOpt's builder
    first: with a ModelOpt checkpoint in --load (or --export-kd-teacher-load) Megatron-LM's
    model_provider would build ModelOpt's GPT in place of `model_builder`."""
    from megatron.training import get_args
    from model_provider import model_provider as megatron_model_provider  # the Megatron-LM checkout's

    args = get_args()
    if getattr(args, "modelopt_enabled", False):
        check_megatron_args(args)
    return megatron_model_provider(model_builder, pre_process, post_process, vp_stage, config=config,
                                   pg_collection=pg_collection)
