"""Corpus readers, tokenizers, GPT datasets/blends and data-parallel sharding."""
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
import zstandard

from megatron_lev.data.corpus import build_python_corpus, expand_inputs, read_documents, write_jsonl
from megatron_lev.data.datasets import (PretrainingSampler, build_pretraining_data_loader,
                                        build_train_valid_test_datasets, max_token_id)
from megatron_lev.data.tokenizer import HuggingFaceTokenizer, build_tokenizer
from tests.distributed import run_distributed
from tests.fixtures import CORPUS_DOCUMENTS, SPM_SPECIAL_IDS, SPM_VOCAB_SIZE, run_preprocess


@pytest.fixture(scope="module")
def corpus_texts(python_corpus):
    return [r.texts[0] for r in read_documents(python_corpus)]


@pytest.fixture(scope="module")
def spm(spm_tokenizer):
    return build_tokenizer("SentencePieceTokenizer", spm_tokenizer)


# ----------------------------------------------------------------------------- corpus


def test_python_corpus_is_pile_format_and_deterministic(python_corpus, tmp_path):
    again = tmp_path / "again.jsonl.zst"
    assert build_python_corpus(str(again), max_documents=CORPUS_DOCUMENTS) == CORPUS_DOCUMENTS
    assert again.read_bytes() == open(python_corpus, "rb").read()
    raw = zstandard.ZstdDecompressor().decompressobj().decompress(again.read_bytes()).decode("utf-8")
    records = [json.loads(line) for line in raw.splitlines()]
    assert len(records) == CORPUS_DOCUMENTS
    assert all(set(r) == {"text", "meta"} and set(r["meta"]) == {"pile_set_name"} for r in records)
    from pydoc_data.topics import topics

    subsets = [r["meta"]["pile_set_name"] for r in records]
    assert subsets == ["pydoc_topics"] * len(topics) + ["stdlib_docstrings"] * (CORPUS_DOCUMENTS - len(topics))
    assert [r["text"] for r in records[:len(topics)]] == [topics[k] for k in sorted(topics)]
    assert records[len(topics)]["text"].startswith("abc\n\n")  # docstrings follow module order
    assert all(len(r["text"]) >= 32 for r in records)


