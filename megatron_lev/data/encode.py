"""The worker side of preprocessing: one block of JSON lines -> tokenized shards.

A worker parses and validates a block's records (data/corpus.py), tokenizes them in batches
of about ENCODE_BATCH_CHARS characters, and writes each (subset, key)'s documents to a shard
with a compact version of megatron-core's IndexedDatasetBuilder; the main side
(preprocess.py) appends the shards to the outputs in block order.
"""
from __future__ import annotations

import array
import collections
import itertools
import os
import shutil
import signal
from dataclasses import dataclass, field

import numpy as np
from megatron.core.datasets.indexed_dataset import (DType, IndexedDatasetBuilder, _IndexReader, _IndexWriter,
                                                    get_bin_path, get_idx_path)

from megatron_lev.data.corpus import BadCase, Block, iter_block_records
from megatron_lev.data.tokenizer import build_tokenizer

# ---------------------------------------------------------------------------------------
# Index building with a bounded footprint


class _CompactIndexWriter(_IndexWriter):
    """megatron-core's .idx writer with the sequence pointers computed by numpy.

    (The stock writer builds them in a Python list: ~40 bytes and a Python loop step per
    document, minutes and gigabytes for a whole Pile.) Same bytes on disk.
    """

    def _sequence_pointers(self, sequence_lengths):
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * DType.size(self.dtype), out=pointers[1:])
        return pointers


class CompactIndexedDatasetBuilder(IndexedDatasetBuilder):
    """megatron-core's IndexedDatasetBuilder keeping its index in typed arrays.

    12 bytes per document instead of ~100 for Python lists of numpy scalars (84 MB rather
    than 700 MB for one 7M-document Pile shard). Output is byte-identical to the stock
    builder's; `add_document`/`add_index`/`finalize` are megatron-core's.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        super().__init__(bin_path, dtype=dtype)
        self.sequence_lengths = array.array("i")
        self.document_indices = array.array("q", [0])

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many one-sequence documents at once: `tokens` concatenated, `lengths` each
        one's size. Same bytes as one `add_document` per document, without a Python step
        per document."""
        self.data_file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        first = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(np.asarray(lengths, dtype=np.int32).tobytes())
        self.document_indices.frombytes(np.arange(first + 1, first + len(lengths) + 1, dtype=np.int64).tobytes())

    def add_index(self, path_prefix: str) -> None:
        """megatron-core's add_index without its `gc.collect()` per call (a full collection
        of this process's heap, torch's objects included: ~0.5 s a shard)."""
        index = _IndexReader(get_idx_path(path_prefix), multimodal=False)
        assert index.dtype == self.dtype, (index.dtype, self.dtype)
        offset = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(np.asarray(index.sequence_lengths, dtype=np.int32).tobytes())
        self.document_indices.frombytes((offset + np.asarray(index.document_indices[1:], dtype=np.int64)).tobytes())
        del index
        with open(get_bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self.data_file)

    def finalize(self, idx_path: str) -> None:
        self.data_file.close()
        with _CompactIndexWriter(idx_path, self.dtype) as writer:
            writer.write(self.sequence_lengths, self.sequence_modes, self.document_indices)


# ---------------------------------------------------------------------------------------
# Worker side: one block -> one shard per (subset, key)


@dataclass
class EncodeOptions:
    keys: tuple[str, ...]
    split_key: str | None
    append_eod: bool
    dtype: type
    shard_dir: str
    max_examples: int


@dataclass
class BlockResult:
    index: int
    path: str
    end_offset: int
    nbytes: int
    documents: int = 0
    tokens: int = 0
    bad_counts: collections.Counter = field(default_factory=collections.Counter)
    bad_examples: list[BadCase] = field(default_factory=list)
    # subset (None without --split-by-key) -> shard prefix per key, and per-output stats
    shards: dict = field(default_factory=dict)
    shard_stats: dict = field(default_factory=dict)  # (subset, key) -> [documents, tokens, max id]
    split_documents: int = 0  # texts over ENCODE_BATCH_CHARS, tokenized in pieces


_WORKER_TOKENIZER = None


def _init_worker(tokenizer_type: str, tokenizer_model: str | None, vocab_file: str | None = None,
                 merge_file: str | None = None) -> None:
    global _WORKER_TOKENIZER
    # Forked workers inherit the main process's handlers: SIGTERM (from the main process
    # stopping them) just ends a worker; Ctrl-C reaches the whole process group, and the
    # main process stops the workers itself.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER_TOKENIZER = build_tokenizer(tokenizer_type, tokenizer_model, vocab_file, merge_file)


