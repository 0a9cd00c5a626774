"""slurm/preprocess_pile.sh's tasks: The Pile tokenized into Megatron indexed datasets, one array
task per file, each running tools/preprocess_data.py with one worker per core Slurm gave it.

    tasks 0-29: $PILE_DIR/train/00.jsonl.zst .. 29.jsonl.zst -> $OUTPUT_DIR/train/pile_NN_text_document
    task 30:    $PILE_DIR/val.jsonl.zst                      -> $OUTPUT_DIR/val/pile_val_text_document
    task 31:    $PILE_DIR/test.jsonl.zst                     -> $OUTPUT_DIR/test/pile_test_text_document

A task whose output exists is skipped (FORCE=1 redoes it), so resubmitting the array only redoes
failed shards. Under DRY_RUN=1 without an array task, all 32 commands are printed."""
from __future__ import annotations

import glob
import os
from typing import Mapping, MutableMapping, Optional

from megatron_lev.launcher.shell import LaunchError, get, print_cmd, require_int, stamp, words
from megatron_lev.launcher.variables import tokenizer_flags

NUM_TASKS = 32  # keep equal to the --array range of slurm/preprocess_pile.sh


def pile_task(task: int, pile_dir: str, output_dir: str) -> tuple[str, str]:
    """Input file and output prefix of array task `task`."""
    if task < 30:
        return os.path.join(pile_dir, "train", f"{task:02d}.jsonl.zst"), os.path.join(output_dir, "train",
                                                                                        f"pile_{task:02d}")
    if task == 30:
        return os.path.join(pile_dir, "val.jsonl.zst"), os.path.join(output_dir, "val", "pile_val")
    return os.path.join(pile_dir, "test.jsonl.zst"), os.path.join(output_dir, "test", "pile_test")


def task_command(task: int, env: Mapping[str, str], tokenizer: list[str], workers: int,
                 repo: str) -> Optional[list[str]]:
    """The command of one task, or None when its output exists (a line says so)."""
    source, prefix = pile_task(task, env["PILE_DIR"], env["OUTPUT_DIR"])
    if not os.path.isfile(source):
        raise LaunchError(f"task {task}: input {source} does not exist (PILE_DIR={env['PILE_DIR']})")
    # preprocess_data.py renames its outputs into place only on success, so any final .idx under this
    # prefix means the task is done.
    done = sorted(glob.glob(glob.escape(prefix) + "_*.idx"))
    if done and env.get("FORCE") != "1":
        print(f"{stamp()} task {task}: {done[0]} exists, skipping (FORCE=1 redoes it)", flush=True)
        return None
    return ["python", os.path.join(repo, "tools", "preprocess_data.py"), "--input", source, "--output-prefix", prefix,
            "--json-keys", "text", *tokenizer, "--append-eod", "--workers", str(workers), "--log-interval", "100000",
            *words(env.get("EXTRA_ARGS"))]


def run_pile(env: MutableMapping[str, str], repo: str) -> Optional[list[str]]:
    """The array task's command to run (None: nothing to run; under DRY_RUN the commands are printed)."""
    if not env.get("PILE_DIR"):
        raise LaunchError("PILE_DIR is not set: the folder holding train/00.jsonl.zst .. train/29.jsonl.zst, "
                          "val.jsonl.zst, test.jsonl.zst")
    if not env.get("OUTPUT_DIR"):
        raise LaunchError("OUTPUT_DIR is not set: where the indexed datasets go")
    tokenizer = tokenizer_flags(env)
    env["WORKERS"] = get(env, "WORKERS", get(env, "SLURM_CPUS_PER_TASK", str(len(os.sched_getaffinity(0)))))
    workers = require_int("WORKERS", env["WORKERS"], 1)
    dry_run = env.get("DRY_RUN") == "1"
    if env.get("SLURM_ARRAY_TASK_ID"):
        task = require_int("SLURM_ARRAY_TASK_ID", env["SLURM_ARRAY_TASK_ID"])
        if task >= NUM_TASKS:
            raise LaunchError(f"array task {task}: expected 0-{NUM_TASKS - 1}")
        tasks = [task]
    elif dry_run:
        tasks = list(range(NUM_TASKS))
    else:
        raise LaunchError(f"not an array task: submit with sbatch (the header sets --array=0-{NUM_TASKS - 1}), or "
                          "set SLURM_ARRAY_TASK_ID")
    for task in tasks:
        cmd = task_command(task, env, tokenizer, workers, repo)
        if cmd is None:
            continue
        if dry_run:
            print(print_cmd(cmd), flush=True)
        else:
            os.makedirs(os.path.dirname(cmd[cmd.index("--output-prefix") + 1]), exist_ok=True)
            return cmd
    return None
