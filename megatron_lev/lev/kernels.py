"""Fused Triton kernels for LEV's mode product (generator.py step 5), used on CUDA.

    modes = separable_modes(x, delta, eps)   # x [n, h, d_s] in [0, 1], delta [h, d_s, kappa, r]

Two kernels replace generator.py's per-head loop of basis, dense `bmm`, sign parity and log-sum
(about 90 launched kernels per head, forward and backward):

  forward   one program per (block of rows, head): for each seed coordinate it gathers
            the 3 non-zero knots' rows of S = 1 + delta (never a dense basis), forms
            phi [rows, r] and accumulates log|phi| and the parity of the negative
            factors in registers; phi is never written to memory. Writes M [n, h, r].
  backward  one program per (head, seed coordinate): rebuilds phi, forms
            dM/dphi = M * sign(phi) / (|phi| + eps) times the incoming gradient, writes
            grad_x (the basis derivative in closed form) and accumulates
            grad_S[head, d] [kappa, r] = basis^T @ grad_phi over all rows in registers,
            so grad_delta needs no atomics and no [d_s, n, r] buffer.

Everything is float32 (`tl.dot` in "ieee" precision: no TF32). Each output row depends on
its own id only, so evaluating distinct ids or every position gives the same rows bit
for bit within this path; it is not bit-identical to generator.py's CPU path (which sums the
16-knot dense basis through BLAS): the two agree to float32 rounding (tests/test_lev/kernels.py).

This module imports Triton; generator.py imports it only on first use and only when Triton is
installed (generator.py itself stays torch-only for the HF export). On CPU tensors the kernels
run under Triton's interpreter when TRITON_INTERPRET=1 is set before their first launch,
which is how CI tests them.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 32  # rows per program in the forward and per loop step in the backward


def available(device: torch.device | str) -> bool:
    """True when the kernels can run on tensors of `device`: CUDA, or CPU under Triton's
    interpreter (TRITON_INTERPRET=1)."""
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


# The kernels are plain functions here and pass through `triton.jit` on first launch
# (`_jit`): triton.jit reads TRITON_INTERPRET when it decorates, so a test can set it
# after this module was imported. Kernel bodies find each other as module globals.
def _basis(x, KAPPA: tl.constexpr):
    """Nearest knot c, the normalised weights of knots (c-1, c, c+1) and their x-derivatives."""
    scaled = x * (KAPPA - 1)
    center = tl.minimum(tl.maximum(tl.floor(scaled + 0.5), 0.0), KAPPA - 1.0)
    t0 = scaled - center
    low = (center > 0).to(tl.float32)
    high = (center < KAPPA - 1).to(tl.float32)
    raw0 = 0.5 * (0.5 - t0) * (0.5 - t0) * low
    raw1 = 0.75 - t0 * t0
    raw2 = 0.5 * (0.5 + t0) * (0.5 + t0) * high
    total = raw0 + raw1 + raw2
    w0, w1, w2 = raw0 / total, raw1 / total, raw2 / total
    d0 = (t0 - 0.5) * low * (KAPPA - 1)
    d1 = -2.0 * t0 * (KAPPA - 1)
    d2 = (t0 + 0.5) * high * (KAPPA - 1)
    dsum = d0 + d1 + d2
    dw0, dw1, dw2 = (d0 - w0 * dsum) / total, (d1 - w1 * dsum) / total, (d2 - w2 * dsum) / total
    c = center.to(tl.int32)
    return c, w0, w1, w2, dw0, dw1, dw2

def modes_forward(x_ptr, delta_ptr, modes_ptr, n, eps, H: tl.constexpr, DS: tl.constexpr,
                  KAPPA: tl.constexpr, R: tl.constexpr, R_P2: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    head = tl.program_id(1)
    q = tl.arange(0, R_P2)
    row_ok = rows < n
    mask = row_ok[:, None] & (q < R)[None, :]
    log_sum = tl.zeros((BLOCK, R_P2), dtype=tl.float32)
    negatives = tl.zeros((BLOCK, R_P2), dtype=tl.int32)
    for d in range(DS):
        x = tl.load(x_ptr + (rows * H + head) * DS + d, mask=row_ok, other=0.5)
        c, w0, w1, w2, dw0, dw1, dw2 = _basis(x, KAPPA)
        table = delta_ptr + (head * DS + d) * KAPPA * R + q[None, :]
        s0 = 1.0 + tl.load(table + tl.maximum(c - 1, 0)[:, None] * R, mask=mask, other=0.0)
        s1 = 1.0 + tl.load(table + c[:, None] * R, mask=mask, other=0.0)
        s2 = 1.0 + tl.load(table + tl.minimum(c + 1, KAPPA - 1)[:, None] * R, mask=mask, other=0.0)
        phi = w0[:, None] * s0 + w1[:, None] * s1 + w2[:, None] * s2
        log_sum += tl.log(tl.abs(phi) + eps)
        negatives += (phi < 0).to(tl.int32)
    sign = 1.0 - 2.0 * (negatives % 2).to(tl.float32)
    tl.store(modes_ptr + (rows[:, None] * H + head) * R + q[None, :], sign * tl.exp(log_sum), mask=mask)

def modes_backward(x_ptr, delta_ptr, gm_ptr, grad_x_ptr, grad_delta_ptr, n, eps, H: tl.constexpr,
                   DS: tl.constexpr, KAPPA: tl.constexpr, KAPPA_P2: tl.constexpr, R: tl.constexpr,
                   R_P2: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    head = pid // DS
    d = pid % DS
    q = tl.arange(0, R_P2)
    knots = tl.arange(0, KAPPA_P2)
    table = delta_ptr + pid * KAPPA * R + q[None, :]  # (head * DS + d) == pid
    grad_table = tl.zeros((KAPPA_P2, R_P2), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        row_ok = rows < n
        mask = row_ok[:, None] & (q < R)[None, :]
        x = tl.load(x_ptr + (rows * H + head) * DS + d, mask=row_ok, other=0.5)
        c, w0, w1, w2, dw0, dw1, dw2 = _basis(x, KAPPA)
        lo = tl.maximum(c - 1, 0)
        hi = tl.minimum(c + 1, KAPPA - 1)
        s0 = 1.0 + tl.load(table + lo[:, None] * R, mask=mask, other=0.0)
        s1 = 1.0 + tl.load(table + c[:, None] * R, mask=mask, other=0.0)
        s2 = 1.0 + tl.load(table + hi[:, None] * R, mask=mask, other=0.0)
        phi = w0[:, None] * s0 + w1[:, None] * s1 + w2[:, None] * s2
        gm = tl.load(gm_ptr + (rows[:, None] * H + head) * R + q[None, :], mask=mask, other=0.0)
        sign = tl.where(phi > 0, 1.0, tl.where(phi < 0, -1.0, 0.0))
        grad_phi = gm * sign / (tl.abs(phi) + eps)  # zero on masked rows and modes
        dphi = dw0[:, None] * s0 + dw1[:, None] * s1 + dw2[:, None] * s2
        tl.store(grad_x_ptr + (rows * H + head) * DS + d, tl.sum(grad_phi * dphi, axis=1), mask=row_ok)
        # Off-grid neighbours (clamped onto c) carry weight 0, so they add nothing.
        basis = (w0[:, None] * (lo[:, None] == knots[None, :]).to(tl.float32)
                 + w1[:, None] * (c[:, None] == knots[None, :]).to(tl.float32)
                 + w2[:, None] * (hi[:, None] == knots[None, :]).to(tl.float32))
        grad_table += tl.dot(tl.trans(basis), grad_phi, input_precision="ieee")
    out = grad_delta_ptr + (pid * KAPPA + knots[:, None]) * R + q[None, :]
    tl.store(out, grad_table, mask=(knots < KAPPA)[:, None] & (q < R)[None, :])


_JIT_DONE = []


def _jit():
    if not _JIT_DONE:
        for name in ("_basis", "modes_forward", "modes_backward"):
            globals()[name] = triton.jit(globals()[name])
        _JIT_DONE.append(True)


def _p2(value: int) -> int:
    """Next power of two, at least 16 (`tl.arange` sizes; `tl.dot`'s minimum)."""
    return max(16, 1 << (value - 1).bit_length())


@torch.library.custom_op("megatron_lev::lev_modes_forward", mutates_args=())
def modes_forward_op(x: torch.Tensor, delta: torch.Tensor, eps: float) -> torch.Tensor:
    """One kernel launch: modes [n, h, r] from x [n, h, d_s] and delta [h, d_s, kappa, r]."""
    n, h, ds = x.shape
    kappa, r = delta.shape[2], delta.shape[3]
    modes = torch.empty(n, h, r, dtype=torch.float32, device=x.device)
    _jit()
    if n:
        modes_forward[(triton.cdiv(n, BLOCK_ROWS), h)](
            x, delta, modes, n, eps, H=h, DS=ds, KAPPA=kappa, R=r, R_P2=_p2(r), BLOCK=BLOCK_ROWS)
    return modes


@torch.library.custom_op("megatron_lev::lev_modes_backward", mutates_args=())
def modes_backward_op(x: torch.Tensor, delta: torch.Tensor, grad_times_modes: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel launch: (grad_x, grad_delta) from dL/dM * M [n, h, r]."""
    n, h, ds = x.shape
    kappa, r = delta.shape[2], delta.shape[3]
    grad_x = torch.empty_like(x)
    grad_delta = torch.empty_like(delta)
    _jit()
    modes_backward[(h * ds,)](
        x, delta, grad_times_modes, grad_x, grad_delta, n, eps, H=h, DS=ds, KAPPA=kappa,
        KAPPA_P2=_p2(kappa), R=r, R_P2=_p2(r), BLOCK=BLOCK_ROWS)
    return grad_x, grad_delta


@modes_forward_op.register_fake
def _(x, delta, eps):
    return x.new_empty(x.shape[0], x.shape[1], delta.shape[3])


@modes_backward_op.register_fake
def _(x, delta, grad_times_modes, eps):
    return torch.empty_like(x), torch.empty_like(delta)


class _FusedSeparableModes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, delta, eps):
        modes = modes_forward_op(x, delta, eps)
        ctx.save_for_backward(x, delta, modes)
        ctx.eps = eps
        return modes

    @staticmethod
    def backward(ctx, grad_modes):
        x, delta, modes = ctx.saved_tensors
        grad_x, grad_delta = modes_backward_op(x, delta, (grad_modes.to(torch.float32) * modes).contiguous(),
                                               ctx.eps)
        return grad_x, grad_delta, None


def separable_modes(x: torch.Tensor, delta: torch.Tensor, eps: float) -> torch.Tensor:
    """lev.separable_modes with the coefficients given as `delta` (S = 1 + delta is formed
    inside the kernels): x [n, h, d_s] float32, delta [h, d_s, kappa, r] -> modes [n, h, r]
    float32."""
    return _FusedSeparableModes.apply(x.to(torch.float32).contiguous(), delta.to(torch.float32).contiguous(),
                                      float(eps))
