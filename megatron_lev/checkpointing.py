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

from megatron_lev.distributed.launch import default_device
from megatron_lev.distributed.rng import load_rng_state_dict, rng_state_dict
from megatron_lev.safe_load import (CheckpointLoadError, UnsafeCheckpointError, check_checkpoint_files, safe_torch_load,
                                    use_safe_checkpoint_engine)
from megatron_lev.utils.errors import ConfigError
from megatron_lev.utils.files import atomic_path, fsync_dir, fsync_file, write_text_atomic

LATEST = "latest"
COMPLETE_MARKER = "complete.json"
CONFIG_FILE = "config.json"
_TAG_RE = re.compile(r"^iter_(\d{7,})$")


def checkpoint_tag(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def tag_iteration(tag: str) -> Optional[int]:
    match = _TAG_RE.match(tag)
    return int(match.group(1)) if match else None


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


# Settings a checkpoint's tensor files are laid out by: resuming under other values goes
# through DeepSpeed's universal checkpoint (see `layout_changes`).
_LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")
# Model fields that only matter before the first step (the weights come from the checkpoint).
_INIT_ONLY_KEYS = ("init_seed", "init_method_std")


def check_resume_compatible(ckpt_dir: str, tag: str, config: dict) -> None:
    """Refuse a checkpoint whose model differs from this run's, naming every differing
    field. `config` is `arguments.effective_config(...)`. A different parallel layout is
    no reason to refuse (`layout_changes`)."""
    saved = read_checkpoint_config(ckpt_dir, tag)
    saved_model, model = saved.get("model", {}), config["model"]
    diffs = [f"{key}: {saved_model.get(key, '<unset>')!r} in the checkpoint, {model.get(key, '<unset>')!r} now"
             for key in sorted(set(saved_model) | set(model))
             if key not in _INIT_ONLY_KEYS and saved_model.get(key) != model.get(key)]
    if diffs:
        raise ConfigError(f"--load {ckpt_dir}: checkpoint {tag} was saved with a different model config ("
                          + "; ".join(diffs) + "); resume with the checkpoint's settings or use a new --save "
                          "directory")


# --------------------------------------------------------------------------- another scale

UNIVERSAL = "universal"  # DIR/iter_N/universal/: DeepSpeed's universal form of DIR/iter_N
UNIVERSAL_INFO_KEY = "universal_checkpoint_info"  # deepspeed.checkpoint.constants.UNIVERSAL_CHECKPOINT_INFO


def _zero_stage(config: dict):
    return config.get("deepspeed", {}).get("zero_optimization", {}).get("stage")


def layout_changes(ckpt_dir: str, tag: str, config: dict) -> list[str]:
    """How this run's parallel layout (TP, PP, DP size, ZeRO stage) differs from the
    checkpoint's, one "key: then -> now" string each; empty when DeepSpeed can load the
    checkpoint's files as they are."""
    saved = read_checkpoint_config(ckpt_dir, tag)
    changes = [f"{key}: {saved['training'].get(key)} -> {config['training'].get(key)}" for key in _LAYOUT_KEYS
               if saved.get("training", {}).get(key) != config["training"].get(key)]
    if _zero_stage(saved) != _zero_stage(config):
        changes.append(f"zero stage: {_zero_stage(saved)} -> {_zero_stage(config)}")
    return changes


def check_layout_change(ckpt_dir: str, tag: str, config: dict, changes: list[str]) -> None:
    """Refuse the layout changes a universal checkpoint cannot make, saying what to do."""
    then, now = _zero_stage(read_checkpoint_config(ckpt_dir, tag)), _zero_stage(config)
    if (then == 3) != (now == 3):
        # DeepSpeed names ZeRO-3 model files per data-parallel rank (zero_pp_rank_*), the
        # others per model-parallel rank; its universal loader only finds its own kind.
        raise ConfigError(f"--load {ckpt_dir}: checkpoint {tag} was saved under ZeRO stage {then} and this run "
                          f"uses stage {now} ({'; '.join(changes)}): DeepSpeed's universal checkpoint does not "
                          f"convert between ZeRO-3 and stages 1/2; resume with --zero-stage {then}")


def universal_checkpoint_info(config: dict) -> dict:
    """The `universal_checkpoint_info` client state DeepSpeed's ds_to_universal needs, for
    the run whose effective config is `config`: how every parameter of the whole model (all
    pipeline stages) is split over TP ranks, as regexes on DeepSpeed's parameter names
    (Megatron-DeepSpeed's UNIVERSAL_CHECKPOINT_INFO). The partitions come from
    convert.partition_of (the table of models/decoder.py)."""
    from deepspeed.checkpoint import constants as ds

    from megatron_lev.convert import expected_parameter_names, partition_of
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.pipeline import model_to_pipeline_key

    model_config = model_config_from_dict(config["model"])
    pipeline = config["training"].get("pipeline_model_parallel_size", 1) > 1
    tied = model_config.embedding == "tied"
    info = {ds.UNIVERSAL_CHECKPOINT_VERSION_KEY: ds.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            "original_vocab_size": model_config.vocab_size,  # padding rows are dropped, re-added for the new TP
            ds.TP_REPLICATED_PARAMETER_PATTERNS: [], ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [],
            ds.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: [], ds.VOCABULARY_PARAMETER_PATTERNS: [],
            ds.PIPELINE_REPLICATED_PARAMETER_PATTERNS: []}
    for name in expected_parameter_names(model_config):
        part = partition_of(name, model_config.embedding)
        ds_name = model_to_pipeline_key(name, model_config.num_layers, tied) if pipeline else name
        pattern = re.escape(ds_name) + "$"
        if part.dim is None:
            info[ds.TP_REPLICATED_PARAMETER_PATTERNS].append(pattern)
        elif part.dim == 1:
            info[ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS].append(pattern)
        elif part.stride == 2:  # [gate; up]: rank r holds [gate_r; up_r]
            info[ds.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0].append(pattern)
        # else: contiguous along dim 0, ds_to_universal's default
        if part.vocab:
            info[ds.VOCABULARY_PARAMETER_PATTERNS].append(pattern)
        if pipeline and tied and name.startswith("embedding."):  # on the first and the last stage
            info[ds.PIPELINE_REPLICATED_PARAMETER_PATTERNS].append(pattern)
    return info


def _is_pipeline_name(name: str) -> bool:
    return name.split(".", 1)[0].isdigit() or name.startswith("tied_modules.")


def _stage_for_universal(src: str, staged: str) -> None:
    """ds_to_universal's input: links to DIR/tag's DeepSpeed files, except the model-state
    files, copied without megatron-core's `_extra_state` entries (None; DeepSpeed 0.19's
    converter calls .float() on every module entry)."""
    os.makedirs(staged)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if not name.endswith(".pt") or not os.path.isfile(path):
            continue
        if name.startswith("mp_rank_") or (name.startswith("zero_pp_rank_") and name.endswith("model_states.pt")):
            state = safe_torch_load(path)
            if isinstance(state.get("module"), dict):
                state["module"] = {k: v for k, v in state["module"].items() if v is not None}
            torch.save(state, os.path.join(staged, name))
        else:
            os.symlink(os.path.abspath(path), os.path.join(staged, name))


def convert_to_universal(ckpt_dir: str, tag: str, *, pipeline: bool, num_layers: int, tied: bool) -> str:
    """DeepSpeed's ds_to_universal on DIR/tag, written to DIR/tag/universal (reused when
    complete), with parameter directories named as this run's module names them
    (pipeline or plain form). Rank 0 only. Returns the universal folder."""
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    from megatron_lev.models.pipeline import model_to_pipeline_key, pipeline_to_model_key

    src = os.path.join(ckpt_dir, tag)
    out = os.path.join(src, UNIVERSAL)
    if os.path.isfile(os.path.join(out, COMPLETE_MARKER)):
        return out
    tmp, staged = out + ".tmp", out + ".input"
    for leftover in (tmp, staged, out):
        shutil.rmtree(leftover, ignore_errors=True)
    _stage_for_universal(src, staged)
    try:
        ds_to_universal.main(Namespace(input_folder=staged, output_folder=tmp, num_extract_workers=1,
                                       num_merge_workers=1, keep_temp_folder=False, strict=True,
                                       inject_missing_state=False))
    except AssertionError as exc:
        if "universal_checkpoint_info" in str(exc):
            raise ConfigError(f"--load {ckpt_dir}: checkpoint {tag} predates universal checkpoint support (no "
                              f"universal_checkpoint_info): resume it with the layout it was saved with, let it "
                              f"save once, then change the layout") from exc
        raise
    finally:
        shutil.rmtree(staged, ignore_errors=True)
        # ds_to_universal points DIR/tag/latest_universal at its output; we pass the tag instead.
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(src, "latest_universal"))
    zero = os.path.join(tmp, "zero")
    for name in os.listdir(zero):
        if not os.path.isdir(os.path.join(zero, name)) or _is_pipeline_name(name) == pipeline:
            continue
        new = (model_to_pipeline_key(name, num_layers, tied) if pipeline
               else pipeline_to_model_key(name, num_layers))
        os.rename(os.path.join(zero, name), os.path.join(zero, new))
    write_text_atomic(os.path.join(tmp, COMPLETE_MARKER), json.dumps({"source": tag}), durable=True)
    os.replace(tmp, out)
    return out


