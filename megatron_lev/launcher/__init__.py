"""The Slurm launcher: what slurm/common.sh used to compute in bash, as tested Python.

    training.py   the training job: checks at submit, batch arithmetic, torchrun and srun commands
    batch.py      the batch arithmetic (DP, micro-batch, accumulation) and its refusals
    variables.py  the scripts' variables: Megatron-LM's names, EXTRA_ARGS, tokenizer, blends
    steps.py      after a job step: restart it in the allocation, requeue, or end the job
    disk.py       one checkpoint's size and the disk the run needs (KEEP_CHECKPOINTS)
    resume.py     a resume at another layout: the conversion step before the trainers
    pile.py       slurm/preprocess_pile.sh's array tasks
    shell.py      bash's quoting and word splitting, integer checks, the one-line refusal
    __main__.py   `python -m megatron_lev.launcher plan | after-step | pile`, run by slurm/common.sh

The batch shell keeps what only it can do: the signal traps, srun in the background, `wait`, and
`scontrol requeue` (slurm/common.sh's header explains why). Nothing here imports torch but the
parameter count of disk.py (the model code's own).
"""
