"""The Slurm scripts' variables as the user gives them: Megatron-LM's names for ours, the trainer
flags typed in EXTRA_ARGS that a variable already passes, the tokenizer's files and the blends.
Each function reads and updates `env` (a dict of the job's environment) in the order the scripts
always checked them, and refuses a bad value with a LaunchError naming the variable."""
from __future__ import annotations

import os
import re
from typing import MutableMapping

from megatron_lev.launcher.shell import LaunchError, words

# Megatron-LM's example scripts name some knobs differently: CHECKPOINT_PATH, GLOBAL_BATCH_SIZE,
# MICRO_BATCH_SIZE, TENSORBOARD_LOGS_PATH work as this folder's names. Both names with different
# values is refused (which one was meant cannot be known).
MEGATRON_ALIASES = {"CHECKPOINT_PATH": "CHECKPOINT_DIR", "GLOBAL_BATCH_SIZE": "GLOBAL_BATCH",
                    "MICRO_BATCH_SIZE": "MICRO_BATCH", "TENSORBOARD_LOGS_PATH": "TENSORBOARD_DIR"}

# Trainer flags that the scripts pass from a variable. Typed in EXTRA_ARGS as well, the trainer
# would take EXTRA_ARGS's value (argparse keeps the last one) while the batch arithmetic, the log,
# `--load` and the requeue went by the variable's. So such a flag is taken as the variable's value
# and passed once; when the variable says otherwise, the job is refused. A (variable, value) pair
# is a switch that means variable=value.
EXTRA_ARGS_VARIABLES = {
    "--micro-batch-size": "MICRO_BATCH", "--global-batch-size": "GLOBAL_BATCH", "--seq-length": "SEQ_LENGTH",
    "--tensor-model-parallel-size": "TP", "--pipeline-model-parallel-size": "PP", "--train-tokens": "TRAIN_TOKENS",
    "--train-iters": "TRAIN_ITERS", "--exit-interval": "EXIT_INTERVAL", "--save-interval": "SAVE_INTERVAL",
    "--log-interval": "LOG_INTERVAL", "--tensorboard-dir": "TENSORBOARD_DIR", "--deepspeed-config": "DEEPSPEED_CONFIG",
    "--deepspeed_config": "DEEPSPEED_CONFIG", "--gpu-type": "GPU_TYPE", "--config": "CONFIG", "--save": "CHECKPOINT_DIR",
    "--load": "CHECKPOINT_DIR", "--tokenizer-type": "TOKENIZER_TYPE", "--tokenizer-model": "TOKENIZER_MODEL",
    "--vocab-file": "VOCAB_FILE", "--merge-file": "MERGE_FILE", "--bf16": ("BF16", "1"), "--no-bf16": ("BF16", "0"),
    "--compile-layers": ("COMPILE_LAYERS", "1"), "--no-compile-layers": ("COMPILE_LAYERS", "0"),
    "--keep-last-checkpoints": "KEEP_CHECKPOINTS", "--keep-checkpoints-every": "KEEP_EVERY",
}
# Blends (several values each) are only taken from their variables, which check every prefix.
EXTRA_ARGS_REFUSED = {"--data-path": "DATA_PATH", "--train-data-path": "DATA_PATH",
                      "--valid-data-path": "VALID_DATA_PATH", "--test-data-path": "TEST_DATA_PATH"}

_WEIGHT = re.compile(r"^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$")


def resolve_aliases(env: MutableMapping[str, str]) -> None:
    for alias, canonical in MEGATRON_ALIASES.items():
        if not env.get(alias):
            continue
        if env.get(canonical) and env[canonical] != env[alias]:
            raise LaunchError(f"{alias}={env[alias]} and {canonical}={env[canonical]} disagree ({alias} is "
                              f"Megatron-LM's name for {canonical}): set one of them")
        env[canonical] = env[alias]


