"""Parallel set-up below the model: the process group, megatron-core's groups, the RNG streams.

  launch.py   read the launcher's environment (torchrun, deepspeed, srun, mpirun); start torch.distributed
  state.py    megatron-core's TP/PP/DP groups, DeepSpeed's `mpu` and topology, rank-0 printing
  rng.py      seeding, the model-parallel RNG tracker (CPU too), RNG state for exact resume
"""
