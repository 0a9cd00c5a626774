"""tools/preprocess_data.py: round trip, determinism across workers, bad input, failures."""
import gzip
import json
import os

import numpy as np
import pytest
import zstandard
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from megatron_lev.data.corpus import read_documents
from megatron_lev.data.encode import CompactIndexedDatasetBuilder
from megatron_lev.data.preprocess import PreprocessError, main
from megatron_lev.data.tokenizer import build_tokenizer
from tests.fixtures import run_preprocess


@pytest.fixture(scope="module")
def tokenizer(spm_tokenizer):
    return build_tokenizer("SentencePieceTokenizer", spm_tokenizer)


@pytest.fixture(scope="module")
def corpus_records(python_corpus):
    return [{"text": r.texts[0], "meta": {"pile_set_name": r.subset}}
            for r in read_documents(python_corpus, split_key="meta.pile_set_name")]


def write_lines(path, lines: list[bytes]):
    data = b"".join(line + b"\n" for line in lines)
    if path.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    elif path.endswith(".gz"):
        data = gzip.compress(data)
    with open(path, "wb") as f:
        f.write(data)


def encode(record: dict) -> bytes:
    return json.dumps(record, ensure_ascii=False).encode("utf-8")


def documents(prefix: str) -> list[list[int]]:
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def output_files(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_round_trip_formats_and_keys(tmp_path, corpus_records, tokenizer, spm_tokenizer):
    # Three formats in one directory (read in name order), two keys plus a dotted one.
    records = [dict(r, title=r["text"].split("\n", 1)[0]) for r in corpus_records[70:160]]
    inputs = tmp_path / "in"
    inputs.mkdir()
    parts = {"a.jsonl": records[:30], "b.jsonl.zst": records[30:60], "c.jsonl.gz": records[60:]}
    for name, part in parts.items():
        write_lines(str(inputs / name), [encode(r) for r in part])
    prefix = str(tmp_path / "out" / "rt")
    keys = ("text", "title", "meta.pile_set_name")
    summary, _ = run_preprocess(str(inputs), prefix, spm_tokenizer, "--append-eod", "--json-keys", *keys,
                                "--chunk-size-mb", "0.02")
    assert summary.documents == len(records) and summary.skipped == 0
    for key in keys:
        out = f"{prefix}_{key}_document"
        dataset = IndexedDataset(out)
        assert dataset.index.dtype == np.uint16
        # One sequence per document; boundaries in the .idx are the documents'.
        assert dataset.document_indices.tolist() == list(range(len(records) + 1))
        expected = []
        for r in records:
            value = r["meta"]["pile_set_name"] if key == "meta.pile_set_name" else r[key]
            expected.append(tokenizer.tokenize(value) + [tokenizer.eod])
        assert dataset.sequence_lengths.tolist() == [len(e) for e in expected]
        assert documents(out) == expected
        stats = json.load(open(out + ".stats.json"))
        assert stats["documents"] == len(records) and stats["tokens"] == sum(map(len, expected))
        assert stats["max_token_id"] == max(max(e) for e in expected)
    # Without --append-eod the documents are exactly the tokenizer's output.
    run_preprocess(str(inputs / "a.jsonl"), prefix + "_noeod", spm_tokenizer)
    assert documents(f"{prefix}_noeod_text_document") == [tokenizer.tokenize(r["text"]) for r in records[:30]]


def test_two_workers_byte_identical_to_one(tmp_path, python_corpus, spm_tokenizer, corpus_records):
    outputs = {}
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}" / "py")
        summary, log = run_preprocess(python_corpus, prefix, spm_tokenizer, "--append-eod", "--workers", str(workers),
                                      "--chunk-size-mb", "0.05", "--split-by-key", "meta.pile_set_name",
                                      "--log-interval", "100")
        assert summary.documents == len(corpus_records)
        assert "docs/s" in log and "MB/s" in log and "tokens/s" in log and "ETA" in log
        outputs[workers] = {name: (tmp_path / f"w{workers}" / name).read_bytes()
                            for name in output_files(tmp_path / f"w{workers}")}
    assert sorted(outputs[1]) == ["py_pydoc_topics_text_document." + s for s in ("bin", "idx", "stats.json")] + \
        ["py_stdlib_docstrings_text_document." + s for s in ("bin", "idx", "stats.json")]
    assert outputs[1] == outputs[2]
    # Per-subset datasets hold each subset's documents, in corpus order.
    counts = {s: sum(r["meta"]["pile_set_name"] == s for r in corpus_records)
              for s in ("pydoc_topics", "stdlib_docstrings")}
    for subset, count in counts.items():
        assert len(IndexedDataset(str(tmp_path / "w2" / f"py_{subset}_text_document"))) == count


