"""tools/tiktoken_to_hf.py (megatron_lev/hf/tiktoken_convert.py): a tiktoken encoding, trained here
(byte-level BPE, 300 merges, on the first 20 documents of the test corpus and a few lines of
Unicode and code) with o200k_base's split pattern and special-token ids, becomes a tokenizer.json
whose ids equal tiktoken's own (tiktoken.Encoding over the same ranks) on 508 documents: the
test corpus's 500 (pydoc topics and standard-library docstrings, 577k characters, mostly unseen
in training) and 8 edge cases (Unicode, emoji, whitespace runs, digits, contractions, the special
tokens <|endoftext|> 199999 and <|endofprompt|> 200018 in the text); so do preprocessing's
.bin (HuggingFaceTokenizer, EOD appended) and the Hugging Face export's AutoTokenizer."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import regex  # transformers' dependency
import tiktoken  # the test extra's

from megatron_lev.hf.tiktoken_convert import (convert_tiktoken, main, named_encoding_parts, read_ranks, to_hf_tokenizer,
                                               write_ranks)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = ("The Pile is a large corpus. The tokenizer learns the corpus's frequent pieces: the, corpus, token.\n"
          "def tokenize(text):\n    return [piece for piece in text.split()]  # 12345 6789\n"
          "Ünïcödé text, naïve café; 東京 and Ελληνικά too.\n") * 3
TEXTS = ["The corpus is tokenized.", "def f(x):\n    return x  # 2024 naïve", "  two spaces\tand a tab\n\n",
         "東京 Ελληνικά ümlaut 🙂 emoji", "<|endoftext|>after the end<|endofprompt|>", "corpus<|endoftext|>",
         "", "12345678901 digits", "I'm here, they'll go; WE'RE LOUD."]


def train_ranks(text: str, pattern: str, merges: int) -> dict[bytes, int]:
    """Byte-level BPE within the pattern's pieces: the 256 bytes, then the most frequent pair
    merged `merges` times (ties broken by the pair's bytes, so the ranks are reproducible)."""
    ranks = {bytes([i]): i for i in range(256)}
    words = collections.Counter(tuple(bytes([b]) for b in piece.encode()) for piece in regex.findall(pattern, text))
    for _ in range(merges):
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        ranks.setdefault(best[0] + best[1], len(ranks))  # the same bytes from another split keep their rank
        merged = collections.Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return ranks


@pytest.fixture(scope="module")
def corpus_texts(python_corpus):
    from megatron_lev.data.corpus import read_documents

    return [record.texts[0] for record in read_documents([python_corpus])]


@pytest.fixture(scope="module")
def encoding(corpus_texts):
    pattern, specials = named_encoding_parts("o200k_base")
    assert specials == {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}
    ranks = train_ranks(CORPUS + "".join(corpus_texts[:20]), pattern, 300)
    assert len(ranks) > 256 + 250
    return tiktoken.Encoding(name="tiny_o200k", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(scope="module")
def check_corpus(corpus_texts, tmp_path_factory) -> tuple[str, list[str]]:
    """A Pile-format file of the edge cases and the test corpus (508 documents once "" is skipped,
    as preprocessing skips it), and its texts."""
    texts = TEXTS + corpus_texts
    path = str(tmp_path_factory.mktemp("check") / "check.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return path, [t for t in texts if t]


def test_ranks_files_are_tiktokens_format(encoding, tmp_path, monkeypatch):
    from tiktoken.load import load_tiktoken_bpe

    path = str(tmp_path / "tiny.tiktoken")
    write_ranks(encoding._mergeable_ranks, path)
    lines = open(path, "rb").read().splitlines()
    assert len(lines) == len(encoding._mergeable_ranks)
    assert lines[0] == b"AA== 0" and lines[65] == b"QQ== 65"  # byte 0, byte 'A'
    assert read_ranks(path) == encoding._mergeable_ranks
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken's reader, without its path-keyed cache
    assert load_tiktoken_bpe(path) == encoding._mergeable_ranks


@pytest.fixture(scope="module")
def converted(encoding, check_corpus, tmp_path_factory) -> str:
    """The tool run as a command on the encoding's .tiktoken file, --check on the 508 documents:
    returns the output folder."""
    folder = tmp_path_factory.mktemp("tool")
    ranks_file, out = str(folder / "tiny.tiktoken"), str(folder / "tok")
    write_ranks(encoding._mergeable_ranks, ranks_file)
    corpus, texts = check_corpus
    tokens = sum(len(encoding.encode(t, allowed_special="all")) for t in texts)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "tiktoken_to_hf.py"), "--encoding", ranks_file,
                           "--like", "o200k_base", "--output", out, "--check", corpus], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert (proc.returncode, proc.stdout) == (0, f"wrote {out}/tokenizer.json (ids equal tiktoken's on 508 documents, "
                                                 f"{tokens} tokens, of {corpus})\n"), proc.stderr
    assert sorted(os.listdir(out)) == ["tokenizer.json", "tokenizer_config.json"]  # no temporary file left
    return out


def test_the_tool_writes_a_tokenizer_with_tiktokens_ids(encoding, check_corpus, converted):
    from tokenizers import Tokenizer

    texts = check_corpus[1]
    hf = Tokenizer.from_file(os.path.join(converted, "tokenizer.json"))
    expected = [encoding.encode(t, allowed_special="all") for t in texts]
    assert [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)] == expected
    assert sum(map(len, expected)) < 0.5 * sum(len(t.encode()) for t in texts)  # the merges are used
    assert expected[4] == [199999, *encoding.encode("after the end"), 200018] and expected[5][-1] == 199999
    assert hf.decode_batch(expected, skip_special_tokens=False) == texts
    assert hf.get_vocab_size() == len(encoding._mergeable_ranks) + 2
    config = json.load(open(os.path.join(converted, "tokenizer_config.json")))
    assert (config["eos_token"], config["add_bos_token"], config["add_eos_token"]) == ("<|endoftext|>", False, False)

    # The training tokenizer (preprocess_data.py --tokenizer-type HuggingFaceTokenizer) reads the file.
    from megatron_lev.data.tokenizer import build_tokenizer

    ours = build_tokenizer("HuggingFaceTokenizer", os.path.join(converted, "tokenizer.json"))
    assert (ours.eod, ours.bos, ours.pad) == (199999, None, -1)
    assert ours.vocab_size == 200019  # the highest id + 1, not the 256 + 300 + 2 entries
    assert ours.tokenize_batch(texts) == expected


