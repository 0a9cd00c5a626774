"""LEV: the input-embedding generator of Leviathan models, all of its math in one file.

A token id `i` of a vocabulary of `V` ids becomes a `D`-wide embedding (spec:
LEV_SPEC.md section 1):

1. digits   `i` written in base `b` (the smallest `b` with `b**k >= V`) as `k` digits;
2. seed     `z = sum_r codebooks[r, digit_r]`                                 [d_s]
3. per head `l`:  `x = sigmoid(LayerNorm_l(w_seed[l] @ z) / 2)`, in [0, 1]     [d_s]
4. basis    quadratic B-spline weights of each `x_d` on `kappa` uniform knots,
            normalised to sum to 1 (at most 3 are non-zero); options (KHRONOS's):
            `knot_scale_learnable` t = |x_d - g_j| * s[l, d], s learned (from kappa - 1),
            `basis_normalize: false` the weights not divided by their sum;
5. modes    `phi[d, q] = sum_j B_j(x_d) * (1 + delta[l, d, j, q])`,
            `M_l[q] = prod_d phi[d, q]`, the spec's sign parity * exp(sum_d log(|phi| + eps))
            computed as float32 products of 16 factors combined by a sum of their logs,
            |M| capped at 2^115 (`mode_product`: the same in the fused kernels);
            options (issue 49, the modes' shared direction): `mode_groups: G` the mode is the
            mean over G groups of d_s / G coordinates of each group's product; `mode_product:
            geometric_mean` each product is sign * exp(mean_d log|phi'|) (the log-sum / its
            count); `center_modes` M_l[q] - c[l, q], c learned, initialised to the mean mode
            over `calibration_ids` (`grouped_modes`: plain autograd, the PyTorch path everywhere);
6. output   `e = sum_l M_l @ w_out[l]`                                         [D]
            (steps 3 and 6's matmuls in float32; option `matmul_dtype: bfloat16` rounds
            their operands to bfloat16: `dense_product`)
7. option   `output_norm`: `e = g * e / rms(e)` (RMSNorm, learned gain g)      [D]

This file is torch-only on purpose: the Hugging Face export copies it verbatim beside
`modeling_lev.py`, as lev.py, with its config (`lev_config.py`, LEVConfig). Tensor parallelism lives in `lev/parallel.py`. On CUDA, step 5 (and its
backward) runs as two fused Triton kernels from `lev/kernels.py` when Triton is installed
(`FUSED_MODES_DEVICES`); `_SeparableModes` is the reference and the CPU path (its per-head
`mode_product` compiled by torch.compile).

Parameters of `LEVGenerator` (stable names: checkpoints and the HF export depend on them).
Head-sharded tensors have the head on dim 0; a generator holding heads `[head_start,
head_end)` stores only those rows, so merging TP shards is a concatenation along dim 0.

    codebooks  [k, b, d_s]           digit codebooks (replicated under TP)
    w_seed     [h, d_s, d_s]         per-head seed projection, u = w_seed[l] @ z
    ln_gamma   [h, d_s]              per-head LayerNorm scale
    ln_beta    [h, d_s]              per-head LayerNorm shift
    delta      [h, d_s, kappa, r]    mode coefficients, S = 1 + delta
    w_out      [h, r, D]             per-head aggregation to the model width
    knot_scale [h, d_s]              per-dimension knot scale (`knot_scale_learnable` only)
    mode_offset [h, r]               per-mode offset subtracted from the modes (`center_modes` only)
    out_norm_weight [D]              RMSNorm gain of the embedding (`output_norm` only; replicated)
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .lev_config import (DIGIT_ORDERS, HEAD_SHARDED_PARAMETERS, MATMUL_DTYPES, MODE_PRODUCTS,  # noqa: F401
                         REPLICATED_PARAMETERS, LEVConfig, smallest_base)

# Rows are evaluated in multiples of this many (padded with id 0). BLAS libraries pick different
# kernels for very small matrices (MKL: fewer than ~12 rows), which round differently; a fixed minimum
# block keeps each id's float32 embedding independent of how many other ids are evaluated with it, so
# unique-id and per-position evaluation agree to the last bit. Verified on CPU (MKL, tests/test_lev.py);
# cuBLAS also picks kernels by shape, and the GPU has not been checked.
ROW_BLOCK = 64


# --------------------------------------------------------------------------- math


def token_digits(ids: torch.Tensor, base: int, num_coordinates: int, order: str = "msb_first") -> torch.Tensor:
    """ids [...] -> digits [..., k] in base `base` (most significant first by default)."""
    powers = base ** torch.arange(num_coordinates - 1, -1, -1, device=ids.device, dtype=torch.int64)
    digits = torch.div(ids.to(torch.int64).unsqueeze(-1), powers, rounding_mode="floor") % base
    if order == "lsb_first":
        digits = digits.flip(-1)
    elif order != "msb_first":
        raise ValueError(f"digit order {order!r} must be one of {DIGIT_ORDERS}")
    return digits


def bspline_basis(x: torch.Tensor, num_knots: int, with_derivative: bool = False):
    """Normalised quadratic B-spline basis of x in [0, 1] on `num_knots` uniform knots. Only the
    nearest knot `c` and its two neighbours can be non-zero, so they are returned in closed form:
      center  [...]     long, nearest knot index c
      weights [..., 3]  weights of knots (c-1, c, c+1), zero for a knot off the grid,
                        divided by their sum (which is 1 away from the two ends)
      dweights [..., 3] d weights / d x (only with `with_derivative`)
    With t0 = x*(kappa-1) - c in [-1/2, 1/2] the spec's piecewise polynomial gives
    0.5*(0.5 - t0)^2, 0.75 - t0^2, 0.5*(0.5 + t0)^2."""
    scaled = x * (num_knots - 1)
    center = torch.floor(scaled + 0.5).clamp_(0, num_knots - 1)
    t0 = scaled - center
    on_grid = torch.stack((center > 0, torch.ones_like(center, dtype=torch.bool), center < num_knots - 1), dim=-1)
    raw = torch.stack((0.5 * (0.5 - t0) ** 2, 0.75 - t0 * t0, 0.5 * (0.5 + t0) ** 2), dim=-1) * on_grid
    total = raw.sum(-1, keepdim=True)
    weights = raw / total
    if not with_derivative:
        return center.long(), weights
    # Quotient rule on raw / total; dt0/dx = kappa - 1 (the nearest knot is locally constant).
    draw = torch.stack((t0 - 0.5, -2.0 * t0, t0 + 0.5), dim=-1) * on_grid * (num_knots - 1)
    return center.long(), weights, (draw - weights * draw.sum(-1, keepdim=True)) / total


def _neighbour_knots(center: torch.Tensor, num_knots: int) -> torch.Tensor:
    """center [n, h, d] -> knot indices (c-1, c, c+1) as [h, d, n, 3], clamped onto the grid."""
    return (center.permute(1, 2, 0).unsqueeze(-1) + torch.arange(-1, 2, device=center.device)).clamp_(0, num_knots - 1)


def _dense_basis(knots: torch.Tensor, weights: torch.Tensor, num_knots: int) -> torch.Tensor:
    """Sparse basis, knots [h, d, n, 3] and weights [n, h, d, 3] -> dense [h, d, n, kappa]."""
    dense = torch.zeros(*knots.shape[:3], num_knots, dtype=weights.dtype, device=weights.device)
    # Off-grid knots carry weight 0, so clamping their index onto the grid adds nothing.
    return dense.scatter_add_(-1, knots, weights.permute(1, 2, 0, 3))


# The mode product (spec step 5 and "Overflow"), computed the same way here and in lev/kernels.py
# (docs/lev.md derives its float32 error bound):
#   phi' = phi + copysign(eps, phi)           |phi'| = |phi| + eps, the sign of phi: the spec's eps form,
#                                             and never 0, so dM/dphi = M / phi' is always defined;
#   P_c  = prod of MODE_CHUNK factors phi'    plain float32 products (exact range: 2^-7.8 <= |phi'| <= 2^7.9);
#   L    = sum_c log(min(|P_c|, FLOAT32_MAX)) one log per chunk instead of one per factor;
#   M    = parity(P) * min(exp(L), MODE_MAX)  |M| is capped, so it, M @ w_out and the gradients stay finite.
# Where the cap binds (|M| == MODE_MAX) the mode is constant: dM/dphi = 0.
MODE_CHUNK = 16
MODE_MAX = 2.0**115  # the log-sum clamped at 115 ln 2 = 79.7; 2^13 below float32's largest value
FLOAT32_MAX = torch.finfo(torch.float32).max


def mode_product(phi: torch.Tensor, eps: float):
    """One head's mode factors phi [d_s, n, r] -> (M [n, r], 1 / phi'): M[q] = prod_d phi'[d, q]
    as chunked float32 products combined by a sum of logs, |M| capped at MODE_MAX (see above),
    and the factor 1 / phi' that turns dL/dM * M into dL/dphi."""
    shifted = torch.where(phi < 0, phi - eps, phi + eps)  # phi + copysign(eps, phi)
    d = phi.shape[0]
    whole = d - d % MODE_CHUNK
    chunks = [shifted[:whole].unflatten(0, (-1, MODE_CHUNK)).prod(1)] if whole else []
    if whole < d:
        chunks.append(shifted[whole:].prod(0, keepdim=True))
    products = torch.cat(chunks) if len(chunks) > 1 else chunks[0]  # [K, n, r]
    log_sum = torch.log(products.abs().clamp(max=FLOAT32_MAX)).sum(0)
    negatives = torch.signbit(products).sum(0, dtype=torch.int32)
    parity_sign = 1.0 - 2.0 * (negatives % 2).to(phi.dtype)
    return parity_sign * torch.exp(log_sum).clamp(max=MODE_MAX), shifted.reciprocal()


