"""The LEV embedding as a tensor-parallel megatron-core module (LEV_SPEC.md section 2).

    embedding = ParallelLEVEmbedding(LEVConfig(vocab_size=V, hidden_size=D), init_seed=1234)
    hidden = embedding(input_ids)       # [b, s] ids -> [s, b, D] (megatron's layout)

Heads are split over the tensor-parallel (TP) group: rank t holds heads
[t*h/tp, (t+1)*h/tp) of every head-sharded tensor (partition dim 0) and a full
copy of the codebooks. The seed z goes through the copy-to-TP mapping (identity
forward, all-reduce of the gradient backward) so every rank's codebook gradient
is the whole one; the per-rank partial embeddings are summed over TP.

Each distinct id of the micro-batch is evaluated once (`LEVConfig.unique_ids`)
and gathered to its positions; in float32 the output equals per-position
evaluation bit for bit (lev.ROW_BLOCK says how). Under TP the all-reduce runs on
the distinct ids' rows before the gather; with more than 2 TP ranks the
collective's summation order may then differ from a per-position reduction in
the last bit.

The math is in `generator.py`; this file only wires it to megatron-core.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_lev.lev.generator import HEAD_SHARDED_PARAMETERS, LEVConfig, LEVGenerator, ids_to_evaluate


def tensor_parallel_rank_and_size() -> tuple[int, int]:
    """(TP rank, TP size) from megatron-core, or (0, 1) when its groups are not set up."""
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


class ParallelLEVEmbedding(MegatronModule):
    """LEV input embedding, heads split over tensor-parallel ranks.

    forward(input_ids: LongTensor [b, s]) -> Tensor [s, b, D] in `params_dtype`
    ([s/tp, b, D] when `sequence_parallel`). Parameters live in `self.generator`
    (names documented in generator.py) and are stored in `params_dtype`; the generator
    computes in float32 whatever that dtype is.

    `transformer_config` is only what MegatronModule keeps as `self.config` (fp8
    flags and the like); pass the model's config when there is one, else a minimal
    one is made. LEV's own settings come from `config` alone.
    """

    def __init__(self, config: LEVConfig, *, init_seed: int = 1234, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None,
                 transformer_config: Optional[TransformerConfig] = None):
        tp_rank, tp_size = tensor_parallel_rank_and_size()
        config.validate(tp_size)
        if transformer_config is None:
            transformer_config = TransformerConfig(
                num_layers=1, hidden_size=config.hidden_size, num_attention_heads=config.num_heads,
                tensor_model_parallel_size=tp_size, sequence_parallel=sequence_parallel and tp_size > 1,
                params_dtype=params_dtype, use_cpu_initialization=True,
                cuda_graph_scope=[])  # megatron-core's default "full" is deprecated and warns
        super().__init__(transformer_config)
        self.lev_config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None
        self.sequence_parallel = sequence_parallel
        self.params_dtype = params_dtype
        heads_per_rank = config.num_heads // tp_size
        self.generator = LEVGenerator(config, tp_rank * heads_per_rank, (tp_rank + 1) * heads_per_rank,
                                      init_seed=init_seed, dtype=params_dtype, device=device)
        for name, param in self.generator.named_parameters():
            if name in HEAD_SHARDED_PARAMETERS:
                set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
            else:
                # Replicated: grad-norm counts it on TP rank 0 only
                # (megatron's param_is_not_tensor_parallel_duplicate).
                # A replicated codebook needs no `sequence_parallel` grad all-reduce either: the
                # generator runs on the whole batch before any sequence split, and the
                # copy-to-TP mapping already makes its gradient whole.
                set_tensor_model_parallel_attributes(param, is_parallel=False, dim=-1, stride=1)
        if config.output_norm and sequence_parallel and tp_size > 1:
            # The norm runs on this rank's sequence shard: its gain's gradient is partial, summed
            # over TP as megatron-core sums its norms' (finalize_model_grads reads this attribute).
            self.generator.out_norm_weight.sequence_parallel = True

    def forward(self, input_ids: torch.Tensor, lev_ids: Optional[torch.Tensor] = None,
                lev_inverse: Optional[torch.Tensor] = None, lev_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`lev_ids` [n] and `lev_inverse` [b, s] (input_ids == lev_ids[lev_inverse]): the
        distinct ids, range-checked by the data loader on CPU (datasets.collate_pretraining_batch),
        so the step needs no `unique` and no host synchronisation. Without them the ids are
        found here (one `unique` and one min/max read, which synchronise on CUDA).

        `lev_rows` [n, D]: embedding rows already computed by `rows` (--lev-union-ids: the
        generator ran once on the union of a step's micro-batches' ids, training/union_ids.py);
        `lev_inverse` then indexes them, and the generator does not run here."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"LEV embedding expects int64/int32 token ids of shape [batch, seq], "
                             f"got {input_ids.dtype} {tuple(input_ids.shape)}")
        batch, seq = input_ids.shape
        if lev_rows is not None:
            if lev_inverse is None or lev_inverse.shape != input_ids.shape:
                raise ValueError(f"lev_rows needs lev_inverse of the shape of input_ids {tuple(input_ids.shape)}")
            if self.sequence_parallel and self.tp_size > 1:
                raise ValueError("lev_rows: not with sequence parallelism (its rows are reduce-scattered per position)")
            return self._to_positions(lev_rows.to(self.params_dtype), lev_inverse, batch, seq)
        if self.sequence_parallel and self.tp_size > 1:
            if input_ids.device.type != "cuda":
                raise RuntimeError("--sequence-parallel LEV embedding needs CUDA (its reduce-scatter is not "
                                   "supported by gloo); run without sequence parallelism on CPU")
            if seq % self.tp_size != 0:
                raise ValueError(f"--sequence-parallel: sequence length {seq} must be divisible by "
                                 f"--tensor-model-parallel-size {self.tp_size}")

        if lev_ids is not None and self.lev_config.unique_ids:
            if lev_inverse is None or lev_inverse.shape != input_ids.shape:
                raise ValueError(f"lev_inverse must have the shape of input_ids {tuple(input_ids.shape)}, got "
                                 f"{None if lev_inverse is None else tuple(lev_inverse.shape)}")
            ids, inverse = lev_ids, lev_inverse
        else:
            ids, inverse = ids_to_evaluate(input_ids, self.lev_config.vocab_size, self.lev_config.unique_ids)
        # Every TP rank sees the same ids, hence the same distinct ids in the same order.
        seed_hook = self._copy_to_tensor_parallel if self.tp_size > 1 else None
        if self.sequence_parallel and self.tp_size > 1:
            # The reduce-scatter splits positions, so gather to positions first; the generator's
            # `finish` (output_norm) runs on the summed shard.
            partial = self.generator(ids, seed_hook=seed_hook).to(self.params_dtype)  # [n, D], this rank's heads
            rows = reduce_scatter_to_sequence_parallel_region(self._to_positions(partial, inverse, batch, seq),
                                                              group=self.tp_group)
            return self.generator.finish(rows).to(self.params_dtype)
        # Without SP, sum the partials over TP before the gather: the same numbers as
        # reducing the [s, b, D] output (the gather only copies rows), with traffic the
        # size of the distinct ids rather than of the micro-batch.
        return self._to_positions(self.rows(ids).to(self.params_dtype), inverse, batch, seq)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Distinct ids [n] (range-checked) -> their embeddings [n, D], whole over TP, in the
        generator's output dtype (float32, or params_dtype after a TP reduction without
        output_norm); not with sequence parallelism."""
        seed_hook = self._copy_to_tensor_parallel if self.tp_size > 1 else None
        heads_hook = self._reduce_from_tensor_parallel if self.tp_size > 1 else None
        return self.generator(ids, seed_hook=seed_hook, heads_hook=heads_hook)

    def _copy_to_tensor_parallel(self, z: torch.Tensor) -> torch.Tensor:
        return copy_to_tensor_model_parallel_region(z, group=self.tp_group)

    def _reduce_from_tensor_parallel(self, partial: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_model_parallel_region(partial.to(self.params_dtype), group=self.tp_group)

    @staticmethod
    def _to_positions(rows: torch.Tensor, inverse: Optional[torch.Tensor], batch: int, seq: int) -> torch.Tensor:
        """Rows per evaluated id -> [s, b, D]."""
        if inverse is not None:
            return F.embedding(inverse.t(), rows)
        return rows.view(batch, seq, -1).transpose(0, 1).contiguous()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None):
        """Distributed-checkpoint view: head-sharded tensors split along dim 0 over TP,
        codebooks replicated (so a checkpoint can be loaded at another TP size)."""
        state = self.state_dict(prefix="", keep_vars=True)
        axis_map = {key: 0 for key in state if key.rsplit(".", 1)[-1] in HEAD_SHARDED_PARAMETERS}
        return make_sharded_tensors_for_checkpoint(state, prefix, axis_map, sharded_offsets)

    def extra_repr(self) -> str:
        return f"tp_rank={self.tp_rank}, tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}, " \
               f"params_dtype={self.params_dtype}"
