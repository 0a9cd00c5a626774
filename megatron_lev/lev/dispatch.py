"""Where LEV's mode product runs (generator.py step 5): compiled by torch.compile on CPU, as
the fused Triton kernels of kernels.py on CUDA, else eager PyTorch; and its prologue (step 3:
W_seed, LayerNorm, sigmoid, the casts) compiled on CUDA. The math is generator.py's;
this module only picks the implementation, and falls back, with one warning, where one cannot
compile or launch. generator.py imports it only inside the package: an HF export folder, which
holds generator.py (as lev.py) and lev_config.py without the package, takes the eager PyTorch path (the same math).

It does not import generator.py (generator.py imports it): the functions to compile and the
kernels' constants are passed in.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import torch


def exception_line(exc: BaseException) -> str:
    """'TypeName: first line of the message' (at most 200 characters of it), for a warning."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


class CompiledOrEager:
    """`function` compiled by torch.compile on its first call (dynamic shapes: one compilation
    serves every number of ids), or `function` itself, with one warning, once compilation failed
    in this process (no C++ compiler, no Triton launcher). `compiled`: None before the first
    call, False after a failure."""

    def __init__(self, function: Callable, what: str):
        self.function, self.what, self.compiled = function, what, None

    def __call__(self, *args):
        if self.compiled is False:
            return self.function(*args)
        if self.compiled is None:
            # emulate_precision_casts: a cast to bfloat16 rounds as eager's does (inductor would
            # otherwise keep the float32 value through a fused cast), so compiled equals eager.
            self.compiled = torch.compile(self.function, dynamic=True, options={"emulate_precision_casts": True})
        try:  # compiles on the first call, and again for a new model's shapes
            return self.compiled(*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: keep training, eagerly
            warnings.warn(f"LEV: torch.compile of {self.what} failed, using eager PyTorch (slower, same math): "
                          f"{exception_line(exc)}")
            self.compiled = False
            return self.function(*args)


# On CUDA the prologue of the modes (generator.seed_coordinates: the W_seed product, LayerNorm, its
# affine, the sigmoid and the casts; about 10 eager kernels) runs compiled: inductor fuses what
# follows the matmul into one or two kernels. Devices listed here take it; set () for the eager
# reference. Untimed on a GPU.
COMPILED_PROLOGUE_DEVICES = ("cuda",)
_compiled_prologue: Optional[CompiledOrEager] = None


def prologue(seed_coordinates: Callable, device: torch.device) -> Callable:
    """The implementation of generator.seed_coordinates on `device`: compiled, or itself."""
    global _compiled_prologue
    if device.type not in COMPILED_PROLOGUE_DEVICES:
        return seed_coordinates
    if _compiled_prologue is None or _compiled_prologue.function is not seed_coordinates:
        _compiled_prologue = CompiledOrEager(seed_coordinates, "the LEV prologue (W_seed, LayerNorm, sigmoid)")
    return _compiled_prologue


# On CPU `mode_product` runs compiled by torch.compile (inductor: one loop over phi instead
# of several passes, 6-10x faster at the demo's shapes), falling back to eager once, with a
# warning, where compilation fails (no C++ compiler). Shapes are dynamic: one compilation
# serves every number of ids. Set False for the eager reference.
COMPILE_CPU_MODE_PRODUCT = True
_cpu_mode_product: Optional[CompiledOrEager] = None


def cpu_mode_product(mode_product: Callable) -> Callable:
    """The CPU implementation of generator.mode_product: compiled, or itself."""
    global _cpu_mode_product
    if not COMPILE_CPU_MODE_PRODUCT:
        return mode_product
    if _cpu_mode_product is None or _cpu_mode_product.function is not mode_product:
        _cpu_mode_product = CompiledOrEager(mode_product, "the CPU mode product")
    return _cpu_mode_product


# Devices whose tensors take the fused kernels of lev/kernels.py (when Triton imports): on CUDA
# they replace the per-head loop with one forward and one backward kernel. The CPU keeps the
# `bmm` path: faster there than the 3-knot gather form, and its bit-exactness is verified.
FUSED_MODES_DEVICES = ("cuda",)
# The reason the fused kernels failed to compile or launch in this process (e.g. no C compiler or
# no Python.h for Triton's launcher): every later call takes the PyTorch path (the same modes).
fused_modes_failure: Optional[str] = None


@functools.lru_cache(maxsize=None)
def _fused_kernels():
    """megatron_lev.lev.kernels, or None without Triton."""
    try:
        from megatron_lev.lev import kernels
    except ImportError:
        return None
    except Exception as exc:  # noqa: BLE001 - Triton installed but broken: the PyTorch path, said once
        warnings.warn(f"LEV: Triton failed to import, using the PyTorch path (same math, slower): "
                      f"{exception_line(exc)}")
        return None
    return kernels


def uses_fused_modes(device: torch.device) -> bool:
    if device.type not in FUSED_MODES_DEVICES or fused_modes_failure is not None:
        return False
    kernels = _fused_kernels()
    return kernels is not None and kernels.available(device)


def fused_separable_modes(x: torch.Tensor, delta: torch.Tensor, eps: float, *, chunk: int,
                          mode_max: float) -> Optional[torch.Tensor]:
    """The fused kernels' modes, or None (after one warning) where Triton cannot compile or launch
    them. The first call per shape also runs the backward kernel (kernels.py), so a failure shows
    here, in forward, where the PyTorch path can still take over."""
    global fused_modes_failure
    try:
        return _fused_kernels().separable_modes(x, delta, eps, chunk=chunk, mode_max=mode_max)
    except Exception as exc:  # noqa: BLE001 - any compiler or launch failure: keep training
        fused_modes_failure = exception_line(exc)
        warnings.warn(f"LEV: the fused Triton kernels failed on {x.device.type}, using the PyTorch path "
                      f"(same math, slower): {fused_modes_failure}")
        return None
