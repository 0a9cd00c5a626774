"""Shared test set-up. Session-wide fixtures (tokenizer, tiny dataset) live here so
they are built once per run."""
import os

# Before anything imports deepspeed: run its CPU accelerator.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
