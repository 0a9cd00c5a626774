"""Where LEV's mode product runs (generator.py step 5): compiled by torch.compile on CPU, as
the fused Triton kernels of kernels.py on CUDA, else eager PyTorch. The math is generator.py's;
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


# On CPU `mode_product` runs compiled by torch.compile (inductor: one loop over phi instead
# of several passes, 6-10x faster at the demo's shapes), falling back to eager once, with a
# warning, where compilation fails (no C++ compiler). Shapes are dynamic: one compilation
# serves every number of ids. Set False for the eager reference.
COMPILE_CPU_MODE_PRODUCT = True
_compiled_mode_product = None  # the compiled function; False once compilation failed in this process


def cpu_mode_product(mode_product: Callable) -> Callable:
    """The CPU implementation of generator.mode_product: compiled, or itself."""
    if not COMPILE_CPU_MODE_PRODUCT:
        return mode_product

    def compiled(phi: torch.Tensor, eps: float):
        global _compiled_mode_product
        if _compiled_mode_product is False:  # compilation failed earlier in this process
            return mode_product(phi, eps)
        if _compiled_mode_product is None:
            _compiled_mode_product = torch.compile(mode_product, dynamic=True)
        try:  # compiles on the first call, and again for a new model's shapes
            return _compiled_mode_product(phi, eps)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: keep training, eagerly
            warnings.warn(f"LEV: torch.compile of the CPU mode product failed, using eager PyTorch "
                          f"(slower, same math): {exception_line(exc)}")
            _compiled_mode_product = False
            return mode_product(phi, eps)

    return compiled


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
