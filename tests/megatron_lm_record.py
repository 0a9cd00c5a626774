"""What tools/megatron_lm/record.py recorded from Megatron-LM core_v0.16.1 into tests/data/megatron_lm/
(megatron.training and the scripts are not part of the megatron-core wheel):

    recorded()                       the JSON: argv, the namespace ("args") and the parser's table
    recorded_namespace(**changes)    the namespace as Megatron-LM built it (dtypes and enums restored)
    recorded_source(name)            pretrain_gpt.py, gpt_builders.py, model_provider.py, ...

Re-record with `python tools/megatron_lm/record.py --megatron-lm /path/to/Megatron-LM` (docs/megatron-lm.md).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import os

import torch

DATA = os.path.join(os.path.dirname(__file__), "data", "megatron_lm")
RERECORD = "re-record: python tools/megatron_lm/record.py --megatron-lm /path/to/Megatron-LM (core_v0.16.1)"


@functools.lru_cache(maxsize=1)
def recorded() -> dict:
    with open(os.path.join(DATA, "pretrain_gpt_args.json"), encoding="utf-8") as f:
        return json.load(f)


def _restore(value):
    if isinstance(value, dict) and "__dtype__" in value:
        return getattr(torch, value["__dtype__"])
    if isinstance(value, dict) and "__enum__" in value:
        module, cls, name = value["__enum__"].rsplit(".", 2)
        return getattr(getattr(importlib.import_module(module), cls), name)
    if isinstance(value, list):
        return [_restore(v) for v in value]
    return value


def recorded_namespace(**changes) -> argparse.Namespace:
    args = argparse.Namespace(**{k: _restore(v) for k, v in recorded()["args"].items()})
    for key, value in changes.items():
        setattr(args, key, value)
    return args


def recorded_source(name: str) -> str:
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return f.read()
