"""Hugging Face model of a Leviathan language model: LLaMA with the LEV embedding generator.

This file is copied into every exported `embedding: lev` model folder, beside
`configuration_lev.py` and `lev.py` (a verbatim copy of `megatron_lev/lev/generator.py`, the
generator's math in plain PyTorch), and registered through `auto_map`:

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    model.generate(input_ids, max_new_tokens=32)

Everything but the input embedding is transformers' own LLaMA (attention with KV cache,
RoPE with the two-halves rotation, SwiGLU, RMSNorm, `generate()`), so only
`model.embed_tokens` differs: instead of a V x D table it is `LevEmbedding`, which
computes each token's embedding from its id. Its parameters are the generator's,
under `model.embed_tokens.generator.` (codebooks, w_seed, ln_gamma, ln_beta, delta,
w_out; all heads). The output head `lm_head` is untied, as in Leviathan.
"""
import torch
from torch import nn
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaForCausalLM, LlamaModel,
                                                      LlamaPreTrainedModel, LlamaRMSNorm, LlamaRotaryEmbedding)

from .configuration_lev import LevConfig

try:  # an exported folder: lev.py sits beside this file
    from .lev import LEVConfig, LEVGenerator
except ImportError:  # imported from the megatron_lev package (megatron_lev/hf/): megatron_lev/lev/generator.py
    from megatron_lev.lev.generator import LEVConfig, LEVGenerator


class LevEmbedding(nn.Module):
    """input_ids [batch, seq] -> embeddings [batch, seq, hidden] in the model's dtype.

    The generator works in float32 whatever the parameter dtype, evaluates each distinct id
    of the batch once, and raises a ValueError for ids outside [0, vocab_size).
    """

    def __init__(self, config: LevConfig):
        super().__init__()
        # transformers sets the default dtype to the model's while it builds it (from_pretrained's
        # `dtype`); LEVGenerator would otherwise pin float32.
        self.generator = LEVGenerator(LEVConfig.from_dict(config.lev_generator_fields()),
                                      dtype=torch.get_default_dtype())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.generator.embed(input_ids).to(self.generator.w_out.dtype)


class LevPreTrainedModel(LlamaPreTrainedModel):
    config_class = LevConfig
    config: LevConfig
    _no_split_modules = ["LlamaDecoderLayer"]

    def _init_weights(self, module):
        if isinstance(module, LevEmbedding):
            module.generator.reset_parameters()  # the spec's initialisation (LEV_SPEC.md section 1)
        else:
            super()._init_weights(module)


class LevModel(LevPreTrainedModel, LlamaModel):
    """LlamaModel whose `embed_tokens` is the LEV generator. Its forward is LlamaModel's."""

    def __init__(self, config: LevConfig):
        # Not LlamaModel.__init__: it would allocate the V x D table LEV replaces.
        LevPreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = LevEmbedding(config)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def resize_token_embeddings(self, *args, **kwargs):
        raise NotImplementedError("a LEV model has no embedding table to resize: its generator covers "
                                  "vocab_size ids by construction (retrain or re-export to change it)")


class LevForCausalLM(LevPreTrainedModel, LlamaForCausalLM):
    """LlamaForCausalLM with the LEV input embedding and an untied head. forward/generate are LLaMA's."""

    _tied_weights_keys = {}

    def __init__(self, config: LevConfig):
        if config.tie_word_embeddings:
            raise ValueError("LevConfig.tie_word_embeddings must be False: LEV has no table to tie the head to")
        LevPreTrainedModel.__init__(self, config)
        self.model = LevModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def resize_token_embeddings(self, *args, **kwargs):
        return self.model.resize_token_embeddings(*args, **kwargs)


__all__ = ["LevConfig", "LevEmbedding", "LevForCausalLM", "LevModel", "LevPreTrainedModel"]
