"""Megatron-LM checkpoints of a GPTModel with the LEV embedding (models/gpt_lev.py) -> this
project's full state dict (layout.py), whatever tensor-parallel size they were saved with.

    full, source = read_mcore_checkpoint(load_dir, config, iteration=None)
    args = read_saved_args(iter_dir)        # the namespace Megatron-LM saved (megatron_lm/checkpoint.py reads it)

Layouts read (Megatron-LM's `--save` folder: `latest_checkpointed_iteration.txt`, `iter_NNNNNNN/`):

    torch_dist  iter_NNNNNNN/{.metadata, metadata.json, *.distcp}: megatron-core distributed
                checkpointing over torch.distributed.checkpoint (DCP). Every tensor is stored
                whole (global shape; per-layer tensors stacked as decoder.layers.<name> [L, ...]),
                so TP does not matter. Read without a process group (`dcp.load(no_dist=True)`).
    torch       iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt (legacy `--ckpt-format torch`), one
                file per TP rank: the "model" state dicts are merged over TP with the partition
                rules of layout.py. Pipeline-parallel legacy checkpoints are refused.

Safe loading: DCP's `.metadata` is a pickle; it is read by an unpickler that builds only the
DCP metadata types (anything else is refused, nothing runs). Tensor data is read by torch with
`weights_only=True`, after checking that every file `.metadata` names is there and long enough.
`common.pt` and a legacy file go through safe_load.safe_torch_load, with what Megatron-LM's saved
args hold also allowed (argparse's Namespace, megatron-core's enums, the exit signal). Optimizer
state and RNG entries are skipped.
"""
from __future__ import annotations

import argparse
import glob
import os
import pickle
import re
import warnings
from typing import Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lev.checkpointing.layout import expected_parameter_names, merge_tp_shards, partition_of, trim_vocab
from megatron_lev.checkpointing.safe_load import UnsafeCheckpointError, allowing, safe_torch_load
from megatron_lev.models.config import LeviathanConfig
from megatron_lev.models.mcore_args import from_mcore_name
from megatron_lev.utils.errors import CheckpointError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
_LEGACY_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_DCP_GLOBALS = {  # (module, name) that a DCP .metadata pickle may name; nothing else is built
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *(("torch.distributed.checkpoint.planner", n) for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")),
}


def find_iteration_dir(load_dir: str, iteration: Optional[int] = None) -> str:
    """A Megatron-LM --save folder (its tracker file, or `iteration`) or an iter_NNNNNNN folder ->
    the iteration folder."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    if _layout(load_dir) is not None:
        return load_dir
    if iteration is None:
        tracker = os.path.join(load_dir, TRACKER_FILE)
        if not os.path.isfile(tracker):
            raise CheckpointError(f"--load {load_dir}: neither a Megatron-LM checkpoint folder ({TRACKER_FILE}) "
                                  "nor an iter_NNNNNNN folder")
        text = open(tracker, encoding="utf-8").read().strip()
        if text == "release":
            path = os.path.join(load_dir, "release")
        elif text.isdigit():
            path = os.path.join(load_dir, f"iter_{int(text):07d}")
        else:
            raise CheckpointError(f"{tracker}: expected an iteration number or 'release', got {text[:40]!r}")
    else:
        path = os.path.join(load_dir, f"iter_{iteration:07d}")
    if not os.path.isdir(path) or _layout(path) is None:
        raise CheckpointError(f"{path}: no Megatron-LM checkpoint there (neither torch_dist's metadata.json nor "
                              "mp_rank_*/model_optim_rng.pt)")
    return path


def _layout(path: str) -> Optional[str]:
    if os.path.isfile(os.path.join(path, "metadata.json")) and os.path.isfile(os.path.join(path, ".metadata")):
        return "torch_dist"
    if glob.glob(os.path.join(path, "mp_rank_*", "model_optim_rng.pt")):
        return "torch"
    return None


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _DCP_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_dcp_metadata(iter_dir: str):
    """The DCP `.metadata` of a torch_dist checkpoint, unpickled with an allow-list."""
    path = os.path.join(iter_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            return _DCPMetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{path}: refused: loading it would build {exc}, which DCP metadata does not "
                                    "hold; it may be hostile (docs/security.md)") from None
    except (OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from None


def _read_torch_dist(iter_dir: str) -> dict[str, torch.Tensor]:
    """The model tensors of a torch_dist checkpoint, whole, layers unstacked (Megatron names)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class _Reader(dcp.FileSystemReader):
        def read_metadata(self):  # the safe unpickler instead of pickle.load
            metadata = read_dcp_metadata(iter_dir)
            metadata.storage_meta = getattr(metadata, "storage_meta", None)
            return metadata

    reader = _Reader(iter_dir)
    metadata = reader.read_metadata()
    _check_dcp_files(iter_dir, metadata)
    stacked = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in metadata.state_dict_metadata.items()
               if isinstance(meta, TensorStorageMetadata) and key.startswith(_MODEL_PREFIXES)}
    if not stacked:
        raise CheckpointError(f"{iter_dir}: a torch_dist checkpoint without model tensors (embedding.*, decoder.*)")
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(stacked, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"{iter_dir}: cannot be read, damaged ({_first_failure(exc)})") from None
    out = {}
    for key, tensor in stacked.items():
        if key.startswith("decoder.layers."):  # [num_layers, ...]: one entry per layer
            rest = key[len("decoder.layers."):]
            for i, layer in enumerate(tensor.unbind(0)):
                out[f"decoder.layers.{i}.{rest}"] = layer.clone()
        else:
            out[key] = tensor
    return out


