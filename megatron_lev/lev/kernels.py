"""Fused Triton kernels for LEV's mode product (generator.py step 5), used on CUDA.

    modes = separable_modes(x, delta, eps)   # x [n, h, d_s] in [0, 1], delta [h, d_s, kappa, r]

Two kernels (and a small second stage) replace generator.py's per-head loop of basis, dense `bmm`
and chunked mode product (about 90 launched kernels per head, forward and backward):

  forward   one program per (block of rows, head): for each seed coordinate it gathers
            the 3 non-zero knots' rows of S = 1 + delta (never a dense basis), forms
            phi' = phi + copysign(eps, phi) [rows, r], multiplies 16 of them in registers and
            adds one log per 16 (generator.mode_product's rule, its cap on |M| included);
            phi is never written to memory. Writes M [n, h, r].
  backward  grid (h * d_s, splits): one program per (head, seed coordinate, split of the rows).
            For each block of its split's rows it rebuilds phi', forms dM/dphi = M / phi' times
            the incoming gradient (0 where |M| is capped), writes grad_x (the basis derivative
            in closed form) and accumulates grad_S[head, d] [kappa, r] = basis^T @ grad_phi in
            registers; at the end it stores that split's partial into a float32 workspace
            [splits, h, d_s, kappa, r] (grad_delta itself when there is one split), and
            `modes_backward_sum` adds the splits in split order. No atomics and no
            [d_s, n, r] buffer: the same result run to run, and one that depends on the split
            count only through float32 summation order (grad_x not at all). x and grad_x
            travel transposed, [h, d_s, n] (one copy each way around the kernel), so a
            program's block of rows is one contiguous load and store. The op
            (`modes_backward_op`) is one operator to utils/profiling.KernelCounter but launches
            up to four kernels on a GPU: x's copy, the kernel, the sum, grad_x's copy back.
            Why: with one program per (head, coordinate) each program looped over every row
            (tens of thousands of distinct ids a step) behind only h * d_s programs (1,024 at
            lev-1.2b, 10 at the toy shapes, fewer per rank under TP), loading x with a stride of
            h * d_s floats. `row_splits` (a pure function of n and h * d_s) cuts the rows into
            whole blocks of BLOCK_ROWS until there are TARGET_BACKWARD_PROGRAMS programs (4
            waves of 132 SMs) where n allows; at lev-1.2b's 1,024 columns it keeps 1 split.
            Not yet timed on a GPU (docs/performance.md).

Everything is float32 (`tl.dot` in "ieee" precision: no TF32). Each output row depends on
its own id only, so evaluating distinct ids or every position gives the same rows bit
for bit within this path; it is not bit-identical to generator.py's CPU path (which sums the
16-knot dense basis through BLAS): both are within the float32 error bound of the exact modes.

This module imports Triton; generator.py imports it only on first use and only when Triton is
installed (generator.py itself stays torch-only for the HF export). The first forward of a shape
on a GPU also launches the backward kernels once (on zeros), so that a failure to compile or
launch any kernel (Triton's launcher needs a C compiler and Python.h) raises in forward,
where generator.py warns once and takes the PyTorch path. `LAUNCHES` counts the launches
(forward, backward, backward_sum). On CPU tensors the kernels run under Triton's interpreter
when TRITON_INTERPRET=1 is set before their first launch, which is how CI tests them
(tests/test_lev_kernels.py, within the float32 error bound of docs/lev.md).
"""
from __future__ import annotations

import collections
import os

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 32  # rows per program in the forward and per loop step in the backward
# The backward splits the rows over programs until there are at least this many (4 waves of an
# H100's / H200's 132 SMs at one program each; a fixed number, so a given shape sums in the same
# order on any GPU). `row_splits` is the rule; FORCE_ROW_SPLITS (tests) overrides its count.
TARGET_BACKWARD_PROGRAMS = 4 * 132
FORCE_ROW_SPLITS: int | None = None
SUM_BLOCK = 1024  # grad_delta entries per program of the second stage (the sum over the splits)
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)  # a chunk product past it counts as it


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

def _shifted_factor(x_ptr, delta_ptr, rows, row_ok, head, d, q, mask, eps, H: tl.constexpr, DS: tl.constexpr,
                    KAPPA: tl.constexpr, R: tl.constexpr):
    """phi' = phi + copysign(eps, phi) of seed coordinate d for a block of rows [BLOCK, R_P2]."""
    x = tl.load(x_ptr + (rows * H + head) * DS + d, mask=row_ok, other=0.5)
    c, w0, w1, w2, dw0, dw1, dw2 = _basis(x, KAPPA)
    table = delta_ptr + (head * DS + d) * KAPPA * R + q[None, :]
    s0 = 1.0 + tl.load(table + tl.maximum(c - 1, 0)[:, None] * R, mask=mask, other=0.0)
    s1 = 1.0 + tl.load(table + c[:, None] * R, mask=mask, other=0.0)
    s2 = 1.0 + tl.load(table + tl.minimum(c + 1, KAPPA - 1)[:, None] * R, mask=mask, other=0.0)
    phi = w0[:, None] * s0 + w1[:, None] * s1 + w2[:, None] * s2
    return tl.where(phi < 0, phi - eps, phi + eps)


