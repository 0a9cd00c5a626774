"""Reading a training checkpoint of any parallel layout into one *full* state dict.

The full state dict (layout.py) does not depend on TP, PP or ZeRO, so it is the meeting point
of every conversion:

    training checkpoint (any TP, PP, ZeRO stage)  --read_checkpoint-->  full state dict
    full state dict  --shard_for_rank / load_full_state_dict-->  a model at any TP / PP
    full state dict  <-->  Hugging Face (megatron_lev/hf/export.py)

Checkpoint layouts read (written by `megatron_lev.train` through DeepSpeed, see catalog.py and save.py):

    plain     PP = 1, ZeRO 1/2   mp_rank_{tp:02d}_model_states.pt, "module" = the rank's state dict
    zero3     PP = 1, ZeRO 3     zero_pp_rank_{dp}_mp_rank_{tp:02d}_{model,optim}_states.pt: the fp32
                                 weights are rebuilt from the optimizer partitions with DeepSpeed's
                                 zero_to_fp32, one tensor-parallel rank at a time
    pipeline  PP > 1             layer_{index:02d}-model_{tp:02d}-model_states.pt, one file per pipeline
                                 layer and TP rank (models/pipeline.py maps the names)
"""
from __future__ import annotations

import glob
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_lev.checkpointing.catalog import (COMPLETE_MARKER, CONFIG_FILE, checkpoint_tag, complete_checkpoints,
                                                find_latest, is_complete, read_checkpoint_config, tag_iteration)
from megatron_lev.checkpointing.layout import (expected_parameter_names, is_extra_state, merge_tp_shards, partition_of,
                                               trim_vocab)
from megatron_lev.checkpointing.safe_load import safe_torch_load
from megatron_lev.models.config import LeviathanConfig, model_config_from_dict, pad_vocab_size
from megatron_lev.utils.errors import CheckpointError


@dataclass
class CheckpointInfo:
    """What a training checkpoint is: where, which iteration, which model and layout."""

    load_dir: str
    tag: str
    iteration: int
    config: dict  # the effective run configuration (checkpointing.CONFIG_FILE)
    model_section: dict  # resolved YAML `model:` section
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    zero_stage: int
    layout: str  # plain | zero3 | pipeline

    @property
    def path(self) -> str:
        return os.path.join(self.load_dir, self.tag)

    @property
    def seq_length(self) -> int:
        """The context the run trained with: its --seq-length (the `training:` section). The
        YAML `model:` section's seq_length is only a default the flag overrides; checkpoints
        without a training value fall back to it."""
        trained = (self.config.get("training") or {}).get("seq_length")
        return int(trained or self.model_section.get("seq_length") or LeviathanConfig.seq_length)

    def model_config(self, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                     bf16: bool = False) -> LeviathanConfig:
        """The model, with the run's context length (exports write it as max_position_embeddings)."""
        return model_config_from_dict(self.model_section, tensor_model_parallel_size=tensor_model_parallel_size,
                                      pipeline_model_parallel_size=pipeline_model_parallel_size, bf16=bf16,
                                      seq_length=self.seq_length)


