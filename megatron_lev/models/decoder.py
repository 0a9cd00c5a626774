"""The Leviathan decoder: a LLaMA-style transformer on megatron-core's tensor-parallel layers.

    embedding (LEV generator | vocab table | factorised table)  ->  num_layers x DecoderLayer
        ->  final_norm  ->  output_layer

Each DecoderLayer is pre-RMSNorm, RoPE self-attention (grouped-query optional) through
`F.scaled_dot_product_attention(is_causal=True)` and a SwiGLU MLP; no biases anywhere.
The input side is chosen by `embedding` (LEV_SPEC.md section 4):

    lev      LEV generator (lev.parallel.ParallelLEVEmbedding)   + untied head   (Leviathan, v2)
    tied     vocab-parallel table                                 = the head      (v2 baseline)
    untied   vocab-parallel table                                 + untied head   (v1 baseline;
             `freeze_input_embedding`: the table never trained, the floor of issue 42)
    factorized  vocab-parallel V x r table, r -> H projection     + untied head   (ALBERT's;
             r = `embedding_rank`; layers.FactorizedEmbedding says how it is initialised)

Why not megatron-core's GPTModel: its RoPE and attention assume CUDA. Everything here runs on
CPU (gloo) and on GPU, where SDPA picks flash kernels. The config *is* megatron-core's
`TransformerConfig` (subclassed with the few fields it lacks), so flags keep Megatron's names.

Layout inside is Megatron's `[s, b, h]` (sequence first). Inputs and outputs are batch first.

Initialisation does not depend on the parallel layout: every module draws its *full* weights
from its own generator, seeded by `derive_seed(config.init_seed, <module name>)`, and keeps its
tensor-parallel slice (`use_cpu_initialization=True`). So TP=1, TP=2 and any pipeline split
built from one seed hold the same weights. Vocabulary padding rows (see below) are zero.

Vocabulary padding: the table and head have `padded_vocab_size` rows (vocab_size rounded up to
`make_vocab_size_divisible_by x TP`, Megatron's rule). Unlike Megatron, the padding logits are
set to -inf before the softmax and in returned logits, so padding never changes a loss: a
model's numbers do not depend on TP, and resharding to another TP only adds/drops zero rows.

Parameters (names are stable: checkpoints, the pipeline form and the HF export rely on them).
Shapes are global; "TP split" says how each rank's shard is cut from the global tensor.

| name                                   | global shape              | TP split                      |
| -------------------------------------- | ------------------------- | ----------------------------- |
| embedding.weight (tied, untied)        | [Vp, H]                   | dim 0, contiguous (vocab)     |
| embedding.weight (factorized)          | [Vp, r]                   | dim 0, contiguous (vocab)     |
| embedding.projection.weight (fact.)    | [H, r]                    | replicated                    |
| embedding.generator.codebooks (lev)    | [k, b, d_s]               | replicated                    |
| embedding.generator.{w_seed, ln_gamma, | [h_lev, ...]              | dim 0 (LEV head), contiguous  |
|   ln_beta, delta, w_out} (lev)         |   (shapes: lev/generator.py)|                               |
| layers.{i}.input_norm.weight           | [H]                       | replicated                    |
| layers.{i}.attention.qkv.weight        | [(nh + 2 ng) dh, H]       | dim 0, contiguous (see below) |
| layers.{i}.attention.out_proj.weight   | [H, nh dh]                | dim 1, contiguous             |
| layers.{i}.mlp_norm.weight             | [H]                       | replicated                    |
| layers.{i}.mlp.gate_up.weight          | [2 F, H]                  | dim 0, stride 2 (see below)   |
| layers.{i}.mlp.down.weight             | [H, F]                    | dim 1, contiguous             |
| final_norm.weight                      | [H]                       | replicated                    |
| output_layer.weight (all but tied)     | [Vp, H]                   | dim 0, contiguous (vocab)     |

- qkv rows are grouped by kv head (Megatron's layout): for each of the `ng` query groups,
  `nh/ng` query heads then one key head then one value head, each `dh` rows. A contiguous TP
  split therefore hands each rank whole groups. To HF: q/k/v = per group slices.
- gate_up is [gate; up] (F rows each). Rank r holds [gate rows r*F/tp:(r+1)*F/tp ; up rows the
  same] (megatron's stride-2 split, `partition_stride=2` on the parameter).
- For `tied` there is no output weight: `output_layer` is a weightless ColumnParallelLinear fed
  `embedding.weight` (Megatron's GPTModel does the same). megatron-core's linear layers add
  an `_extra_state` (None) entry to state dicts; exporters skip it.
- Every tensor-parallel parameter carries megatron-core's `tensor_model_parallel`,
  `partition_dim` and `partition_stride` attributes; the rest are replicated.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed.nn.functional as dist_nn
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule

from megatron_lev.models.config import LeviathanConfig
from megatron_lev.models.cross_entropy import language_model_loss
from megatron_lev.models.layers import (OutputLayer, RMSNorm, build_embedding, checkpoint, default_position_ids,
                                        model_rotary_cos_sin)
from megatron_lev.models.transformer import DecoderLayer


class LeviathanModel(MegatronModule):
    """The full decoder (one pipeline stage holds all of it; see models/pipeline.py for PP>1).

    forward(input_ids [b, s], position_ids [b, s] = arange, labels [b, s], loss_mask [b, s],
            lev_ids [n], lev_inverse [b, s]: LEV's distinct ids from the data loader;
            lev_rows [n, D]: their embeddings already computed, --lev-union-ids):
      with labels: the float32 scalar loss (masked mean over this micro-batch's tokens);
      without: vocab-parallel logits [b, s, padded_vocab_size / TP] (padding at -inf);
      `gather_logits` turns those into full [b, s, vocab_size].
    """

    def __init__(self, config: LeviathanConfig):
        super().__init__(config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp != config.tensor_model_parallel_size:
            raise ValueError(f"config is for --tensor-model-parallel-size {config.tensor_model_parallel_size} "
                             f"but megatron-core's TP group has {tp} ranks "
                             "(call megatron_lev.distributed.state.initialize_model_parallel first)")
        self.embedding = build_embedding(config)
        self.layers = torch.nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.layernorm_epsilon, config.params_dtype)
        self.output_layer = OutputLayer(config)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None,
                lev_ids: Optional[torch.Tensor] = None, lev_inverse: Optional[torch.Tensor] = None,
                lev_rows: Optional[torch.Tensor] = None):
        cfg = self.config
        if cfg.embedding == "lev":  # the loader's distinct ids, if it sent them (no sync)
            hidden = self.embedding(input_ids, lev_ids, lev_inverse, lev_rows)  # [s, b, H]
        else:
            hidden = self.embedding(input_ids)
        if position_ids is None:
            position_ids = default_position_ids(input_ids)
        cos, sin = model_rotary_cos_sin(position_ids, cfg)
        hidden = self._run_layers(hidden, cos, sin)
        logits = self.output_layer(self.final_norm(hidden), self.tied_head_weight())
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return language_model_loss(logits, labels, loss_mask)

    def tied_head_weight(self) -> Optional[torch.Tensor]:
        return self.embedding.weight if self.config.embedding == "tied" else None

    def _run_layers(self, hidden, cos, sin):
        cfg = self.config
        if cfg.recompute_granularity != "full" or not self.training:
            for layer in self.layers:
                hidden = layer(hidden, cos, sin)
            return hidden
        n = cfg.recompute_num_layers
        if cfg.recompute_method == "uniform":  # checkpoint chunks of n layers
            for start in range(0, len(self.layers), n):
                hidden = checkpoint(_LayerChunk(self.layers[start:start + n]), hidden, cos, sin)
        else:  # "block": checkpoint the first n layers one by one, run the rest normally
            for i, layer in enumerate(self.layers):
                hidden = checkpoint(layer, hidden, cos, sin) if i < n else layer(hidden, cos, sin)
        return hidden


class _LayerChunk:
    def __init__(self, layers):
        self.layers = layers

    def __call__(self, hidden, cos, sin):
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return hidden


def gather_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vocab-parallel logits [..., Vp/TP] -> full logits [..., vocab_size] on every TP rank
    (differentiable). torch's all_gather: megatron-core's gather allocates on CUDA only."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        shards = dist_nn.all_gather(logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(shards, dim=-1)
    return logits[..., :vocab_size]


def build_model(config: LeviathanConfig) -> LeviathanModel:
    return LeviathanModel(config)


def merge_tensor_parallel_shards(shards: list, partition_dim: int, stride: int = 1) -> torch.Tensor:
    """The global tensor from its TP shards (rank order), for `partition_dim`/`partition_stride`
    as megatron-core marks them: stride s means each shard is s chunks, chunk j of every
    rank forming the j-th block of the global tensor (gate_up: [gate; up])."""
    if stride == 1:
        return torch.cat(shards, dim=partition_dim)
    chunks = [shard.chunk(stride, dim=partition_dim) for shard in shards]
    return torch.cat([c[j] for j in range(stride) for c in chunks], dim=partition_dim)


def gather_tensor_parallel(tensor: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """`tensor` (a parameter, or its gradient) made global over the TP group, following the
    parameter's partition attributes; replicated tensors come back as they are."""
    world = parallel_state.get_tensor_model_parallel_world_size()
    if world == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(world)]
    torch.distributed.all_gather(shards, tensor.contiguous(),
                                 group=parallel_state.get_tensor_model_parallel_group())
    return merge_tensor_parallel_shards(shards, param.partition_dim, getattr(param, "partition_stride", 1))
