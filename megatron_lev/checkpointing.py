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

import contextlib
import json
import os
import re
import shutil
import sys
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import yaml

from megatron_lev import parallel
from megatron_lev.arguments import ConfigError
from megatron_lev.data.corpus import atomic_path
from megatron_lev.safe_load import check_checkpoint_files, safe_torch_load, use_safe_checkpoint_engine

LATEST = "latest"
COMPLETE_MARKER = "complete.json"
CONFIG_FILE = "config.json"
_TAG_RE = re.compile(r"^iter_(\d{7,})$")


def checkpoint_tag(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def tag_iteration(tag: str) -> Optional[int]:
    match = _TAG_RE.match(tag)
    return int(match.group(1)) if match else None


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


def _atomic_write_text(path: str, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _atomic_torch_save(obj, path: str) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
        fsync_file(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def _fsync_engine_saves(engine):
    """Every file DeepSpeed's checkpoint engine writes on this rank is fsynced right after
    (each rank flushes its own files: another node's fsync would not reach them), and so
    are the folders holding them."""
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if checkpoint_engine is None:
        yield
        return
    save = checkpoint_engine.save
    own = "save" in vars(checkpoint_engine)  # already set on the instance: put it back after
    folders = set()

    def save_and_fsync(state_dict, path, *args, **kwargs):
        result = save(state_dict, path, *args, **kwargs)
        if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
            fsync_file(path)
            folders.add(os.path.dirname(os.path.abspath(path)))
        return result

    checkpoint_engine.save = save_and_fsync  # this instance only, for this save
    try:
        yield
    finally:
        if own:
            checkpoint_engine.save = save
        else:
            del checkpoint_engine.save
        for folder in sorted(folders):
            fsync_dir(folder)


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


def find_latest(ckpt_dir: Optional[str]) -> Optional[str]:
    """The tag to resume from: `latest` if it names a complete, undamaged checkpoint, else
    the newest complete undamaged one, else None (an empty or missing directory starts
    fresh). A damaged checkpoint (`checkpoint_problem`) is skipped with one line naming
    the file."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return None
    latest_path = os.path.join(ckpt_dir, LATEST)
    newest_first = [tag for _, tag in reversed(complete_checkpoints(ckpt_dir))]
    if os.path.isfile(latest_path):
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


def read_checkpoint_config(ckpt_dir: str, tag: str) -> dict:
    with open(os.path.join(ckpt_dir, tag, CONFIG_FILE), encoding="utf-8") as f:
        return json.load(f)


# Settings a checkpoint's tensors depend on, besides the model section.
_LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
# Model fields that only matter before the first step (the weights come from the checkpoint).
_INIT_ONLY_KEYS = ("init_seed", "init_method_std")


def check_resume_compatible(ckpt_dir: str, tag: str, config: dict) -> None:
    """Refuse a checkpoint whose model (or TP/PP layout) differs from this run's, naming
    every differing field. `config` is `arguments.effective_config(...)`."""
    saved = read_checkpoint_config(ckpt_dir, tag)
    saved_model, model = saved.get("model", {}), config["model"]
    diffs = [f"{key}: {saved_model.get(key, '<unset>')!r} in the checkpoint, {model.get(key, '<unset>')!r} now"
             for key in sorted(set(saved_model) | set(model))
             if key not in _INIT_ONLY_KEYS and saved_model.get(key) != model.get(key)]
    for key in _LAYOUT_KEYS:
        then, now = saved.get("training", {}).get(key), config["training"].get(key)
        if then != now:
            diffs.append(f"{key}: {then!r} in the checkpoint, {now!r} now")
    if diffs:
        raise ConfigError(f"--load {ckpt_dir}: checkpoint {tag} was saved with a different model config ("
                          + "; ".join(diffs) + "); resume with the checkpoint's settings or use a new --save "
                          "directory")


def write_run_config(save_dir: str, config: dict) -> None:
    """DIR/config.yaml: the effective configuration of the current run (rank 0)."""
    os.makedirs(save_dir, exist_ok=True)
    _atomic_write_text(os.path.join(save_dir, "config.yaml"),
                       yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=100))


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(engine, save_dir: str, iteration: int, client_state: dict, config: dict,
                    keep_last: Optional[int] = None) -> str:
    """Collective: every rank calls it. Returns the tag written."""
    tag = checkpoint_tag(iteration)
    tag_dir = os.path.join(save_dir, tag)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        os.makedirs(tag_dir, exist_ok=True)
        # Re-saving a tag: it stops counting as complete before any file changes.
        if os.path.exists(os.path.join(tag_dir, COMPLETE_MARKER)):
            os.remove(os.path.join(tag_dir, COMPLETE_MARKER))
    _barrier()
    with _fsync_engine_saves(engine):
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    os.makedirs(os.path.join(tag_dir, "rng"), exist_ok=True)
    _atomic_torch_save(parallel.rng_state_dict(), os.path.join(tag_dir, "rng", f"rank_{rank:05d}.pt"))
    if rank == 0:
        _atomic_write_text(os.path.join(tag_dir, CONFIG_FILE), json.dumps(config, indent=1, default=str))
    _barrier()  # every rank's files are written and fsynced
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        sizes = checkpoint_file_sizes(tag_dir)
        for rel in sizes:  # files DeepSpeed wrote outside its checkpoint engine (its recovery script)
            fsync_file(os.path.join(tag_dir, rel))
        for root, _, _ in os.walk(tag_dir):
            fsync_dir(root)
        # The marker lists every file with its size: a later truncation is found before loading.
        _atomic_write_text(os.path.join(tag_dir, COMPLETE_MARKER),
                           json.dumps({"iteration": iteration, "world_size": world,
                                       "consumed_samples": client_state.get("consumed_samples"), "files": sizes}))
        _atomic_write_text(os.path.join(save_dir, LATEST), tag)
        if keep_last:
            prune_checkpoints(save_dir, keep_last)
    _barrier()
    return tag


def prune_checkpoints(save_dir: str, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints, and incomplete
    leftovers older than the newest complete one. Returns the deleted tags."""
    complete = complete_checkpoints(save_dir)
    if not complete:
        return []
    newest = complete[-1][0]
    doomed = [tag for _, tag in complete[:-keep_last]]
    for name in os.listdir(save_dir):
        it = tag_iteration(name)
        if it is not None and it < newest and not is_complete(save_dir, name):
            doomed.append(name)
    for tag in doomed:
        shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)
    return doomed


def load_checkpoint(engine, load_dir: str, tag: str, *, load_optimizer: bool = True) -> dict:
    """Collective: restore the engine (and, unless `load_optimizer` is False, optimizer,
    LR schedule and counters) and this rank's RNG streams. Returns the client state.
    Every file is loaded weights_only first (safe_load: a hostile pickle is refused on every
    rank, never run), and DeepSpeed's own loads go through the same safe loader."""
    check_checkpoint_files(os.path.join(load_dir, tag))
    use_safe_checkpoint_engine(engine)
    path, client_state = engine.load_checkpoint(
        load_dir, tag=tag, load_optimizer_states=load_optimizer, load_lr_scheduler_states=load_optimizer,
        load_module_only=not load_optimizer)
    if path is None:
        raise RuntimeError(f"--load {load_dir}: DeepSpeed could not load checkpoint {tag}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_path = os.path.join(load_dir, tag, "rng", f"rank_{rank:05d}.pt")
    if load_optimizer:
        if os.path.isfile(rng_path):
            parallel.load_rng_state_dict(safe_torch_load(rng_path))
        else:
            warnings.warn(f"{rng_path} is missing (saved by a job of another size?): RNG streams start from "
                          f"--seed, so the run will not continue bit-identically")
    return client_state or {}
