"""The tokenizer's flags and the vocabulary that follows from the tokenizer, as Megatron-LM:
--tokenizer-type with --tokenizer-model, or GPT2BPETokenizer's --vocab-file/--merge-file; the
model's vocab_size from the tokenizer, padded to --make-vocab-size-divisible-by x TP.
`arguments.validate_args` checks the flags; the start-up validation (validation.py) sizes the
vocabulary once the tokenizer is loaded."""
from __future__ import annotations

import argparse

from megatron_lev.utils.errors import ConfigError
from megatron_lev.utils.flags import tokenizer_flags_error


def check_tokenizer_flags(args: argparse.Namespace) -> None:
    """Megatron's tokenizer flags: GPT2BPETokenizer reads --vocab-file and --merge-file, the
    other types --tokenizer-model."""
    if args.tokenizer_type is None:
        raise ConfigError("--tokenizer-type is required (with --tokenizer-model, or --vocab-file and --merge-file "
                          "for GPT2BPETokenizer)")
    if args.tokenizer_type == "GPT2BPETokenizer" and (args.vocab_file is None or args.merge_file is None):
        raise ConfigError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    problem = tokenizer_flags_error(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
    if problem:
        raise ConfigError(problem)


def tokenizer_source(args: argparse.Namespace) -> str:
    """The tokenizer's flag and file(s), for messages: `--tokenizer-model tok.model` or
    `--vocab-file v.json --merge-file m.txt`."""
    if args.tokenizer_type == "GPT2BPETokenizer":
        return f"--vocab-file {args.vocab_file} --merge-file {args.merge_file}"
    return f"--tokenizer-model {args.tokenizer_model}"


def derive_vocab_size(args: argparse.Namespace, tokenizer_vocab_size: int,
                      checkpoint_vocab_size: int | None = None) -> int:
    """As Megatron-LM, the vocabulary comes from the tokenizer: model.vocab_size becomes the
    tokenizer's size, and the model pads it to a multiple of --make-vocab-size-divisible-by x
    TP (`padded_vocab_size`). A packaged config's vocab_size is only a default (for parameter
    counts without a tokenizer); a vocab_size the user's own YAML sets is kept (say, GPT-NeoX's
    50,304 rows for its 50,277 tokens) but refused when smaller than the tokenizer. A resumed
    run keeps the --load checkpoint's vocab_size when the tokenizer fits in it.
    Returns the padded size."""
    from megatron_lev.models.config import pad_vocab_size  # torch: only when a run starts

    source = args.vocab_size_source
    if source is None:
        fits = checkpoint_vocab_size is not None and checkpoint_vocab_size >= tokenizer_vocab_size
        args.model["vocab_size"] = checkpoint_vocab_size if fits else tokenizer_vocab_size
    elif args.model["vocab_size"] < tokenizer_vocab_size:
        raise ConfigError(f"{source}: model.vocab_size {args.model['vocab_size']} is smaller than the "
                          f"{tokenizer_vocab_size} tokens of {tokenizer_source(args)}: remove vocab_size (the "
                          f"tokenizer sets it) or raise it")
    return pad_vocab_size(args.model["vocab_size"], args.model.get("make_vocab_size_divisible_by", 128),
                          args.tensor_model_parallel_size)


def padded_vocab_line(vocab_size: int, padded: int) -> str:
    """Megatron-LM's line (megatron/training/tokenizer/tokenizer.py, _vocab_size_with_padding)."""
    return f" > padded vocab (size: {vocab_size}) with {padded - vocab_size} dummy tokens (new size: {padded})"
