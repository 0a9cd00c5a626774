"""megatron_lev: pre-training stack for Leviathan language models.

Where things are:
  lev.py        the LEV embedding generator (all of its math, one file)
  parallel.py   torch.distributed start-up, megatron-core groups, RNG, DeepSpeed mpu
  configs/      packaged YAML configs (model + training defaults)
"""
__version__ = "0.1.0"
