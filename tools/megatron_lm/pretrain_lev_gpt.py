#!/usr/bin/env python
"""Megatron-LM's pretrain_gpt.py with LEV as the input side (docs/megatron-lm.md).

Copy this file into the root of a Megatron-LM checkout (tag core_v0.16.1, beside
pretrain_gpt.py), install megatron_lev in the same environment, and run it exactly as
pretrain_gpt.py, adding --untie-embeddings-and-output-weights and any --lev-* flags:

    torchrun --nproc-per-node 8 pretrain_lev_gpt.py <your pretrain_gpt.py flags> \
        --position-embedding-type rope --untie-embeddings-and-output-weights \
        --lev-num-heads 8 --lev-seed-dim 128 --lev-num-knots 16 --lev-num-modes 64

Everything but the model builder and the extra flags is pretrain_gpt.py's own: its data,
forward step, loss and the `pretrain()` loop.
"""
import time

_PROGRAM_START_TIME = time.time()

from functools import partial  # noqa: E402

import pretrain_gpt  # noqa: E402  Megatron-LM's, from the same folder
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import pretrain, set_startup_timestamps  # noqa: E402
from model_provider import model_provider  # noqa: E402

from megatron_lev.megatron_lm.arguments import add_lev_args  # noqa: E402
from megatron_lev.megatron_lm.provider import lev_gpt_builder  # noqa: E402

if __name__ == "__main__":
    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())
    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        partial(model_provider, lev_gpt_builder),
        ModelType.encoder_or_decoder,
        pretrain_gpt.forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=add_lev_args,
        get_embedding_ranks=pretrain_gpt.get_embedding_ranks,
    )