def test_readers_stream_every_format_with_line_numbers(tmp_path):
    records = [{"text": f"line {i} " + "x" * (i % 37), "meta": {"pile_set_name": "S"}} for i in range(300)]
    for name in ("a.jsonl", "b.jsonl.zst", "c.json.gz", "d.jsonl.gz"):
        assert write_jsonl(str(tmp_path / name), records) == 300
    # gzip and zstd output are reproducible byte for byte.
    write_jsonl(str(tmp_path / "again.json.gz"), records)
    assert (tmp_path / "again.json.gz").read_bytes() == (tmp_path / "c.json.gz").read_bytes()
    # A .zst holding two frames reads as one stream.
    zc = zstandard.ZstdCompressor()
    lines = [json.dumps(r).encode() + b"\n" for r in records]
    (tmp_path / "e.jsonl.zst").write_bytes(zc.compress(b"".join(lines[:150])) + zc.compress(b"".join(lines[150:])))
    os.remove(tmp_path / "again.json.gz")
    for block_bytes in (64, 1 << 20):  # blocks much smaller than a line, and one block
        got = list(read_documents(str(tmp_path), split_key="meta.pile_set_name", block_bytes=block_bytes))
        assert [os.path.basename(r.path) for r in got[::300]] == ["a.jsonl", "b.jsonl.zst", "c.json.gz",
                                                                   "d.jsonl.gz", "e.jsonl.zst"]
        assert [(r.line, r.texts[0], r.subset) for r in got] == \
            [(i + 1, rec["text"], "S") for _ in range(5) for i, rec in enumerate(records)]
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="--input .*unsupported file type"):
        expand_inputs(str(tmp_path / "x.txt"))
    with pytest.raises(FileNotFoundError, match="--input .*matches no"):
        expand_inputs(str(tmp_path / "*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="--input .*holds no"):
        expand_inputs(str(tmp_path / "empty"))


# ----------------------------------------------------------------------------- tokenizers


def test_sentencepiece_tokenizer_round_trips_text(spm, spm_tokenizer, corpus_texts):
    assert spm.vocab_size == SPM_VOCAB_SIZE
    assert {"unk": 0, "bos": spm.bos, "eod": spm.eod, "pad": spm.pad} == SPM_SPECIAL_IDS
    assert spm.vocab["</s>"] == spm.eod and spm.inv_vocab[spm.bos] == "<s>"
    for text in corpus_texts:
        ids = spm.tokenize(text)
        assert spm.detokenize(ids) == text
        assert 3 < min(ids) and max(ids) < SPM_VOCAB_SIZE  # text never encodes to specials
    for text in ("  indented\n\tcode  ", "naïve café 🐍 中文", "x" * 5000, " leading", "trailing "):
        assert spm.detokenize(spm.tokenize(text)) == text
    assert spm.tokenize_batch(corpus_texts[:5]) == [spm.tokenize(t) for t in corpus_texts[:5]]
    assert spm.unique_identifiers["tokenizer_path"] == os.path.abspath(spm_tokenizer)
    with pytest.raises(FileNotFoundError, match="--tokenizer-model /no/such.model: no such file"):
        build_tokenizer("SentencePieceTokenizer", "/no/such.model")
    with pytest.raises(ValueError, match="--tokenizer-type BertWordPieceCase: unknown"):
        build_tokenizer("BertWordPieceCase", spm_tokenizer)


def test_huggingface_tokenizer_special_tokens_and_round_trip(tmp_path, corpus_texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def train(specials):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(corpus_texts[:200], trainer)
        return tok

    file = tmp_path / "neox" / "tokenizer.json"
    file.parent.mkdir()
    train(["<|endoftext|>", "<|padding|>"]).save(str(file))
    hf = build_tokenizer("HuggingFaceTokenizer", str(file))
    assert (hf.eod, hf.pad, hf.bos) == (0, 1, None) and hf.vocab_size == 600
    for text in corpus_texts[:100]:
        assert hf.detokenize(hf.tokenize(text)) == text
    # A folder: tokenizer_config.json names the special tokens.
    (file.parent / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|padding|>"}, "bos_token": "<|endoftext|>"}))
    declared = HuggingFaceTokenizer(str(file.parent))
    assert (declared.eod, declared.bos, declared.pad) == (1, 0, 1)
    other = tmp_path / "plain.json"
    train(["<unk>"]).save(str(other))
    with pytest.raises(ValueError, match="--tokenizer-model .*no end-of-document token"):
        HuggingFaceTokenizer(str(other))



def test_train_tokenizer_tool(tmp_path, python_corpus, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tokenizer", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "train_tokenizer.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    model = tmp_path / "tok" / "uni.model"
    tool.main(["--input", python_corpus, "--output", str(model), "--vocab-size", "700", "--model-type", "unigram",
               "--user-defined-symbols", "<|im_start|>", "<|im_end|>", "--sample-documents", "300",
               "--num-threads", "1"])
    assert "wrote" in capsys.readouterr().out
    assert sorted(os.listdir(model.parent)) == ["uni.model", "uni.vocab"]  # no temporary files left
    tok = build_tokenizer("SentencePieceTokenizer", str(model))
    assert tok.vocab_size == 700 and (tok.bos, tok.eod, tok.pad) == (1, 2, 3)
    # User-defined symbols get the ids after the specials and are never split.
    ids = tok.tokenize("<|im_start|>user text<|im_end|>")
    assert ids.count(4) == 1 and ids.count(5) == 1 and ids.index(4) < ids.index(5)
    text = "def f():\n    return 'ünïcödé ∑ 𝔘'  # unseen characters go through byte fallback"
    assert tok.detokenize(tok.tokenize(text)) == text
    with pytest.raises(SystemExit):
        tool.main(["--input", python_corpus, "--output", str(tmp_path / "bad.bin"), "--vocab-size", "700"])
    assert "must end with .model" in capsys.readouterr().err

# ----------------------------------------------------------------------------- datasets


def expected_window_check(dataset, docs: list[list[int]], seq_length: int) -> int:
    """Every sample equals the window of the stream of documents in the dataset's
    (shuffled) document order at the sample's place: [j*L, j*L + L + 1)."""
    stream = np.concatenate([docs[d] for d in dataset.document_index])
    for i in range(len(dataset)):
        j = int(dataset.shuffle_index[i])
        window = torch.from_numpy(stream[j * seq_length: j * seq_length + seq_length + 1].astype(np.int64))
        sample = dataset[i]
        assert torch.equal(sample["tokens"], window[:-1]) and torch.equal(sample["labels"], window[1:])
    return len(dataset)


def test_gpt_dataset_yields_expected_token_windows(tiny_dataset, spm, corpus_texts, tmp_path):
    # The dataset's documents are the tokenizer's output + EOD, in corpus order.
    docs = [spm.tokenize(t) + [spm.eod] for t in corpus_texts]
    seq = 64
    common = dict(data_path=[tiny_dataset], split="80,20,0", seq_length=seq, seed=1234, train_samples=None,
                  valid_samples=None, test_samples=None, tokenizer=spm, cache_dir=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(**common)
    assert test is None
    assert sorted(train.document_index.tolist()) == list(range(400))  # one epoch of the first 80%
    assert sorted(valid.document_index.tolist()) == list(range(400, 500))
    assert sorted(train.shuffle_index.tolist()) == list(range(len(train)))
    total = sum(len(docs[d]) for d in range(400))
    assert len(train) == (total - 1) // seq
    expected_window_check(train, docs, seq)
    expected_window_check(valid, docs, seq)
    first = train[0]
    assert set(first) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert torch.equal(first["loss_mask"], torch.ones(seq)) and torch.equal(first["position_ids"], torch.arange(seq))
    # Rebuilt from the cache: the same samples; another seed: another order.
    again, _, _ = build_train_valid_test_datasets(**common)
    assert all(torch.equal(again[i]["tokens"], train[i]["tokens"]) for i in range(0, len(train), 17))
    reseeded, _, _ = build_train_valid_test_datasets(**{**common, "seed": 99})
    assert not np.array_equal(reseeded.shuffle_index, train.shuffle_index)
    # --eod-mask-loss / --reset-position-ids: EOD positions carry no loss, positions restart after EOD.
    masked, _, _ = build_train_valid_test_datasets(**common, eod_mask_loss=True, reset_position_ids=True)
    checked_eod = 0
    for i in range(0, len(masked), 7):
        s = masked[i]
        assert torch.equal(s["loss_mask"] == 0, s["tokens"] == spm.eod)
        expected_pos, p = [], 0
        for token in s["tokens"].tolist():
            expected_pos.append(p)
            p = 0 if token == spm.eod else p + 1
        assert s["position_ids"].tolist() == expected_pos
        checked_eod += int((s["tokens"] == spm.eod).sum())
    assert checked_eod > 10


def test_blends_and_per_split_paths(tmp_path, python_corpus, spm_tokenizer, spm):
    prefix = str(tmp_path / "pile")
    run_preprocess(python_corpus, prefix, spm_tokenizer, "--append-eod", "--split-by-key", "meta.pile_set_name")
    topics, docstrings = prefix + "_pydoc_topics_text_document", prefix + "_stdlib_docstrings_text_document"
    train, valid, _ = build_train_valid_test_datasets(
        data_path=f"0.25 {topics} 0.75 {docstrings}", split="90,10,0", seq_length=32, seed=7, train_samples=400,
        valid_samples=40, test_samples=None, tokenizer=spm, cache_dir=str(tmp_path / "cache"))
    ids = np.array([train[i]["dataset_id"] for i in range(len(train))])
    assert len(train) == 400 and len(valid) == 40
    assert abs((ids == 0).sum() - 100) <= 1 and abs((ids == 1).sum() - 300) <= 1
    batch = next(iter(build_pretraining_data_loader(train, 0, 4, 0, 1)))
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"} and batch["tokens"].shape == (4, 32)
    train2, valid2, test2 = build_train_valid_test_datasets(
        train_data_path=[topics], valid_data_path=[docstrings], seq_length=32, seed=7, train_samples=50,
        valid_samples=20, test_samples=None, tokenizer=spm, cache_dir=str(tmp_path / "cache"))
    assert test2 is None and len(train2) >= 50 and len(valid2) >= 20
    assert train2.dataset.path_prefix == topics and valid2.dataset.path_prefix == docstrings


def test_bad_data_flags_fail_clearly(tiny_dataset, spm, tmp_path):
    lonely = str(tmp_path / "lonely_text_document")
    shutil.copy(tiny_dataset + ".bin", lonely + ".bin")
    kwargs = dict(seq_length=16, seed=1, train_samples=10, valid_samples=10, test_samples=10, tokenizer=spm)
    with pytest.raises(FileNotFoundError, match=re.escape(f"--data-path {lonely}: {lonely}.idx does not exist")):
        build_train_valid_test_datasets(data_path=["0.5", tiny_dataset, "0.5", lonely], **kwargs)
    with pytest.raises(FileNotFoundError, match=re.escape(f"--valid-data-path {lonely}: {lonely}.idx does not")):
        build_train_valid_test_datasets(train_data_path=[tiny_dataset], valid_data_path=[lonely], **kwargs)
    with pytest.raises(ValueError, match="exclusive"):
        build_train_valid_test_datasets(data_path=[tiny_dataset], train_data_path=[tiny_dataset], **kwargs)
    # 500 documents under "969,30,1": the test share rounds to no document (megatron-core would loop forever).
    with pytest.raises(ValueError, match="--split 969,30,1: the test split of .* gets no document"):
        build_train_valid_test_datasets(data_path=[tiny_dataset], split="969,30,1", **kwargs)


def test_max_token_id_from_stats_and_by_scan(tiny_dataset, corpus_texts, spm, tmp_path):
    true_max = max(max(spm.tokenize(t)) for t in corpus_texts)
    assert max_token_id(tiny_dataset) == true_max
    copy = str(tmp_path / "copy_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copy(tiny_dataset + suffix, copy + suffix)
    assert max_token_id(copy) == true_max  # no stats file: scanned
    stale = json.load(open(tiny_dataset + ".stats.json"))
    json.dump({**stale, "max_token_id": 5, "bin_bytes": 1}, open(copy + ".stats.json", "w"))
    assert max_token_id(copy) == true_max  # stats for another .bin: ignored
    # Scanned once per .bin: the answer is kept in the data cache for the next start.
    os.remove(copy + ".stats.json")
    cache = tmp_path / "cache"
    assert max_token_id(copy, str(cache)) == true_max
    (kept,) = cache.glob("max_token_id_*.json")
    record = json.loads(kept.read_text())
    assert record["max_token_id"] == true_max and record["bin"] == os.path.abspath(copy + ".bin")
    kept.write_text(json.dumps({**record, "max_token_id": 7}))
    assert max_token_id(copy, str(cache)) == 7  # read, not scanned
    os.utime(copy + ".bin", ns=(record["bin_mtime_ns"] + 10**9,) * 2)
    assert max_token_id(copy, str(cache)) == true_max  # the .bin changed: scanned again


# ----------------------------------------------------------------------------- data-parallel sharding


def test_sampler_splits_global_batches_and_resumes():
    total, micro, dp = 50, 3, 2
    single = list(PretrainingSampler(total, 0, micro * dp, 0, 1))
    ranks = [list(PretrainingSampler(total, 0, micro, r, dp)) for r in range(dp)]
    assert len(single) == len(ranks[0]) == len(ranks[1]) == 8 == len(PretrainingSampler(total, 0, micro, 1, dp))
    for g, batch in enumerate(single):
        assert ranks[0][g] + ranks[1][g] == batch
    assert not set(sum(ranks[0], [])) & set(sum(ranks[1], []))
    resumed = [list(PretrainingSampler(total, 18, micro, r, dp)) for r in range(dp)]
    assert resumed == [ranks[0][3:], ranks[1][3:]]
    # drop_last=False: the last, partial global batch [48, 49] fits in rank 0's slice only.
    keep = [PretrainingSampler(total, 0, micro, r, dp, drop_last=False) for r in range(dp)]
    assert list(keep[0])[-1] == [48, 49] and len(keep[0]) == 9
    assert list(keep[1]) == ranks[1] and len(keep[1]) == 8
    with pytest.raises(ValueError, match="consumed_samples 60 is outside"):
        PretrainingSampler(total, 60, micro, 0, dp)


def _dp_rank_batches(rank, world_size, prefix, tokenizer_model, cache_dir, micro):
    from megatron_lev.data.datasets import build_pretraining_data_loader, build_train_valid_test_datasets
    from megatron_lev.data.tokenizer import build_tokenizer

    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model)
    train, _, _ = build_train_valid_test_datasets(
        data_path=[prefix], split="90,10,0", seq_length=48, seed=5, train_samples=200, valid_samples=20,
        test_samples=None, tokenizer=tok, cache_dir=cache_dir)
    fresh = build_pretraining_data_loader(train, 0, micro, rank, world_size)
    resumed = build_pretraining_data_loader(train, 6 * micro * world_size, micro, rank, world_size)
    take = lambda loader, n: [b for b, _ in zip(loader, range(n))]  # noqa: E731
    return {"ids": [ids for ids, _ in zip(fresh.batch_sampler, range(10))],
            "fresh": take(fresh, 10), "resumed": take(resumed, 4)}


def test_two_dp_ranks_get_disjoint_samples_whose_union_is_the_one_rank_order(tiny_dataset, spm_tokenizer, spm,
                                                                            tmp_path):
    micro = 2
    cache = str(tmp_path / "cache")
    r0, r1 = run_distributed(_dp_rank_batches, world_size=2, args=(tiny_dataset, spm_tokenizer, cache, micro))
    assert not set(sum(r0["ids"], [])) & set(sum(r1["ids"], []))
    # The 1-rank run: same dataset (same seed, same cache), micro x 2 per batch.
    train, _, _ = build_train_valid_test_datasets(
        data_path=[tiny_dataset], split="90,10,0", seq_length=48, seed=5, train_samples=200, valid_samples=20,
        test_samples=None, tokenizer=spm, cache_dir=cache)
    single = [b for b, _ in zip(build_pretraining_data_loader(train, 0, 2 * micro, 0, 1), range(10))]
    for g in range(10):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(torch.cat([r0["fresh"][g][key], r1["fresh"][g][key]]), single[g][key])
    # Resuming at sample 24 (= 6 global batches) continues exactly there on each rank.
    for rank in (r0, r1):
        for g in range(4):
            assert torch.equal(rank["resumed"][g]["tokens"], rank["fresh"][6 + g]["tokens"])
