#!/usr/bin/env python
"""Megatron-LM's pretrain_gpt.py with LEV as the input side (docs/megatron-lm.md).

Copy this file into the root of a Megatron-LM checkout (tag core_v0.16.1, beside
pretrain_gpt.py), install megatron_lev in the same environment, and run it exactly as
pretrain_gpt.py, adding --untie-embeddings-and-output-weights and any --lev-* flags:

    torchrun --nproc-per-node 8 pretrain_lev_gpt.py <your pretrain_gpt.py flags> \\
        --position-embedding-type rope --untie-embeddings-and-output-weights \\
        --lev-num-heads 8 --lev-seed-dim 128 --lev-num-knots 16 --lev-num-modes 64

The main block below is pretrain_gpt.py's, line for line, but for the model builder
(`lev_gpt_builder` for `gpt_builder`): in-process restart, the ModelOpt argument hooks, data,
forward step and loss are pretrain_gpt.py's own (tests/test_megatron_script.py compares the two).
`model_provider` is megatron_lev's, which refuses what would replace the LEV builder and then
calls Megatron-LM's. The --lev-* flags are registered with Megatron-LM's parser at import, so every
parse of the command line knows them (--help included).
"""
import time

_PROGRAM_START_TIME = time.time()

from functools import partial  # noqa: E402

from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import inprocess_restart, pretrain, set_startup_timestamps  # noqa: E402
from pretrain_gpt import (  # noqa: E402  Megatron-LM's, from the same folder
    forward_step,
    get_embedding_ranks,
    has_nvidia_modelopt,
    train_valid_test_datasets_provider,
)

from megatron_lev.megatron_lm.arguments import register_lev_args  # noqa: E402
from megatron_lev.megatron_lm.provider import lev_gpt_builder, model_provider  # noqa: E402

if has_nvidia_modelopt:
    from pretrain_gpt import add_modelopt_args  # noqa: E402

register_lev_args()

if __name__ == "__main__":
    # Timestamp right after entering __main__ block (after all imports/library setup)
    _MAIN_ENTRY_TIME = time.time()

    # Register startup timestamps for timing report in pretrain()
    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=_MAIN_ENTRY_TIME)

    # Temporary for transition to core datasets
    train_valid_test_datasets_provider.is_distributed = True

    # Optionally enable inprocess restart on pretrain
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)

    pretrain(
        train_valid_test_datasets_provider,
        partial(model_provider, lev_gpt_builder),
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,
        store=store,
        get_embedding_ranks=get_embedding_ranks,
    )
