"""Pile-format corpora: find the input files, stream them, validate each record, write them.

One reader serves every tool (preprocess_data.py, train_tokenizer.py, the tests):

    for doc in read_documents(["pile/00.jsonl.zst"], keys=("text",), on_bad=report):
        doc.texts[0], doc.subset, doc.path, doc.line

Underneath, `iter_blocks(path)` streams a file in blocks of whole lines (decompressing
`.zst`/`.gz` as it goes, so memory stays bounded whatever the file size) and
`iter_block_records(block, keys)` turns a block into validated records. The preprocess
workers get raw blocks and run `iter_block_records` themselves, so parsing happens in
parallel and the main process only reads and decompresses.

Bad input never raises from the reader: each case comes back as a `BadCase` with its
`file:line` so callers can count, report or (with --strict) fail. The kinds are:
malformed_json, missing_key, non_string_key, invalid_utf8, empty_document,
missing_split_key, truncated (a compressed file that ends mid-frame) and corrupt (a
compressed stream that cannot be decoded).

`build_python_corpus(out_path)` writes a real-text corpus in The Pile's format from text
that ships with Python itself (the `pydoc` topics and the standard library's docstrings),
so demos and tests need no download. `python -m megatron_lev.data.corpus OUT.jsonl.zst`
does the same from the command line.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import gzip
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import zstandard

try:
    import orjson
except ImportError:  # optional: the json module decodes the same records, slower
    orjson = None

from megatron_lev.data import python_text
from megatron_lev.data.python_text import DEFAULT_PYTHON_SOURCES, DOCUMENT_ORDERS, PYTHON_SOURCES, check_sources
from megatron_lev.utils.files import atomic_path

# Suffixes read as JSON lines. Megatron's own examples call loose-JSON-lines files ".json".
INPUT_SUFFIXES = (".jsonl", ".json", ".jsonl.zst", ".json.zst", ".jsonl.gz", ".json.gz")
BAD_KINDS = ("malformed_json", "missing_key", "non_string_key", "invalid_utf8", "empty_document",
             "missing_split_key", "truncated", "corrupt")

_READ_BYTES = 1 << 20  # raw read size; blocks are assembled from these
DEFAULT_BLOCK_BYTES = 8 << 20
# The Pile's .zst files were written with long-distance matching; allow windows up to 2 GiB.
_ZSTD_MAX_WINDOW = 1 << 31
# A lone surrogate can only come from a JSON escape (the raw line already decoded as UTF-8).
_SURROGATE = re.compile("[\ud800-\udfff]")


class BadInputError(ValueError):
    """Raised for bad input when the caller asked for failure instead of skipping."""


# ---------------------------------------------------------------------------------------
# Finding the input files


def input_suffix(path: str) -> str | None:
    """The supported suffix `path` ends with, or None."""
    name = os.path.basename(path).lower()
    return next((s for s in sorted(INPUT_SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def expand_inputs(specs: str | Sequence[str], flag: str = "--input") -> list[str]:
    """Files named by `specs`: files, globs, or directories (their supported files, sorted).

    Order is the order of `specs`, each expanded in sorted order, so a run is reproducible.
    """
    if isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    files: list[str] = []
    for spec in map(str, specs):
        if os.path.isdir(spec):
            found = sorted(os.path.join(spec, n) for n in os.listdir(spec)
                           if input_suffix(n) and os.path.isfile(os.path.join(spec, n)))
            if not found:
                raise FileNotFoundError(f"{flag} {spec}: directory holds no {'/'.join(INPUT_SUFFIXES)} files")
        elif glob.has_magic(spec):
            found = sorted(p for p in glob.glob(spec) if os.path.isfile(p) and input_suffix(p))
            if not found:
                raise FileNotFoundError(f"{flag} {spec}: pattern matches no {'/'.join(INPUT_SUFFIXES)} files")
        elif os.path.isfile(spec):
            if not input_suffix(spec):
                raise ValueError(f"{flag} {spec}: unsupported file type (expected one of {', '.join(INPUT_SUFFIXES)})")
            found = [spec]
        else:
            raise FileNotFoundError(f"{flag} {spec}: no such file or directory")
        files.extend(f for f in found if f not in files)
    if not files:
        raise FileNotFoundError(f"{flag}: no input files given")
    return files


# ---------------------------------------------------------------------------------------
# Streaming: raw decompressed chunks -> blocks of whole lines


@dataclass
class Block:
    """Whole lines of one file: `data` ends with a newline except at the file's very end."""

    path: str
    first_line: int  # 1-based number of the first line in `data`
    data: bytes
    end_offset: int  # bytes of the (compressed) file consumed when this block was cut
    damaged: str | None = None  # "truncated"/"corrupt": `data` is the unusable tail
    detail: str = ""