def mode_gradient_weight(grad_modes: torch.Tensor, modes: torch.Tensor) -> torch.Tensor:
    """dL/dM * M in float32, 0 where the cap binds (|M| == MODE_MAX: the mode is constant there):
    dL/dphi[d] = this / phi'[d] (both paths)."""
    return torch.where(modes.abs() < MODE_MAX, grad_modes.to(torch.float32) * modes, 0.0)


@functools.lru_cache(maxsize=None)
def _dispatch():
    """megatron_lev.lev.dispatch (the compiled CPU mode product, the fused CUDA kernels), or None
    outside the package: an HF export folder, where this file is copied as lev.py, takes the
    eager PyTorch path (the same math)."""
    try:
        from megatron_lev.lev import dispatch
    except ImportError:
        return None
    return dispatch


def _mode_product_function(device: torch.device) -> Callable:
    dispatch = _dispatch()
    return dispatch.cpu_mode_product(mode_product) if dispatch is not None and device.type == "cpu" else mode_product


class _SeparableModes(torch.autograd.Function):
    """M[n, l, q] = prod_d phi[n, l, d, q],  phi = sum_j B_j(x[n, l, d]) * S[l, d, j, q].

    The CPU path (and the reference for lev/kernels.py). The basis of every head is built in one
    pass; the [d_s, n, r] mode factors phi are formed one head at a time (a bmm with the dense
    basis) and reduced by `mode_product`, which also returns dM/dphi[d] / M = 1 / phi'[d]. Forward
    keeps it and the basis (with its closed-form derivative), so backward multiplies the factor by
    the incoming gradient (`mode_gradient_weight`) instead of rebuilding phi and the basis:
    h * d_s * n * (r + kappa + 9) floats of memory, on CPU, for one matmul and a dozen passes fewer."""

    @staticmethod
    def forward(ctx, x, coeffs, eps):
        kappa = coeffs.shape[2]
        center, weights, *dweights = bspline_basis(x, kappa, with_derivative=ctx.needs_input_grad[0])
        knots = _neighbour_knots(center, kappa)  # [h, d, n, 3]
        basis = _dense_basis(knots, weights, kappa)  # [h, d, n, kappa]
        modes, factors = _modes_of_basis(basis, coeffs, eps)
        ctx.save_for_backward(coeffs, modes, basis, knots, *dweights, *factors)
        return modes

    @staticmethod
    def backward(ctx, grad_modes):
        # float32 inside even when backward runs under autocast (bmm(out=) needs it).
        with torch.autocast(grad_modes.device.type, enabled=False):
            return _SeparableModes._backward(ctx, grad_modes)

    @staticmethod
    def _backward(ctx, grad_modes):
        coeffs, modes, basis, knots, *saved = ctx.saved_tensors
        dweights, factor = (saved[0], saved[1:]) if ctx.needs_input_grad[0] else (None, saved)
        n, (h, d) = modes.shape[0], coeffs.shape[:2]
        grad_x = torch.empty(n, h, d, dtype=torch.float32, device=modes.device) if ctx.needs_input_grad[0] else None
        grad_coeffs = torch.empty_like(coeffs) if ctx.needs_input_grad[1] else None
        for l, grad_phi in _head_mode_gradients(factor, grad_modes, modes, basis, coeffs, grad_coeffs):
            if grad_x is not None:
                grad_weights = torch.bmm(grad_phi, coeffs[l].transpose(1, 2)).gather(-1, knots[l])  # [d, n, 3]
                grad_x[:, l] = (grad_weights.transpose(0, 1) * dweights[:, l]).sum(-1)
        return grad_x, grad_coeffs, None


