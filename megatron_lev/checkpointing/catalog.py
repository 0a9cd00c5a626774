"""Checkpoints: DeepSpeed's engine state plus our own bookkeeping, safe under preemption.

Layout of `--save DIR`:

    DIR/config.yaml                  the run's effective configuration (rewritten at start)
    DIR/latest                       "iter_0001000": the newest COMPLETE checkpoint
    DIR/iter_0001000/                DeepSpeed's files (model, optimizer, LR schedule;
                                     client state = iteration, consumed samples/tokens,
                                     skipped-step counters, the effective config)
    DIR/iter_0001000/config.json     the effective config, readable before any model work
    DIR/iter_0001000/rng/rank_00003.pt   every RNG stream of global rank 3
    DIR/iter_0001000/complete.json   written last, by rank 0, after every rank finished

A checkpoint is complete only when `complete.json` exists. It is written after a
barrier that follows every rank's writes, and `latest` is replaced atomically (tmp +
os.replace) only after it, so a job killed mid-save leaves `latest` on the previous
checkpoint. `find_latest` never returns an incomplete directory, even if `latest` was
tampered with or a crash hit between the marker and `latest`.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import warnings
from typing import Optional

from megatron_lev.utils.errors import ConfigError

LATEST = "latest"


COMPLETE_MARKER = "complete.json"


CONFIG_FILE = "config.json"


_TAG_RE = re.compile(r"^iter_(\d{7,})$")


def checkpoint_tag(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def tag_iteration(tag: str) -> Optional[int]:
    match = _TAG_RE.match(tag)
    return int(match.group(1)) if match else None


def checkpoint_file_sizes(tag_dir: str) -> dict[str, int]:
    """Relative path -> size of every file under a checkpoint folder but the marker."""
    sizes = {}
    for root, _, names in os.walk(tag_dir):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, tag_dir)
            if rel != COMPLETE_MARKER:
                sizes[rel] = os.path.getsize(path)
    return dict(sorted(sizes.items()))


def checkpoint_problem(ckpt_dir: str, tag: str) -> Optional[str]:
    """Why a complete checkpoint cannot be used, naming the file (None: it can). The
    marker lists every file with its size at save time; one now missing or of another
    size (truncated, half-copied) makes the checkpoint damaged. Markers written before
    sizes were recorded are taken as they are."""
    tag_dir = os.path.join(ckpt_dir, tag)
    try:
        with open(os.path.join(tag_dir, COMPLETE_MARKER), encoding="utf-8") as f:
            files = json.load(f).get("files") or {}
    except (OSError, ValueError, AttributeError) as exc:
        return f"{os.path.join(tag_dir, COMPLETE_MARKER)}: unreadable ({exc})"
    for rel, size in files.items():
        path = os.path.join(tag_dir, rel)
        if not os.path.isfile(path):
            return f"{path}: missing"
        actual = os.path.getsize(path)
        if actual != size:
            return f"{path}: {actual} bytes, {size} when saved (truncated or damaged)"
    return None


_WARNED: set[str] = set()


def _warn_rank_0(message: str) -> None:
    # Every rank finds the same checkpoint, at start-up and again in the trainer: one line.
    if os.environ.get("RANK", "0") == "0" and message not in _WARNED:
        _WARNED.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)


def is_complete(ckpt_dir: str, tag: str) -> bool:
    return os.path.isfile(os.path.join(ckpt_dir, tag, COMPLETE_MARKER))


def check_retention(keep_last: Optional[int], keep_every: Optional[int], save_interval: Optional[int]) -> None:
    """--keep-checkpoints-every N keeps, besides the newest --keep-last-checkpoints K, every
    checkpoint whose iteration is a multiple of N: refused in one line where it cannot."""
    if keep_every is None:
        return
    if isinstance(keep_every, bool) or keep_every < 1:
        raise ConfigError(f"--keep-checkpoints-every must be >= 1, got {keep_every}")
    if not keep_last:
        raise ConfigError(f"--keep-checkpoints-every {keep_every}: needs --keep-last-checkpoints K (without it "
                          "every checkpoint is kept already)")
    if save_interval and keep_every % save_interval:
        raise ConfigError(f"--keep-checkpoints-every {keep_every} is not a multiple of --save-interval "
                          f"{save_interval}: checkpoints are saved every {save_interval} iterations, so only "
                          f"those of every {math.lcm(keep_every, save_interval)}-th would be kept")


def retained(iterations: list[int], keep_last: int, keep_every: Optional[int] = None) -> list[int]:
    """Which of the complete checkpoints' `iterations` the retention keeps: the newest `keep_last`,
    and every multiple of `keep_every` (when given)."""
    ordered = sorted(iterations)
    newest = set(ordered[-keep_last:]) if keep_last else set(ordered)
    return [it for it in ordered if it in newest or (keep_every and it % keep_every == 0)]


def complete_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """(iteration, tag) of every complete checkpoint, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = []
    for name in os.listdir(ckpt_dir):
        it = tag_iteration(name)
        if it is not None and is_complete(ckpt_dir, name):
            found.append((it, name))
    return sorted(found)


