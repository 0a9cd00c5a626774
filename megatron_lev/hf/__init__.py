"""Hugging Face export of megatron_lev models.

  configuration_lev.py, modeling_lev.py   remote code copied into exported `lev` model
                                          folders (with ../lev/generator.py as lev.py and
                                          ../lev/lev_config.py), loaded by transformers
                                          through `auto_map` and trust_remote_code=True
  export.py                               checkpoint <-> Hugging Face conversion (library code
                                          behind tools/convert_to_hf.py, tools/convert_from_hf.py)
  tokenizers.py, card.py                  the export's tokenizer files; its model card and provenance
  mcore_export.py                         Megatron-LM checkpoints -> Hugging Face (tools/convert_from_mcore.py)
  import_hf.py, cli.py, trust.py          Hugging Face -> checkpoint; the commands; trusted remote code

Nothing is imported here, so `import megatron_lev.hf` stays cheap.
"""
