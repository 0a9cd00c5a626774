"""How a LeviathanModel's parameters are laid out over tensor-parallel ranks, and the *full*
state dict that does not depend on the layout.

A full state dict holds every parameter of `LeviathanModel` (models/decoder.py) under its plain
name (`layers.3.attention.qkv.weight`, ...) as one whole tensor, with the vocabulary unpadded
(`embedding.weight` / `output_layer.weight` have `vocab_size` rows). It is the meeting point of
every conversion: training checkpoints (convert.py), DeepSpeed's universal checkpoints
(universal.py) and Hugging Face folders (megatron_lev/hf/).

How each parameter is split over tensor-parallel ranks is `partition_of` below, the table of
models/decoder.py's docstring: column-parallel weights along dim 0 (gate_up with megatron's
stride 2), row-parallel ones along dim 1, LEV heads along dim 0, vocabulary tables along dim 0
with padding, the rest replicated. Replicated tensors must be identical on every TP rank; a
checkpoint where they are not is refused (it would mean the ranks trained different models).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_lev.lev.generator import HEAD_SHARDED_PARAMETERS, REPLICATED_PARAMETERS
from megatron_lev.models.config import LeviathanConfig
from megatron_lev.models.decoder import merge_tensor_parallel_shards
from megatron_lev.utils.errors import CheckpointError

# Where the decoder's LEV embedding (lev.parallel.ParallelLEVEmbedding) keeps the generator's parameters.
LEV_PREFIX = "embedding.generator."
# The factorised input side's r -> hidden projection (models/layers.FactorizedEmbedding); its
# V x r table is `embedding.weight`, split over the vocabulary like every table.
FACTORIZED_PROJECTION = "embedding.projection.weight"


@dataclass(frozen=True)
class Partition:
    """How one parameter is split over tensor-parallel ranks.

    dim None: replicated. stride 2: megatron's strided split of a fused [a; b] weight, where
    rank r holds [a_r; b_r]. vocab: the rows are the (padded) vocabulary.
    """

    dim: Optional[int]
    stride: int = 1
    vocab: bool = False


REPLICATED = Partition(None)


_LAYER_PARTITIONS = {
    "input_norm.weight": REPLICATED,
    "attention.qkv.weight": Partition(0),
    "attention.out_proj.weight": Partition(1),
    "mlp_norm.weight": REPLICATED,
    "mlp.gate_up.weight": Partition(0, stride=2),
    "mlp.down.weight": Partition(1),
}
_QK_NORM_PARTITIONS = {"attention.q_norm.weight": REPLICATED, "attention.k_norm.weight": REPLICATED}  # qk_layernorm


_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")


def is_extra_state(name: str) -> bool:
    """megatron-core's `_extra_state` entries (None for our layers): not weights, never converted."""
    return name.endswith("._extra_state") or name == "_extra_state"


def partition_of(name: str, embedding: str) -> Partition:
    """The TP partition of a LeviathanModel parameter (models/decoder.py's docstring table)."""
    match = _LAYER_KEY.match(name)
    if match and match.group(2) in _LAYER_PARTITIONS:
        return _LAYER_PARTITIONS[match.group(2)]
    if match and match.group(2) in _QK_NORM_PARTITIONS:
        return _QK_NORM_PARTITIONS[match.group(2)]
    if name == "final_norm.weight":
        return REPLICATED
    if name == "output_layer.weight" and embedding != "tied":
        return Partition(0, vocab=True)
    if embedding == "lev" and name.startswith(LEV_PREFIX):
        param = name[len(LEV_PREFIX):]
        if param in HEAD_SHARDED_PARAMETERS:
            return Partition(0)
        if param in REPLICATED_PARAMETERS:
            return REPLICATED
    if embedding != "lev" and name == "embedding.weight":
        return Partition(0, vocab=True)
    if embedding == "factorized" and name == FACTORIZED_PROJECTION:
        return REPLICATED
    raise CheckpointError(f"unknown parameter {name!r} for an embedding={embedding!r} model: the checkpoint "
                          "does not come from this version of megatron_lev.models")


def layer_parameter_suffixes(config: LeviathanConfig) -> list[str]:
    """A decoder layer's parameter names after `layers.i.`, in the model's order."""
    suffixes = list(_LAYER_PARTITIONS)
    if config.qk_layernorm:
        suffixes[3:3] = list(_QK_NORM_PARTITIONS)  # the attention's, after its out_proj
    return suffixes