class _StreamDamaged(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def _plain_chunks(raw) -> Iterator[bytes]:
    while chunk := raw.read(_READ_BYTES):
        yield chunk


def _zstd_chunks(raw) -> Iterator[bytes]:
    """Decompress frame by frame; a file that ends inside a frame is truncated.

    (zstandard's stream_reader returns a truncated stream's data without complaint, so the
    frames are tracked here with decompressobj, whose `eof` says a frame completed.)
    """
    dctx = zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW)
    dobj, in_frame = dctx.decompressobj(), False
    while chunk := raw.read(_READ_BYTES):
        while chunk:
            try:
                out = dobj.decompress(chunk)
            except zstandard.ZstdError as exc:
                raise _StreamDamaged("corrupt", f"zstd: {exc}") from None
            in_frame = not dobj.eof
            if out:
                yield out
            chunk = dobj.unused_data if dobj.eof else b""
            if dobj.eof:  # next frame (a file may hold several)
                dobj, in_frame = dctx.decompressobj(), bool(chunk)
    if in_frame:
        raise _StreamDamaged("truncated", "zstd stream ends mid-frame (truncated .zst file)")


def _gzip_chunks(raw) -> Iterator[bytes]:
    gz = gzip.GzipFile(fileobj=raw, mode="rb")
    while True:
        try:
            chunk = gz.read1(_READ_BYTES)  # read() would drop what it got before a truncation
        except EOFError as exc:
            raise _StreamDamaged("truncated", f"gzip: {exc} (truncated .gz file)") from None
        except (gzip.BadGzipFile, zlib.error, OSError) as exc:
            raise _StreamDamaged("corrupt", f"gzip: {exc}") from None
        if not chunk:
            return
        yield chunk


def iter_blocks(path: str, block_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[Block]:
    """Stream `path` as blocks of about `block_bytes` whole lines.

    A damaged compressed file yields its readable lines, then one Block with `damaged`
    set whose `data` is the incomplete last line (possibly empty).
    """
    suffix = input_suffix(path) or ""
    line = 1
    pending: list[bytes] = []
    pending_size = 0
    with open(path, "rb") as raw:
        chunks = (_zstd_chunks(raw) if suffix.endswith(".zst")
                  else _gzip_chunks(raw) if suffix.endswith(".gz") else _plain_chunks(raw))
        try:
            for chunk in chunks:
                pending.append(chunk)
                pending_size += len(chunk)
                # Cut only once a newline arrives (a line longer than a block keeps growing).
                if pending_size < block_bytes or b"\n" not in chunk:
                    continue
                data = b"".join(pending)
                cut = data.rfind(b"\n") + 1
                block, rest = data[:cut], data[cut:]
                yield Block(path, line, block, raw.tell())
                line += block.count(b"\n")
                pending, pending_size = ([rest], len(rest)) if rest else ([], 0)
        except _StreamDamaged as damage:
            data = b"".join(pending)
            cut = data.rfind(b"\n") + 1
            if cut:
                yield Block(path, line, data[:cut], raw.tell())
                line += data.count(b"\n", 0, cut)
            yield Block(path, line, data[cut:], raw.tell(), damage.kind, damage.detail)
            return
        if pending:
            yield Block(path, line, b"".join(pending), raw.tell())


# ---------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class BadCase:
    kind: str
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.message}"


@dataclass
class Record:
    """One valid document: the text of each requested key, in order, and its subset."""

    path: str
    line: int
    texts: list[str]
    subset: str | None = None
    nbytes: int = 0  # size of the raw JSON line


