#!/usr/bin/env python
"""Check on a CPU the LEV model a pretrain_lev_gpt.py command line would train (docs/megatron-lm.md).

Run it from the root of a Megatron-LM checkout (core_v0.16.1), with megatron_lev installed, the
flags you would give pretrain_lev_gpt.py and the job's size; no GPU is used and no data is read
(the tokenizer's files must be there):

    WORLD_SIZE=64 python /path/to/megatron_lev/tools/megatron_lm/check_lev_gpt.py <your pretrain_lev_gpt.py flags>

Megatron-LM's own parse_args and validate_args read the flags (with the --lev-* ones), Megatron-LM
builds the tokenizer, and megatron_lev/megatron_lm/check.py builds the model in this one process.
It prints what will be trained and exported, or the one line that would stop the run (exit 2).
"""
import os
import socket
import sys


def main() -> int:
    sys.path.insert(0, os.getcwd())  # the Megatron-LM checkout
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    from megatron_lev.megatron_lm.arguments import register_lev_args
    from megatron_lev.megatron_lm.check import check_lev_gpt

    register_lev_args()
    args = parse_args()
    # validate_args asks the GPU its architecture when TP or CP > 1 (CUDA settings, not the model's):
    # validated at 1, then the run's sizes are back for the tokenizer's padding and the checks.
    sizes = args.tensor_model_parallel_size, args.context_parallel_size
    args.tensor_model_parallel_size = args.context_parallel_size = 1
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})  # pretrain_gpt.py's default
    args.tensor_model_parallel_size, args.context_parallel_size = sizes
    set_global_variables(args)  # builds Megatron-LM's tokenizer
    with socket.socket() as s:  # one local process, whatever the job's WORLD_SIZE
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    try:
        print(check_lev_gpt(args))
    except ValueError as exc:
        print(f"check_lev_gpt.py: error: {exc}", file=sys.stderr)
        return 2
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
