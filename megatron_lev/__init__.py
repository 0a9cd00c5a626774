"""megatron_lev: pre-training stack for Leviathan language models.

Packages, top to bottom (docs/layout.md): entry points (train, evaluate, demo, cli,
flag_table); evaluation/; hf/; training/; checkpointing/; models/ and data/; lev/ and
distributed/; utils/ and configs/. The LEV math is lev/generator.py.
"""
import warnings as _warnings

__version__ = "0.1.0"

# Third-party import-time warnings, filtered here once for every entry point: megatron-core
# says, once per module, that Transformer Engine and Apex are missing (its torch fallbacks
# are what this package runs on purpose).
_warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
