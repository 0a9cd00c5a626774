"""Training: from a command line to a trained, checkpointed model.

  arguments.py       flags over the YAML's training: section (Megatron-LM's names), batch arithmetic
  megatron_flags.py  Megatron-LM flags accepted with a warning, refused, or worth a note
  validation.py      the start-up path: every check of a run before anything is built (also the dry run)
  ds_config.py       the DeepSpeed config from deepspeed_configs/ and the flags
  optim.py           AdamW weight-decay groups and megatron-core's LR schedule
  engine.py          the DeepSpeed engine over the model (or its pipeline form)
  batches.py         datasets -> this rank's micro-batches on the device
  trainer.py         the loop: steps, logs, evaluation, checkpoints, clean exits
  metrics.py         metrics.jsonl, TensorBoard (Megatron's tags), W&B
  flops.py           model FLOPs and MFU

`python -m megatron_lev.train` (megatron_lev/train.py) runs them in that order.
"""
