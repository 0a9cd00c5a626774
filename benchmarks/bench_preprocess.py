"""Preprocessing throughput and memory against worker count, printed as JSON.

    python benchmarks/bench_preprocess.py --workers 1 2 --size-mb 200

Generates a Pile-format corpus of at least --size-mb MB (.jsonl.zst) from Python's own
text (pydoc topics, docstrings and the standard library's source, shuffled and repeated
with a fixed seed), trains a SentencePiece BPE tokenizer on part of it (or uses
--tokenizer-model), then runs megatron_lev.data.preprocess on it once per worker count,
in this process. For each run: documents/s, MB/s (uncompressed JSON input), tokens/s,
the speed-up against the first run (the baseline), and peak memory of the process tree
(PSS: shared pages counted once, so forked workers are not double-counted; and the
largest single process's RSS) sampled every 0.2 s, and CPU seconds used (MB per CPU
second does not depend on what else the machine is running; MB/s does). Also the reader alone (decompress +
cut into blocks), which bounds what any number of workers can reach.

The floor: the same documents' texts, already parsed into one Python list, tokenized by
one `SentencePieceProcessor.encode(texts, num_threads=workers)` call, timed in this
process next to each run (`floor_s`, `floor_cpu_s`). `vs_floor` = our wall time over the
floor's (target <= 1.15), `cpu_vs_floor` the same for CPU seconds (steadier on a
shared machine). Runs and floors are interleaved --repeats times; medians are reported.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lev.data.corpus import iter_blocks, python_corpus_records, read_documents, write_jsonl  # noqa: E402
from megatron_lev.data.preprocess import build_parser, preprocess  # noqa: E402
from megatron_lev.data.tokenizer import train_sentencepiece, training_sentences  # noqa: E402


def generate_corpus(path: str, size_mb: float, seed: int) -> dict:
    """Python's text, shuffled and repeated until the JSON lines reach size_mb MB."""
    base = list(python_corpus_records(sources=("pydoc_topics", "stdlib_docstrings", "stdlib_source")))
    base_bytes = sum(len(json.dumps(r, ensure_ascii=False).encode()) + 1 for r in base)
    rng = random.Random(seed)

    def records():
        written = 0
        while True:
            order = base[:]
            rng.shuffle(order)
            for record in order:
                if written >= size_mb * 1e6:
                    return
                written += len(json.dumps(record, ensure_ascii=False).encode()) + 1
                yield record

    documents = write_jsonl(path, records())
    return {"documents": documents, "distinct_documents": len(base), "distinct_mb": base_bytes / 1e6,
            "compressed_mb": os.path.getsize(path) / 1e6}