def test_preprocessing_and_the_export_give_tiktokens_ids(encoding, check_corpus, converted, tmp_path):
    """preprocess_data.py --tokenizer-type HuggingFaceTokenizer --append-eod writes tiktoken's ids
    and EOD (int32: ids past 65,535), and the Hugging Face export's AutoTokenizer encodes as tiktoken."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_lev.data.tokenizer import build_tokenizer
    from megatron_lev.hf.tokenizers import write_tokenizer
    from tests.fixtures import run_preprocess

    corpus, texts = check_corpus
    expected = [encoding.encode(t, allowed_special="all") for t in texts]
    tokenizer_json = os.path.join(converted, "tokenizer.json")
    run_preprocess(corpus, str(tmp_path / "pile"), tokenizer_json, "--append-eod",
                   tokenizer_type="HuggingFaceTokenizer")
    dataset = IndexedDataset(str(tmp_path / "pile_text_document"))
    assert dataset.index.dtype == np.int32
    assert [dataset[i].tolist() for i in range(len(dataset))] == [ids + [199999] for ids in expected]

    from transformers import AutoTokenizer

    export = str(tmp_path / "hf")
    os.makedirs(export)
    write_tokenizer(build_tokenizer("HuggingFaceTokenizer", tokenizer_json), export, 512)
    auto = AutoTokenizer.from_pretrained(export)
    assert auto(texts, add_special_tokens=False)["input_ids"] == expected
    assert (auto.eos_token, auto.eos_token_id, auto.bos_token) == ("<|endoftext|>", 199999, None)
    assert auto.decode(expected[4]) == texts[4]


def test_an_encoding_with_contiguous_special_ids(encoding):
    n = len(encoding._mergeable_ranks)
    specials = {"<|endoftext|>": n, "<|pad|>": n + 1}
    tiny = tiktoken.Encoding(name="tiny", pat_str=encoding._pat_str, mergeable_ranks=encoding._mergeable_ranks,
                             special_tokens=specials)
    hf = to_hf_tokenizer(tiny._mergeable_ranks, tiny._pat_str, specials)
    texts = [*TEXTS[:4], "a<|pad|>b<|endoftext|>"]
    assert [hf.encode(t, add_special_tokens=False).ids for t in texts] == [
        tiny.encode(t, allowed_special="all") for t in texts]
    assert hf.encode("<|pad|>", add_special_tokens=False).ids == [n + 1]


def test_a_named_encoding_from_tiktokens_cache(encoding, tmp_path):
    with mock.patch("tiktoken.get_encoding", lambda name: encoding):
        assert main(["--encoding", "o200k_base", "--output", str(tmp_path / "tok")]) == 0
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert [hf.encode(t, add_special_tokens=False).ids for t in TEXTS] == [
        encoding.encode(t, allowed_special="all") for t in TEXTS]


def test_bad_input_is_one_line(encoding, tmp_path, capsys):
    import requests

    def offline(name):
        raise requests.ConnectionError("no network")

    with mock.patch("tiktoken.get_encoding", offline):
        assert main(["--encoding", "o200k_base", "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == ("tiktoken_to_hf: error: --encoding o200k_base: tiktoken could not load it "
                                       "(ConnectionError); download its .tiktoken file once where there is network "
                                       "(docs/cluster.md, \"3. The tokenizer\")\n")
    ok = str(tmp_path / "ok.tiktoken")
    write_ranks(encoding._mergeable_ranks, ok)
    lines = open(ok, "rb").read().splitlines(keepends=True)
    files = {"bad": b"not base64 at all\n", "rank": lines[0] + b"YQ== one\n", "b64": lines[0] + b"Y*== 7\n",
             "twice": b"".join(lines[:3]) + b"Yw== 1\n", "bytes": b"".join(lines[1:])}
    for name, text in files.items():
        (tmp_path / f"{name}.tiktoken").write_bytes(text)
    for argv, message in (
            ([str(tmp_path / "none.tiktoken")], f"--encoding {tmp_path}/none.tiktoken: no such file"),
            ([str(tmp_path / "bad.tiktoken")], f"--encoding {tmp_path}/bad.tiktoken: not a .tiktoken file (line 1: "
                                               "expected 'base64 rank')"),
            ([str(tmp_path / "rank.tiktoken")], f"--encoding {tmp_path}/rank.tiktoken: not a .tiktoken file (line 2: "
                                                "invalid literal for int()"),
            ([str(tmp_path / "b64.tiktoken")], f"--encoding {tmp_path}/b64.tiktoken: not a .tiktoken file (line 2: "),
            ([str(tmp_path / "twice.tiktoken")], f"--encoding {tmp_path}/twice.tiktoken: line 4 repeats rank 1 or its "
                                                 "token (line 2)"),
            ([str(tmp_path / "bytes.tiktoken")], f"--encoding {tmp_path}/bytes.tiktoken: byte 0 is not a token (1 of "
                                                 "the 256 bytes missing): not a byte-level BPE"),
            (["nope_base"], "--encoding nope_base: neither a file nor one of tiktoken's encodings "
                            f"({', '.join(tiktoken.list_encoding_names())})"),
            ([ok, "--like", "nope"], "--like nope: not one of tiktoken's encodings"),
            ([ok, "--special-token", "<|x|>=5"], "special token <|x|>=5: the id is already a token of the encoding's "
                                                 "ranks (--like, --special-token)"),
            ([ok, "--special-token", "nope"], "--special-token nope: expected NAME=ID")):
        assert main(["--encoding", *argv, "--output", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith(f"tiktoken_to_hf: error: {message}"), err
    assert not (tmp_path / "out").exists()
    with mock.patch("megatron_lev.hf.tiktoken_convert.named_encoding_parts", lambda name: (encoding._pat_str, {})):
        with pytest.raises(ValueError, match="no <\\|endoftext\\|> special token"):
            convert_tiktoken(ok, str(tmp_path / "out2"))


def test_check_refuses_a_tokenizer_whose_ids_differ(encoding, tmp_path):
    from megatron_lev.hf.tiktoken_convert import check_same_ids

    corpus = tmp_path / "check.jsonl"
    corpus.write_text(json.dumps({"text": "corpus"}) + "\n" + json.dumps({"text": "a<|endofprompt|>"}) + "\n")
    ranks, pattern, specials = encoding._mergeable_ranks, encoding._pat_str, encoding._special_tokens
    without_prompt = to_hf_tokenizer(ranks, pattern, {"<|endoftext|>": 199999})  # reads <|endofprompt|> as text
    as_text = encoding.encode("<|endofprompt|>", disallowed_special=())
    assert len(as_text) > 3
    with pytest.raises(ValueError) as error:
        check_same_ids(without_prompt, ranks, pattern, specials, str(corpus), 10)
    assert str(error.value) == (f"--check {corpus}:2: ids differ from tiktoken's at token 1 (tiktoken [200018], "
                                f"tokenizer.json {as_text[:3]})")
    assert check_same_ids(without_prompt, ranks, pattern, specials, str(corpus), 1) == (
        1, len(encoding.encode("corpus")))  # --check-documents 1: the first document only
    with pytest.raises(ValueError, match=f"^--check {tmp_path}/none.jsonl: no such file or directory$"):
        check_same_ids(without_prompt, ranks, pattern, specials, str(tmp_path / "none.jsonl"), 10)
    assert main(["--encoding", "o200k_base", "--output", str(tmp_path / "out"), "--check", str(corpus),
                 "--check-documents", "0"]) == 2
    assert not (tmp_path / "out").exists()