def find_checkpoint(load_dir: str, iteration: Optional[int] = None) -> CheckpointInfo:
    """The checkpoint `--load DIR [--iteration N]` names: N's, else the newest complete one."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    if iteration is not None:
        tag = checkpoint_tag(iteration)
        if not os.path.isdir(os.path.join(load_dir, tag)):
            found = ", ".join(t for _, t in complete_checkpoints(load_dir)) or "none"
            raise CheckpointError(f"--load {load_dir} --iteration {iteration}: no directory {tag} "
                                  f"(complete checkpoints: {found})")
        if not is_complete(load_dir, tag):
            raise CheckpointError(f"{os.path.join(load_dir, tag)}: incomplete checkpoint (no "
                                  f"{COMPLETE_MARKER}: the job died while saving it)")
    else:
        damaged: list[tuple[str, str]] = []
        tag = find_latest(load_dir, skipped=damaged)
        if tag is None and damaged:
            newest, problem = damaged[0]
            raise CheckpointError(f"--load {load_dir}: checkpoint {newest} is damaged ({problem}) and no older "
                                  "complete checkpoint is intact")
        if damaged:
            print(f"warning: --load {load_dir}: converting {tag}; newer checkpoint {damaged[0][0]} is damaged "
                  f"({damaged[0][1]})", file=sys.stderr)
        if tag is None:
            raise CheckpointError(f"--load {load_dir}: no complete checkpoint (no iter_NNNNNNN/"
                                  f"{COMPLETE_MARKER}): is it a megatron_lev.train --save directory?")
    config_file = os.path.join(load_dir, tag, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise CheckpointError(f"{config_file}: missing: unknown checkpoint layout (not written by megatron_lev.train)")
    config = read_checkpoint_config(load_dir, tag)
    model_section = config.get("model_resolved") or config.get("model")
    training = config.get("training") or {}
    if not isinstance(model_section, dict) or "tensor_model_parallel_size" not in training:
        raise CheckpointError(f"{config_file}: unknown checkpoint layout: no model section or no "
                              "training.tensor_model_parallel_size")
    tp = int(training["tensor_model_parallel_size"])
    pp = int(training.get("pipeline_model_parallel_size") or 1)
    zero_stage = int((config.get("deepspeed") or {}).get("zero_optimization", {}).get("stage")
                     or training.get("zero_stage") or 1)
    layout = "pipeline" if pp > 1 else ("zero3" if zero_stage == 3 else "plain")
    return CheckpointInfo(load_dir=load_dir, tag=tag, iteration=tag_iteration(tag) or 0,
                          config=config, model_section=model_section, tensor_model_parallel_size=tp,
                          pipeline_model_parallel_size=pp, zero_stage=zero_stage, layout=layout)


def _torch_load(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing shard")
    return safe_torch_load(path)  # weights_only: a hostile pickle is refused, never run


def _plain_rank_state(info: CheckpointInfo, tp_rank: int) -> dict:
    path = os.path.join(info.path, f"mp_rank_{tp_rank:02d}_model_states.pt")
    state = _torch_load(path).get("module")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: has no 'module' state dict: unknown checkpoint layout")
    return {k: v for k, v in state.items() if not is_extra_state(k)}


def _zero3_rank_state(info: CheckpointInfo, tp_rank: int) -> dict:
    """One TP rank's fp32 weights from its ZeRO-3 partitions (DeepSpeed's zero_to_fp32).

    zero_to_fp32 reads every *_model_states.pt / *_optim_states.pt of a directory as one
    data-parallel group, so each TP rank's files are linked into a directory of their own.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    suffix = f"mp_rank_{tp_rank:02d}"
    model_files = sorted(glob.glob(os.path.join(info.path, f"zero_pp_rank_*_{suffix}_model_states.pt")))
    optim_files = sorted(glob.glob(os.path.join(info.path, f"*zero_pp_rank_*_{suffix}_optim_states.pt")))
    dp = int((info.config.get("training") or {}).get("data_parallel_size") or len(model_files) or 1)
    for dp_rank in range(dp):
        for kind, files in (("model", model_files), ("optim", optim_files)):
            if not any(re.search(rf"zero_pp_rank_{dp_rank}_{suffix}_{kind}_states\.pt$", f) for f in files):
                raise CheckpointError(f"{os.path.join(info.path, f'zero_pp_rank_{dp_rank}_{suffix}_{kind}_states.pt')}: "
                                      f"missing shard (ZeRO-3, data-parallel rank {dp_rank} of {dp})")
    for f in model_files + optim_files:  # zero_to_fp32 unpickles them with weights_only=False
        safe_torch_load(f, mmap=True)
    with tempfile.TemporaryDirectory(prefix="megatron_lev_zero3_") as tmp:
        os.makedirs(os.path.join(tmp, info.tag))
        for f in model_files + optim_files:
            os.symlink(os.path.abspath(f), os.path.join(tmp, info.tag, os.path.basename(f)))
        try:
            state = get_fp32_state_dict_from_zero_checkpoint(tmp, tag=info.tag)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{info.path}: ZeRO-3 shards of tensor-parallel rank {tp_rank} cannot be "
                                  f"merged ({exc})") from None
    return {k: v for k, v in state.items() if not is_extra_state(k)}


