"""Command lines of tools/convert_to_hf.py, tools/convert_from_hf.py and tools/convert_from_mcore.py.

    python tools/convert_to_hf.py --load runs/lev-1.2b --output hf/lev-1.2b [--iteration N]
        [--dtype bf16|fp16|fp32] [--tokenizer-model tok.model] [--materialize-embeddings]
        [--max-shard-size 5GB]
    python tools/convert_from_hf.py --load hf/lev-1.2b --save runs/lev-1.2b-ft
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 [--config lev-1.2b] [--bf16]
    python tools/convert_from_mcore.py --load megatron-lm-save-dir --output hf/lev [--iteration N]
        [--tokenizer-model tok.model | --vocab-file vocab.json --merge-file merges.txt] [--config model.yaml]
        [--dtype ...]

Errors (a missing shard, an unknown layout, a tokenizer that disagrees with the model, ...)
are one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # conversion runs on CPU


def add_export_flags(p: argparse.ArgumentParser, *, tokenizer_type_help: str, tokenizer_model_help: str) -> None:
    """The Hugging Face folder's flags, shared by the commands that write one (save_hf_model)."""
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="weights' dtype (default: the checkpoint's)")
    p.add_argument("--tokenizer-type", choices=("SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                                                 "Llama2Tokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer"),
                   help=tokenizer_type_help)
    p.add_argument("--tokenizer-model", help=tokenizer_model_help)
    p.add_argument("--vocab-file", help="GPT2BPETokenizer: GPT-2's vocab.json (default: the checkpoint's)")
    p.add_argument("--merge-file", help="GPT2BPETokenizer: GPT-2's merges.txt (default: the checkpoint's)")
    p.add_argument("--materialize-embeddings", action="store_true",
                   help="lev models: write the generated V x D table, factorized ones the table times the "
                        "projection, loadable as a standard LlamaForCausalLM")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--license", help="the weights' licence as a Hub identifier, e.g. apache-2.0 (model card; "
                   "default: 'other', not declared)")
    p.add_argument("--dataset", help="the training data's Hub dataset id, e.g. monology/pile-uncopyrighted "
                   "(model card)")
    p.add_argument("--downstream", metavar="FILE[:MODEL]",
                   help="downstream.json of python -m megatron_lev.evaluation.downstream run on these weights: "
                        "its MODEL's scores and standard errors go into the model card")


def card_fields(args) -> dict:
    """The model card's fields given on the command line (Provenance's names)."""
    from megatron_lev.hf.card import read_downstream

    return {"license": args.license, "dataset": args.dataset,
            "downstream": read_downstream(args.downstream) if args.downstream else None}


def to_hf_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convert_to_hf.py",
        description="Convert a megatron_lev training checkpoint (any TP/PP/ZeRO) to a Hugging Face folder.")
    p.add_argument("--load", required=True, help="the training run's --save directory")
    p.add_argument("--iteration", type=int, help="checkpoint to convert (default: the latest complete one)")
    p.add_argument("--output", required=True, help="Hugging Face folder to create (must not exist, or be empty)")
    add_export_flags(p, tokenizer_type_help="default: the checkpoint's, else guessed from --tokenizer-model",
                     tokenizer_model_help="default: the tokenizer the checkpoint was trained with")
    return p


def from_hf_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convert_from_hf.py",
        description="Convert a Hugging Face folder (our export, or a LLaMA) into a checkpoint that "
                    "python -m megatron_lev.train can --load (use --no-load-optim to fine-tune).")
    p.add_argument("--load", required=True, help="Hugging Face model folder")
    p.add_argument("--save", required=True, help="checkpoint directory to create (must not exist, or be empty)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--config", help="the training YAML you will run with (its model section must describe the "
                   "same model); default: write SAVE/model.yaml from the Hugging Face config")
    p.add_argument("--bf16", action="store_true", help="store bf16 weights (fp32 master copies), as a --bf16 run")
    return p


def from_mcore_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convert_from_mcore.py",
        description="Convert a Megatron-LM checkpoint of a GPTModel with the LEV embedding (torch_dist at any "
                    "TP/PP, or legacy torch at any TP) to a Hugging Face folder (docs/megatron-lm.md).")
    p.add_argument("--load", required=True, help="Megatron-LM's --save folder, or one of its iter_NNNNNNN folders")
    p.add_argument("--iteration", type=int, help="checkpoint to convert (default: latest_checkpointed_iteration.txt)")
    p.add_argument("--config", help="YAML (or packaged config name) whose model: section must agree with the "
                   "checkpoint's saved arguments (needed only for a checkpoint without them)")
    p.add_argument("--output", required=True, help="Hugging Face folder to create (must not exist, or be empty)")
    add_export_flags(p, tokenizer_type_help="default: the checkpoint's (its saved --tokenizer-type), else guessed "
                     "from --tokenizer-model", tokenizer_model_help="default: the checkpoint's saved --tokenizer-model")
    return p


def _fail(tool: str, exc: Exception) -> int:
    print(f"{tool}: error: {exc}", file=sys.stderr)
    return 2


def convert_to_hf_main(argv=None) -> int:
    args = to_hf_parser().parse_args(argv)
    from megatron_lev.hf.export import export_checkpoint

    try:
        out = export_checkpoint(args.load, args.output, iteration=args.iteration, dtype=args.dtype, card=card_fields(args),
                                tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                materialize=args.materialize_embeddings, max_shard_size=args.max_shard_size,
                                vocab_file=args.vocab_file, merge_file=args.merge_file)
    except (ValueError, FileNotFoundError) as exc:  # CheckpointError/ExportError/ConfigError are ValueErrors
        return _fail("convert_to_hf", exc)
    print(f"wrote {out}")
    return 0


def convert_from_hf_main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = from_hf_parser().parse_args(argv)
    from megatron_lev.hf.import_hf import import_hf_model

    try:
        out = import_hf_model(args.load, args.save, args.tensor_model_parallel_size,
                              args.pipeline_model_parallel_size, config=args.config, bf16=args.bf16, argv=argv)
    except (ValueError, FileNotFoundError) as exc:
        return _fail("convert_from_hf", exc)
    print(f"wrote {out}")
    return 0


def convert_from_mcore_main(argv=None) -> int:
    args = from_mcore_parser().parse_args(argv)
    from megatron_lev.hf.mcore_export import export_mcore_checkpoint

    try:
        out = export_mcore_checkpoint(
            args.load, args.output, iteration=args.iteration, config=args.config, tokenizer_type=args.tokenizer_type,
            tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file, merge_file=args.merge_file,
            dtype=args.dtype, materialize=args.materialize_embeddings, max_shard_size=args.max_shard_size,
            card=card_fields(args))
    except (ValueError, FileNotFoundError) as exc:
        return _fail("convert_from_mcore", exc)
    print(f"wrote {out}")
    return 0
