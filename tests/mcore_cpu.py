"""Test helpers for megatron-core's GPTModel on CPU (tests/test_megatron_gpt.py and friends).

GPTModel's local-spec path needs CUDA in four places (megatron-core 0.16.1), and
dist_checkpointing's torch_dist save in a fifth; the tests, not the product, work around them:

  1. GlobalMemoryBuffer.get_tensor allocates the attention-score buffer on CUDA
     -> a fresh CPU tensor (it is only an `out=` buffer of baddbmm with beta 0);
  2. CudaRNGStatesTracker.fork forks the CUDA RNG even at dropout 0 -> a null context;
  3. RotaryEmbedding.get_emb moves inv_freq to CUDA -> the same table on CPU;
  4. the default causal mask is built on cuda -> `causal_mask` passed explicitly (as
     Megatron-LM's pretrain_gpt does);
  5. dist_checkpointing.save calls torch.cuda.synchronize (filesystem_async.preload_tensors)
     and puts its failure flag on torch.cuda.current_device() (state_dict_saver) -> a no-op and
     "cpu", where torch has no CUDA.
"""
from __future__ import annotations

import contextlib

import torch


def _cpu_buffer(self, tensor_shape, dtype, name, mem_alloc_context=None):
    return torch.empty(tensor_shape, dtype=dtype)


def _no_fork(self, name=None):
    return contextlib.nullcontext()


def _no_synchronize(device=None):
    return None


def _cpu_device():
    return "cpu"


def _cpu_rope_table(self, max_seq_len: int, offset: int = 0):
    assert not self.rotary_interleaved, "the CPU stand-in covers the halves layout only"
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def patch_mcore_for_cpu(monkeypatch=None) -> None:
    """Apply the CPU stand-ins 1-3 and 5 (with pytest's monkeypatch, undone after the test; without,
    for the rest of the process: spawned ranks)."""
    from megatron.core import utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    patches = [(utils.GlobalMemoryBuffer, "get_tensor", _cpu_buffer), (CudaRNGStatesTracker, "fork", _no_fork),
               (RotaryEmbedding, "get_emb", _cpu_rope_table)]
    if not torch.cuda.is_available():
        patches += [(torch.cuda, "synchronize", _no_synchronize), (torch.cuda, "current_device", _cpu_device)]
    for owner, name, value in patches:
        if monkeypatch is not None:
            monkeypatch.setattr(owner, name, value)
        else:
            setattr(owner, name, value)


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's mask convention: True = masked out, shape [1, 1, s, s]."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def copy_weights_to_gpt(ours: torch.nn.Module, gpt: torch.nn.Module) -> None:
    """This rank's shards of a LeviathanModel copied by name into a GPTModel+LEV of the same TP."""
    from megatron_lev.models.mcore_args import to_mcore_name

    target = dict(gpt.named_parameters())
    with torch.no_grad():
        for name, param in ours.named_parameters():
            target[to_mcore_name(name)].copy_(param)
    assert len(target) == len(list(ours.parameters())), sorted(target)
