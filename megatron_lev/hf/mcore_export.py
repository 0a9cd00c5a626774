"""megatron-lev-convert-from-mcore: a Megatron-LM checkpoint of a GPTModel with the LEV embedding ->
a Hugging Face folder (docs/megatron-lm.md).

The packages the export needs are checked first, before any checkpoint file is read. The model's
settings, the tokenizer and the model card's provenance come from the arguments Megatron-LM saved
with the checkpoint (megatron_lm/checkpoint.py); the weights are read by checkpointing/mcore.py and
written by the same export as megatron-lev-convert-to-hf (hf/export.py).
"""
from __future__ import annotations

import importlib
from typing import Optional

from megatron_lev.utils.errors import ExportError

# What writing a Hugging Face folder imports (transformers' config and tokenizer classes, the
# safetensors writer and its sharding, tokenizers), and what a SentencePiece tokenizer adds.
EXPORT_MODULES = ("transformers", "safetensors", "huggingface_hub", "tokenizers")
SENTENCEPIECE_MODULES = ("sentencepiece", "google.protobuf")
INSTALL_HINT = "pip install 'transformers>=5.0' safetensors protobuf sentencepiece tokenizers"


def require_modules(names, purpose: str) -> None:
    """ExportError in one line naming every missing package (nothing is read before)."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ExportError(f"{purpose} needs {', '.join(missing)}, which do not import here: {INSTALL_HINT} "
                          "(docs/megatron-lm.md, Installation)")


def export_mcore_checkpoint(load: str, output: str, *, iteration: Optional[int] = None, config: Optional[str] = None,
                            tokenizer_type: Optional[str] = None, tokenizer_model: Optional[str] = None,
                            vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                            dtype: Optional[str] = None, materialize: bool = False,
                            max_shard_size: str | int = "5GB", card: Optional[dict] = None) -> str:
    require_modules(EXPORT_MODULES, "the Hugging Face export")
    from megatron_lev.checkpointing.mcore import read_mcore_checkpoint
    from megatron_lev.hf.card import Provenance
    from megatron_lev.hf.export import DTYPES, check_llama_export, save_hf_model
    from megatron_lev.hf.tokenizers import infer_tokenizer_type, load_tokenizer
    from megatron_lev.megatron_lm.checkpoint import TokenizerSpec, read_megatron_run

    def tokenizer_vocab_size(spec: TokenizerSpec) -> int:
        return _build(spec, None).vocab_size

    def _build(spec: TokenizerSpec, vocab: Optional[int]):
        kind = spec.type or (infer_tokenizer_type(spec.model) if spec.model else None)
        if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
            require_modules(SENTENCEPIECE_MODULES, f"--tokenizer-type {kind}")
        return load_tokenizer(kind, spec.model, vocab if vocab is not None else 1 << 62, spec.flag,
                              vocab_file=spec.vocab_file, merge_file=spec.merge_file)

    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    run = read_megatron_run(load, iteration, config, TokenizerSpec(tokenizer_type, tokenizer_model, vocab_file,
                                                                   merge_file), tokenizer_vocab_size)
    if materialize:
        check_llama_export(run.config, materialize)  # before any tensor is read
    tokenizer = _build(run.tokenizer, run.config.vocab_size)
    full, _ = read_mcore_checkpoint(run.iter_dir, run.config,
                                    tensor_model_parallel_size=getattr(run.args, "tensor_model_parallel_size", None))
    return save_hf_model(full, run.config, output, tokenizer, DTYPES[dtype] if dtype else None, materialize,
                         max_shard_size, provenance=Provenance(**{**run.provenance(), **(card or {})}))
