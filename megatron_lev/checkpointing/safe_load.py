"""Reading `.pt` files without running their code (docs/security.md).

A `.pt` file is a pickle, and unpickling may call any Python function. Every checkpoint
file this package reads goes through `safe_torch_load`: `torch.load(weights_only=True)`
with an allow-list of exactly the non-torch types our own files hold (measured on
checkpoints of every layout: TP, PP, ZeRO-1/2/3, fp32 and bf16):

    numpy's RNG state             the per-rank rng/rank_*.pt files (np.random.get_state())
    LossScaler, ZeroStageEnum     DeepSpeed's ZeRO-2/3 and bf16 optimizer state files
    fragment_address              DeepSpeed's bf16 optimizer state files

Anything else is refused with one line naming the file and the callable it would run.

DeepSpeed reads checkpoints with `weights_only=False`. `check_checkpoint_files` loads every
`.pt` file of a checkpoint safely first (memory-mapped: only the pickles are parsed, no
tensor bytes are read), and `use_safe_checkpoint_engine` makes DeepSpeed's own loads go
through `safe_torch_load` too.

Hugging Face folders run code of their own too: megatron_lev/hf/trust.py decides which may.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import os
import pickle
import re
import zipfile

import torch


class CheckpointLoadError(ValueError):
    """A checkpoint file that cannot be read (damaged, truncated, not a torch file)."""


class UnsafeCheckpointError(CheckpointLoadError):
    """A checkpoint file whose pickle needs a callable outside the allow-list."""


@functools.lru_cache(maxsize=None)
def allowed_globals() -> tuple:
    """The non-torch types our checkpoint files hold, as `torch.serialization.safe_globals` takes them.
    DeepSpeed's only where DeepSpeed imports: a Megatron-LM environment converts its checkpoints
    without it (docs/megatron-lm.md), and a file that names them is then refused like any other."""
    import numpy as np

    reconstruct = np.ndarray.__reduce__(np.zeros(0))[0]  # numpy.(_)core.multiarray._reconstruct
    allowed = (
        # numpy 2 pickles the array rebuilder as numpy._core..., numpy 1 as numpy.core...
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray, np.dtype, type(np.dtype(np.uint32)),  # the MT19937 key: a uint32 array
    )
    try:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return allowed
    return (*allowed, LossScaler, ZeroStageEnum, fragment_address)


@contextlib.contextmanager
def allowing(extra_globals) -> "contextlib.AbstractContextManager[None]":
    """`torch.serialization.safe_globals(extra_globals)` that leaves the process's own allow-list
    as it found it. torch's context manager removes every listed type on exit, also those that
    were allowed before it: megatron-core allows argparse.Namespace, numpy's arrays and more for
    the whole process when imported, and its own loads then fail once we have loaded a file."""
    already = set(torch.serialization.get_safe_globals())
    with torch.serialization.safe_globals([g for g in extra_globals if g not in already]):
        yield


def safe_torch_load(path: str, map_location="cpu", mmap: bool = False):
    """`torch.load(path, weights_only=True)` with our allow-list. Raises UnsafeCheckpointError
    (a pickle that would call anything else) or CheckpointLoadError (an unreadable file),
    one line naming the file; the pickle's code never runs."""
    if not os.path.isfile(path):
        raise CheckpointLoadError(f"{path}: no such file")
    # mmap needs torch's zip format (DeepSpeed's default); a legacy file is read whole.
    mmap = mmap and zipfile.is_zipfile(path)
    try:
        with allowing(allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        message = str(exc)
        if "Weights only load failed" in message:  # torch's wording for every refusal
            called = re.search(r"GLOBAL (\S+)", message)
            detail = re.search(r"WeightsUnpickler error: ([^\n]+)", message)
            what = (f"would call {called.group(1)}, which is not a type our checkpoints hold" if called else
                    f"does what a weights-only load forbids ({detail.group(1) if detail else 'unpickling error'})")
            raise UnsafeCheckpointError(f"{path}: refused: loading it {what} (torch.load weights_only); it may be "
                                        "hostile or not written by megatron_lev (docs/security.md)") from None
        raise CheckpointLoadError(f"{path}: cannot be read ({message.splitlines()[0]})") from None
    except Exception as exc:  # truncated, damaged or not a torch file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointLoadError(f"{path}: cannot be read, damaged or truncated ({type(exc).__name__}: {first})") from None


def checkpoint_files(tag_dir: str) -> list[str]:
    """Every .pt file of one checkpoint directory (DeepSpeed's shards, our RNG files, and
    the per-parameter files of a universal checkpoint), sorted."""
    return sorted(glob.glob(os.path.join(glob.escape(tag_dir), "**", "*.pt"), recursive=True))


def check_checkpoint_files(tag_dir: str) -> None:
    """Load every .pt file of a checkpoint with `safe_torch_load` (memory-mapped: the pickles
    are parsed, the tensor bytes are not read) and raise the first error.

    Collective when torch.distributed is initialised: each rank checks its share of the
    files and every rank raises the same error, so no rank is left waiting in DeepSpeed."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    error = None
    for path in checkpoint_files(tag_dir)[rank::world]:
        try:
            safe_torch_load(path, mmap=True)
        except CheckpointLoadError as exc:
            error = (type(exc).__name__, str(exc))
            break
    if distributed and world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        kind, message = error
        raise (UnsafeCheckpointError if kind == UnsafeCheckpointError.__name__ else CheckpointLoadError)(message)


def use_safe_checkpoint_engine(engine) -> None:
    """Make a DeepSpeed engine read checkpoints with `safe_torch_load` (its default
    TorchCheckpointEngine loads with weights_only=False). Other engines (a configured
    fast or decoupled writer) are left alone: `check_checkpoint_files` still guards them."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if type(engine.checkpoint_engine) is TorchCheckpointEngine:
        # Same object and settings (serialization format), only `load` replaced.
        engine.checkpoint_engine.__class__ = _safe_engine_class()


@functools.lru_cache(maxsize=None)
def _safe_engine_class():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch.save/torch.load engine, loading through `safe_torch_load`."""

        def load(self, path: str, map_location=None):
            return safe_torch_load(path, map_location=map_location)

    return SafeTorchCheckpointEngine