class PeakMemory:
    """Peak PSS of this process and its children, and the largest single RSS, while active."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.peak_pss = self.peak_rss = 0
        self._stop = threading.Event()

    def _sample(self):
        start = time.thread_time()
        me = psutil.Process()
        while not self._stop.is_set():
            pss = 0
            for proc in [me] + me.children(recursive=True):
                try:
                    info = proc.memory_full_info()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                pss += info.pss
                self.peak_rss = max(self.peak_rss, info.rss)
            self.peak_pss = max(self.peak_pss, pss)
            self._stop.wait(self.interval)
        self.cpu_s = time.thread_time() - start  # reading /proc/*/smaps is not preprocessing's cost

    def __enter__(self):
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the pool's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def digest(prefix: str) -> str:
    sha = hashlib.sha256()
    for suffix in (".bin", ".idx"):
        with open(prefix + suffix, "rb") as f:
            while chunk := f.read(1 << 24):
                sha.update(chunk)
    return sha.hexdigest()


def read_only_rate(path: str) -> float:
    start, nbytes = time.perf_counter(), 0
    for block in iter_blocks(path):
        nbytes += len(block.data)
    return nbytes / (time.perf_counter() - start) / 1e6


def corpus_texts(path: str) -> list[str]:
    return [record.texts[0] for record in read_documents(path)]


def time_floor(model: str, texts: list[str], threads: int) -> tuple[float, float]:
    """(wall s, CPU s) of one batch encode of every text: what the tokenizer alone costs."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    cpu, start = time.process_time(), time.perf_counter()
    sp.encode(texts, out_type=int, num_threads=threads)
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--size-mb", type=float, default=200)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--tokenizer-model", default=None, help="use this SentencePiece model instead of training")
    parser.add_argument("--work-dir", default=None, help="where the corpus and outputs go (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved run/floor pairs per worker count")
    args = parser.parse_args()

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_preprocess_")
    os.makedirs(work, exist_ok=True)
    corpus = os.path.join(work, f"python_{int(args.size_mb)}mb.jsonl.zst")
    t0 = time.perf_counter()
    corpus_info = generate_corpus(corpus, args.size_mb, args.seed)
    corpus_info["generate_s"] = round(time.perf_counter() - t0, 1)
    model = args.tokenizer_model
    if model is None:
        model = os.path.join(work, "bench_spm.model")
        texts = (r["text"] for r in python_corpus_records(sources=("pydoc_topics", "stdlib_docstrings", "stdlib_source")))
        train_sentencepiece(training_sentences(texts), model, args.vocab_size)

    report = {"benchmark": "preprocess", "cpus": os.cpu_count(), "corpus": corpus_info,
              "tokenizer": {"model": model, "vocab_size": args.vocab_size if args.tokenizer_model is None else None},
              "reader_only_MBps": round(read_only_rate(corpus), 1), "runs": []}
    baseline = None
    base_pss = psutil.Process().memory_full_info().pss
    texts = corpus_texts(corpus)
    for workers in args.workers:
        prefix = os.path.join(work, f"out_w{workers}", "bench")
        flags = build_parser().parse_args(["--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
                                           "SentencePieceTokenizer", "--tokenizer-model", model, "--append-eod",
                                           "--workers", str(workers), "--log-interval", "0"])
        ours, floors = [], []
        for _ in range(args.repeats):
            floors.append(time_floor(model, texts, workers))
            cpu_before = cpu_seconds()
            with PeakMemory() as memory:
                summary = preprocess(flags, log=io.StringIO())
            ours.append((summary.seconds, cpu_seconds() - cpu_before - memory.cpu_s))
        seconds = statistics.median(s for s, _ in ours)
        cpu = statistics.median(c for _, c in ours)
        floor_s = statistics.median(s for s, _ in floors)
        floor_cpu = statistics.median(c for _, c in floors)
        run = {"workers": workers, "seconds": round(seconds, 2),
               "docs_per_s": round(summary.documents / seconds, 1),
               "MBps": round(summary.bytes / seconds / 1e6, 2),
               "tokens_per_s": round(summary.tokens / seconds),
               "cpu_s": round(cpu, 1), "MB_per_cpu_s": round(summary.bytes / cpu / 1e6, 2),
               "floor_s": round(floor_s, 2), "floor_cpu_s": round(floor_cpu, 1),
               "vs_floor": round(seconds / floor_s, 3), "cpu_vs_floor": round(cpu / floor_cpu, 3),
               "documents": summary.documents, "tokens": summary.tokens,
               "peak_tree_pss_mb": round(memory.peak_pss / 2**20), "peak_tree_pss_over_idle_mb":
                   round((memory.peak_pss - base_pss) / 2**20), "peak_process_rss_mb": round(memory.peak_rss / 2**20)}
        baseline = baseline or run
        run["speedup_vs_first"] = round(run["MBps"] / baseline["MBps"], 2)
        report["runs"].append(run)
        print(json.dumps(run), file=sys.stderr, flush=True)
    report["outputs_identical"] = len({digest(os.path.join(work, f"out_w{w}", "bench_text_document"))
                                       for w in args.workers}) == 1
    report["work_dir"] = work
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