def _pipeline_rank_state(info: CheckpointInfo, tp_rank: int, config: LeviathanConfig) -> dict:
    from megatron_lev.models.pipeline import pipeline_to_model_key

    state = {}
    num_layers = config.num_layers
    # Layer index L + 2 is the head; for `tied` it is the embedding module again (a function, no file).
    last = num_layers + 1 if config.embedding == "tied" else num_layers + 2
    for index in range(last + 1):
        path = os.path.join(info.path, f"layer_{index:02d}-model_{tp_rank:02d}-model_states.pt")
        for key, value in _torch_load(path).items():
            name = pipeline_to_model_key(f"{index}.{key}", num_layers)
            if not is_extra_state(name):
                state[name] = value
    return state


def _check_layout_files(info: CheckpointInfo) -> None:
    """Refuse a directory whose files are not the layout its config.json announces."""
    patterns = {"plain": "mp_rank_*_model_states.pt", "zero3": "zero_pp_rank_*_model_states.pt",
                "pipeline": "layer_*-model_*-model_states.pt"}
    if not glob.glob(os.path.join(info.path, patterns[info.layout])):
        present = sorted(os.path.basename(p) for p in glob.glob(os.path.join(info.path, "*")))
        raise CheckpointError(
            f"{info.path}: unknown checkpoint layout: its config says TP={info.tensor_model_parallel_size}, "
            f"PP={info.pipeline_model_parallel_size}, ZeRO-{info.zero_stage} ({info.layout}: "
            f"{patterns[info.layout]}) but it holds {', '.join(present[:8]) or 'no files'}")


def read_checkpoint(info: CheckpointInfo, replicated_atol: float = 0.0) -> dict[str, torch.Tensor]:
    """The full state dict (LeviathanModel names, vocabulary unpadded) of a training checkpoint."""
    _check_layout_files(info)
    config = info.model_config()
    tp = info.tensor_model_parallel_size
    ranks = []
    from megatron_lev.utils.progress import progress_bar

    for tp_rank in progress_bar(range(tp), f"reading {info.path}", unit="TP rank"):
        if info.layout == "pipeline":
            ranks.append(_pipeline_rank_state(info, tp_rank, config))
        elif info.layout == "zero3":
            ranks.append(_zero3_rank_state(info, tp_rank))
        else:
            ranks.append(_plain_rank_state(info, tp_rank))
    expected = expected_parameter_names(config)
    for tp_rank, state in enumerate(ranks):
        missing = [n for n in expected if n not in state]
        unknown = [n for n in state if n not in expected]
        if missing or unknown:
            what = f"missing {missing[:3]}" if missing else f"unexpected {unknown[:3]}"
            raise CheckpointError(f"{info.path}: tensor-parallel rank {tp_rank} of {tp}: {what} for the "
                                  f"embedding={config.embedding!r}, {config.num_layers}-layer model of its config")
    padded = pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, tp)
    full = {}
    for name in expected:
        part = partition_of(name, config.embedding)
        tensor = merge_tp_shards(name, [state[name] for state in ranks], part, info.path, replicated_atol)
        if part.vocab:
            if tensor.shape[0] != padded:
                raise CheckpointError(f"{info.path}: {name} has {tensor.shape[0]} rows over {tp} ranks, expected "
                                      f"the padded vocabulary {padded}")
            tensor = trim_vocab(tensor, config.vocab_size)
        full[name] = tensor.contiguous()
    return full


def load_checkpoint_full(load_dir: str, iteration: Optional[int] = None) -> tuple[dict[str, torch.Tensor], CheckpointInfo]:
    """`read_checkpoint(find_checkpoint(load_dir, iteration))`, with its info."""
    info = find_checkpoint(load_dir, iteration)
    return read_checkpoint(info), info