def find_latest(ckpt_dir: Optional[str], skipped: Optional[list[tuple[str, str]]] = None,
                older_than: Optional[int] = None) -> Optional[str]:
    """The tag to resume from: `latest` if it names a complete, undamaged checkpoint, else
    the newest complete undamaged one, else None (an empty or missing directory starts
    fresh). A damaged checkpoint (`checkpoint_problem`) is skipped with one line naming
    the file, or, when the caller passes a `skipped` list, recorded there as (tag, problem)
    for the caller to word (convert names the damage in its one-line error). `older_than`:
    only checkpoints before that iteration (the one before a checkpoint found unreadable)."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return None
    latest_path = os.path.join(ckpt_dir, LATEST)
    newest_first = [tag for it, tag in reversed(complete_checkpoints(ckpt_dir))
                    if older_than is None or it < older_than]
    if older_than is None and os.path.isfile(latest_path):
        with open(latest_path, encoding="utf-8") as f:
            tag = f.read().strip()
        if is_complete(ckpt_dir, tag):
            newest_first = [tag] + [t for t in newest_first if t != tag]
        else:
            warnings.warn(f"{latest_path} names {tag!r}, which is not a complete checkpoint; "
                          f"using the newest complete one instead")
    for tag in newest_first:
        problem = checkpoint_problem(ckpt_dir, tag)
        if problem is None:
            return tag
        if skipped is not None:
            skipped.append((tag, problem))
        else:
            _warn_rank_0(f"--load {ckpt_dir}: skipping checkpoint {tag}: {problem}; trying the previous complete one")
    return None


def select_checkpoint(ckpt_dir: Optional[str], ckpt_step: Optional[int] = None) -> Optional[str]:
    """The tag `--load` resumes from: `--ckpt-step N`'s checkpoint, which must be complete
    and undamaged (ConfigError naming it otherwise), else `find_latest`."""
    if ckpt_step is None:
        return find_latest(ckpt_dir)
    tag = checkpoint_tag(ckpt_step)
    if not ckpt_dir or not os.path.isdir(os.path.join(ckpt_dir, tag)):
        raise ConfigError(f"--ckpt-step {ckpt_step}: no checkpoint {tag} in --load {ckpt_dir}")
    if not is_complete(ckpt_dir, tag):
        raise ConfigError(f"--ckpt-step {ckpt_step}: checkpoint {os.path.join(ckpt_dir, tag)} is incomplete (no "
                          f"{COMPLETE_MARKER}: its save did not finish)")
    problem = checkpoint_problem(ckpt_dir, tag)
    if problem is not None:
        raise ConfigError(f"--ckpt-step {ckpt_step}: checkpoint {tag} is damaged: {problem}")
    return tag


def select_readable_checkpoint(ckpt_dir: Optional[str], ckpt_step: Optional[int] = None) -> Optional[str]:
    """Collective: `select_checkpoint`'s tag, once every file of it loads weights_only
    (`check_checkpoint_files`). A file that cannot be read although its size is intact is
    handled like a short one in `find_latest`: the checkpoint is skipped, with one line
    naming the file, for the previous complete one. `--ckpt-step`'s checkpoint is refused
    instead, and a hostile file (UnsafeCheckpointError) is always refused, never skipped."""
    # Here, not at the top: the rest of this module is read without torch (the Slurm launcher's sizes).
    from megatron_lev.checkpointing.safe_load import CheckpointLoadError, UnsafeCheckpointError, check_checkpoint_files

    tag = select_checkpoint(ckpt_dir, ckpt_step)
    while tag is not None:
        try:
            check_checkpoint_files(os.path.join(ckpt_dir, tag))
            return tag
        except UnsafeCheckpointError:
            raise
        except CheckpointLoadError as exc:
            if ckpt_step is not None:
                raise CheckpointLoadError(f"--ckpt-step {ckpt_step}: checkpoint {tag} is damaged: {exc}") from None
            _warn_rank_0(f"--load {ckpt_dir}: skipping checkpoint {tag}: {exc}; trying the previous complete one")
            tag = find_latest(ckpt_dir, older_than=tag_iteration(tag))
    return None


def read_checkpoint_config(ckpt_dir: str, tag: str) -> dict:
    with open(os.path.join(ckpt_dir, tag, CONFIG_FILE), encoding="utf-8") as f:
        return json.load(f)
