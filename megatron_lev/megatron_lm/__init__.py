"""Leviathan models trained by Megatron-LM's own `pretrain()` (docs/megatron-lm.md).

  arguments.py   add_lev_args / register_lev_args (the --lev-* flags, one per LEVConfig field), the
                 LEV config, TransformerConfig and model: section from Megatron-LM's args
  flags.py       every Megatron-LM argument that changes GPTModel: carried, precision only, no
                 effect, or refused in one line (check_megatron_args); docs/megatron-lm.md's table
  provider.py    lev_gpt_builder (gpt_builders.gpt_builder's signature) and model_provider
                 (model_provider.model_provider's, refusing ModelOpt's builder)
  checkpoint.py  a Megatron-LM checkpoint's model, tokenizer and provenance from its saved args
  check.py       the CPU check of a run's model (tools/megatron_lm/check_lev_gpt.py)
"""
