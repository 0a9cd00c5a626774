"""Files that are complete or absent: write under a temporary name, then rename.

A reader never sees a half-written file under its final name, and a crash leaves the
previous version in place. `durable=True` also flushes the data and the folder entry to
stable storage (fsync), for files a job resumes from (checkpoint markers, `latest`).
"""
from __future__ import annotations

import contextlib
import json
import os


@contextlib.contextmanager
def atomic_path(path: str):
    """Yield a temporary name beside `path`; rename it to `path` only if the block succeeds."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def fsync_file(path: str) -> None:
    """Flush a file's data to stable storage (a node crash cannot leave it short)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a folder's entries (the names of files created or renamed in it)."""
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a folder
        fsync_file(path)


def write_text_atomic(path: str, text: str, durable: bool = False) -> None:
    """Write `text` under a temporary name beside `path`, then rename it into place."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json_atomic(path: str, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def update_json_file(path: str, **keys) -> None:
    """Set `keys` in a JSON object file (rewritten with sorted keys, 2-space indent)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data.update(keys)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def replace_generated_table(page: str, heading: str, marker: str, table: str) -> None:
    """Replace a generated table of a markdown page: from the line holding `marker` (its first line,
    the counts) after `heading`, to the next heading. Written under a temporary name."""
    with open(page, encoding="utf-8") as f:
        text = f.read()
    counts_line = text.index(marker, text.index(heading))
    first = text.rindex("\n", 0, counts_line) + 1
    end = text.find("\n#", first)
    end = len(text) if end == -1 else end + 1
    with atomic_path(page) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text[:first] + table.rstrip("\n") + "\n" + ("\n" if end < len(text) else "") + text[end:])
