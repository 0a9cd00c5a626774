"""Leviathan models trained by Megatron-LM's own `pretrain()` (docs/megatron-lm.md).

  arguments.py  add_lev_args (the extra_args_provider: --lev-* flags, one per LEVConfig field),
                the LEV config, TransformerConfig and YAML model section from Megatron-LM's args
  provider.py   lev_gpt_builder (gpt_builders.gpt_builder's signature) and model_provider
                (model_provider.model_provider's signature at core_v0.16.1, args optional)
"""
