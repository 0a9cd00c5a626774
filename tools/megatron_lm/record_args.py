#!/usr/bin/env python
"""Record the argument namespace Megatron-LM's own parser builds for pretrain_gpt.py, with
megatron_lev's --lev-* flags, as JSON (tests/data/megatron_lm/pretrain_gpt_args.json; the test
of megatron_lev/megatron_lm builds the model from it, since megatron.training is not part of the
megatron-core wheel).

    git clone https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout core_v0.16.1
    WORLD_SIZE=1 python tools/megatron_lm/record_args.py --megatron-lm Megatron-LM \\
        --output tests/data/megatron_lm/pretrain_gpt_args.json

It runs megatron.training.arguments.parse_args(extra_args_provider=add_lev_args) and
validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"}) (what pretrain_gpt.py's pretrain()
does) on FLAGS below. torch dtypes are written as {"__dtype__": "float32"}; values JSON cannot
hold (enums, functions) as {"__repr__": "..."}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A tiny Leviathan model (tiny-lev's sizes, vocabulary 1024), trained the way docs/megatron-lm.md says.
FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "192", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "20", "--lr", "1e-3",
    "--position-embedding-type", "rope", "--rotary-base", "10000", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--init-method-std", "0.02", "--seed", "1234",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--make-vocab-size-divisible-by", "128",
    # local layers, no RoPE fusion, no persistent LayerNorm: the recording and its test run without
    # TransformerEngine or apex (torch norms, no fused weight-gradient accumulation).
    "--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion", "--use-cpu-initialization", "--ckpt-format", "torch_dist",
    "--save", "/tmp/megatron_lev_record_args", "--save-interval", "10",
    "--lev-num-heads", "4", "--lev-seed-dim", "16", "--lev-num-knots", "8", "--lev-num-modes", "16",
]


def to_json(value):
    import torch

    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).replace("torch.", "")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    return {"__repr__": repr(value)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout at tag core_v0.16.1")
    parser.add_argument("--output", required=True)
    parser.add_argument("--ref", help="what the checkout is, when it is not a git clone (e.g. an archive of core_v0.16.1)")
    opts = parser.parse_args(argv)
    checkout = os.path.abspath(opts.megatron_lm)
    sys.path[:0] = [checkout, REPO]
    os.environ.setdefault("WORLD_SIZE", "1")
    from megatron.training.arguments import parse_args, validate_args

    from megatron_lev.megatron_lm.arguments import add_lev_args

    sys.argv = ["pretrain_gpt.py", *FLAGS]
    args = parse_args(extra_args_provider=add_lev_args)
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    commit = opts.ref
    if commit is None:
        try:
            commit = subprocess.run(["git", "-C", checkout, "describe", "--tags"], capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown (not a git checkout; pass --ref)"
    record = {"megatron_lm": commit, "argv": FLAGS, "args": {k: to_json(v) for k, v in sorted(vars(args).items())}}
    tmp = opts.output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, opts.output)
    print(f"wrote {opts.output}: {len(record['args'])} arguments from Megatron-LM {commit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