def expected_parameter_names(config: LeviathanConfig) -> list[str]:
    """Every parameter name of a LeviathanModel with this config (what a full state dict holds)."""
    if config.embedding == "lev":
        names = [LEV_PREFIX + p for p in config.lev_config().parameter_names()]
    else:
        names = ["embedding.weight"] + ([FACTORIZED_PROJECTION] if config.embedding == "factorized" else [])
    for i in range(config.num_layers):
        names += [f"layers.{i}.{suffix}" for suffix in layer_parameter_suffixes(config)]
    names.append("final_norm.weight")
    if config.embedding != "tied":
        names.append("output_layer.weight")
    return names


def _split_strided(t: torch.Tensor, dim: int, stride: int) -> list[torch.Tensor]:
    return list(t.chunk(stride, dim=dim))


def merge_tp_shards(name: str, shards: list[torch.Tensor], part: Partition, source: str,
                    replicated_atol: float = 0.0) -> torch.Tensor:
    """TP rank shards of one parameter -> the whole tensor (padding rows still in)."""
    if part.dim is None:
        for rank, shard in enumerate(shards[1:], start=1):
            if shard.shape != shards[0].shape or not torch.allclose(shard, shards[0], rtol=0, atol=replicated_atol):
                diff = ((shard.float() - shards[0].float()).abs().max().item()
                        if shard.shape == shards[0].shape else f"shapes {tuple(shards[0].shape)} vs {tuple(shard.shape)}")
                raise CheckpointError(
                    f"{source}: replicated parameter {name} differs between tensor-parallel ranks 0 and {rank} "
                    f"(max |diff| {diff}): the ranks did not train one model")
        return shards[0]
    return merge_tensor_parallel_shards(shards, part.dim, part.stride)


def split_for_tp(full: torch.Tensor, part: Partition, tp: int, rank: int) -> torch.Tensor:
    """The whole tensor -> TP rank `rank`'s shard (inverse of merge_tp_shards)."""
    if part.dim is None:
        return full
    if full.shape[part.dim] % (tp * part.stride):
        raise CheckpointError(f"dim {part.dim} of size {full.shape[part.dim]} cannot be split over "
                              f"{tp} tensor-parallel ranks (stride {part.stride})")
    if part.stride == 1:
        return full.chunk(tp, dim=part.dim)[rank]
    return torch.cat([piece.chunk(tp, dim=part.dim)[rank] for piece in _split_strided(full, part.dim, part.stride)],
                     dim=part.dim)


def trim_vocab(t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return t[:vocab_size].clone() if t.shape[0] > vocab_size else t


def pad_vocab(t: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """Append zero rows (the model keeps padding rows at zero; their logits are masked to -inf)."""
    if t.shape[0] > padded_vocab_size:
        raise CheckpointError(f"a vocabulary table of {t.shape[0]} rows does not fit the padded vocabulary "
                              f"{padded_vocab_size}")
    if t.shape[0] == padded_vocab_size:
        return t
    return torch.cat([t, t.new_zeros(padded_vocab_size - t.shape[0], *t.shape[1:])])


def shard_for_rank(full: dict[str, torch.Tensor], config: LeviathanConfig, tp_rank: int) -> dict[str, torch.Tensor]:
    """The TP rank's slice of every tensor of a full state dict, vocabulary padded for
    `config`'s TP size (LeviathanModel names)."""
    tp = config.tensor_model_parallel_size
    out = {}
    for name, tensor in full.items():
        part = partition_of(name, config.embedding)
        if part.vocab:
            tensor = pad_vocab(tensor, config.padded_vocab_size)
        out[name] = split_for_tp(tensor, part, tp, tp_rank)
    return out


@torch.no_grad()
def load_full_state_dict(module: torch.nn.Module, full: dict[str, torch.Tensor], config: LeviathanConfig,
                         tp_rank: int, to_model_key: Callable[[str], str] = lambda name: name) -> None:
    """Copy this TP rank's slices of a full state dict into `module`'s parameters.

    `module` is a LeviathanModel, or a pipeline stage (`to_model_key` maps its names to
    LeviathanModel names, e.g. `lambda n: pipeline_to_model_key(n, num_layers)`). Every
    parameter of the module must be found, with the right shape.
    """
    shards = shard_for_rank(full, config, tp_rank)
    for name, tensor in module.state_dict(keep_vars=True).items():
        if is_extra_state(name):
            continue
        key = to_model_key(name)
        if key not in shards:
            raise CheckpointError(f"the state dict has no {key!r} (module parameter {name!r})")
        if shards[key].shape != tensor.shape:
            raise CheckpointError(f"{key}: the state dict gives shape {tuple(shards[key].shape)} for TP rank "
                                  f"{tp_rank}, the module has {tuple(tensor.shape)}")
        tensor.copy_(shards[key])
