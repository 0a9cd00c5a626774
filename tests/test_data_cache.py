"""The dataset index cache (megatron_lev.data.datasets.index_cache_dir): keyed on the data
files, so a prefix preprocessed again is never read through stale indices; by default
under --save (a folder every node sees), and a read-only data folder works."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megatron_lev.data.datasets import build_train_valid_test_datasets
from megatron_lev.data.tokenizer import build_tokenizer


def _write_dataset(prefix, docs) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(np.array(doc, dtype=np.int64), [len(doc)])
    builder.finalize(f"{prefix}.idx")


def _docs(seed: int, count: int = 40):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 1000, size=int(rng.integers(5, 60))).tolist() for _ in range(count)]


def _build(prefix, tokenizer, cache_dir):
    train, _, _ = build_train_valid_test_datasets(
        data_path=str(prefix), split="100,0,0", seq_length=16, seed=5, train_samples=None, valid_samples=None,
        test_samples=None, tokenizer=tokenizer, cache_dir=None if cache_dir is None else str(cache_dir))
    return train


def _tokens(dataset) -> torch.Tensor:
    return torch.stack([torch.as_tensor(dataset[i]["tokens"]) for i in range(len(dataset))])


def test_cache_is_keyed_on_the_data_and_a_read_only_data_folder_works(tmp_path, spm_tokenizer, monkeypatch):
    tokenizer = build_tokenizer("SentencePieceTokenizer", spm_tokenizer)
    data = tmp_path / "data"
    data.mkdir()
    prefix = data / "corpus_text_document"
    cache = tmp_path / "save" / "data_cache"

    _write_dataset(prefix, _docs(1))
    first = _build(prefix, tokenizer, cache)
    (first_dir,) = cache.iterdir()
    assert first_dir.name.startswith("indices-") and any(first_dir.glob("*-shuffle_index.npy"))
    assert sorted(p.name for p in data.iterdir()) == ["corpus_text_document.bin", "corpus_text_document.idx"]
    assert torch.equal(_tokens(_build(prefix, tokenizer, cache)), _tokens(first))  # read back from the cache
    assert sorted(cache.iterdir()) == [first_dir]

    # Preprocessed again in place: same document count, other lengths and tokens. The
    # indices of the old files would cut samples at the old boundaries.
    _write_dataset(prefix, _docs(2))
    again = _build(prefix, tokenizer, cache)
    fresh = _build(prefix, tokenizer, tmp_path / "fresh_cache")
    assert len(list(cache.iterdir())) == 2  # a new folder, the old one untouched
    assert len(again) == len(fresh) and torch.equal(_tokens(again), _tokens(fresh))
    assert len(again) != len(first) or not torch.equal(_tokens(again), _tokens(first))
    # Same sizes, new contents (only the modification time tells): rebuilt too.
    before = {p.name for p in cache.iterdir()}
    os.utime(f"{prefix}.idx", ns=(1, 1))
    _build(prefix, tokenizer, cache)
    assert len({p.name for p in cache.iterdir()} - before) == 1

    # No --data-cache-path and a read-only data folder (os.access, since root may write
    # anywhere): the cache goes to the user's cache folder, nothing into the data folder.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path) == str(data) else access(path, mode, **kw))
    os.chmod(data, 0o555)
    try:
        read_only = _build(prefix, tokenizer, None)
    finally:
        os.chmod(data, 0o755)
    assert torch.equal(_tokens(read_only), _tokens(fresh))
    assert sorted(p.name for p in data.iterdir()) == ["corpus_text_document.bin", "corpus_text_document.idx"]
    (user_dir,) = (tmp_path / "xdg" / "megatron_lev" / "index_cache").iterdir()
    assert any(user_dir.glob("*-shuffle_index.npy"))


def test_data_cache_path_defaults_under_save(tmp_path):
    from megatron_lev.training.arguments import parse_args, validate_args

    base = ["--config", "tiny-lev", "--data-path", "x", "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", "t", "--train-iters", "10"]
    args = validate_args(parse_args(base + ["--save", str(tmp_path / "run")]), world_size=1)
    assert args.data_cache_path == str(tmp_path / "run" / "data_cache")
    args = validate_args(parse_args(base + ["--save", str(tmp_path / "run"), "--data-cache-path", "/c"]), world_size=1)
    assert args.data_cache_path == "/c"
    assert validate_args(parse_args(base), world_size=1).data_cache_path is None