# Characters handed to one batch-encode call. Bounds the ids held as Python ints (~40
# bytes each) and SentencePiece's own per-character working memory (~40 bytes a
# character): about 80 MB per worker whatever the block or document size.
ENCODE_BATCH_CHARS = 1 << 20


def split_long_text(text: str, limit: int | None = None) -> list[str]:
    """`text` in pieces of at most `limit` (ENCODE_BATCH_CHARS) characters, cut after a
    newline where there is one (a single huge document is tokenized piece by piece, so
    memory stays bounded). Pieces are tokenized separately: tokens at a cut may differ
    from one whole encode."""
    limit = limit or ENCODE_BATCH_CHARS
    if len(text) <= limit:
        return [text]
    pieces, start = [], 0
    while len(text) - start > limit:
        cut = text.rfind("\n", start, start + limit) + 1
        if cut <= start:
            cut = start + limit
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def encode_block(index: int, block: Block, opts: EncodeOptions, tokenizer=None) -> BlockResult:
    """Parse, validate and tokenize one block; write its documents to shard files.

    Documents are tokenized in batches (`tokenize_batch`: one call into the tokenizer's
    C++ code per ~1M characters rather than one per document) and written to the shard
    as one array per batch."""
    tokenizer = tokenizer or _WORKER_TOKENIZER
    result = BlockResult(index, block.path, block.end_offset, len(block.data))
    builders: dict[str | None, list[CompactIndexedDatasetBuilder]] = {}
    pending: list = []
    pending_chars = 0

    def flush() -> None:
        by_subset: dict[str | None, list] = {}
        for record in pending:  # each subset's documents in corpus order
            by_subset.setdefault(record.subset, []).append(record)
        for subset, records in by_subset.items():
            if subset not in builders:
                shard = os.path.join(opts.shard_dir, f"{index:09d}_{len(builders)}")
                result.shards[subset] = [f"{shard}_{k}" for k in range(len(opts.keys))]
                builders[subset] = [CompactIndexedDatasetBuilder(get_bin_path(p), dtype=opts.dtype)
                                    for p in result.shards[subset]]
            for key_index, key in enumerate(opts.keys):
                tokens, lengths = _tokenize_documents(tokenizer, [r.texts[key_index] for r in records],
                                                      opts.append_eod, result)
                builders[subset][key_index].add_documents(tokens, lengths)
                stats = result.shard_stats.setdefault((subset, key), [0, 0, -1])
                stats[0] += len(lengths)
                stats[1] += len(tokens)
                if len(tokens):
                    stats[2] = max(stats[2], int(tokens.max()))
        result.documents += len(pending)
        pending.clear()

    try:
        for item in iter_block_records(block, opts.keys, opts.split_key):
            if isinstance(item, BadCase):
                result.bad_counts[item.kind] += 1
                if len(result.bad_examples) < opts.max_examples:
                    result.bad_examples.append(item)
                continue
            pending.append(item)
            pending_chars += sum(map(len, item.texts))
            if pending_chars >= ENCODE_BATCH_CHARS:
                flush()
                pending_chars = 0
        flush()
    finally:
        for subset, key_builders in builders.items():
            for builder, prefix in zip(key_builders, result.shards[subset]):
                builder.finalize(get_idx_path(prefix))
    result.tokens = sum(tokens for _, tokens, _ in result.shard_stats.values())
    return result


def _tokenize_documents(tokenizer, texts: list[str], append_eod: bool, result: BlockResult
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `texts` concatenated (EOD after each if asked) and each one's length."""
    if all(len(text) <= ENCODE_BATCH_CHARS for text in texts):
        ids = tokenizer.tokenize_batch(texts, num_threads=1)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        body = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        del ids
    else:  # rare: a document too long for one call goes piece by piece, straight into arrays
        arrays = []
        for text in texts:
            pieces = split_long_text(text)
            result.split_documents += len(pieces) > 1
            arrays.append(np.concatenate([np.array(tokenizer.tokenize(p), dtype=np.int32) for p in pieces]))
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        body = np.concatenate(arrays)
    if not append_eod:
        return body, lengths
    lengths += 1
    ends = np.cumsum(lengths) - 1
    tokens = np.full(len(body) + len(lengths), tokenizer.eod, dtype=np.int32)
    mask = np.ones(len(tokens), dtype=bool)
    mask[ends] = False
    tokens[mask] = body
    return tokens, lengths
