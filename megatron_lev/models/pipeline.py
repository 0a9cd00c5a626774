"""The Leviathan model as a DeepSpeed `PipelineModule`, for pipeline parallelism (PP >= 1).

The layers are the plain model's modules (model.py), subclassed only to pass tuples between
stages, so weights, initialisation and numerics are the same. Layer list (index: module):

    0             embedding      (TiedLayerSpec "embedding" for tied)   ids -> (hidden, position_ids)
    1 .. L        DecoderLayerPipe, one per decoder layer              (hidden, pos) -> (hidden, pos)
    L + 1         FinalNormPipe                                        (hidden, pos) -> hidden
    L + 2         output head    (for tied: the "embedding" tied module again, via forward_fn)
    loss_fn       pipeline_loss(logits, (labels, loss_mask))  -> float32 masked-mean loss

Data-iterator batches (what `engine.train_batch(data_iter)` reads), per micro-batch:

    ((input_ids [b, s] int64, position_ids [b, s] int64), (labels [b, s] int64, loss_mask [b, s] float))

`position_ids` may be left out (`(input_ids,)` or a bare `input_ids`): positions are then
0..s-1. `loss_mask` may be left out too (a bare `labels`): every token counts.

Stages are cut so each gets an equal share of decoder layers (`partition_method=
"type:DecoderLayerPipe"`); the embedding goes with the first, norm and head with the last.
Topology: `parallel.pipe_topology(tp, pp)`, the same rank order as megatron-core's groups.
Build the engine with `deepspeed.initialize(model=pipe, mpu=None, ...)` (ZeRO 0/1).

Parameter names, pipeline form <-> plain form (`pipeline_to_model_key`, `model_to_pipeline_key`):

    0.<rest>                         <-> embedding.<rest>          (lev, untied, factorized)
    tied_modules.embedding.<rest>    <-> embedding.<rest>          (tied)
    tied_modules.embedding.output_layer.<rest> <-> output_layer.<rest>   (tied; no parameters)
    {i + 1}.<rest>                   <-> layers.{i}.<rest>
    {L + 1}.weight                   <-> final_norm.weight
    {L + 2}.<rest>                   <-> output_layer.<rest>       (lev, untied, factorized)

(A DeepSpeed engine's own `state_dict` prefixes these with `module.`; strip it first.)
With PP=1 the plain `LeviathanModel` is the form to use under ZeRO 1/2/3.
"""
from __future__ import annotations

import re
from typing import Optional

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from megatron_lev.distributed.state import pipe_topology
from megatron_lev.lev.parallel import ParallelLEVEmbedding
from megatron_lev.models.config import LeviathanConfig
from megatron_lev.models.cross_entropy import language_model_loss
from megatron_lev.models.layers import (FactorizedEmbedding, OutputLayer, RMSNorm, VocabEmbedding, checkpoint,
                                        default_position_ids, lev_embedding_kwargs, model_rotary_cos_sin)
from megatron_lev.models.transformer import DecoderLayer

TIED_KEY = "embedding"


def _stage0_inputs(inputs):
    """input_ids | (input_ids,) | (input_ids, position_ids[, lev_ids, lev_inverse])
    -> (input_ids, position_ids, (lev_ids, lev_inverse) or ())."""
    if torch.is_tensor(inputs):
        inputs = (inputs,)
    if len(inputs) not in (1, 2, 4):
        raise ValueError(f"pipeline inputs: expected (input_ids[, position_ids[, lev_ids, lev_inverse]]), "
                         f"got {len(inputs)} tensors")
    input_ids = inputs[0]
    position_ids = inputs[1] if len(inputs) >= 2 else default_position_ids(input_ids).contiguous()
    return input_ids, position_ids, tuple(inputs[2:])


class _EmbeddingPipe:
    """Mixin: the first stage's embedding takes the batch's inputs, emits (hidden, positions)."""

    def forward(self, inputs):
        input_ids, position_ids, _ = _stage0_inputs(inputs)
        return super().forward(input_ids), position_ids


class VocabEmbeddingPipe(_EmbeddingPipe, VocabEmbedding):
    pass


class FactorizedEmbeddingPipe(_EmbeddingPipe, FactorizedEmbedding):
    pass


class TiedEmbeddingPipe(VocabEmbeddingPipe):
    """The tied table: the embedding on the first stage, the head (`head_forward`) on the last.
    DeepSpeed keeps one copy per stage and all-reduces their gradients."""

    def __init__(self, config: LeviathanConfig):
        super().__init__(config)
        self.output_layer = OutputLayer(config)  # weightless: the table is `self.weight`

    @staticmethod
    def head_forward(module: "TiedEmbeddingPipe", hidden: torch.Tensor) -> torch.Tensor:
        return module.output_layer(hidden, module.weight)


class LEVEmbeddingPipe(ParallelLEVEmbedding):
    def __init__(self, config: LeviathanConfig):
        super().__init__(**lev_embedding_kwargs(config))

    def forward(self, inputs):
        """Also takes the data loader's distinct ids (train.PipelineBatches sends them): no sync."""
        input_ids, position_ids, lev = _stage0_inputs(inputs)
        return super().forward(input_ids, *lev), position_ids


class DecoderLayerPipe(DecoderLayer):
    def forward(self, inputs):
        hidden, position_ids = inputs
        cos, sin = model_rotary_cos_sin(position_ids, self.config)
        return super().forward(hidden, cos, sin), position_ids