def _check_dcp_files(iter_dir: str, metadata) -> None:
    """Every data file `.metadata` names is there and long enough (one line naming the first that
    is not), before DCP reads any."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            needed[path] = max(needed.get(path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = os.path.join(iter_dir, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing shard (named by {os.path.join(iter_dir, '.metadata')}): the "
                                  "checkpoint is incomplete")
        if os.path.getsize(path) < size:
            raise CheckpointError(f"{path}: truncated shard ({os.path.getsize(path)} bytes, .metadata needs {size})")


def _first_failure(exc: BaseException) -> str:
    """The first underlying error of a DCP CheckpointException (or `exc`), as one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        exc = getattr(inner, "exc", inner)
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _megatron_args_types() -> list:
    """What Megatron-LM's saved `args` hold beyond torch's own types: the Namespace, megatron-core's
    enums (args.model_type, args.attention_backend, ...) and the exit signal (args.exit_signal)."""
    import enum
    import signal

    from megatron.core import enums
    from megatron.core.transformer import enums as transformer_enums

    found = [argparse.Namespace, signal.Signals]
    for module in (enums, transformer_enums):
        found += [v for v in vars(module).values()
                  if isinstance(v, type) and issubclass(v, enum.Enum) and v.__module__ == module.__name__]
    return found


def _safe_legacy_load(path: str) -> dict:
    with allowing(_megatron_args_types()):
        return safe_torch_load(path)


def read_saved_args(iter_dir: str) -> Optional[argparse.Namespace]:
    """The argument namespace Megatron-LM saved with an iteration (torch_dist: common.pt; torch: the
    first rank's model_optim_rng.pt), loaded safely; None when the checkpoint holds none."""
    if _layout(iter_dir) == "torch_dist":
        path = os.path.join(iter_dir, "common.pt")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (every torch_dist checkpoint of Megatron-LM has one): the "
                                  "checkpoint is incomplete")
    else:
        path = sorted(glob.glob(os.path.join(iter_dir, "mp_rank_*", "model_optim_rng.pt")))[0]
    state = _safe_legacy_load(path)
    args = state.get("args") if isinstance(state, dict) else None
    return args if isinstance(args, argparse.Namespace) else None