def write_run_config(save_dir: str, config: dict) -> None:
    """DIR/config.yaml: the effective configuration of the current run (rank 0)."""
    os.makedirs(save_dir, exist_ok=True)
    write_text_atomic(os.path.join(save_dir, "config.yaml"),
                      yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=100), durable=True)


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
    # Every checkpoint can be resumed at another scale (DeepSpeed's ds_to_universal reads this).
    client_state = {**client_state, UNIVERSAL_INFO_KEY: universal_checkpoint_info(config)}
    with _fsync_engine_saves(engine):
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    os.makedirs(os.path.join(tag_dir, "rng"), exist_ok=True)
    _atomic_torch_save(rng_state_dict(), os.path.join(tag_dir, "rng", f"rank_{rank:05d}.pt"))
    if rank == 0:
        write_text_atomic(os.path.join(tag_dir, CONFIG_FILE), json.dumps(config, indent=1, default=str), durable=True)
    _barrier()  # every rank's files are written and fsynced
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        sizes = checkpoint_file_sizes(tag_dir)
        for rel in sizes:  # files DeepSpeed wrote outside its checkpoint engine (its recovery script)
            fsync_file(os.path.join(tag_dir, rel))
        for root, _, _ in os.walk(tag_dir):
            fsync_dir(root)
        # The marker lists every file with its size: a later truncation is found before loading.
        marker = {"iteration": iteration, "world_size": world, "consumed_samples": client_state.get("consumed_samples"),
                  "files": sizes}
        write_text_atomic(os.path.join(tag_dir, COMPLETE_MARKER), json.dumps(marker), durable=True)
        write_text_atomic(os.path.join(save_dir, LATEST), tag, durable=True)
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