def _modes_of_basis(basis: torch.Tensor, coeffs: torch.Tensor, eps: float):
    """Dense basis [h, d, n, kappa] and S [h, d, kappa, r] -> (modes [n, h, r], per-head 1 / phi'
    [d, n, r]): per head one batched matmul forms phi, `mode_product` reduces it."""
    product = _mode_product_function(basis.device)
    modes, factors = [], []
    for l in range(basis.shape[0]):
        head_modes, head_factor = product(torch.bmm(basis[l], coeffs[l]), eps)  # phi [d, n, r]
        modes.append(head_modes)
        factors.append(head_factor)
    return torch.stack(modes, dim=1), factors


def _head_mode_gradients(factor, grad_modes, modes, basis, coeffs, grad_coeffs):
    """Yields (head, dL/dphi [d, n, r]) and fills grad_coeffs (when not None) on the way. In place
    on the saved factor: a second backward fails loudly (autograd's version check)."""
    g = mode_gradient_weight(grad_modes, modes)  # [n, h, r]
    for l in range(coeffs.shape[0]):
        grad_phi = factor[l].mul_(g[:, l])
        if grad_coeffs is not None:
            torch.bmm(basis[l].transpose(1, 2), grad_phi, out=grad_coeffs[l])
        yield l, grad_phi


