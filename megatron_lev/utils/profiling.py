"""Count what a piece of PyTorch code would launch on a GPU, on any device.

    with KernelCounter() as counter:
        loss = model(batch); loss.backward()
    counter.summary()   # {"kernels": 41, "host_syncs": 0, "bytes_moved": ..., "ops": {...}}

A `TorchDispatchMode` sees every aten operator after autograd, i.e. what each device's
backend is asked to run, forward and backward alike. An operator that computes (not a view,
not an allocation) is one launched kernel on CUDA to a first approximation (a few, such
as a sort-based embedding backward, launch several; a custom op such as LEV's fused Triton
kernels counts as the one kernel it launches). Host synchronisations are the operators
whose result size or value the host must read back (`unique`, `nonzero`, `.item()`, ...).
`bytes_moved` sums the sizes of every computing operator's tensor inputs and outputs: an
upper-bound estimate of the memory traffic when nothing is fused.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Operators that make the host wait for the device: data-dependent output sizes or values.
HOST_SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim",
    "aten::unique_consecutive", "aten::masked_select", "aten::is_nonzero", "aten::equal",
    "aten::_assert_async", "aten::repeat_interleave",
})
# Operators that only allocate or relabel memory: no kernel.
NO_KERNEL_OPS = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
    "aten::lift_fresh", "aten::detach",
    "aten::set_", "aten::resize_", "aten::_unsafe_view", "aten::clone_noop",
})


def _is_kernel(func) -> bool:
    name = func._schema.name
    return not (func.is_view or name in NO_KERNEL_OPS)


class KernelCounter(TorchDispatchMode):
    """Counts computing operators (`kernels`), `host_syncs` and `bytes_moved` while active."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.bytes_moved = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in HOST_SYNC_OPS:
            self.syncs[name] += 1
        if _is_kernel(func):
            self.ops[name] += 1
            leaves, _ = tree_flatten((args, kwargs, out))
            self.bytes_moved += sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        return out

    @property
    def kernels(self) -> int:
        return sum(self.ops.values())

    @property
    def host_syncs(self) -> int:
        return sum(self.syncs.values())

    def summary(self) -> dict:
        return {"kernels": self.kernels, "host_syncs": self.host_syncs, "host_sync_ops": dict(self.syncs),
                "bytes_moved": self.bytes_moved, "ops": dict(self.ops.most_common())}