class _Bad(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind, self.message = kind, message


def lookup_key(obj: dict, dotted: str):
    """`obj["meta"]["pile_set_name"]` for "meta.pile_set_name"; KeyError if absent."""
    for part in dotted.split("."):
        if not isinstance(obj, dict) or part not in obj:
            raise KeyError(dotted)
        obj = obj[part]
    return obj


def parse_record(line: bytes, keys: Sequence[str], split_key: str | None = None) -> tuple[list[str], str | None]:
    """Validate one JSON line; return its texts (one per key) and subset, or raise _Bad.

    A record is all-or-nothing: if any key is bad the record is skipped for every key, so
    the per-key datasets stay aligned document for document.
    """
    fast = _parse_record_fast(line, keys, split_key)
    if fast is not None:
        return fast
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Bad("invalid_utf8", f"byte {exc.start}: {exc.reason}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Bad("malformed_json", f"{exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise _Bad("malformed_json", f"expected a JSON object, got {type(obj).__name__}")
    texts = []
    for key in keys:
        try:
            value = lookup_key(obj, key)
        except KeyError:
            raise _Bad("missing_key", f"no key {key!r}") from None
        if not isinstance(value, str):
            raise _Bad("non_string_key", f"{key!r} is {type(value).__name__}, not a string")
        if not value.strip():
            raise _Bad("empty_document", f"{key!r} is empty")
        if "\\u" in text and _SURROGATE.search(value):
            raise _Bad("invalid_utf8", f"{key!r} holds a lone surrogate escape (not valid Unicode)")
        texts.append(value)
    subset = None
    if split_key is not None:
        try:
            subset = lookup_key(obj, split_key)
        except KeyError:
            raise _Bad("missing_split_key", f"no key {split_key!r}") from None
        if not isinstance(subset, str) or not subset:
            raise _Bad("missing_split_key", f"{split_key!r} is {subset!r}, not a non-empty string")
    return texts, subset


def _parse_record_fast(line: bytes, keys: Sequence[str], split_key: str | None) -> tuple[list[str], str | None] | None:
    """orjson's parse of a good record (about 3x faster than json's), or None: then the
    json path decides and words the error. orjson refuses invalid UTF-8 and lone
    surrogate escapes, and its strings equal json's, so a record it accepts gives the
    same texts."""
    if orjson is None:
        return None
    try:
        obj = orjson.loads(line)
        texts = [lookup_key(obj, key) for key in keys]
        subset = lookup_key(obj, split_key) if split_key is not None else None
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    if not all(isinstance(t, str) and t.strip() for t in texts):
        return None
    if split_key is not None and not (isinstance(subset, str) and subset):
        return None
    return texts, subset


def iter_block_records(block: Block, keys: Sequence[str], split_key: str | None = None
                       ) -> Iterator[Record | BadCase]:
    """The block's records in order: a Record per valid line, a BadCase per bad one.

    Blank lines carry no data and are skipped without a report.
    """
    if block.damaged:
        lost = f"; last line incomplete, {len(block.data)} bytes dropped" if block.data else ""
        yield BadCase(block.damaged, block.path, block.first_line, block.detail + lost)
        return
    for offset, line in enumerate(block.data.split(b"\n")):
        if not line.strip():
            continue
        number = block.first_line + offset
        try:
            texts, subset = parse_record(line, keys, split_key)
        except _Bad as bad:
            yield BadCase(bad.kind, block.path, number, bad.message)
            continue
        yield Record(block.path, number, texts, subset, len(line) + 1)


def read_documents(paths: str | Sequence[str], keys: Sequence[str] = ("text",), split_key: str | None = None,
                   on_bad: Callable[[BadCase], None] | None = None,
                   block_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[Record]:
    """Stream valid records from files/globs/directories, in order.

    `on_bad(case)` is called for each bad case; without it the first one raises BadInputError.
    """
    for path in expand_inputs(paths):
        for block in iter_blocks(path, block_bytes):
            for item in iter_block_records(block, keys, split_key):
                if isinstance(item, BadCase):
                    if on_bad is None:
                        raise BadInputError(str(item))
                    on_bad(item)
                else:
                    yield item


# ---------------------------------------------------------------------------------------
# Writing


def _open_writer(raw, path: str, level: int):
    suffix = input_suffix(path) or ""
    if suffix.endswith(".zst"):
        # Single-threaded zstd at a fixed level is deterministic: same records, same bytes.
        return zstandard.ZstdCompressor(level=level).stream_writer(raw, closefd=False)
    if suffix.endswith(".gz"):
        return gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0, compresslevel=min(level, 9))
    return contextlib.nullcontext(raw)


def write_jsonl(path: str, records: Iterable[dict], level: int = 3) -> int:
    """Write records as JSON lines, compressed by suffix (.zst, .gz, or none); atomic.

    Returns the number of records written.
    """
    if not input_suffix(path):
        raise ValueError(f"{path}: output must end with one of {', '.join(INPUT_SUFFIXES)}")
    count = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as raw:
        with _open_writer(raw, path, level) as out:
            buffered = io.BufferedWriter(out, 1 << 20) if out is not raw else raw
            for record in records:
                buffered.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
                count += 1
            buffered.flush()
    return count


# ---------------------------------------------------------------------------------------
# A real-text corpus from Python itself


def python_corpus_records(sources: Sequence[str] = DEFAULT_PYTHON_SOURCES, max_documents: int | None = None,
                          min_chars: int = 32, order: str = "source") -> Iterator[dict]:
    """Pile-format records ({"text", "meta": {"pile_set_name"}}) of Python's own text.

    The documents come from `python_text.py` run in a fresh interpreter (-I -S): the same
    documents whatever this process imported, and no import side effects here.
    """
    check_sources(sources)
    script = python_text.__file__
    cmd = [sys.executable, "-I", "-S", script, "--sources", *sources, "--min-chars", str(min_chars),
           "--order", order]
    with tempfile.TemporaryFile() as errors, \
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors) as proc:
        count, finished = 0, False
        try:
            for line in proc.stdout:
                if max_documents is not None and count >= max_documents:
                    break
                subset, text = json.loads(line)
                yield {"text": text, "meta": {"pile_set_name": subset}}
                count += 1
            else:
                finished = True
        finally:
            if not finished:
                proc.kill()
            proc.wait()
        if finished and proc.returncode != 0:
            errors.seek(0)
            raise RuntimeError(f"{script} failed (exit {proc.returncode}): "
                               f"{errors.read().decode(errors='replace')[-2000:]}")


def build_python_corpus(out_path: str, max_documents: int | None = None,
                        sources: Sequence[str] = DEFAULT_PYTHON_SOURCES, min_chars: int = 32,
                        order: str = "source") -> int:
    """Write Python's own text as a Pile-format corpus (`.jsonl.zst`, `.jsonl.gz` or `.jsonl`).

    Sources, in this order: "pydoc_topics" (the language reference topics behind `help()`),
    "stdlib_docstrings" (docstrings of standard-library modules, classes, functions and
    methods; modules that fail to import or have import side effects are skipped) and,
    when asked for, "stdlib_source" (the standard library's .py files). Each record's
    meta.pile_set_name names its source. Output is identical run to run on one Python
    install. `order="hashed"` sorts the documents by a hash of their text (python_text.py:
    every contiguous train/valid/test range then mixes the sources). Returns the number of
    documents.
    """
    return write_jsonl(out_path, python_corpus_records(sources, max_documents, min_chars, order))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a Pile-format corpus of Python's own text.")
    parser.add_argument("output", help="output file (.jsonl.zst, .jsonl.gz or .jsonl)")
    parser.add_argument("--max-documents", type=int, default=None)
    parser.add_argument("--sources", nargs="+", default=list(DEFAULT_PYTHON_SOURCES), choices=PYTHON_SOURCES)
    parser.add_argument("--min-chars", type=int, default=32)
    parser.add_argument("--order", default="source", choices=DOCUMENT_ORDERS,
                        help="'hashed': documents sorted by a hash of their text, so a contiguous "
                             "--split range mixes the sources")
    args = parser.parse_args(argv)
    count = build_python_corpus(args.output, args.max_documents, args.sources, args.min_chars, args.order)
    print(f"wrote {count} documents to {args.output}")


if __name__ == "__main__":
    main()