def load_checkpoint(engine, load_dir: str, tag: str, *, load_optimizer: bool = True,
                    universal: Optional[dict] = None, files_checked: bool = False) -> dict:
    """Collective: restore the engine (and, unless `load_optimizer` is False, optimizer,
    LR schedule and counters) and this rank's RNG streams. Returns the client state.
    Every file is loaded weights_only first (safe_load: a hostile pickle is refused on every
    rank, never run), and DeepSpeed's own loads go through the same safe loader.

    `universal` (convert_to_universal's keyword arguments): the checkpoint was saved under
    another layout; rank 0 converts it to DeepSpeed's universal form, which every rank then
    loads (the engine was built with `checkpoint.load_universal`). `files_checked`: the
    caller chose `tag` with `select_readable_checkpoint`, which ran the same check."""
    # Before anything unpickles the files (DeepSpeed's ds_to_universal loads them weights_only=False).
    if not files_checked:
        check_checkpoint_files(os.path.join(load_dir, tag))
    ds_dir, ds_tag = load_dir, tag
    if universal is not None:
        error = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                convert_to_universal(load_dir, tag, **universal)
            except (ConfigError, OSError) as exc:
                error = exc
        failed = torch.tensor([float(error is not None)], device=default_device())
        if dist.is_initialized():
            dist.all_reduce(failed)
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError(f"--load {load_dir}: rank 0 could not convert {tag} to a universal checkpoint")
        ds_dir, ds_tag = os.path.join(load_dir, tag), UNIVERSAL
        check_checkpoint_files(os.path.join(ds_dir, ds_tag))  # DeepSpeed's universal loader: weights_only=False
    use_safe_checkpoint_engine(engine)
    path, client_state = engine.load_checkpoint(
        ds_dir, tag=ds_tag, load_optimizer_states=load_optimizer, load_lr_scheduler_states=load_optimizer,
        load_module_only=not load_optimizer)
    if path is None:
        raise RuntimeError(f"--load {load_dir}: DeepSpeed could not load checkpoint {tag}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_path = os.path.join(load_dir, tag, "rng", f"rank_{rank:05d}.pt")
    if load_optimizer:
        if os.path.isfile(rng_path):
            load_rng_state_dict(safe_torch_load(rng_path))
        else:
            warnings.warn(f"{rng_path} is missing (saved by a job of another size?): RNG streams start from "
                          f"--seed, so the run will not continue bit-identically")
    return client_state or {}
