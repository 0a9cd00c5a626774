"""A Megatron-LM checkpoint of a GPTModel+LEV read as this project's model, from the checkpoint alone:
the settings from the argument namespace Megatron-LM saved with it (the same translation the model
builder used, megatron_lm/arguments.py and models/settings.py), the tokenizer it was trained with
and where it came from.

    run = read_megatron_run(load_dir, iteration=None, config=None)
    run.config (LeviathanConfig), run.iter_dir, run.args, run.tokenizer (type, model, vocab, merges),
    run.provenance() (Provenance fields for the model card)

A `config` YAML, when given, must describe the same model as the saved arguments (the dropouts and
the initialisation may differ: they do not change what the weights mean); a checkpoint without
saved arguments needs one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from megatron_lev.checkpointing.mcore import find_iteration_dir, read_saved_args
from megatron_lev.megatron_lm.arguments import model_section_from_args
from megatron_lev.megatron_lm.flags import check_megatron_args
from megatron_lev.models.config import LeviathanConfig, model_config_from_dict, pad_vocab_size
from megatron_lev.utils.errors import CheckpointError

# Fields a --config may set otherwise than the run: they do not change what the weights mean.
FREE_FIELDS = ("init_seed", "init_method_std", "hidden_dropout", "attention_dropout")
# Megatron-LM tokenizers this project reads as Megatron-LM does (data/tokenizer.py).
EXPORTABLE_TOKENIZERS = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                         "Llama2Tokenizer", "HuggingFaceTokenizer")


@dataclass
class TokenizerSpec:
    type: Optional[str]
    model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    flag: str = "--tokenizer-model"  # what an error about the files names


@dataclass
class MegatronRun:
    iter_dir: str
    config: LeviathanConfig
    args: Optional[object] = None  # Megatron-LM's saved namespace
    tokenizer: TokenizerSpec = field(default_factory=lambda: TokenizerSpec(None))

    def provenance(self) -> dict:
        """Iteration, tokens (consumed samples x sequence length), data and the layout, from the
        saved arguments."""
        tag = os.path.basename(self.iter_dir).removeprefix("iter_")
        out = {"iteration": int(tag) if tag.isdigit() else None, "source": self.iter_dir,
               "tool": "megatron-lev-convert-from-mcore"}
        args = self.args
        if args is None:
            return {**out, "trained_with": "Megatron-LM"}
        samples = getattr(args, "consumed_train_samples", None)
        out["tokens"] = samples * args.seq_length if samples else None
        data = getattr(args, "data_path", None) or getattr(args, "train_data_path", None)
        out["data"] = " ".join(map(str, data)) if data else ("mock data" if getattr(args, "mock_data", False) else None)
        valid = getattr(args, "valid_data_path", None)
        out["valid_data"] = " ".join(map(str, valid)) if valid else None
        layout = [f"TP {args.tensor_model_parallel_size}", f"PP {args.pipeline_model_parallel_size}"]
        if getattr(args, "context_parallel_size", 1) > 1:
            layout.append(f"CP {args.context_parallel_size}")
        out["trained_with"] = (f"Megatron-LM (pretrain_lev_gpt.py), {' x '.join(layout)}, "
                               f"{getattr(args, 'ckpt_format', 'torch_dist')} checkpoint")
        return out


def lev_vocab_size(args) -> Optional[int]:
    """LEV's vocabulary as the builder recorded it (args.lev_vocab_size), or by Megatron-LM's rule
    for NullTokenizer (--vocab-size ids plus its EOD); None when only the tokenizer can tell."""
    if getattr(args, "lev_vocab_size", None):
        return args.lev_vocab_size
    if getattr(args, "tokenizer_type", None) == "NullTokenizer" and getattr(args, "vocab_size", None):
        return args.vocab_size + 1
    return None


def saved_tokenizer(args, given: TokenizerSpec) -> TokenizerSpec:
    """The tokenizer to export: the flags given (GPT-2's files alone mean GPT2BPETokenizer, the other
    file the saved one), else the one the run was trained with."""
    if given.type or given.model or given.vocab_file or given.merge_file:
        gpt2 = given.type in (None, "GPT2BPETokenizer") and not given.model
        return TokenizerSpec(given.type or ("GPT2BPETokenizer" if gpt2 else None), given.model,
                             given.vocab_file or (getattr(args, "vocab_file", None) if gpt2 else None),
                             given.merge_file or (getattr(args, "merge_file", None) if gpt2 else None))
    kind = getattr(args, "tokenizer_type", None) if args is not None else None
    if kind == "NullTokenizer":
        raise CheckpointError("the checkpoint was trained with --tokenizer-type NullTokenizer (ids without text): pass "
                              "--tokenizer-type/--tokenizer-model (or --vocab-file/--merge-file) for the tokenizer "
                              "its ids stand for")
    if kind is not None and kind not in EXPORTABLE_TOKENIZERS:
        raise CheckpointError(f"the checkpoint was trained with --tokenizer-type {kind}, which the export cannot "
                              f"write (supported: {', '.join(EXPORTABLE_TOKENIZERS)})")
    if kind is None:
        raise CheckpointError("no saved tokenizer settings: pass --tokenizer-model (or --tokenizer-type "
                              "GPT2BPETokenizer --vocab-file --merge-file)")
    return TokenizerSpec(kind, getattr(args, "tokenizer_model", None), getattr(args, "vocab_file", None),
                         getattr(args, "merge_file", None), "the tokenizer the checkpoint was trained with (pass "
                         "--tokenizer-model, or --vocab-file/--merge-file, where it lies here)")


def read_megatron_run(load_dir: str, iteration: Optional[int] = None, config: Optional[str] = None,
                      tokenizer: Optional[TokenizerSpec] = None, tokenizer_vocab_size=None) -> MegatronRun:
    """The model of a Megatron-LM checkpoint (no tensors read). `tokenizer_vocab_size(spec)` gives
    the vocabulary of a tokenizer, for checkpoints that did not record LEV's."""
    iter_dir = find_iteration_dir(load_dir, iteration)
    args = read_saved_args(iter_dir)
    given = tokenizer or TokenizerSpec(None)
    if args is None:
        if config is None:
            raise CheckpointError(f"{iter_dir}: the checkpoint holds no saved arguments (Megatron-LM's 'args'): pass "
                                  "--config with the model's YAML")
        return MegatronRun(iter_dir, _yaml_config(config), None, given)
    try:
        check_megatron_args(args)
    except ValueError as exc:
        raise CheckpointError(f"{iter_dir}: trained with {exc}") from None
    spec = saved_tokenizer(args, given)
    vocab = lev_vocab_size(args)
    if vocab is None:
        vocab = tokenizer_vocab_size(spec) if tokenizer_vocab_size is not None else None
        if vocab is None:
            raise CheckpointError(f"{iter_dir}: the saved arguments do not record LEV's vocabulary")
    padded = pad_vocab_size(vocab, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    if getattr(args, "padded_vocab_size", None) not in (None, padded):
        raise CheckpointError(f"{iter_dir}: the tokenizer's {vocab} ids pad to {padded} rows but the checkpoint's "
                              f"output layer has {args.padded_vocab_size}: not the tokenizer it was trained with")
    cfg = model_config_from_dict(model_section_from_args(args, vocab))
    if config is not None:
        _check_agrees(_yaml_config(config), cfg, config, iter_dir)
    return MegatronRun(iter_dir, cfg, args, spec)


def _yaml_config(path: str) -> LeviathanConfig:
    from megatron_lev.configs import load_config

    return model_config_from_dict(load_config(path)["model"])


def _check_agrees(theirs: LeviathanConfig, ours: LeviathanConfig, path: str, iter_dir: str) -> None:
    a, b = theirs.to_dict(), ours.to_dict()
    diffs = [f"{k}: {a.get(k)!r} in it, {b.get(k)!r} in the checkpoint's arguments"
             for k in sorted(set(a) | set(b)) if k not in FREE_FIELDS and a.get(k) != b.get(k)]
    if diffs:
        raise CheckpointError(f"--config {path} describes another model than {iter_dir} (" + "; ".join(diffs) + ")")