def _log_magnitude(product):
    """log|P| of a chunk product, a product past float32's range counting as its largest value."""
    magnitude = tl.abs(product)
    return tl.log(tl.where(magnitude > FLOAT32_MAX, FLOAT32_MAX, magnitude))


def modes_forward(x_ptr, delta_ptr, modes_ptr, n, eps, mode_max, H: tl.constexpr, DS: tl.constexpr,
                  KAPPA: tl.constexpr, R: tl.constexpr, R_P2: tl.constexpr, BLOCK: tl.constexpr,
                  CHUNK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    head = tl.program_id(1)
    q = tl.arange(0, R_P2)
    row_ok = rows < n
    mask = row_ok[:, None] & (q < R)[None, :]
    log_sum = tl.zeros((BLOCK, R_P2), dtype=tl.float32)
    negatives = tl.zeros((BLOCK, R_P2), dtype=tl.int32)
    # Chunks of CHUNK factors multiplied directly, then one log per chunk (generator.mode_product).
    for start in range(0, DS - DS % CHUNK, CHUNK):
        product = tl.full((BLOCK, R_P2), 1.0, dtype=tl.float32)
        for i in range(CHUNK):
            product *= _shifted_factor(x_ptr, delta_ptr, rows, row_ok, head, start + i, q, mask, eps,
                                       H, DS, KAPPA, R)
        log_sum += _log_magnitude(product)
        negatives += (product < 0).to(tl.int32)
    if DS % CHUNK != 0:  # the last, shorter chunk
        product = tl.full((BLOCK, R_P2), 1.0, dtype=tl.float32)
        for d in range(DS - DS % CHUNK, DS):
            product *= _shifted_factor(x_ptr, delta_ptr, rows, row_ok, head, d, q, mask, eps, H, DS, KAPPA, R)
        log_sum += _log_magnitude(product)
        negatives += (product < 0).to(tl.int32)
    sign = 1.0 - 2.0 * (negatives % 2).to(tl.float32)
    magnitude = tl.exp(log_sum)
    modes = sign * tl.where(magnitude > mode_max, mode_max, magnitude)
    tl.store(modes_ptr + (rows[:, None] * H + head) * R + q[None, :], modes, mask=mask)

def modes_backward(xt_ptr, delta_ptr, grad_ptr, modes_ptr, grad_xt_ptr, work_ptr, n, rows_per_split, eps, mode_max,
                   H: tl.constexpr, DS: tl.constexpr, KAPPA: tl.constexpr, KAPPA_P2: tl.constexpr, R: tl.constexpr,
                   R_P2: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # head * DS + d
    split = tl.program_id(1)  # this program's rows: [split * rows_per_split, + rows_per_split) within n
    head = pid // DS
    q = tl.arange(0, R_P2)
    knots = tl.arange(0, KAPPA_P2)
    table = delta_ptr + pid * KAPPA * R + q[None, :]  # (head * DS + d) == pid
    column = pid * n  # x and grad_x transposed to [h, d_s, n]: this coordinate's rows are contiguous
    row_lo = split * rows_per_split
    row_hi = tl.minimum(row_lo + rows_per_split, n)
    grad_table = tl.zeros((KAPPA_P2, R_P2), dtype=tl.float32)
    for start in range(row_lo, row_hi, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        row_ok = rows < row_hi
        mask = row_ok[:, None] & (q < R)[None, :]
        x = tl.load(xt_ptr + column + rows, mask=row_ok, other=0.5)
        c, w0, w1, w2, dw0, dw1, dw2 = _basis(x, KAPPA)
        lo = tl.maximum(c - 1, 0)
        hi = tl.minimum(c + 1, KAPPA - 1)
        s0 = 1.0 + tl.load(table + lo[:, None] * R, mask=mask, other=0.0)
        s1 = 1.0 + tl.load(table + c[:, None] * R, mask=mask, other=0.0)
        s2 = 1.0 + tl.load(table + hi[:, None] * R, mask=mask, other=0.0)
        phi = w0[:, None] * s0 + w1[:, None] * s1 + w2[:, None] * s2
        at = (rows[:, None] * H + head) * R + q[None, :]
        modes = tl.load(modes_ptr + at, mask=mask, other=0.0)
        # dL/dM * M, 0 where |M| is capped (generator.mode_gradient_weight) and on masked rows and modes.
        gm = tl.where(tl.abs(modes) < mode_max, tl.load(grad_ptr + at, mask=mask, other=0.0) * modes, 0.0)
        grad_phi = gm / tl.where(phi < 0, phi - eps, phi + eps)
        dphi = dw0[:, None] * s0 + dw1[:, None] * s1 + dw2[:, None] * s2
        tl.store(grad_xt_ptr + column + rows, tl.sum(grad_phi * dphi, axis=1), mask=row_ok)
        # Off-grid neighbours (clamped onto c) carry weight 0, so they add nothing.
        basis = (w0[:, None] * (lo[:, None] == knots[None, :]).to(tl.float32)
                 + w1[:, None] * (c[:, None] == knots[None, :]).to(tl.float32)
                 + w2[:, None] * (hi[:, None] == knots[None, :]).to(tl.float32))
        grad_table += tl.dot(tl.trans(basis), grad_phi, input_precision="ieee")
    # This split's partial grad_S[head, d] [kappa, r]: work is [splits, h, d_s, kappa, r] (grad_delta when 1 split).
    out = work_ptr + ((split * (H * DS) + pid) * KAPPA + knots[:, None]) * R + q[None, :]
    tl.store(out, grad_table, mask=(knots < KAPPA)[:, None] & (q < R)[None, :])


def modes_backward_sum(work_ptr, grad_delta_ptr, size, splits, BLOCK: tl.constexpr):
    """grad_delta = sum of the splits' partials, in split order (deterministic, no atomics)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < size
    total = tl.load(work_ptr + offsets, mask=ok, other=0.0)
    for split in range(1, splits):
        total += tl.load(work_ptr + split * size + offsets, mask=ok, other=0.0)
    tl.store(grad_delta_ptr + offsets, total, mask=ok)


_JIT_DONE = []


def _jit():
    if not _JIT_DONE:
        for name in ("_basis", "_shifted_factor", "_log_magnitude", "modes_forward", "modes_backward",
                     "modes_backward_sum"):
            globals()[name] = triton.jit(globals()[name])
        _JIT_DONE.append(True)


def _p2(value: int) -> int:
    """Next power of two, at least 16 (`tl.arange` sizes; `tl.dot`'s minimum)."""
    return max(16, 1 << (value - 1).bit_length())


# Kernel launches in this process, by kernel: what a GPU check reads to confirm the fused path ran.
LAUNCHES = collections.Counter()


@torch.library.custom_op("megatron_lev::lev_modes_forward", mutates_args=())
def modes_forward_op(x: torch.Tensor, delta: torch.Tensor, eps: float, chunk: int,
                     mode_max: float) -> torch.Tensor:
    """One kernel launch: modes [n, h, r] from x [n, h, d_s] and delta [h, d_s, kappa, r]."""
    n, h, ds = x.shape
    kappa, r = delta.shape[2], delta.shape[3]
    modes = torch.empty(n, h, r, dtype=torch.float32, device=x.device)
    _jit()
    if n:
        modes_forward[(triton.cdiv(n, BLOCK_ROWS), h)](
            x, delta, modes, n, eps, mode_max, H=h, DS=ds, KAPPA=kappa, R=r, R_P2=_p2(r), BLOCK=BLOCK_ROWS,
            CHUNK=chunk)
        LAUNCHES["forward"] += 1
    return modes


def row_splits(n: int, columns: int, splits: int | None = None) -> tuple[int, int]:
    """(splits, rows_per_split) of the backward's grid, `columns` = h * d_s programs per split.

    The rows are cut into splits of whole BLOCK_ROWS blocks (at least one each, none empty) so that
    columns * splits >= TARGET_BACKWARD_PROGRAMS where n has the blocks for it (the count wanted
    is `splits` when given, for tests). It lands below twice the count wanted, so the float32
    workspace [splits, h, d_s, kappa, r] stays under 4 * TARGET_BACKWARD_PROGRAMS * kappa * r floats
    (8.7 MB at kappa 16, r 64), and it is 1 (no workspace, no second stage) once the columns reach
    the target (lev-1.2b's 8 heads of 128 coordinates on one GPU). n = 0 gives (1, BLOCK_ROWS)."""
    blocks = max(1, triton.cdiv(n, BLOCK_ROWS))
    wanted = triton.cdiv(TARGET_BACKWARD_PROGRAMS, max(1, columns)) if splits is None else max(1, splits)
    per_split = max(1, blocks // wanted)
    return triton.cdiv(blocks, per_split), per_split * BLOCK_ROWS


@torch.library.custom_op("megatron_lev::lev_modes_backward", mutates_args=())
def modes_backward_op(x: torch.Tensor, delta: torch.Tensor, grad_modes: torch.Tensor, modes: torch.Tensor,
                      eps: float, mode_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_delta) from dL/dM and M [n, h, r] (float32, contiguous): the row-split kernel,
    then the sum over its splits (a second launch, only when there is more than one split)."""
    grad_x, grad_delta, _ = _modes_backward(x, delta, grad_modes, modes, eps, mode_max, splits=FORCE_ROW_SPLITS)
    return grad_x, grad_delta


def _modes_backward(x, delta, grad_modes, modes, eps, mode_max, *, splits=None):
    """modes_backward_op's body, with the split count forced when `splits` is given (tests):
    (grad_x, grad_delta, splits launched)."""
    n, h, ds = x.shape
    kappa, r = delta.shape[2], delta.shape[3]
    splits, rows_per_split = row_splits(n, h * ds, splits)
    xt = x.permute(1, 2, 0).contiguous()  # [h, d_s, n]: a program's block of rows is contiguous
    grad_xt = torch.empty_like(xt)
    grad_delta = torch.empty_like(delta)
    work = grad_delta if splits == 1 else torch.empty(splits, *delta.shape, dtype=torch.float32, device=x.device)
    _jit()
    modes_backward[(h * ds, splits)](
        xt, delta, grad_modes, modes, grad_xt, work, n, rows_per_split, eps, mode_max, H=h, DS=ds, KAPPA=kappa,
        KAPPA_P2=_p2(kappa), R=r, R_P2=_p2(r), BLOCK=BLOCK_ROWS)
    LAUNCHES["backward"] += 1
    if splits > 1:
        _sum_splits(work, grad_delta)
    # Back to x's layout [n, h, d_s], contiguous as the op's fake says.
    return grad_xt.permute(2, 0, 1).contiguous(), grad_delta, splits


def _sum_splits(work: torch.Tensor, grad_delta: torch.Tensor) -> None:
    """grad_delta = work.sum(0), work [splits, h, d_s, kappa, r]: the backward's second stage."""
    size = grad_delta.numel()
    modes_backward_sum[(triton.cdiv(size, SUM_BLOCK),)](work, grad_delta, size, work.shape[0], BLOCK=SUM_BLOCK)
    LAUNCHES["backward_sum"] += 1


@modes_forward_op.register_fake
def _(x, delta, eps, chunk, mode_max):
    return x.new_empty(x.shape[0], x.shape[1], delta.shape[3])


@modes_backward_op.register_fake
def _(x, delta, grad_modes, modes, eps, mode_max):
    return torch.empty_like(x), torch.empty_like(delta)


class _FusedSeparableModes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, delta, eps, chunk, mode_max):
        modes = modes_forward_op(x, delta, eps, chunk, mode_max)
        ctx.save_for_backward(x, delta, modes)
        ctx.eps, ctx.mode_max = eps, mode_max
        return modes

    @staticmethod
    def backward(ctx, grad_modes):
        x, delta, modes = ctx.saved_tensors
        grad_x, grad_delta = modes_backward_op(x, delta, grad_modes.to(torch.float32).contiguous(), modes, ctx.eps,
                                               ctx.mode_max)
        return grad_x, grad_delta, None, None, None


# Shapes whose backward kernels have run in this process: the first forward of a shape also
# launches them (on zeros), so a Triton compile or launch failure of any kernel surfaces in
# forward, where generator.py can still take the PyTorch path for this step and the next.
_BACKWARD_CHECKED = set()


def _compiles(device: torch.device) -> bool:
    """Whether launching on `device` compiles anything (Triton's interpreter does not)."""
    return device.type != "cpu"


def separable_modes(x: torch.Tensor, delta: torch.Tensor, eps: float, *, chunk: int,
                    mode_max: float) -> torch.Tensor:
    """lev.separable_modes with the coefficients given as `delta` (S = 1 + delta is formed
    inside the kernels): x [n, h, d_s] float32, delta [h, d_s, kappa, r] -> modes [n, h, r]
    float32. `chunk` and `mode_max` are generator.py's MODE_CHUNK and MODE_MAX."""
    x, delta = x.to(torch.float32).contiguous(), delta.to(torch.float32).contiguous()
    modes = _FusedSeparableModes.apply(x, delta, float(eps), int(chunk), float(mode_max))
    key = (x.device, *delta.shape)
    if key not in _BACKWARD_CHECKED and _compiles(x.device):
        with torch.no_grad():
            modes_backward_op(x.detach(), delta.detach(), torch.zeros_like(modes), modes.detach(), float(eps),
                              float(mode_max))
            # The second stage too, whichever split count this step's rows got (later steps' may differ).
            _sum_splits(torch.zeros(2, *delta.shape, device=x.device), torch.empty_like(delta))
        _BACKWARD_CHECKED.add(key)
    return modes