def general_basis(x: torch.Tensor, num_knots: int, knot_scale: Optional[torch.Tensor] = None,
                  normalize: bool = True) -> torch.Tensor:
    """x [n, h, d] in [0, 1] -> dense basis [h, d, n, kappa] in autograd ops (the author's options):
    B_j the quadratic B-spline of t = |x - j / (kappa - 1)| * s, s = knot_scale[h, d] (default kappa
    - 1), divided by the weights' sum when `normalize` (a sum of 0, from a scale above 3 (kappa - 1),
    leaves them 0)."""
    grid = torch.arange(num_knots, device=x.device, dtype=torch.float32) / (num_knots - 1)
    scale = float(num_knots - 1) if knot_scale is None else knot_scale.to(torch.float32)[..., None, None]
    t = (x.to(torch.float32).permute(1, 2, 0).unsqueeze(-1) - grid).abs() * scale
    basis = torch.where(t < 0.5, 0.75 - t * t, torch.where(t < 1.5, 0.5 * (1.5 - t).square(), torch.zeros_like(t)))
    if normalize:
        basis = basis / basis.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return basis


class _BasisModes(torch.autograd.Function):
    """`_SeparableModes` with a given dense basis [h, d, n, kappa] (`general_basis`) as the input:
    autograd carries dL/dbasis back to x and the learned knot scale."""

    @staticmethod
    def forward(ctx, basis, coeffs, eps):
        modes, factors = _modes_of_basis(basis, coeffs, eps)
        ctx.save_for_backward(coeffs, modes, basis, *factors)
        return modes

    @staticmethod
    def backward(ctx, grad_modes):
        with torch.autocast(grad_modes.device.type, enabled=False):
            coeffs, modes, basis, *factor = ctx.saved_tensors
            grad_basis = torch.empty_like(basis) if ctx.needs_input_grad[0] else None
            grad_coeffs = torch.empty_like(coeffs) if ctx.needs_input_grad[1] else None
            for l, grad_phi in _head_mode_gradients(factor, grad_modes, modes, basis, coeffs, grad_coeffs):
                if grad_basis is not None:
                    torch.bmm(grad_phi, coeffs[l].transpose(1, 2), out=grad_basis[l])
            return grad_basis, grad_coeffs, None


