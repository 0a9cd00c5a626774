"""Tokenizers of a Hugging Face export: the pre-training tokenizer, checked against the model, written
as tokenizer.json / tokenizer_config.json (plus SentencePiece's tokenizer.model) that encode as
pre-training did (library code of the export commands, hf/export.py)."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Optional

from megatron_lev.utils.errors import ExportError
from megatron_lev.utils.files import update_json_file


@dataclass
class SpecialTokens:
    bos: Optional[int]
    eos: int
    pad: Optional[int]


def infer_tokenizer_type(path: str) -> str:
    if os.path.isdir(path) or path.endswith(".json"):
        return "HuggingFaceTokenizer"
    return "SentencePieceTokenizer"


def load_tokenizer(tokenizer_type: Optional[str], tokenizer_model: str, vocab_size: int, flag: str = "--tokenizer-model",
                   vocab_file: Optional[str] = None, merge_file: Optional[str] = None):
    """Our pre-training tokenizer, checked against the model: it may not produce an id the
    model cannot embed (fewer tokens than vocab_size is fine: padded vocabularies such as
    GPT-NeoX's 50,277 tokens in a 50,304-row model). GPT2BPETokenizer: vocab_file/merge_file."""
    from megatron_lev.data.tokenizer import build_tokenizer

    if tokenizer_type == "GPT2BPETokenizer":
        try:
            tokenizer = build_tokenizer(tokenizer_type, None, vocab_file, merge_file)
        except (FileNotFoundError, ValueError) as exc:
            raise ExportError(f"{flag}: {exc}") from None
        tokenizer_model = f"--vocab-file {vocab_file} --merge-file {merge_file}"
    elif not tokenizer_model or not os.path.exists(tokenizer_model):
        raise ExportError(f"{flag} {tokenizer_model}: no such file")
    else:
        tokenizer = build_tokenizer(tokenizer_type or infer_tokenizer_type(tokenizer_model), tokenizer_model)
    if tokenizer.vocab_size > vocab_size:
        raise ExportError(f"{flag} {tokenizer_model} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                          f"{vocab_size}: not the tokenizer this model was trained with")
    return tokenizer


def special_tokens(tokenizer) -> SpecialTokens:
    pad = tokenizer.pad if tokenizer.pad is not None and tokenizer.pad >= 0 else None
    return SpecialTokens(bos=tokenizer.bos, eos=tokenizer.eod, pad=pad)


def _spm_to_tokenizers(model_path: str):
    """A `tokenizers` Tokenizer that encodes exactly like SentencePiece (BPE or unigram)."""
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    proto = import_protobuf().ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    if proto.trainer_spec.model_type == 1:  # unigram
        vocab = [(p.piece, p.score) for p in proto.pieces]
    else:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    # legacy=True follows SentencePiece's own dummy prefix (one "▁" before the text).
    return SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)


def write_tokenizer(tokenizer, out_dir: str, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json (AutoTokenizer), plus SentencePiece's
    tokenizer.model when that is the source (for llama.cpp and SentencePiece users).

    No BOS/EOS is added on encode: pre-training never saw them (documents end with EOD).
    GPT2BPETokenizer: the text "<|endoftext|>" is ordinary text, as Megatron-LM's `_GPT2BPETokenizer`
    encodes it (transformers' `split_special_tokens`, kept in tokenizer_config.json; a reader of
    tokenizer.json alone, e.g. the `tokenizers` library, matches it as the EOS token).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from megatron_lev.data.tokenizer import GPT2BPETokenizer, SentencePieceTokenizer

    options = {}
    if isinstance(tokenizer, SentencePieceTokenizer):
        backend = _spm_to_tokenizers(tokenizer.path)
        shutil.copyfile(tokenizer.path, os.path.join(out_dir, "tokenizer.model"))
        unk = tokenizer._sp.unk_id()
    elif isinstance(tokenizer, GPT2BPETokenizer):
        backend, unk = tokenizer.backend_tokenizer(), None  # GPT-2's byte-level BPE as tokenizer.json
        options["split_special_tokens"] = True
    else:
        path = tokenizer.path
        backend = Tokenizer.from_file(os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path)
        unk = None

    def piece(i):
        return None if i is None or i < 0 else tokenizer.inv_vocab[i]

    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=piece(tokenizer.bos), eos_token=piece(tokenizer.eod),
        pad_token=piece(tokenizer.pad), unk_token=piece(unk), model_max_length=model_max_length,
        clean_up_tokenization_spaces=False, **options)
    hf.save_pretrained(out_dir)
    # transformers 5 names its own class (TokenizersBackend), which transformers 4.x and the
    # vLLM builds that pin it cannot import; both map PreTrainedTokenizerFast to tokenizer.json.
    update_json_file(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_class="PreTrainedTokenizerFast")
