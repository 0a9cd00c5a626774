"""Data: tokenizers, Pile-format corpora, preprocessing to indexed datasets, training data.

  tokenizer.py   SentencePieceTokenizer, HuggingFaceTokenizer (megatron-core's
                 MegatronTokenizerBase), build_tokenizer, train_sentencepiece
  corpus.py      find/stream/validate/write JSON-lines corpora (.jsonl, .zst, .gz);
                 build_python_corpus: a real-text Pile-format corpus from Python itself
  preprocess.py  tools/preprocess_data.py: corpora -> .bin/.idx, in parallel
  encode.py      its worker side: one block of JSON lines -> tokenized .bin/.idx shards
  datasets.py    GPT datasets and blends over megatron-core, the data-parallel loader

Names are importable from here too (loaded on first use, so `import megatron_lev.data`
stays cheap).
"""
import importlib

_EXPORTS = {
    "SentencePieceTokenizer": "tokenizer", "HuggingFaceTokenizer": "tokenizer", "build_tokenizer": "tokenizer",
    "train_sentencepiece": "tokenizer",
    "build_python_corpus": "corpus", "read_documents": "corpus", "write_jsonl": "corpus",
    "expand_inputs": "corpus",
    "preprocess": "preprocess", "PreprocessError": "preprocess",
    "build_train_valid_test_datasets": "datasets", "build_pretraining_data_loader": "datasets",
    "max_token_id": "datasets", "parse_blend": "datasets",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
