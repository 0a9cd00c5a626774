"""Builders behind the session fixtures in conftest.py (python_corpus, spm_tokenizer,
tiny_dataset). Small and fast: about 500 documents, a 1000-token vocabulary.

Facts tests may rely on (asserted in tests/test_data.py):
  corpus     the pydoc topics (79 on Python 3.11, pile_set_name "pydoc_topics") then standard-library
             docstrings ("stdlib_docstrings"), CORPUS_DOCUMENTS in all, .jsonl.zst
  tokenizer  SentencePiece BPE, vocab_size SPM_VOCAB_SIZE = 1000, lossless
             ids: unk 0, bos 1, eod (</s>) 2, pad 3
  dataset    the corpus's "text" tokenized with that tokenizer, EOD appended to each
             document, uint16, one document per corpus record in corpus order
"""
from __future__ import annotations

import io
import os

CORPUS_DOCUMENTS = 500
SPM_VOCAB_SIZE = 1000
SPM_SPECIAL_IDS = {"unk": 0, "bos": 1, "eod": 2, "pad": 3}


def build_corpus(out_dir: str, max_documents: int = CORPUS_DOCUMENTS) -> str:
    from megatron_lev.data.corpus import build_python_corpus

    path = os.path.join(out_dir, "python.jsonl.zst")
    build_python_corpus(path, max_documents=max_documents)
    return path


def build_spm(corpus_path: str, out_dir: str, vocab_size: int = SPM_VOCAB_SIZE) -> str:
    from megatron_lev.data.corpus import read_documents
    from megatron_lev.data.tokenizer import train_sentencepiece, training_sentences

    model = os.path.join(out_dir, "spm.model")
    texts = (record.texts[0] for record in read_documents(corpus_path))
    train_sentencepiece(training_sentences(texts), model, vocab_size, num_threads=1)
    return model


def preprocess_args(inputs, output_prefix: str, tokenizer_model: str, *extra: str,
                    tokenizer_type: str = "SentencePieceTokenizer"):
    """Parsed preprocess_data.py flags (for calling megatron_lev.data.preprocess in-process)."""
    from megatron_lev.data.preprocess import build_parser

    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else inputs
    return build_parser().parse_args(["--input", *map(str, inputs), "--output-prefix", str(output_prefix),
                                      "--tokenizer-type", tokenizer_type, "--tokenizer-model", str(tokenizer_model),
                                      "--workers", "1", "--log-interval", "0", *extra])


def run_preprocess(inputs, output_prefix: str, tokenizer_model: str, *extra: str, **kwargs):
    """Run preprocessing in this process; returns (summary, log text)."""
    from megatron_lev.data.preprocess import preprocess

    log = io.StringIO()
    summary = preprocess(preprocess_args(inputs, output_prefix, tokenizer_model, *extra, **kwargs), log=log)
    return summary, log.getvalue()


def build_tiny_dataset(corpus_path: str, tokenizer_model: str, out_dir: str) -> str:
    prefix = os.path.join(out_dir, "python")
    run_preprocess(corpus_path, prefix, tokenizer_model, "--append-eod")
    return prefix + "_text_document"


def assert_release_modes(folder: str) -> None:
    """Released folders are readable by group and others: folders 0755, files 0644."""
    import glob
    import stat

    paths = [folder, *glob.glob(os.path.join(folder, "**"), recursive=True)]
    modes = {os.path.relpath(p, folder): stat.S_IMODE(os.stat(p).st_mode) for p in paths}
    expected = {p: 0o755 if os.path.isdir(os.path.join(folder, p)) else 0o644 for p in modes}
    assert modes == expected, {p: oct(m) for p, m in modes.items() if m != expected[p]}