def _read_legacy(iter_dir: str, config: LeviathanConfig, tp: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Merge the TP ranks' "model" state dicts of a legacy checkpoint (this project's names); `tp`:
    the tensor-parallel size it was saved with, when known (its saved arguments)."""
    ranks = {}
    for path in sorted(glob.glob(os.path.join(iter_dir, "mp_rank_*", "model_optim_rng.pt"))):
        match = _LEGACY_RANK_DIR.match(os.path.basename(os.path.dirname(path)))
        if not match:
            raise CheckpointError(f"{path}: unexpected folder name (mp_rank_TT or mp_rank_TT_PPP)")
        if match.group(2) is not None and int(match.group(2)) > 0:
            raise CheckpointError(f"{iter_dir}: a pipeline-parallel legacy checkpoint; convert it from "
                                  "--ckpt-format torch_dist (any PP) instead")
        ranks[int(match.group(1))] = path
    if tp is not None and sorted(ranks) != list(range(tp)):
        raise CheckpointError(f"{iter_dir}: tensor-parallel ranks {sorted(ranks)} of the {tp} the checkpoint was saved "
                              "with: the checkpoint is incomplete")
    if sorted(ranks) != list(range(len(ranks))):
        raise CheckpointError(f"{iter_dir}: tensor-parallel ranks {sorted(ranks)} are not 0..{len(ranks) - 1}")
    shards: dict[str, list] = {}
    for rank in range(len(ranks)):
        state = _safe_legacy_load(ranks[rank])
        model = state.get("model") if isinstance(state, dict) else None
        if not isinstance(model, dict):
            raise CheckpointError(f"{ranks[rank]}: no 'model' state dict (virtual pipeline 'model0' is not supported)")
        for key, tensor in model.items():
            name = _our_name(key, ranks[rank])
            if name is not None:
                shards.setdefault(name, []).append(tensor)
    return {name: merge_tp_shards(name, tensors, partition_of(name, config.embedding), iter_dir)
            for name, tensors in shards.items()}


def _our_name(key: str, source: str) -> Optional[str]:
    try:
        return from_mcore_name(key)
    except KeyError as exc:
        raise CheckpointError(f"{source}: {exc.args[0]}") from None


def read_mcore_checkpoint(load_dir: str, config: LeviathanConfig, iteration: Optional[int] = None,
                          tensor_model_parallel_size: Optional[int] = None) -> tuple[dict[str, torch.Tensor], str]:
    """A Megatron-LM GPTModel+LEV checkpoint -> (this project's full state dict for `config`, the
    iteration folder read). Names, the vocabulary (padding rows dropped) and shapes are checked;
    `tensor_model_parallel_size` (the saved arguments') that a legacy checkpoint has all its ranks."""
    if config.embedding != "lev":
        raise CheckpointError(f"model embedding {config.embedding!r}: Megatron-LM conversion is for LEV models")
    iter_dir = find_iteration_dir(load_dir, iteration)
    if _layout(iter_dir) == "torch_dist":
        full = {}
        for key, tensor in _read_torch_dist(iter_dir).items():
            name = _our_name(key, iter_dir)
            if name is not None:
                full[name] = tensor
    else:
        full = _read_legacy(iter_dir, config, tensor_model_parallel_size)
    expected = expected_parameter_names(config)
    missing, unexpected = sorted(set(expected) - set(full)), sorted(set(full) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{iter_dir}: does not hold the model of the config ("
                              + (f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}")
                              + f"; {len(missing)} missing, {len(unexpected)} unexpected)")
    full["output_layer.weight"] = trim_vocab(full["output_layer.weight"], config.vocab_size)
    _check_shapes(full, config, iter_dir)
    return {name: full[name] for name in expected}, iter_dir


def _check_shapes(full: dict[str, torch.Tensor], config: LeviathanConfig, source: str) -> None:
    h, f, dh = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    want = {"final_norm.weight": (h,), "output_layer.weight": (config.vocab_size, h)}
    lev = config.lev_config()
    heads, ds = lev.num_heads, lev.seed_dim
    want.update({f"layers.{i}.attention.{n}_norm.weight": (dh,) for i in range(config.num_layers) for n in "qk"
                 if config.qk_layernorm})
    want.update({f"embedding.generator.{k}": v for k, v in {
        "codebooks": (lev.num_coordinates, lev.base, ds), "w_seed": (heads, ds, ds), "ln_gamma": (heads, ds),
        "ln_beta": (heads, ds), "delta": (heads, ds, lev.num_knots, lev.num_modes),
        "w_out": (heads, lev.num_modes, h), **({"out_norm_weight": (h,)} if lev.output_norm else {}),
        **({"knot_scale": (heads, ds)} if lev.knot_scale_learnable else {}),
        **({"mode_offset": (heads, lev.num_modes)} if lev.center_modes else {})}.items()})
    for i in range(config.num_layers):
        want.update({f"layers.{i}.input_norm.weight": (h,), f"layers.{i}.mlp_norm.weight": (h,),
                     f"layers.{i}.attention.qkv.weight": ((config.num_attention_heads + 2 * config.num_query_groups) * dh, h),
                     f"layers.{i}.attention.out_proj.weight": (h, config.num_attention_heads * dh),
                     f"layers.{i}.mlp.gate_up.weight": (2 * f, h), f"layers.{i}.mlp.down.weight": (h, f)})
    for name, shape in want.items():
        if tuple(full[name].shape) != shape:
            raise CheckpointError(f"{source}: {name} has shape {tuple(full[name].shape)} but the config needs {shape} "
                                  "(pass the --config the model was trained with)")