class FinalNormPipe(RMSNorm):
    def forward(self, inputs):
        return super().forward(inputs[0])


class OutputLayerPipe(OutputLayer):
    def forward(self, hidden):
        return super().forward(hidden)


def pipeline_loss(logits: torch.Tensor, labels) -> torch.Tensor:
    """DeepSpeed's loss_fn: logits [s, b, Vp/TP] and (labels, loss_mask) or labels."""
    if torch.is_tensor(labels):
        return language_model_loss(logits, labels)
    labels, loss_mask = labels
    return language_model_loss(logits, labels, loss_mask)


def layer_specs(config: LeviathanConfig) -> list:
    """The pipeline's layer list (see the module docstring)."""
    if config.embedding == "tied":
        embedding = TiedLayerSpec(TIED_KEY, TiedEmbeddingPipe, config, tied_weight_attr=["weight"])
        head = TiedLayerSpec(TIED_KEY, TiedEmbeddingPipe, config, tied_weight_attr=["weight"],
                             forward_fn=TiedEmbeddingPipe.head_forward)
    else:
        embedding = LayerSpec({"lev": LEVEmbeddingPipe, "factorized": FactorizedEmbeddingPipe}.get(
            config.embedding, VocabEmbeddingPipe), config)
        head = LayerSpec(OutputLayerPipe, config)
    return [
        embedding,
        *(LayerSpec(DecoderLayerPipe, config, i) for i in range(config.num_layers)),
        LayerSpec(FinalNormPipe, config.hidden_size, config.layernorm_epsilon, config.params_dtype),
        head,
    ]


def build_pipeline_model(config: LeviathanConfig, activation_checkpoint_interval: Optional[int] = None,
                         topology=None) -> PipelineModule:
    """The PipelineModule over this job's ranks (megatron-core's groups must be initialised).

    activation_checkpoint_interval: recompute every N decoder layers; None derives it from the
    config (recompute_granularity "full" + "uniform" -> recompute_num_layers, else 0).
    """
    if activation_checkpoint_interval is None:
        activation_checkpoint_interval = (
            config.recompute_num_layers
            if config.recompute_granularity == "full" and config.recompute_method == "uniform" else 0)
    if config.recompute_granularity == "full" and config.recompute_method == "block":
        raise ValueError("recompute_method 'block' is not available in the pipeline form; use 'uniform'")
    # DeepSpeed's comm layer must wrap the already started torch.distributed (idempotent).
    deepspeed.comm.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)
    topology = topology or pipe_topology(config.tensor_model_parallel_size,
                                         config.pipeline_model_parallel_size)
    if topology.get_dim("pipe") != config.pipeline_model_parallel_size:
        raise ValueError(f"topology has {topology.get_dim('pipe')} pipeline stages, config has "
                         f"--pipeline-model-parallel-size {config.pipeline_model_parallel_size}")
    return PipelineModule(
        layers=layer_specs(config),
        topology=topology,
        loss_fn=pipeline_loss,
        partition_method="type:DecoderLayerPipe",
        activation_checkpoint_interval=activation_checkpoint_interval,
        activation_checkpoint_func=checkpoint,
        checkpointable_layers=["DecoderLayerPipe"],
    )


# --------------------------------------------------------------------------- name mapping

_PIPE_INDEX = re.compile(r"^(\d+)\.(.+)$")
_TIED_PREFIX = f"tied_modules.{TIED_KEY}."


def pipeline_to_model_key(name: str, num_layers: int) -> str:
    """A PipelineModule parameter/state name -> the LeviathanModel name (see module docstring)."""
    if name.startswith(_TIED_PREFIX):
        rest = name[len(_TIED_PREFIX):]
        return rest if rest.startswith("output_layer.") else f"embedding.{rest}"
    match = _PIPE_INDEX.match(name)
    if not match:
        raise ValueError(f"{name!r} is not a pipeline parameter name (expected '<layer index>.<name>')")
    index, rest = int(match.group(1)), match.group(2)
    if index == 0:
        return f"embedding.{rest}"
    if index <= num_layers:
        return f"layers.{index - 1}.{rest}"
    if index == num_layers + 1:
        return f"final_norm.{rest}"
    if index == num_layers + 2:
        return f"output_layer.{rest}"
    raise ValueError(f"{name!r}: layer index {index} is past the head ({num_layers + 2}) of a "
                     f"{num_layers}-layer model")


def model_to_pipeline_key(name: str, num_layers: int, tied: bool = False) -> str:
    """A LeviathanModel parameter/state name -> the PipelineModule name."""
    head, _, rest = name.partition(".")
    if head == "embedding":
        return f"{_TIED_PREFIX}{rest}" if tied else f"0.{rest}"
    if head == "layers":
        index, _, rest = rest.partition(".")
        if not index.isdigit() or int(index) >= num_layers:
            raise ValueError(f"{name!r}: no such layer in a {num_layers}-layer model")
        return f"{int(index) + 1}.{rest}"
    if head == "final_norm":
        return f"{num_layers + 1}.{rest}"
    if head == "output_layer":
        return f"{_TIED_PREFIX}output_layer.{rest}" if tied else f"{num_layers + 2}.{rest}"
    raise ValueError(f"{name!r} is not a LeviathanModel parameter name")
