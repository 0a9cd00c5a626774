"""--lev-union-ids: with gradient accumulation (G > 1 micro-batches per optimizer step) the LEV
generator runs once per step, on the union U of the step's micro-batches' distinct ids, instead
of once per micro-batch (forward and backward each time).

    step start      E = embedding.rows(U)  [|U|, D]: the generator's one forward
                    leaf = E detached (float32, requires_grad)
    micro-batch i < G   its rows gathered from `leaf`: its backward stops there and adds
                        dL_i/dE into leaf.grad; the generator's parameters get nothing
    micro-batch G       its rows gathered from `_AddGradient(E, leaf.grad)`: the identity
                        forward, whose backward adds leaf.grad to the gradient arriving from
                        micro-batch G, so the generator's one backward, inside the last
                        micro-batch's engine.backward, carries sum_i dL_i/dE

Why an identity that adds a gradient, rather than a surrogate term sum(E * G_acc) in the last
micro-batch's loss: engine.backward scales the loss before autograd runs (1/G for the
accumulation, and a loss scale where one is used), and leaf.grad already holds the earlier
micro-batches' gradients with that same scaling, so adding it to the gradient of the same
backward needs no knowledge of how the engine scales. The surrogate would have to be rescaled
by G (G x then 1/G is not exact in float32 for G = 3) and would change the loss value the
engine sees. The backward must be the last micro-batch's own: DeepSpeed reduces and partitions
gradients inside engine.backward at the accumulation boundary (ZeRO-1 there, ZeRO-2 in each
backward's hooks), so a backward after it would come too late.

What stays the same: the loss of every micro-batch (each embedding row is computed per id,
whatever ids are evaluated with it: lev.ROW_BLOCK) and the generator's gradient up to the order
of its float32 sum. What it costs: the generator's activations for the |U| ids live for the
whole step. Untimed on a GPU. `torch.unique` of the step's ids synchronises on CUDA once.
"""
from __future__ import annotations

import torch


class _AddGradient(torch.autograd.Function):
    """rows -> rows; backward: the incoming gradient plus `extra` (the earlier micro-batches')."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        ctx.extra = extra
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad + ctx.extra.to(grad.dtype), None


class UnionIds:
    """One optimizer step's micro-batches under --lev-union-ids: the generator's forward on their
    union (at construction), then `inputs(i)` for micro-batch i's forward (module docstring)."""

    def __init__(self, embedding: torch.nn.Module, micro_batches: list[dict]):
        sizes = [b["lev_ids"].numel() for b in micro_batches]
        union, where = torch.unique(torch.cat([b["lev_ids"] for b in micro_batches]), sorted=True,
                                    return_inverse=True)
        # Micro-batch i's positions -> rows of U: its own distinct ids' places in U, at its inverse.
        self.inverses = [w[b["lev_inverse"]] for w, b in zip(where.split(sizes), micro_batches)]
        self.distinct = union.numel()  # what the generator evaluates this step (the FLOPs count)
        # Float32, so the accumulated gradient is summed in float32 whatever the generator returns
        # (params_dtype after a TP reduction without output_norm); the loader range-checked the ids.
        self.rows = embedding.rows(union).float()
        self.leaf = self.rows.detach().requires_grad_()
        self.count = len(micro_batches)

    def inputs(self, i: int) -> dict:
        """Micro-batch i's LEV inputs of LeviathanModel.forward (over the loader's)."""
        if i < self.count - 1:
            rows = self.leaf
        else:  # the last: through the generator's graph, carrying the earlier gradients
            grad = self.leaf.grad
            rows = self.rows if grad is None else _AddGradient.apply(self.rows, grad)
            self.rows = self.leaf = None  # the graph is freed by this backward
        return {"lev_inverse": self.inverses[i], "lev_rows": rows}
