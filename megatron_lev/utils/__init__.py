"""Foundations every layer may use; nothing here imports the rest of megatron_lev.

  errors.py      ConfigError, CheckpointError: the one-line errors commands report
  files.py       atomic writes (temporary name, then rename) and fsync helpers
  flags.py       Megatron-LM-style argument parsing: one-line errors, compat flags
  progress.py    tqdm progress bars for long-running tools
  profiling.py   KernelCounter: what a piece of PyTorch would launch on a GPU
"""