def grouped_modes(basis: torch.Tensor, coeffs: torch.Tensor, groups: int, geometric: bool, eps: float) -> torch.Tensor:
    """Dense basis [h, d, n, kappa], S [h, d, kappa, r] -> modes [n, h, r] in plain autograd ops:
    per head phi = basis @ S, the d coordinates split into `groups` contiguous groups, each
    group's product sign * exp(sum log|phi'|) (with `geometric`, the log-sum divided by the
    group's d / groups coordinates), capped at MODE_MAX, and the mean over the groups."""
    modes = []
    for l in range(basis.shape[0]):
        phi = torch.bmm(basis[l], coeffs[l])  # [d, n, r]
        shifted = torch.where(phi < 0, phi - eps, phi + eps).unflatten(0, (groups, -1))  # [G, d / G, n, r]
        log_sum = torch.log(shifted.abs()).sum(1)
        if geometric:
            log_sum = log_sum / shifted.shape[1]
        negatives = torch.signbit(shifted).sum(1, dtype=torch.int32)
        parity_sign = 1.0 - 2.0 * (negatives % 2).to(phi.dtype)
        modes.append((parity_sign * torch.exp(log_sum).clamp(max=MODE_MAX)).mean(0))
    return torch.stack(modes, dim=1)


def separable_modes(x: torch.Tensor, delta: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """x [n, h, d_s] in [0, 1], delta [h, d_s, kappa, r] (S = 1 + delta) -> modes [n, h, r];
    float32 inside whatever the dtype of x and delta, and under autocast."""
    with torch.autocast(x.device.type, enabled=False):
        dispatch = _dispatch()
        if dispatch is not None and dispatch.uses_fused_modes(x.device):
            modes = dispatch.fused_separable_modes(x, delta, eps, chunk=MODE_CHUNK, mode_max=MODE_MAX)
            if modes is not None:
                return modes
        return _SeparableModes.apply(x.to(torch.float32), 1.0 + delta.to(torch.float32), eps)


def init_lev_parameters(config: LEVConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The FULL (all heads) float32 parameters, drawn from one seeded CPU generator in a fixed
    order (codebooks, w_seed, delta, w_out), so the values do not depend on how the heads are
    later split over TP ranks; then the options that evaluate the generator (the mode offset,
    `calibrate_w_out`). On CPU whatever the default device: transformers builds models under
    `torch.device("meta")`, where those evaluations cannot run."""
    with torch.device("cpu"):
        return _init_lev_parameters(config, generator)


def _init_lev_parameters(config: LEVConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    k, b, ds, h = config.num_coordinates, config.base, config.seed_dim, config.num_heads
    kappa, r, d = config.num_knots, config.num_modes, config.hidden_size

    def normal(shape, std):
        return torch.randn(shape, generator=generator, dtype=torch.float32).mul_(std)

    params = {
        "codebooks": normal((k, b, ds), config.init_std),
        "w_seed": normal((h, ds, ds), config.init_std),
        "ln_gamma": torch.full((h, ds), float(config.ln_gain_init)),
        "ln_beta": torch.zeros(h, ds),
        "delta": normal((h, ds, kappa, r), config.delta_init_std),
        "w_out": normal((h, r, d), config.init_std / math.sqrt(h)),
    }
    if config.center_modes:  # no random draw: the other parameters are the spec init's
        with torch.no_grad():
            z = seed_vectors(config, params["codebooks"], calibration_ids(config.vocab_size))
            params["mode_offset"] = seed_modes(config, params, z).mean(0)  # [h, r]
    if config.init_remove_shared or config.init_embedding_rms is not None:
        params["w_out"] = calibrate_w_out(config, params)
    if config.output_norm:
        params["out_norm_weight"] = torch.full((d,), float(config.output_norm_init))
    if config.knot_scale_learnable:  # KHRONOS' init: the spec's fixed scale, kappa - 1
        params["knot_scale"] = torch.full((h, ds), float(kappa - 1))
    return params


def calibration_ids(vocab_size: int, count: int = 1024) -> torch.Tensor:
    """A fixed, evenly spread sample of ids: what the init options and the init statistics see."""
    return torch.linspace(0, vocab_size - 1, min(count, vocab_size)).round().long().unique()


def calibrate_w_out(config: LEVConfig, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """W_out after the init options, from the modes of `calibration_ids` (e is linear in W_out):
    - init_remove_shared: every mode is about 1 plus noise, so every token carries
      mean(M_l) @ W_out[l]; projecting each W_out[l] off the mean mode direction removes that
      shared vector and leaves the token-specific part;
    - init_embedding_rms: then scale W_out so the sample's embedding RMS is exactly this."""
    ids = calibration_ids(config.vocab_size)
    with torch.no_grad():
        modes = seed_modes(config, params, seed_vectors(config, params["codebooks"], ids))  # [n, h, r]
        w_out = params["w_out"].clone()
        if config.init_remove_shared:
            mean = modes.mean(0)  # [h, r]
            unit = mean / mean.norm(dim=1, keepdim=True)
            w_out -= unit.unsqueeze(2) * torch.einsum("hr,hrd->hd", unit, w_out).unsqueeze(1)
        if config.init_embedding_rms is not None:
            emb = modes.reshape(len(ids), -1) @ w_out.reshape(-1, config.hidden_size)
            w_out *= config.init_embedding_rms / emb.pow(2).mean().sqrt()
    return w_out


def seed_vectors(config: LEVConfig, codebooks: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """ids [n] -> z [n, d_s] float32: the sum of the k digit codebook rows."""
    digits = token_digits(ids, config.base, config.num_coordinates, config.digit_order)
    offsets = torch.arange(config.num_coordinates, device=ids.device) * config.base
    rows = F.embedding(digits + offsets, codebooks.reshape(-1, config.seed_dim))  # [n, k, d_s]
    return rows.to(torch.float32).sum(1)


def seed_coordinates(z: torch.Tensor, w_seed: torch.Tensor, ln_gamma: torch.Tensor, ln_beta: torch.Tensor,
                     layernorm_eps: float, matmul_dtype: str = "float32") -> torch.Tensor:
    """Spec step 3: z [n, d_s] -> x = sigmoid(LayerNorm_l(w_seed[l] @ z) / 2) [n, h, d_s] float32,
    for the h heads of w_seed [h, d_s, d_s]."""
    h, ds = w_seed.shape[0], w_seed.shape[-1]
    u = dense_product(z, w_seed.reshape(h * ds, ds).t(), matmul_dtype).view(-1, h, ds)
    u = F.layer_norm(u, (ds,), eps=layernorm_eps) * ln_gamma.to(torch.float32) + ln_beta.to(torch.float32)
    return torch.sigmoid(0.5 * u)


def _prologue_function(device: torch.device) -> Callable:
    dispatch = _dispatch()
    return dispatch.prologue(seed_coordinates, device) if dispatch is not None else seed_coordinates


def seed_modes(config: LEVConfig, params: dict[str, torch.Tensor], z: torch.Tensor) -> torch.Tensor:
    """z [n, d_s] -> modes [n, h, r] float32 for the heads `params` holds (W_seed, LN, sigmoid, modes,
    less `mode_offset` when params has it)."""
    f32 = torch.float32
    x = _prologue_function(z.device)(z, params["w_seed"], params["ln_gamma"], params["ln_beta"],
                                     config.layernorm_eps, config.matmul_dtype)
    if config.fused_modes:
        modes = separable_modes(x, params["delta"], config.log_eps)
    else:
        with torch.autocast(x.device.type, enabled=False):  # the options: the PyTorch path on every device
            basis = general_basis(x, config.num_knots, params.get("knot_scale"), config.basis_normalize)
            coeffs = 1.0 + params["delta"].to(f32)
            if config.spec_product:
                modes = _BasisModes.apply(basis, coeffs, config.log_eps)
            else:
                modes = grouped_modes(basis, coeffs, config.mode_groups, config.mode_product == "geometric_mean",
                                      config.log_eps)
    offset = params.get("mode_offset")
    return modes if offset is None else modes - offset.to(f32)


def dense_product(a: torch.Tensor, b: torch.Tensor, matmul_dtype: str = "float32") -> torch.Tensor:
    """a @ b as float32 for the generator's two dense products (z @ W_seed, M @ W_out): in float32
    (the spec), or with `matmul_dtype: bfloat16` both operands rounded to bfloat16 (tensor cores;
    the GEMM accumulates in float32) and the product, rounded to bfloat16, returned as float32.
    Backward follows the same casts: the gradients of both products run in bfloat16 too."""
    if matmul_dtype == "bfloat16":
        return (a.to(torch.bfloat16) @ b.to(torch.bfloat16)).to(torch.float32)
    return a.to(torch.float32) @ b.to(torch.float32)


def pad_to_row_block(ids: torch.Tensor) -> torch.Tensor:
    """ids [n] -> ids [ceil(n / ROW_BLOCK) * ROW_BLOCK] (at least one block), padded with id 0."""
    n = ids.numel()
    padded = max(ROW_BLOCK, -(-n // ROW_BLOCK) * ROW_BLOCK)
    return ids if padded == n else F.pad(ids, (0, padded - n))


def check_token_range(lowest: int, highest: int, vocab_size: int) -> None:
    if lowest < 0 or highest >= vocab_size:
        bad = lowest if lowest < 0 else highest
        raise ValueError(f"token id {bad} is out of range [0, {vocab_size}) (LEVConfig.vocab_size={vocab_size})")


def ids_to_evaluate(input_ids: torch.Tensor, vocab_size: int, unique: bool):
    """The ids to run the generator on, range-checked with one min/max read: with `unique`,
    (distinct ids sorted [n], inverse [input_ids.shape]), input_ids == ids[inverse]; else
    (input_ids flattened [n], None)."""
    if unique:
        ids, inverse = torch.unique(input_ids.reshape(-1), sorted=True, return_inverse=True)
        inverse = inverse.view(input_ids.shape)
        ends = torch.stack((ids[0], ids[-1])) if ids.numel() else None  # sorted: min, max
    else:
        ids, inverse = input_ids.reshape(-1), None
        ends = torch.stack(torch.aminmax(ids)) if ids.numel() else None
    if ends is not None:
        check_token_range(*ends.tolist(), vocab_size)
    return ids, inverse


class LEVGenerator(torch.nn.Module):
    """Computes token embeddings from token ids, for the heads [head_start, head_end): `forward(ids)`
    gives float32 [n, D] (see there); `seed`, `heads` and `finish` are its parts, split so that a
    tensor-parallel wrapper can put its mappings between them. Parameters are stored in `dtype`;
    all arithmetic is float32."""

    def __init__(self, config: LEVConfig, head_start: int = 0, head_end: Optional[int] = None, *,
                 init_seed: int = 1234, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        config.validate()
        head_end = config.num_heads if head_end is None else head_end
        if not 0 <= head_start < head_end <= config.num_heads:
            raise ValueError(f"head range [{head_start}, {head_end}) must lie inside [0, {config.num_heads})")
        self.config, self.head_start, self.head_end = config, head_start, head_end
        self.init_seed = init_seed
        k, b, ds, h = config.num_coordinates, config.base, config.seed_dim, head_end - head_start
        kappa, r, d = config.num_knots, config.num_modes, config.hidden_size
        factory = {"dtype": dtype, "device": device}
        self.codebooks = torch.nn.Parameter(torch.empty(k, b, ds, **factory))
        self.w_seed = torch.nn.Parameter(torch.empty(h, ds, ds, **factory))
        self.ln_gamma = torch.nn.Parameter(torch.empty(h, ds, **factory))
        self.ln_beta = torch.nn.Parameter(torch.empty(h, ds, **factory))
        self.delta = torch.nn.Parameter(torch.empty(h, ds, kappa, r, **factory))
        self.w_out = torch.nn.Parameter(torch.empty(h, r, d, **factory))
        if config.output_norm:
            self.out_norm_weight = torch.nn.Parameter(torch.empty(d, **factory))
        if config.knot_scale_learnable:
            self.knot_scale = torch.nn.Parameter(torch.empty(h, ds, **factory))
        if config.center_modes:
            self.mode_offset = torch.nn.Parameter(torch.empty(h, r, **factory))
        self.reset_parameters()

    @property
    def num_local_heads(self) -> int:
        return self.head_end - self.head_start

    @property
    def holds_every_head(self) -> bool:
        return self.num_local_heads == self.config.num_heads

    def reset_parameters(self) -> None:
        """Spec initialisation from `init_seed`, identical whatever the head split."""
        self.load_full_parameters(init_lev_parameters(self.config, torch.Generator().manual_seed(self.init_seed)))

    @torch.no_grad()
    def load_full_parameters(self, full: dict[str, torch.Tensor]) -> None:
        """Copy this module's slice of full (all heads) tensors into its parameters."""
        for name, param in self.named_parameters(recurse=False):
            src = full[name]
            if name in HEAD_SHARDED_PARAMETERS:
                src = src[self.head_start:self.head_end]
            if src.shape != param.shape:
                raise ValueError(f"LEV parameter {name}: got shape {tuple(src.shape)}, expected {tuple(param.shape)}")
            param.copy_(src)

    def seed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> z [n, d_s] float32: the sum of the k digit codebook rows."""
        return seed_vectors(self.config, self.codebooks, ids)

    def mode_parameters(self) -> dict[str, torch.Tensor]:
        """This module's parameters that `seed_modes` reads (its heads' W_seed, LN, delta, options)."""
        return {name: getattr(self, name) for name in HEAD_SHARDED_PARAMETERS if name != "w_out" and hasattr(self, name)}

    def heads(self, z: torch.Tensor) -> torch.Tensor:
        """z [n, d_s] -> sum over this module's heads of M_l @ w_out[l], float32 [n, D]."""
        modes = seed_modes(self.config, self.mode_parameters(), z)  # [n, h, r]
        h, r = self.num_local_heads, self.config.num_modes
        return dense_product(modes.reshape(-1, h * r), self.w_out.reshape(h * r, -1), self.config.matmul_dtype)

    def forward(self, ids: torch.Tensor, seed_hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                heads_hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        """ids [n] -> float32 [n, D] (ids not range-checked): the embedding when the heads' sum is
        whole (this module holds every head, or `heads_hook` sums it over TP ranks), else the sum
        over this module's heads without `finish`.

        `seed_hook(z)` runs between `seed` and `heads` (the TP wrapper's copy-to-TP mapping),
        `heads_hook(e)` after `heads` (its all-reduce). Going through forward, rather than calling
        the parts directly, keeps module hooks working (DeepSpeed ZeRO-3 gathers parameters in them).
        """
        # Float32 inside, as the spec says, also under torch.autocast (which would run the
        # seed and output matmuls in bf16).
        with torch.autocast(ids.device.type, enabled=False):
            z = self.seed(pad_to_row_block(ids))
            if seed_hook is not None:
                z = seed_hook(z)
            e = self.heads(z)[: ids.numel()]
            if heads_hook is not None:
                e = heads_hook(e)
            return self.finish(e) if heads_hook is not None or self.holds_every_head else e

    def finish(self, e: torch.Tensor) -> torch.Tensor:
        """The embedding from the sum over every head (after any TP reduction): with `output_norm`,
        RMSNorm with the learned gain, in float32; else e itself."""
        if not self.config.output_norm:
            return e
        with torch.autocast(e.device.type, enabled=False):
            e = e.to(torch.float32)
            return e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + self.config.layernorm_eps) \
                * self.out_norm_weight.to(torch.float32)

    def embed(self, input_ids: torch.Tensor, unique: Optional[bool] = None) -> torch.Tensor:
        """input_ids [...] -> float32 [..., D] over this module's heads (the embedding when it holds
        every head), range-checked; with `unique` (default: config.unique_ids) each distinct id is
        evaluated once."""
        unique = self.config.unique_ids if unique is None else unique
        ids, inverse = ids_to_evaluate(input_ids, self.config.vocab_size, unique)
        out = self(ids)
        if inverse is not None:
            return F.embedding(inverse, out)
        return out.view(*input_ids.shape, -1)

    def extra_repr(self) -> str:
        c = self.config
        return (f"V={c.vocab_size}, D={c.hidden_size}, k={c.num_coordinates}, b={c.base}, d_s={c.seed_dim}, "
                f"heads=[{self.head_start}, {self.head_end}) of {c.num_heads}, kappa={c.num_knots}, r={c.num_modes}")
