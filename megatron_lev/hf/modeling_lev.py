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

Two settings of Megatron-LM's GPTModel are added around LLaMA's attention, whose code runs
unchanged: `qk_layernorm` (an RMSNorm of each query and key head, `self_attn.q_norm` /
`k_norm` as in Qwen3, applied to q_proj / k_proj's output by a forward hook), and RoPE on
the first `partial_rotary_factor` of each head's dims (`rope_parameters`): the hook reorders
the query and key dims alike (scores are unchanged) so that LLaMA's two-halves rotation meets
the rotated pairs, and `LevRotaryEmbedding` gives the other dims frequency 0.
"""
import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
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


def rotary_dims(config) -> tuple[int, int]:
    """(head_dim, the rotated dims: int(head_dim x partial_rotary_factor), as Megatron-LM's RoPE)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    return head_dim, int(head_dim * factor) if factor < 1.0 else head_dim


def rotary_head_order(head_dim: int, rotary_dim: int, device=None) -> torch.Tensor:
    """Head dims reordered so that rotate_half's pairs (j, j + head_dim/2) are RoPE's pairs
    (i, i + rotary_dim/2) of the first rotary_dim dims, followed by pairs of unrotated dims."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    spans = ((0, half), (rotary_dim, rotary_dim + rest), (half, rotary_dim), (rotary_dim + rest, head_dim))
    return torch.cat([torch.arange(a, b, device=device) for a, b in spans])


class LevRotaryEmbedding(LlamaRotaryEmbedding):
    """LLaMA's rotary embedding over head_dim with frequency 0 (cos 1, sin 0) beyond the rotated
    dims' frequencies, which are LLaMA's (default or llama3) for a head of rotary_dim dims."""

    def __init__(self, config):
        super().__init__(config)
        self.rope_type = "default"  # transformers re-initialises the buffers with the method below
        inv_freq, self.attention_scaling = self.compute_default_rope_parameters(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def compute_default_rope_parameters(self, config=None, **kwargs):
        config = config if config is not None else self.config
        head_dim, rotary_dim = rotary_dims(config)
        inner = copy.deepcopy(config)
        inner.head_dim = rotary_dim
        inner.rope_parameters = {k: v for k, v in config.rope_parameters.items() if k != "partial_rotary_factor"}
        kind = inner.rope_parameters.get("rope_type", "default")
        compute = LlamaRotaryEmbedding.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
        inv_freq, scaling = compute(inner)
        return F.pad(inv_freq, (0, head_dim // 2 - inv_freq.numel())), scaling


def _per_head(module, inputs, output, *, head_dim: int, rotary_dim: int, norm=None):
    """q_proj / k_proj's output, each head RMS-normed (qk_layernorm) and reordered for partial RoPE."""
    heads = output.view(*output.shape[:-1], -1, head_dim)
    if norm is not None:
        heads = norm(heads)
    if rotary_dim < head_dim:
        heads = heads.index_select(-1, rotary_head_order(head_dim, rotary_dim, heads.device))
    return heads.reshape(output.shape)


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
        head_dim, rotary_dim = rotary_dims(config)
        self.rotary_emb = (LevRotaryEmbedding if rotary_dim < head_dim else LlamaRotaryEmbedding)(config=config)
        if rotary_dim < head_dim or getattr(config, "qk_layernorm", False):
            for layer in self.layers:
                self._per_head_hooks(layer.self_attn, config, head_dim, rotary_dim)
        self.gradient_checkpointing = False
        self.post_init()

    @staticmethod
    def _per_head_hooks(attention, config, head_dim: int, rotary_dim: int) -> None:
        for name in ("q", "k"):
            norm = None
            if getattr(config, "qk_layernorm", False):
                norm = LlamaRMSNorm(head_dim, eps=config.rms_norm_eps)
                setattr(attention, f"{name}_norm", norm)
            getattr(attention, f"{name}_proj").register_forward_hook(
                functools.partial(_per_head, head_dim=head_dim, rotary_dim=rotary_dim, norm=norm))

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


__all__ = ["LevConfig", "LevEmbedding", "LevForCausalLM", "LevModel", "LevPreTrainedModel", "LevRotaryEmbedding"]
