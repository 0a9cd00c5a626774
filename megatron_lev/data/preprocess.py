"""JSON-lines corpora (The Pile) -> megatron-core indexed datasets (.bin/.idx).

    python tools/preprocess_data.py --input /data/pile/train/00.jsonl.zst \
        --output-prefix /data/pile_00 --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model tok.model --append-eod --workers 32

writes `/data/pile_00_text_document.{bin,idx}` (one `{prefix}_{key}_document` per
--json-keys key; with --split-by-key meta.pile_set_name, one
`{prefix}_{subset}_{key}_document` per Pile subset) plus a `.stats.json` beside each
(documents, tokens, highest token id, tokenizer), which training reads instead of
scanning the .bin.

How it runs (this file is the main side; encode.py the workers'): the main process streams the inputs (decompressing .zst/.gz on the fly) and
cuts them into blocks of whole lines (--chunk-size-mb). A pool of --workers processes
parses, validates and tokenizes a block at a time, each writing the block's documents to
its own shard with megatron-core's IndexedDatasetBuilder. The main process appends the
shards to the outputs with `add_index` in block order, as they finish, and deletes
them. So the output is identical whatever the number of workers, at most
`workers + 2` blocks are in flight (memory stays bounded however large the input), and
merging overlaps tokenizing.

Bad input is skipped, counted and reported with file:line for the first few
(--strict: fail instead). Everything is written in a temporary folder beside the
outputs and renamed into place only when the whole run succeeded.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, get_bin_path, get_idx_path

from megatron_lev.data import encode
from megatron_lev.data.corpus import BAD_KINDS, BadCase, expand_inputs, iter_blocks
from megatron_lev.data.encode import (BlockResult, CompactIndexedDatasetBuilder, EncodeOptions, _init_worker,
                                      encode_block)
from megatron_lev.data.tokenizer import TOKENIZER_TYPES, build_tokenizer
from megatron_lev.utils.flags import MegatronArgumentParser, add_compat_flags, tokenizer_flags_error, warn_ignored


class PreprocessError(RuntimeError):
    """A run that cannot start or must stop; the message names the flag or file:line."""


class PreprocessInterrupted(BaseException):
    """SIGTERM/SIGINT arrived: workers are stopped and the temporary folder removed on the
    way out (BaseException: no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# Damaged compressed input: an error unless --allow-truncated.
DAMAGED_KINDS = ("truncated", "corrupt")


# ---------------------------------------------------------------------------------------
# Main side


@dataclass
class OutputStats:
    prefix: str
    documents: int = 0
    tokens: int = 0
    max_token_id: int = -1


@dataclass
class PreprocessSummary:
    documents: int
    tokens: int
    bytes: int
    seconds: float
    bad_counts: dict[str, int]
    bad_examples: list[BadCase]
    outputs: dict[tuple[str | None, str], OutputStats]  # (subset, key) -> final prefix and counts
    split_documents: int = 0  # documents over ENCODE_BATCH_CHARS characters, tokenized in pieces

    @property
    def skipped(self) -> int:
        return sum(self.bad_counts.values())


def subset_file_name(subset: str) -> str:
    """A Pile subset name as a file-name part: "DM Mathematics" -> "DM_Mathematics"."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", subset).strip("_") or "unnamed"


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}P"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


class _Progress:
    def __init__(self, files: list[str], log_interval: int, stream):
        self.sizes = {p: os.path.getsize(p) for p in files}
        self.before = {}  # compressed bytes of the files before each one
        total = 0
        for p in files:
            self.before[p] = total
            total += self.sizes[p]
        self.total = total
        self.log_interval = log_interval
        self.stream = stream
        self.start = time.monotonic()
        self.documents = self.tokens = self.bytes = 0
        self.next_log = log_interval
        self.position = 0

    def update(self, result: BlockResult) -> None:
        self.documents += result.documents
        self.tokens += result.tokens
        self.bytes += result.nbytes
        self.position = self.before[result.path] + result.end_offset
        if self.log_interval and self.documents >= self.next_log:
            self.next_log = (self.documents // self.log_interval + 1) * self.log_interval
            print(self.line(), file=self.stream, flush=True)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        text = (f"processed {self.documents} documents ({self.documents / elapsed:.1f} docs/s, "
                f"{self.bytes / elapsed / 1e6:.2f} MB/s, {_human(self.tokens / elapsed)} tokens/s)")
        if self.total and self.position:
            fraction = min(self.position / self.total, 1.0)
            eta = elapsed * (1 - fraction) / fraction
            text += f", {fraction:.1%} of {self.total / 1e9:.2f} GB read, ETA {_duration(eta)}"
        return text


def _output_prefix(prefix: str, subset: str | None, key: str) -> str:
    name = key if subset is None else f"{subset_file_name(subset)}_{key}"
    return f"{prefix}_{name}_document"


def _make_work_dir(output_prefix: str) -> str:
    folder = os.path.dirname(os.path.abspath(output_prefix))
    parent = folder
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise PreprocessError(f"--output-prefix {output_prefix}: {parent} is a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
        return tempfile.mkdtemp(prefix=f".{os.path.basename(output_prefix)}.tmp-", dir=folder)
    except OSError as exc:
        raise PreprocessError(f"--output-prefix {output_prefix}: cannot write to folder {folder}: "
                              f"{exc.strerror or exc}") from None


def preprocess(args: argparse.Namespace, log=sys.stderr) -> PreprocessSummary:
    """Run the whole preprocessing job described by parsed flags (see build_parser)."""
    try:
        files = expand_inputs(args.input)
        tokenizer = build_tokenizer(*tokenizer_flags(args))
    except (FileNotFoundError, ValueError) as exc:
        raise PreprocessError(str(exc)) from None
    if args.workers < 1:
        raise PreprocessError(f"--workers {args.workers}: must be at least 1")
    if args.chunk_size_mb <= 0:
        raise PreprocessError(f"--chunk-size-mb {args.chunk_size_mb}: must be positive")
    keys = tuple(args.json_keys)
    if len(set(keys)) != len(keys):
        raise PreprocessError(f"--json-keys {' '.join(keys)}: a key is repeated")
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    with _signals_interrupt():
        work_dir = _make_work_dir(args.output_prefix)
        try:
            return _run(args, files, tokenizer, keys, dtype, work_dir, log)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)


class _signals_interrupt:
    """SIGTERM (Slurm's scancel, the time limit) and SIGINT raise PreprocessInterrupted in
    the main thread, once: the clean-up that follows is not interrupted again. Installed
    only in the main thread (signal handlers can only be set there)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __enter__(self):
        self.previous = {}
        self.received = None
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signum
            raise PreprocessInterrupted(signum)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _run(args, files, tokenizer, keys, dtype, work_dir, log) -> PreprocessSummary:
    shard_dir = os.path.join(work_dir, "shards")
    os.makedirs(shard_dir)
    # Workers keep at least one example per block so --strict can name the file:line.
    opts = EncodeOptions(keys, args.split_by_key, args.append_eod, dtype, shard_dir, max(1, args.max_bad_reports))
    progress = _Progress(files, args.log_interval, log)
    builders: dict[tuple[str | None, str], CompactIndexedDatasetBuilder] = {}
    outputs: dict[tuple[str | None, str], OutputStats] = {}
    subset_names: dict[str, str] = {}  # file-name part -> subset, to catch two subsets sharing one
    bad_counts: collections.Counter = collections.Counter()
    bad_examples: list[BadCase] = []
    split_documents = 0
    print(f"preprocessing {len(files)} file(s), {progress.total / 1e9:.2f} GB, keys {list(keys)}, "
          f"{args.workers} worker(s), dtype {np.dtype(dtype).name}, tokenizer {tokenizer.describe()}",
          file=log, flush=True)

    def merge(result: BlockResult) -> None:
        nonlocal split_documents
        if args.strict and result.bad_examples:
            raise PreprocessError(f"{result.bad_examples[0]} (--strict)")
        damaged = [case for case in result.bad_examples if case.kind in DAMAGED_KINDS]
        if damaged and not args.allow_truncated:
            raise PreprocessError(f"{damaged[0]}: the file is damaged and its tail would be missing from the "
                                  "output; re-download it, or pass --allow-truncated to keep its readable lines")
        split_documents += result.split_documents
        for case in result.bad_examples:
            if len(bad_examples) < args.max_bad_reports:
                bad_examples.append(case)
                print(f"warning: skipped {case}", file=log, flush=True)
        bad_counts.update(result.bad_counts)
        for subset, shard_prefixes in result.shards.items():
            if subset is not None:
                other = subset_names.setdefault(subset_file_name(subset), subset)
                if other != subset:
                    raise PreprocessError(f"--split-by-key {args.split_by_key}: subsets {other!r} and {subset!r} "
                                          f"would share the file name {subset_file_name(subset)!r}")
            for key, shard in zip(keys, shard_prefixes):
                if (subset, key) not in builders:
                    final = _output_prefix(args.output_prefix, subset, key)
                    outputs[(subset, key)] = OutputStats(final)
                    tmp = os.path.join(work_dir, os.path.basename(final))
                    builders[(subset, key)] = CompactIndexedDatasetBuilder(get_bin_path(tmp), dtype=dtype)
                builders[(subset, key)].add_index(shard)
                os.remove(get_bin_path(shard))
                os.remove(get_idx_path(shard))
                stats, (documents, tokens, highest) = outputs[(subset, key)], result.shard_stats[(subset, key)]
                stats.documents += documents
                stats.tokens += tokens
                stats.max_token_id = max(stats.max_token_id, highest)
        progress.update(result)

    def tasks():
        index = 0
        for path in files:
            for block in iter_blocks(path, int(args.chunk_size_mb * (1 << 20))):
                yield index, block, opts
                index += 1

    if args.workers == 1:
        for task in tasks():
            merge(encode_block(*task, tokenizer=tokenizer))
    else:
        # fork: workers start in milliseconds (no re-import of torch/megatron-core).
        # ProcessPoolExecutor rather than multiprocessing.Pool: a worker that dies (OOM
        # kill) fails the run with BrokenProcessPool instead of hanging it forever.
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        max_in_flight = args.workers + 2
        pool = ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context(method),
                                   initializer=_init_worker, initargs=tokenizer_flags(args))
        try:
            in_flight = collections.deque()
            for task in tasks():
                in_flight.append(pool.submit(encode_block, *task))
                while len(in_flight) >= max_in_flight or (in_flight and in_flight[0].done()):
                    merge(in_flight.popleft().result())
            while in_flight:
                merge(in_flight.popleft().result())
        except BrokenProcessPool as exc:
            _stop_workers(pool)
            raise PreprocessError(f"a worker process died ({exc}); if it was killed for memory, "
                                  "lower --workers or --chunk-size-mb") from None
        except BaseException:  # an error or a signal: nothing running is needed any more
            _stop_workers(pool)
            raise
        pool.shutdown(wait=True)

    if not builders:
        raise PreprocessError(f"--input {' '.join(args.input)}: no valid documents "
                              f"({sum(bad_counts.values())} skipped)")
    for (subset, key), builder in builders.items():
        tmp = os.path.join(work_dir, os.path.basename(outputs[(subset, key)].prefix))
        builder.finalize(get_idx_path(tmp))
        stats = outputs[(subset, key)]
        with open(tmp + ".stats.json", "w", encoding="utf-8") as f:
            json.dump({"documents": stats.documents, "tokens": stats.tokens, "max_token_id": stats.max_token_id,
                       "dtype": np.dtype(dtype).name, "json_key": key, "subset": subset,
                       "append_eod": args.append_eod, "tokenizer": tokenizer.describe(),
                       "bin_bytes": os.path.getsize(get_bin_path(tmp))}, f, indent=1)
    # All outputs complete: move them into place, every .idx last (a prefix is only
    # usable, and a job only looks done, once its .idx exists).
    for suffixes in ((".bin", ".stats.json"), (".idx",)):
        for stats in outputs.values():
            tmp = os.path.join(work_dir, os.path.basename(stats.prefix))
            for suffix in suffixes:
                os.replace(tmp + suffix, stats.prefix + suffix)
    elapsed = time.monotonic() - progress.start
    summary = PreprocessSummary(progress.documents, progress.tokens, progress.bytes, elapsed,
                                dict(bad_counts), bad_examples, outputs, split_documents)
    _print_summary(summary, dtype, log)
    return summary


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """End the pool's worker processes now (SIGTERM, then wait for them): none is left
    running, or orphaned, once the run has failed or was interrupted. Then wait for the
    pool's manager thread to finish closing its wake-up pipe: on Python 3.11 the exit hook
    that wakes that thread can write to the pipe while the thread closes it, and the exit
    ends in "OSError: [Errno 9] Bad file descriptor" after our error line (CPython
    gh-125451: the fix reached 3.12 and 3.13, not 3.11)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join()
    if manager is not None:
        # The workers are gone, so the thread sees them die and winds up at once.
        manager.join(timeout=30)


def _print_summary(s: PreprocessSummary, dtype, log) -> None:
    rate = max(s.seconds, 1e-9)
    print(f"done: {s.documents} documents, {s.tokens} tokens, {s.bytes / 1e6:.1f} MB in {s.seconds:.1f}s "
          f"({s.documents / rate:.1f} docs/s, {s.bytes / rate / 1e6:.2f} MB/s, {_human(s.tokens / rate)} tokens/s)",
          file=log)
    if s.split_documents:
        print(f"note: {s.split_documents} document(s) over {encode.ENCODE_BATCH_CHARS} characters were tokenized in "
              "pieces cut at line ends (memory stays bounded; tokens at a cut may differ from one whole encode)",
              file=log)
    if s.skipped:
        kinds = ", ".join(f"{k} {s.bad_counts[k]}" for k in BAD_KINDS if s.bad_counts.get(k))
        print(f"skipped {s.skipped} bad record(s): {kinds}", file=log)
    for stats in s.outputs.values():
        print(f"wrote {stats.prefix}.{{bin,idx}}: {stats.documents} documents, {stats.tokens} tokens, "
              f"{np.dtype(dtype).name}", file=log)
    log.flush()


# Megatron-LM tools/preprocess_data.py flags (core_v0.16.1) with no work to do here, or that cannot apply.
PREPROCESS_IGNORED = {
    "--partitions": (1, "input files are split into blocks for --workers already; outputs are merged once"),
    "--keep-newlines": (0, "newlines are always kept (it matters only with --split-sentences)"),
    "--keep-sequential-samples": (0, "documents are always written in input order"),
    "--lang": (1, "only used by --split-sentences"),
}

PREPROCESS_REFUSED = {
    "--split-sentences": (0, "sentence splitting (nltk punkt) is for BERT-style sentence datasets; GPT "
                             "pre-training uses whole documents"),
}


def tokenizer_flags(args: argparse.Namespace) -> tuple:
    """build_tokenizer's arguments from the flags (GPT2BPETokenizer: --vocab-file/--merge-file,
    the others --tokenizer-model), each checked for the type that needs it."""
    problem = tokenizer_flags_error(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
    if problem:
        raise PreprocessError(problem)
    return args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file


PREPROCESS_OWN_FLAGS = ("--split-by-key", "--chunk-size-mb", "--strict", "--max-bad-reports", "--allow-truncated")


def build_parser() -> argparse.ArgumentParser:
    p = MegatronArgumentParser(prog="preprocess_data.py", description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True,
                   help="files, globs or directories of .jsonl/.json/.jsonl.zst/.json.zst/.jsonl.gz/.json.gz")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to tokenize; each gets its own dataset (dotted paths like meta.title work)")
    g.add_argument("--split-by-key", default=None, metavar="KEY",
                   help="write one dataset per value of this key, e.g. meta.pile_set_name")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=sorted(TOKENIZER_TYPES))
    g.add_argument("--tokenizer-model", help="SentencePiece .model, or a Hugging Face tokenizer.json or folder")
    g.add_argument("--vocab-file", help="GPT2BPETokenizer: GPT-2's vocab.json (e.g. gpt2-vocab.json)")
    g.add_argument("--merge-file", help="GPT2BPETokenizer: GPT-2's merges.txt (e.g. gpt2-merges.txt)")
    g.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True)
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    g.add_argument("--chunk-size-mb", type=float, default=8.0,
                   help="input block handed to a worker; memory is about (workers + 2) x 3 x this")
    g.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    g.add_argument("--strict", action="store_true", help="fail on the first bad record instead of skipping it")
    g.add_argument("--max-bad-reports", type=int, default=10, help="bad records reported with file:line")
    g.add_argument("--allow-truncated", action="store_true",
                   help="keep the readable lines of a truncated or corrupt .gz/.zst file (reported) instead of "
                        "failing the run")
    add_compat_flags(p, PREPROCESS_IGNORED, PREPROCESS_REFUSED)
    return p


def main(argv: list[str] | None = None) -> PreprocessSummary:
    args = build_parser().parse_args(argv)
    warn_ignored("preprocess_data.py", vars(args).pop("ignored_flags", ()), PREPROCESS_IGNORED)
    try:
        return preprocess(args)
    except PreprocessError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except PreprocessInterrupted as exc:
        print(f"error: interrupted by {exc}: workers stopped, temporary files removed, no output written",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + exc.signum) from None
