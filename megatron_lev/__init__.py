"""megatron_lev: pre-training stack for Leviathan language models.

Where things are:
  lev/          the LEV embedding generator: its math (generator.py), Triton kernels, TP module
  distributed/  torch.distributed start-up, megatron-core groups, RNG streams, DeepSpeed mpu
  configs/      packaged YAML configs (model + training defaults)
"""
import warnings as _warnings

__version__ = "0.1.0"

# Third-party import-time warnings, filtered here once for every entry point: megatron-core
# says, once per module, that Transformer Engine and Apex are missing (its torch fallbacks
# are what this package runs on purpose).
_warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
