"""Token-type frequencies of a training corpus in megatron's indexed format.

`count_token_frequencies(prefix, vocab_size)` returns an int64 array `counts` of
length `vocab_size` with `counts[t]` = occurrences of token id `t` in every document
of the `.bin` file. Counting is a chunked `np.bincount` over the raw token buffer
(no per-document Python loop), so a Pile-sized shard is counted at memory bandwidth.

`sequences=(begin, end)` counts only those sequences (documents) of the prefix: the
training share of a prefix that `--split` divides is `train_sequence_range(prefix,
split)`, megatron-core's own rule (the first round(share * n) sequences), so tokens of
validation documents never count as training frequencies.

Results are cached as `.npy` in a cache directory, keyed by the dataset's absolute
path, the size and mtime of its `.bin` and `.idx`, the sequence range and
`vocab_size`: a rewritten dataset gets a new key, never a stale count.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

# 16 M tokens a chunk: bincount casts to intp, so a chunk costs 128 MiB at most.
DEFAULT_CHUNK_TOKENS = 1 << 24


def _dataset_files(prefix: str) -> tuple[str, str]:
    bin_path, idx_path = f"{prefix}.bin", f"{prefix}.idx"
    for path in (bin_path, idx_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"indexed dataset {prefix!r}: {path} does not exist")
    return bin_path, idx_path


def default_cache_dir(prefix: str) -> str:
    """The cache lives beside the dataset: `<dataset dir>/cache/token_counts/`."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "token_counts")


def train_sequence_range(prefix: str, split: str) -> tuple[int, int]:
    """Sequences [begin, end) of `prefix` that GPTDataset puts in the train split of `split`."""
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    _dataset_files(prefix)
    try:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    except (AssertionError, ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"--split {split!r}: not a split like 969,30,1") from exc
    n = len(IndexedDataset(prefix, mmap=True).index)
    if matrix[0] is None:
        return 0, 0
    return int(round(matrix[0][0] * n)), int(round(matrix[0][1] * n))


def frequency_cache_path(prefix: str, vocab_size: int, cache_dir: str | None = None,
                         sequences: tuple[int, int] | None = None) -> str:
    """Where the counts of `prefix` are cached (the key changes when the files change)."""
    bin_path, idx_path = _dataset_files(prefix)
    key = [os.path.abspath(prefix), str(vocab_size), str(sequences)]
    for path in (bin_path, idx_path):
        st = os.stat(path)
        key += [str(st.st_size), str(st.st_mtime_ns)]
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
    name = f"{Path(prefix).name}.counts.v{vocab_size}.{digest}.npy"
    return os.path.join(cache_dir or default_cache_dir(prefix), name)


def _count(prefix: str, vocab_size: int, chunk_tokens: int, sequences: tuple[int, int] | None) -> np.ndarray:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix, mmap=True)
    index = dataset.index
    dtype = index.dtype
    counts = np.zeros(vocab_size, dtype=np.int64)
    begin, end = sequences if sequences is not None else (0, len(index))
    if not 0 <= begin <= end <= len(index):
        raise ValueError(f"{prefix}: sequences [{begin}, {end}) outside its {len(index)} sequences")
    if begin == end:
        return counts
    # Sequences are stored back to back; count the span they cover in one pass.
    itemsize = np.dtype(dtype).itemsize
    start = int(index.sequence_pointers[begin])
    total = int(index.sequence_lengths[begin:end].sum(dtype=np.int64))
    from megatron_lev.utils.progress import progress_bar

    for first in progress_bar(range(0, total, chunk_tokens), f"counting tokens of {os.path.basename(prefix)}",
                              unit="chunk"):
        n = min(chunk_tokens, total - first)
        chunk = dataset.bin_reader.read(dtype=dtype, count=n, offset=start + first * itemsize)
        top = int(chunk.max())
        if top >= vocab_size or (np.issubdtype(dtype, np.signedinteger) and int(chunk.min()) < 0):
            bad = top if top >= vocab_size else int(chunk.min())
            raise ValueError(f"{prefix}.bin: token id {bad} is outside the vocabulary [0, {vocab_size}) "
                             f"(is --vocab-size right for this dataset?)")
        counts += np.bincount(chunk, minlength=vocab_size)
    return counts


def count_token_frequencies(prefix: str, vocab_size: int, cache_dir: str | None = None,
                            use_cache: bool = True, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                            sequences: tuple[int, int] | None = None) -> np.ndarray:
    """Occurrences of each token id in indexed dataset `prefix` (int64, length vocab_size),
    in all its sequences or in `sequences=(begin, end)`.

    Cached (see module doc); `count_blend_frequencies` sums several datasets.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    sequences = None if sequences is None else (int(sequences[0]), int(sequences[1]))
    path = frequency_cache_path(prefix, vocab_size, cache_dir, sequences)
    if use_cache and os.path.isfile(path):
        counts = np.load(path)
        if counts.shape == (vocab_size,) and counts.dtype == np.int64:
            return counts
    counts = _count(prefix, vocab_size, chunk_tokens, sequences)
    if use_cache:
        from megatron_lev.utils.files import atomic_path

        with atomic_path(path) as tmp, open(tmp, "wb") as f:  # readers never see a half-written cache
            np.save(f, counts)
    return counts


def count_blend_frequencies(prefixes: list[str], vocab_size: int, split: str | None = None,
                            **kwargs) -> np.ndarray:
    """Summed counts of several indexed datasets (a training blend, unweighted); with
    `split`, only each prefix's train share of it."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for prefix in prefixes:
        sequences = train_sequence_range(prefix, split) if split else None
        counts += count_token_frequencies(prefix, vocab_size, sequences=sequences, **kwargs)
    return counts