def take_extra_args(env: MutableMapping[str, str]) -> list[str]:
    """Sets the variables of EXTRA_ARGS_VARIABLES' flags from EXTRA_ARGS; returns the rest of it."""
    given = words(env.get("EXTRA_ARGS"))
    rest: list[str] = []
    i = 0
    while i < len(given):
        word = given[i]
        i += 1
        name = word.split("=", 1)[0]
        if name in EXTRA_ARGS_REFUSED:
            raise LaunchError(f"EXTRA_ARGS passes {name}: set {EXTRA_ARGS_REFUSED[name]} instead (the script passes "
                              f"{name} from it)")
        target = EXTRA_ARGS_VARIABLES.get(name)
        if target is None:
            rest.append(word)
            continue
        if isinstance(target, tuple):  # a switch
            var, value = target
            if word != name:
                raise LaunchError(f"EXTRA_ARGS: {name} takes no value ({word})")
            shown = name
        else:
            var = target
            if "=" in word:
                value = word.split("=", 1)[1]
            elif i < len(given) and not given[i].startswith("--"):
                value = given[i]
                i += 1
            else:
                raise LaunchError(f"EXTRA_ARGS: {name} needs a value")
            shown = f"{name} {value}"
        if env.get(var) and env[var] != value:
            raise LaunchError(f"EXTRA_ARGS passes {shown}, but {var}={env[var]}: set one of them (the script passes "
                              f"this flag from {var})")
        env[var] = value
    return rest


def tokenizer_flags(env: MutableMapping[str, str]) -> list[str]:
    """Megatron's tokenizer flags: GPT2BPETokenizer reads VOCAB_FILE and MERGE_FILE (Megatron-LM's
    example scripts' names), every other type TOKENIZER_MODEL."""
    kind = env["TOKENIZER_TYPE"] = env.get("TOKENIZER_TYPE") or "SentencePieceTokenizer"
    if kind == "GPT2BPETokenizer":
        for var in ("VOCAB_FILE", "MERGE_FILE"):
            if not env.get(var):
                raise LaunchError(f"{var} is not set: TOKENIZER_TYPE=GPT2BPETokenizer reads "
                                  "VOCAB_FILE=/path/gpt2-vocab.json and MERGE_FILE=/path/gpt2-merges.txt")
            if not os.path.exists(env[var]):
                raise LaunchError(f"{var}={env[var]}: no such file or directory")
        return ["--tokenizer-type", kind, "--vocab-file", env["VOCAB_FILE"], "--merge-file", env["MERGE_FILE"]]
    if not env.get("TOKENIZER_MODEL"):
        raise LaunchError("TOKENIZER_MODEL is not set: export TOKENIZER_MODEL=/path/to/tokenizer.model (or a Hugging "
                          "Face tokenizer directory; GPT-2 BPE files: TOKENIZER_TYPE=GPT2BPETokenizer VOCAB_FILE=... "
                          "MERGE_FILE=...)")
    if not os.path.exists(env["TOKENIZER_MODEL"]):
        raise LaunchError(f"TOKENIZER_MODEL={env['TOKENIZER_MODEL']}: no such file or directory")
    return ["--tokenizer-type", kind, "--tokenizer-model", env["TOKENIZER_MODEL"]]


def check_blend(name: str, blend: str) -> list[str]:
    """A Megatron blend: "PREFIX", "W1 PREFIX1 W2 PREFIX2 ..." or "PREFIX1 PREFIX2 ...". Every
    prefix needs PREFIX.bin and PREFIX.idx. Returns its words."""
    given = words(blend)
    if not given:
        raise LaunchError(f"{name} is empty")
    for word in given:
        if _WEIGHT.match(word):
            continue
        if not (os.path.isfile(word + ".bin") and os.path.isfile(word + ".idx")):
            raise LaunchError(f"{name}: dataset prefix '{word}' has no {word}.bin / {word}.idx (build it with "
                              "tools/preprocess_data.py)")
    return given
