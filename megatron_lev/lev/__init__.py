"""LEV (learned embedding vectorization): the input-embedding generator of Leviathan models.

  generator.py   all of its math, torch only (copied verbatim into Hugging Face exports as lev.py)
  lev_config.py  LEVConfig, its fields and checks, torch-free (exported beside it as lev_config.py)
  kernels.py     fused Triton kernels of the mode product and its backward (CUDA)
  parallel.py    ParallelLEVEmbedding: the generator as a tensor-parallel megatron-core module
"""
