"""The language-model loss: Megatron's vocab-parallel cross entropy in float32, without a
float32 copy of the logits, and its masked mean over a micro-batch."""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state

# Tokens per chunk of the cross entropy: at most this many bytes of float32 logits at a time.
CROSS_ENTROPY_CHUNK_BYTES = 1 << 29


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross entropy, float32 math without a float32 copy of the logits.

    Megatron's version upcasts the whole [tokens, V/TP] logits and saves their softmax (two
    float32 tensors of the logits' size: 6.6 GB at 16k tokens, V = 50k). Here:

    - TP = 1: torch's fused row-wise kernels (`log_softmax` / `softmax` with dtype=float32,
      which upcast inside the kernel). Float32 logits: their log-softmax replaces them as the
      saved tensor (same size) and backward is exp, scatter, scale. Other dtypes: one chunk
      of tokens at a time (CROSS_ENTROPY_CHUNK_BYTES of float32), saving only the logits in
      their own dtype; backward recomputes the softmax chunk by chunk.
    - TP > 1: Megatron's three all-reduces (max, sum of exponentials, target logit), chunked
      the same way; a float32 log-sum-exp per token is saved with the logits.

    The gradient is written in the logits' dtype.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        n, v = logits.shape
        ctx.chunk = chunk = max(1, CROSS_ENTROPY_CHUNK_BYTES // (4 * v))
        chunks = range(0, n, chunk)
        if group is None:  # the whole vocabulary is here: target ids are local, in range
            target = target.unsqueeze(-1)
            if logits.dtype == torch.float32:
                ctx.saved = "log_probs"
                log_probs = torch.log_softmax(logits, -1)
                ctx.save_for_backward(log_probs, target)
                return log_probs.gather(-1, target).squeeze(-1).neg_()
            ctx.saved = "logits"
            ctx.save_for_backward(logits, target)
            return _cat([torch.log_softmax(logits[i:i + chunk], -1, dtype=torch.float32)
                         .gather(-1, target[i:i + chunk]).squeeze(-1).neg_() for i in chunks])
        local = target - vocab_start
        in_range = (local >= 0) & (local < v)
        local = local.clamp(0, v - 1).unsqueeze(-1)
        maxima = _cat([logits[i:i + chunk].float().amax(-1) for i in chunks])
        torch.distributed.all_reduce(maxima, torch.distributed.ReduceOp.MAX, group=group)
        sums = _cat([(logits[i:i + chunk].float() - maxima[i:i + chunk, None]).exp_().sum(-1) for i in chunks])
        target_logits = logits.gather(-1, local).squeeze(-1).float() * in_range
        torch.distributed.all_reduce(sums, group=group)
        torch.distributed.all_reduce(target_logits, group=group)
        lse = sums.log_().add_(maxima)
        ctx.saved = "logits_and_lse"
        ctx.save_for_backward(logits, local, in_range, lse)
        return lse - target_logits

    @staticmethod
    def backward(ctx, grad_loss):
        grad_loss = grad_loss.unsqueeze(-1)
        saved = ctx.saved_tensors
        if ctx.saved == "log_probs":  # TP = 1, float32: softmax = exp(log-softmax)
            log_probs, target = saved
            # In place: a fresh logits-sized tensor costs its page faults on CPU. A second
            # backward through this graph fails loudly (autograd's saved-tensor version check).
            return _subtract_one_hot(log_probs.exp_(), target).mul_(grad_loss), None, None, None
        if ctx.saved == "logits":  # TP = 1, other dtypes
            logits, target = saved
            in_range = None

            def softmax(rows):
                return torch.softmax(logits[rows], -1, dtype=torch.float32)
        else:
            logits, target, in_range, lse = saved
            in_range = in_range.unsqueeze(-1).to(torch.float32)

            def softmax(rows):
                return (logits[rows].float() - lse[rows, None]).exp_()
        grad = None if logits.shape[0] <= ctx.chunk else torch.empty_like(logits)
        for i in range(0, logits.shape[0], ctx.chunk):
            j = slice(i, i + ctx.chunk)
            chunk_grad = _subtract_one_hot(softmax(j), target[j], None if in_range is None else in_range[j])
            chunk_grad.mul_(grad_loss[j])
            if grad is None:  # one chunk: no copy into a gradient buffer
                return chunk_grad.to(logits.dtype), None, None, None
            grad[j] = chunk_grad
        return grad, None, None, None


def _subtract_one_hot(probs: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None):
    """probs[t, target[t]] -= weight[t] (1 when None), in place: softmax - one_hot, the
    cross entropy's gradient. target and weight are [n, 1]."""
    minus = torch.full(target.shape, -1.0, dtype=probs.dtype, device=probs.device) if weight is None else -weight
    return probs.scatter_add_(-1, target, minus)


def _cat(chunks: list) -> torch.Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def vocab_parallel_cross_entropy_float32(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """logits [..., Vp/TP] (any float dtype), target [...] -> float32 losses [...]."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    vocab_start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    losses = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                              vocab_start, group)
    return losses.view(target.shape)


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor,
                        loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Masked mean of the float32 vocab-parallel cross entropy (Megatron's per-micro-batch mean).

    logits [s, b, Vp/TP], labels and loss_mask [b, s]. Returns a float32 scalar.
    """
    losses = vocab_parallel_cross_entropy_float32(logits, labels.t()).t()  # [b, s]
    if loss_mask is None:
        return losses.mean()
    loss_mask = loss_mask.to(losses.dtype)
    # clamp: a micro-batch with every token masked contributes 0, not NaN.
    return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
