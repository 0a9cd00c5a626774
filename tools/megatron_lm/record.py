#!/usr/bin/env python
"""Record what the tests need from Megatron-LM (megatron.training and the scripts are not part of
the megatron-core wheel) into tests/data/megatron_lm/, in one command:

    git clone https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout core_v0.16.1
    python tools/megatron_lm/record.py --megatron-lm Megatron-LM

Re-run it whenever LEVConfig gains a field (one --lev-* flag each) or Megatron-LM moves on. It writes

  pretrain_gpt_args.json  the namespace Megatron-LM's own parse_args + validate_args build for FLAGS
                          below (a tiny LEV model), parsed as tools/megatron_lm/pretrain_lev_gpt.py
                          parses (--lev-* registered, pretrain_gpt.py's extra_args_provider), and
                          for every argument its flags and parser default ("parser");
  pretrain_gpt.py         Megatron-LM's pretrain_gpt.py as it is: pretrain_lev_gpt.py's main block
                          must equal its main block but for the model builder;
  pretrain_lev_gpt_help.txt  what `pretrain_lev_gpt.py --help` prints inside the checkout (its first
                          line, length and LEV group);
  gpt_builders.py, model_provider.py, core_transformer_config_from_args.py   the code that turns
                          Megatron-LM's arguments into a GPTModel (the last one is that function of
                          megatron/training/arguments.py): the flag table must cover what they read.

torch dtypes are written as {"__dtype__": "float32"}, enums as {"__enum__": "module.Class.NAME"},
other values JSON cannot hold as {"__repr__": "..."}.
"""
from __future__ import annotations

import argparse
import enum
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "tests", "data", "megatron_lm")
SCRIPT = os.path.join(REPO, "tools", "megatron_lm", "pretrain_lev_gpt.py")
LEV_GROUP = "LEV embedding (megatron_lev)"  # megatron_lev/megatron_lm/arguments.py's argument group
# A tiny Leviathan model (tiny-lev's sizes; NullTokenizer's 1023 ids + EOD = vocabulary 1024),
# trained the way docs/megatron-lm.md says.
FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "192", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "20", "--lr", "1e-3",
    "--position-embedding-type", "rope", "--rotary-base", "10000", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--init-method-std", "0.02", "--seed", "1234",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1023", "--make-vocab-size-divisible-by", "128",
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
    if isinstance(value, enum.Enum):
        return {"__enum__": f"{type(value).__module__}.{type(value).__qualname__}.{value.name}"}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    return {"__repr__": repr(value)}


def _describe(checkout: str, ref: str | None) -> str:
    if ref is not None:
        return ref
    try:
        return subprocess.run(["git", "-C", checkout, "describe", "--tags"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout; pass --ref)"


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def record_namespace(checkout: str, ref: str) -> dict:
    """Megatron-LM's namespace for FLAGS, parsed as pretrain_lev_gpt.py parses, and its parser's table."""
    sys.path[:0] = [REPO, checkout]
    os.environ.setdefault("WORLD_SIZE", "1")
    import megatron.training.arguments as megatron_arguments
    from pretrain_gpt import has_nvidia_modelopt

    from megatron_lev.megatron_lm.arguments import register_lev_args

    register_lev_args()
    extra = None
    if has_nvidia_modelopt:
        from pretrain_gpt import add_modelopt_args as extra
    sys.argv = ["pretrain_lev_gpt.py", *FLAGS]
    args = megatron_arguments.parse_args(extra_args_provider=extra)
    megatron_arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    parser = megatron_arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    if extra is not None:
        parser = extra(parser)
    table = {}
    for action in parser._actions:
        if action.dest != "help" and action.option_strings:
            entry = table.setdefault(action.dest, {"flags": [], "default": to_json(action.default)})
            entry["flags"] += action.option_strings
    return {"megatron_lm": ref, "argv": FLAGS, "args": {k: to_json(v) for k, v in sorted(vars(args).items())},
            "parser": dict(sorted(table.items()))}


def record_help(checkout: str) -> str:
    """`python pretrain_lev_gpt.py --help` run from the checkout (exit 0, the help on stdout): its
    first line, its length and the LEV group (the whole help is about 170 kB of Megatron-LM's)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([checkout, REPO]), "WORLD_SIZE": "1", "COLUMNS": "100"}
    run = subprocess.run([sys.executable, SCRIPT, "--help"], cwd=checkout, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"pretrain_lev_gpt.py --help exited {run.returncode}: {run.stderr.strip()[-500:]}")
    lines = run.stdout.splitlines()
    group = []
    for line in lines[lines.index(LEV_GROUP + ":") if LEV_GROUP + ":" in lines else len(lines):]:
        if group and line and not line.startswith(" "):
            break
        group.append(line)
    return "\n".join([lines[0], f"... ({len(lines)} lines of help, exit 0; the LEV group:)", *group]).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout at tag core_v0.16.1")
    parser.add_argument("--output-dir", default=DATA, help="default: tests/data/megatron_lm")
    parser.add_argument("--ref", help="what the checkout is, when it is not a git clone (e.g. an archive of core_v0.16.1)")
    opts = parser.parse_args(argv)
    checkout = os.path.abspath(opts.megatron_lm)
    ref = _describe(checkout, opts.ref)
    os.makedirs(opts.output_dir, exist_ok=True)
    help_text = record_help(checkout)
    record = record_namespace(checkout, ref)
    _write(os.path.join(opts.output_dir, "pretrain_gpt_args.json"), json.dumps(record, indent=1) + "\n")
    _write(os.path.join(opts.output_dir, "pretrain_lev_gpt_help.txt"), help_text)
    for name in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py"):
        with open(os.path.join(checkout, name), encoding="utf-8") as f:
            _write(os.path.join(opts.output_dir, name), f.read())
    import inspect

    from megatron.training.arguments import core_transformer_config_from_args

    _write(os.path.join(opts.output_dir, "core_transformer_config_from_args.py"),
           f"# megatron/training/arguments.py of Megatron-LM {ref} (this function only)\n"
           + inspect.getsource(core_transformer_config_from_args))
    print(f"wrote {opts.output_dir}: {len(record['args'])} arguments, the --help of pretrain_lev_gpt.py and "
          f"pretrain_gpt.py, gpt_builders.py, model_provider.py, core_transformer_config_from_args from Megatron-LM {ref}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