BAD_CASES = {
    # kind: (raw line, expected message fragment)
    "malformed_json": (b'{"text": "unterminated', "Unterminated string"),
    "missing_key": (b'{"body": "no text key here"}', "no key 'text'"),
    "non_string_key": (b'{"text": 12345}', "is int"),
    "invalid_utf8": (b'{"text": "bad \xff\xfe bytes"}', "invalid start byte"),
    "empty_document": (b'{"text": "   \\n  "}', "is empty"),
}


def truncated_zst(path: str, lines: list[bytes]) -> None:
    data = zstandard.ZstdCompressor().compress(b"".join(line + b"\n" for line in lines))
    with open(path, "wb") as f:
        f.write(data[: len(data) * 2 // 3])


def test_bad_input_counted_and_reported(tmp_path, tokenizer, spm_tokenizer):
    good = iter(encode({"text": f"document number {i}: some text."}) for i in range(100))
    lines = [next(good), next(good)]
    expected_lines = {}
    for kind, (raw, _) in BAD_CASES.items():
        lines.append(raw)
        expected_lines[kind] = len(lines)
        lines.append(next(good))  # good documents between the bad ones
    lines.append(b"")  # a blank line is no document and no error
    lines.append(b'{"text": "lone \\ud800 surrogate"}')
    folder = tmp_path / "in"
    folder.mkdir()
    write_lines(str(folder / "a.jsonl"), lines)
    # A .zst cut mid-frame: its readable lines are kept, the cut is reported.
    # (zstd decodes whole 128 KB blocks: ~600 KB of varied text spans several)
    rng = np.random.default_rng(0)
    zst_lines = [encode({"text": f"compressed document {i}: " + " ".join(map(str, rng.integers(0, 10**6, 40)))})
                 for i in range(2000)]
    truncated_zst(str(folder / "b.jsonl.zst"), zst_lines)
    gz = gzip.compress(b"".join(line + b"\n" for line in zst_lines[:50]))
    (folder / "c.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    prefix = str(tmp_path / "out" / "bad")
    summary, log = run_preprocess(str(folder), prefix, spm_tokenizer, "--append-eod", "--allow-truncated")
    assert summary.bad_counts == {"malformed_json": 1, "missing_key": 1, "non_string_key": 1, "invalid_utf8": 2,
                                  "empty_document": 1, "truncated": 2}
    assert "skipped 8 bad record(s)" in log and "done: " in log
    where = {(case.kind, case.line) for case in summary.bad_examples if case.path.endswith("a.jsonl")}
    assert where >= {(kind, line) for kind, line in expected_lines.items()}
    for kind, line in expected_lines.items():
        reported = [text for text in log.splitlines() if f"a.jsonl:{line}: {kind}: " in text]
        assert len(reported) == 1 and reported[0].startswith("warning: skipped ") and BAD_CASES[kind][1] in reported[0]
    assert "lone surrogate" in log and "b.jsonl.zst" in log and "truncated" in log
    # Every good document survives, in order: a.jsonl's, then the whole lines of the cut
    # .zst and .gz files; each cut is reported at the first line that did not arrive whole.
    good_a = [json.loads(line)["text"] for line in lines if line.startswith(b'{"text": "document')]
    cut_at = {os.path.basename(c.path): c.line for c in summary.bad_examples if c.kind == "truncated"}
    whole_zst, whole_gz = cut_at["b.jsonl.zst"] - 1, cut_at["c.jsonl.gz"] - 1
    assert 500 < whole_zst < 2000 and 0 < whole_gz < 50
    expected = [t for t in good_a] + [json.loads(zst_lines[i])["text"] for i in range(whole_zst)] + \
        [json.loads(zst_lines[i])["text"] for i in range(whole_gz)]
    assert documents(f"{prefix}_text_document") == [tokenizer.tokenize(t) + [tokenizer.eod] for t in expected]


def _die_in_worker(*args, **kwargs):
    os._exit(9)  # as if the kernel killed the worker for memory


def test_dead_worker_fails_the_run_cleanly(tmp_path, python_corpus, spm_tokenizer, monkeypatch):
    from megatron_lev.data import preprocess

    monkeypatch.setattr(preprocess, "encode_block", _die_in_worker)  # forked workers inherit it
    out = tmp_path / "out"
    with pytest.raises(PreprocessError, match="a worker process died"):
        run_preprocess(python_corpus, str(out / "p"), spm_tokenizer, "--workers", "2")
    assert output_files(out) == []


def test_stopping_workers_waits_for_the_pools_manager_thread():
    """After _stop_workers the pool's manager thread has ended and closed its wake-up pipe,
    so Python 3.11's exit hook cannot write to a pipe that thread is closing (the race that
    ended an interrupted run in "OSError: [Errno 9] Bad file descriptor")."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor

    from megatron_lev.data.preprocess import _stop_workers

    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"))
    futures = [pool.submit(time.sleep, 300) for _ in range(4)]
    deadline = time.time() + 60
    while sum(f.running() for f in futures) < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert sum(f.running() for f in futures) >= 2, "the pool never started its work"
    processes, manager = list(pool._processes.values()), pool._executor_manager_thread
    wakeup = manager.thread_wakeup
    _stop_workers(pool)
    assert [p.exitcode for p in processes] == [-15, -15]
    assert not manager.is_alive() and wakeup._closed
    assert all(f.done() for f in futures)


@pytest.mark.parametrize("kind", [*BAD_CASES, "truncated", "missing_split_key"])
def test_strict_fails_and_leaves_no_output(tmp_path, spm_tokenizer, kind):
    folder = tmp_path / "in"
    folder.mkdir()
    good = [encode({"text": f"good document {i} " + "text " * 200, "meta": {"pile_set_name": "A"}})
            for i in range(300)]
    extra = []
    if kind == "truncated":
        truncated_zst(str(folder / "a.jsonl.zst"), good)
        where = "a.jsonl.zst:"
    else:
        raw = encode({"text": "no subset"}) if kind == "missing_split_key" else BAD_CASES[kind][0]
        write_lines(str(folder / "a.jsonl"), good + [raw])  # bad line far past the first chunk
        where = f"a.jsonl:{len(good) + 1}: {kind}"
        extra = ["--split-by-key", "meta.pile_set_name"] if kind == "missing_split_key" else []
    out = tmp_path / "out"
    out.mkdir()
    # A complete earlier run's outputs must survive a failed run untouched.
    (out / "old_text_document.bin").write_bytes(b"previous")
    with pytest.raises(PreprocessError, match=f"{where}.*--strict"):
        run_preprocess(str(folder), str(out / "new"), spm_tokenizer, "--strict", "--chunk-size-mb", "0.05", *extra)
    assert output_files(out) == ["old_text_document.bin"]  # no partial output, no temp folder
    assert (out / "old_text_document.bin").read_bytes() == b"previous"


def test_clear_errors_before_any_work(tmp_path, python_corpus, spm_tokenizer, capsys):
    common = ["--input", python_corpus, "--tokenizer-type", "SentencePieceTokenizer", "--workers", "1"]
    with pytest.raises(SystemExit) as exit_info:
        main(common[:4] + ["--tokenizer-model", str(tmp_path / "missing.model"),
                           "--output-prefix", str(tmp_path / "x")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "error: --tokenizer-model" in err and "missing.model: no such file" in err
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(PreprocessError) as error:
        run_preprocess(python_corpus, str(blocker / "sub" / "prefix"), spm_tokenizer)
    assert str(error.value) == f"--output-prefix {blocker / 'sub' / 'prefix'}: {blocker} is a file, not a folder"
    with pytest.raises(PreprocessError, match="--input .*no such file"):
        run_preprocess(str(tmp_path / "nope.jsonl"), str(tmp_path / "p"), spm_tokenizer)
    with pytest.raises(PreprocessError, match="--tokenizer-model .*no such file"):
        run_preprocess(python_corpus, str(tmp_path / "p"), str(tmp_path / "missing.model"))
    assert not any(name.startswith(".") for name in os.listdir(tmp_path))


def test_compact_builder_writes_megatron_builders_bytes(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, size=int(n)).tolist() for n in rng.integers(1, 50, size=200)]
    for name, cls in (("stock", IndexedDatasetBuilder), ("compact", CompactIndexedDatasetBuilder)):
        part = cls(str(tmp_path / f"{name}_part.bin"), dtype=np.uint16)
        for doc in docs[100:]:
            part.add_document(doc, [len(doc)])
        part.finalize(str(tmp_path / f"{name}_part.idx"))
        whole = cls(str(tmp_path / f"{name}.bin"), dtype=np.uint16)
        for doc in docs[:100]:
            whole.add_document(doc, [len(doc)])
        whole.add_index(str(tmp_path / f"{name}_part"))
        whole.finalize(str(tmp_path / f"{name}.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"stock{suffix}").read_bytes() == (tmp_path / f"compact{suffix}").read_bytes()
    assert documents(str(tmp_path / "compact")) == docs


def test_damaged_compressed_input_fails_unless_allowed(tmp_path, spm_tokenizer, capsys):
    """A truncated .zst/.gz would silently shorten the shard: one error line naming the
    file:line and --allow-truncated, exit 1, no output (the Slurm array task fails)."""
    rng = np.random.default_rng(1)
    lines = [encode({"text": f"doc {i}: " + " ".join(map(str, rng.integers(0, 10**6, 40)))}) for i in range(2000)]
    zst = tmp_path / "a.jsonl.zst"
    truncated_zst(str(zst), lines)
    out = tmp_path / "out"
    with pytest.raises(PreprocessError) as error:
        run_preprocess(str(zst), str(out / "z"), spm_tokenizer, "--workers", "2")
    assert f"{zst}:" in str(error.value) and ": truncated: zstd stream ends mid-frame" in str(error.value)
    assert str(error.value).endswith("pass --allow-truncated to keep its readable lines")
    gz = tmp_path / "b.jsonl.gz"
    data = gzip.compress(b"".join(line + b"\n" for line in lines[:50]))
    gz.write_bytes(data[: len(data) // 2])
    with pytest.raises(SystemExit) as exit_info:
        main(["--input", str(gz), "--output-prefix", str(out / "g"), "--tokenizer-type", "SentencePieceTokenizer",
              "--tokenizer-model", spm_tokenizer, "--workers", "1", "--log-interval", "0"])
    assert exit_info.value.code == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and f"{gz}:" in err[0] and "truncated .gz file" in err[0] and "--allow-truncated" in err[0]
    assert output_files(out) == []  # no output, no temporary folder


# Workers that never finish a block: the run is still in full flight when the signal comes.
_SLOW_WORKERS = """
import sys, time
from megatron_lev.data import preprocess
def slow_block(*args, **kwargs):
    time.sleep(300)
preprocess.encode_block = slow_block
preprocess.main(sys.argv[1:])
"""


def test_signal_stops_workers_and_removes_temporary_folder(tmp_path, python_corpus, spm_tokenizer):
    """SIGTERM (scancel) or SIGINT (Ctrl-C) to preprocess_data.py: the pool's workers are
    ended, the hidden temporary folder is removed, exit code 128 + signal, one error line."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    procs = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        out = tmp_path / sig.name
        out.mkdir()
        cmd = [sys.executable, "-c", _SLOW_WORKERS, "--input", python_corpus, "--output-prefix", str(out / "p"),
               "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", spm_tokenizer,
               "--workers", "2", "--chunk-size-mb", "0.01"]
        procs[sig] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = {}
        deadline = time.time() + 240
        for sig, proc in procs.items():
            while time.time() < deadline and proc.poll() is None:
                children = psutil.Process(proc.pid).children()
                if len(children) == 2 and os.listdir(tmp_path / sig.name):
                    workers[sig] = children
                    break
                time.sleep(0.2)
            assert sig in workers, proc.communicate(timeout=60)
        assert all(name.startswith(".p.tmp-") for sig in procs for name in os.listdir(tmp_path / sig.name))
        for sig, proc in procs.items():
            proc.send_signal(sig)
        for sig, proc in procs.items():
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 128 + sig, err
            assert err.strip().splitlines()[-1] == (f"error: interrupted by {sig.name}: workers stopped, temporary "
                                                    "files removed, no output written")
            assert os.listdir(tmp_path / sig.name) == []
            for worker in workers[sig]:
                assert not worker.is_running(), (sig.name, worker.pid)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


def test_huge_document_tokenized_in_bounded_pieces(tmp_path, tokenizer, spm_tokenizer, monkeypatch):
    """A document longer than ENCODE_BATCH_CHARS never reaches the tokenizer whole (its
    working memory grows ~40 bytes a character): it goes in pieces cut at line ends,
    concatenated into one document, and the run reports it. Normal documents are
    unchanged; no tokenizer call holds more than two pieces' worth of characters."""
    from megatron_lev.data import encode as workers
    from megatron_lev.data.tokenizer import SentencePieceTokenizer

    limit = 2000
    monkeypatch.setattr(workers, "ENCODE_BATCH_CHARS", limit)
    calls = []
    batch, single = SentencePieceTokenizer.tokenize_batch, SentencePieceTokenizer.tokenize
    monkeypatch.setattr(SentencePieceTokenizer, "tokenize_batch",
                        lambda self, texts, **kw: calls.append(sum(map(len, texts))) or batch(self, texts, **kw))
    monkeypatch.setattr(SentencePieceTokenizer, "tokenize", lambda self, text: calls.append(len(text)) or single(self, text))
    huge = "".join(f"line {i}: def f(x): return x * {i}\n" for i in range(400))  # ~12k characters
    small = [f"small document {i}: " + "text " * 30 for i in range(60)]
    path = tmp_path / "in.jsonl"
    write_lines(str(path), [encode({"text": t}) for t in small[:30] + [huge] + small[30:]])
    summary, log = run_preprocess(str(path), str(tmp_path / "out" / "h"), spm_tokenizer, "--append-eod")
    assert summary.split_documents == 1 and "note: 1 document(s) over 2000 characters" in log
    pieces = workers.split_long_text(huge)
    assert "".join(pieces) == huge and len(pieces) == 7 and all(p.endswith("\n") for p in pieces)
    assert max(map(len, pieces)) <= limit
    expected = [tokenizer.tokenize(t) + [tokenizer.eod] for t in small[:30]]
    expected.append([i for p in pieces for i in tokenizer.tokenize(p)] + [tokenizer.eod])
    expected += [tokenizer.tokenize(t) + [tokenizer.eod] for t in small[30:]]
    assert documents(str(tmp_path / "out" / "h_text_document")) == expected
    assert len(huge) > 5 * limit and max(calls) <= 2 * limit
