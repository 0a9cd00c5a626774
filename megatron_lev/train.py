"""Pre-training under DeepSpeed: `python -m megatron_lev.train --config lev-200m ...`.

    torchrun --nproc_per_node 8 -m megatron_lev.train --config lev-1.2b \
        --data-path /data/pile_text_document --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model /data/tok.model --save ckpt --load ckpt --bf16

What a run does, in order (each step one hop away):
1. validate everything (training/validation.py): flags over the YAML and the job size, the
   DeepSpeed config, data, tokenizer and vocabulary, the save folder, and a --load
   checkpoint's model, tokenizer, seed, layout and schedule. A mistake stops the job here,
   before any process group or model exists (exit 2);
2. start torch.distributed and megatron-core's TP/PP/DP groups, seed (distributed/);
3. build the datasets (training/batches.py over data/datasets.py);
4. build the DeepSpeed engine (training/engine.py: the model of models/, AdamW and the LR
   schedule), resume the checkpoint (checkpointing/), and train (training/trainer.py).

Exit codes: 0 done or stopped cleanly (signal, exit interval/duration: a requeued job
resumes with --load); 1 too many non-finite steps in a row (after saving); 2 bad
configuration (nothing was built).
"""
from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist

from megatron_lev.checkpointing.safe_load import CheckpointLoadError
from megatron_lev.checkpointing.save import write_run_config
from megatron_lev.checkpointing.space import CheckpointSpaceError
from megatron_lev.distributed.launch import detect_launch_env, init_distributed
from megatron_lev.distributed.rng import set_seed
from megatron_lev.distributed.state import destroy_parallel, initialize_model_parallel, is_rank_0, print_rank_0
from megatron_lev.training.run_summary import format_config, summarize_config
from megatron_lev.training.batches import build_datasets
from megatron_lev.training.trainer import ExitSignalHandler, Trainer, fail
from megatron_lev.training.validation import validate_run
from megatron_lev.utils.errors import ConfigError
from megatron_lev.utils.run_log import StartupTimer, configure_logging


def main(argv=None) -> int:
    """Train; returns the exit code. Callable in-process: it initialises torch.distributed
    only if nobody did, and tears down only what it set up."""
    # From the process start (the first phase is the imports); a call in a running process
    # (tests, notebooks) counts from the call.
    timer = StartupTimer() if argv is None else StartupTimer(start=time.time())
    timer.mark("imports")
    launch = detect_launch_env()
    try:
        run = validate_run(argv, launch.world_size, launch.rank)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        return fail(str(exc), launch.rank)
    args, config = run.args, run.config
    configure_logging(args.logging_level)
    timer.mark("validation")

    owns_process_group = not dist.is_initialized()
    init_distributed(timeout_minutes=args.distributed_timeout_minutes)
    initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    exit_handler = None
    try:
        set_seed(args.seed)
        timer.mark("distributed")
        if is_rank_0():
            if args.save:  # the full configuration goes to the run folder, a summary to stdout
                write_run_config(args.save, config)
                print(summarize_config(config, os.path.join(args.save, "config.yaml")), flush=True)
            else:
                print("effective configuration:\n" + format_config(config), flush=True)
        try:  # before the model: a split without documents is a configuration error too
            datasets = build_datasets(args, run.tokenizer)
        except (ValueError, FileNotFoundError) as exc:
            return fail(str(exc), launch.rank)
        timer.mark("data")
        try:
            trainer = Trainer(run, datasets)
        except (CheckpointLoadError, ConfigError) as exc:  # raised on every rank alike (a fallback checkpoint's
            return fail(str(exc), launch.rank)             # files or config, checked collectively)
        timer.mark("model and engine")
        print_rank_0(timer.line())
        trainer.startup = timer  # the first iteration line reports the time to first step
        # Only now: a signal during start-up kills the job as usual (nothing new to save, and
        # a hung start-up must stay killable); from here on it means "checkpoint, exit 0".
        if args.exit_signal_handler:
            exit_handler = trainer.exit_handler = ExitSignalHandler().install()
        try:
            return trainer.run()
        except CheckpointSpaceError as exc:  # raised on every rank alike, before the save wrote anything
            return fail(str(exc), launch.rank)
        finally:
            trainer.metrics.close()
    finally:
        if exit_handler is not None:
            exit_handler.uninstall()
        if owns_process_group:
            destroy_parallel()
        else:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    sys.exit(main())
