"""LEV inside megatron-core's `GPTModel`: the input side of a Megatron-LM model.

    model = build_lev_gpt_model(transformer_config, lev_config, padded_vocab_size, seq_length,
                                layer_spec="local" | "transformer_engine" | <ModuleSpec>)
    model = build_lev_gpt_model_from_config(leviathan_config)       # from this project's config

`LEVLanguageModelEmbedding` has the interface of megatron-core's `LanguageModelEmbedding`
(`forward(input_ids [b, s], position_ids, tokentype_ids=None) -> [s, b, h]`, or
`[s/tp, b, h]` with `config.sequence_parallel`), over this project's TP module
(lev/parallel.py): heads split over TP, codebooks replicated, partial rows summed over TP.

No host synchronisation: GPTModel passes only the token ids, and finding the distinct ids of a
micro-batch on the device (`unique`) makes the host wait for the device. Instead the generator
runs on a buffer whose size the shapes fix: the whole vocabulary when it has no more ids than the
micro-batch has tokens (the rows are then gathered by id, which bounds-checks the ids as
megatron-core's embedding does), else one row per token. The rows are summed over TP (an
all-reduce of at most min(V, b*s) rows) and, with sequence parallelism, this rank's part of the
sequence is kept (`scatter_to_sequence_parallel_region`: no communication forward, an
all-gather backward). Without a host sync and with fixed shapes the embedding is capturable in a
CUDA graph in principle; it has not been captured on a GPU here, so Megatron-LM's full-iteration
CUDA graph is refused (megatron_lm/flags.py) and per-layer graphs run it eagerly.

Like LanguageModelEmbedding it applies `config.hidden_dropout` after the embedding (megatron-core's
default is 0.1) and casts to float32 under `fp32_residual_connection`. There are no position
embeddings (RoPE is in the attention) and no token types.

The builder makes an ordinary GPTModel (any dense layer spec, with megatron-core's q/k_layernorm
when `config.qk_layernorm`) with an untied output layer and LEV as its `embedding`, without ever
allocating the V x D table LEV replaces: GPTModel is built as a later pipeline stage (no input
side) and then made the first. Everything else, megatron-core's distributed checkpointing included,
is GPTModel's own. Parameter names: `embedding.generator.{codebooks, w_seed, ln_gamma, ln_beta,
delta, w_out}`, then GPTModel's (models/mcore_args.py maps them to this project's).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lev.lev.generator import LEVConfig
from megatron_lev.lev.parallel import ParallelLEVEmbedding
from megatron_lev.models.config import LeviathanConfig
from megatron_lev.models.layers import derive_seed
from megatron_lev.models.mcore_args import transformer_config_from_model_config

LAYER_SPECS = ("local", "transformer_engine")


class LEVLanguageModelEmbedding(ParallelLEVEmbedding):
    """megatron-core's LanguageModelEmbedding interface over the LEV generator.

    forward(input_ids [b, s], position_ids (unused: RoPE), tokentype_ids=None) -> [s, b, h]
    in params_dtype (float32 with fp32_residual_connection); [s/tp, b, h] with sequence parallelism.
    """

    def __init__(self, config: TransformerConfig, lev_config: LEVConfig, *, init_seed: int = 1234,
                 scatter_to_sequence_parallel: bool = True):
        if lev_config.hidden_size != config.hidden_size:
            raise ValueError(f"LEV hidden_size {lev_config.hidden_size} != the model's hidden_size {config.hidden_size}")
        # The base module runs without its own sequence split: this class scatters (see the docstring).
        super().__init__(lev_config, init_seed=init_seed, sequence_parallel=False,
                         params_dtype=config.params_dtype, transformer_config=config)
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                tokentype_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if tokentype_ids is not None:
            raise ValueError("LEVLanguageModelEmbedding: token types are not supported (num_tokentypes=0)")
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"LEV embedding expects int64/int32 token ids of shape [batch, seq], "
                             f"got {input_ids.dtype} {tuple(input_ids.shape)}")
        batch, seq = input_ids.shape
        vocab = self.lev_config.vocab_size
        whole_vocabulary = self.lev_config.unique_ids and vocab <= batch * seq
        ids = torch.arange(vocab, device=input_ids.device) if whole_vocabulary else input_ids.reshape(-1)
        tp = self.tp_size > 1  # the rows are summed over TP before the generator's finish (output_norm)
        rows = self.generator(ids, seed_hook=self._copy_to_tensor_parallel if tp else None,
                              heads_hook=self._reduce_from_tensor_parallel if tp else None).to(self.params_dtype)
        if whole_vocabulary:
            embeddings = F.embedding(input_ids.t(), rows)  # [s, b, h]
        else:
            embeddings = rows.view(batch, seq, -1).transpose(0, 1).contiguous()
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        if not self.config.sequence_parallel:
            return self.embedding_dropout(embeddings)
        if self.scatter_to_sequence_parallel and self.tp_size > 1:
            if embeddings.shape[0] % self.tp_size:
                raise ValueError(f"--sequence-parallel: sequence length {embeddings.shape[0]} must be divisible "
                                 f"by --tensor-model-parallel-size {self.tp_size}")
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings, group=self.tp_group)
            if self.config.clone_scatter_output_in_embedding:
                embeddings = embeddings.clone()  # the split is a view that would keep [s, b, h] alive
        if self.training and self.embedding_dropout.p > 0:
            # Each rank holds other positions: dropout masks from the model-parallel RNG stream.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                embeddings = self.embedding_dropout(embeddings)
        return embeddings


def layer_spec_for(layer_spec: Union[str, ModuleSpec, None], config: TransformerConfig) -> ModuleSpec:
    """"local" / "transformer_engine": megatron-core's dense GPT layer spec as Megatron-LM's
    gpt_builder picks it for a dense model (config.normalization, config.qk_layernorm), or a
    ModuleSpec as it is."""
    from megatron.core.models.gpt import gpt_layer_specs

    if isinstance(layer_spec, ModuleSpec):
        return layer_spec
    if layer_spec in (None, "local"):
        return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                                        normalization=config.normalization)
    if layer_spec == "transformer_engine":
        if not gpt_layer_specs.HAVE_TE:
            raise ImportError("layer spec 'transformer_engine': transformer_engine does not import here "
                              "(use layer_spec='local', or install TransformerEngine)")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    raise ValueError(f"layer_spec {layer_spec!r}: expected one of {', '.join(LAYER_SPECS)} or a ModuleSpec")


def build_lev_gpt_model(config: TransformerConfig, lev_config: LEVConfig, padded_vocab_size: int,
                        max_sequence_length: int, *, layer_spec: Union[str, ModuleSpec, None] = "local",
                        rotary_base: float = 10000.0, init_seed: int = 1234, pre_process: bool = True,
                        post_process: bool = True, vp_stage: Optional[int] = None, pg_collection=None,
                        rotary_percent: float = 1.0, rope_scaling: bool = False, rope_scaling_factor: float = 8.0,
                        fp16_lm_cross_entropy: bool = False, parallel_output: bool = True) -> GPTModel:
    """A GPTModel with RoPE, an untied output layer over `padded_vocab_size` and LEV as its input side.

    `rotary_base` is passed to GPTModel's constructor: its RoPE is built from that argument, not
    from any `rotary_base` the config may carry. `init_seed` seeds the LEV generator's weights
    (every TP rank draws the full tensors and keeps its heads). GPTModel is constructed without
    an input side (as a later pipeline stage: its LanguageModelEmbedding would allocate the
    padded V x D table) and then given LEV's, marked as Megatron-LM marks an input embedding.
    """
    if lev_config.vocab_size > padded_vocab_size:
        raise ValueError(f"LEV vocab_size {lev_config.vocab_size} > padded_vocab_size {padded_vocab_size}")
    model = GPTModel(config=config, transformer_layer_spec=layer_spec_for(layer_spec, config),
                     vocab_size=padded_vocab_size, max_sequence_length=max_sequence_length,
                     pre_process=False, post_process=post_process,
                     fp16_lm_cross_entropy=fp16_lm_cross_entropy, parallel_output=parallel_output,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_percent=rotary_percent, rotary_base=rotary_base, rope_scaling=rope_scaling,
                     rope_scaling_factor=rope_scaling_factor, vp_stage=vp_stage, pg_collection=pg_collection)
    if pre_process:  # the first pipeline stage (GPTModel and its TransformerBlock read the flag at run time)
        model.pre_process = model.decoder.pre_process = True
        model.embedding = LEVLanguageModelEmbedding(config, lev_config, init_seed=init_seed)
        for param in model.embedding.parameters():  # --decoupled-lr and the like: as GPTModel's table
            param.is_embedding_or_output_parameter = True
    return model


def build_lev_gpt_model_from_config(config: LeviathanConfig, *, layer_spec: Union[str, ModuleSpec, None] = "local",
                                    pre_process: bool = True, post_process: bool = True,
                                    **config_overrides) -> GPTModel:
    """The GPTModel+LEV counterpart of `LeviathanModel(config)`: same sizes, same LEV generator seed
    (so the same LEV weights), RoPE and padded vocabulary. `config_overrides` are
    TransformerConfig fields (e.g. sequence_parallel=True)."""
    if config.embedding != "lev":
        raise ValueError(f"embedding: {config.embedding!r}: build_lev_gpt_model_from_config builds LEV models only")
    transformer_config = transformer_config_from_model_config(config, **config_overrides)
    return build_lev_gpt_model(transformer_config, config.lev_config(), config.padded_vocab_size, config.seq_length,
                               layer_spec=layer_spec, rotary_base=config.rotary_base,
                               init_seed=derive_seed(config.init_seed, "embedding"),
                               pre_process=pre_process, post_process=post_process,
                               rotary_percent=config.rotary_percent, rope_scaling=config.rope_scaling,
                               rope_scaling_factor=config.rope_scaling_factor)
