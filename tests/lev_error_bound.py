"""The float32 error bound of LEV's mode product and its gradients (docs/lev.md, "Error bound"),
evaluated in float64 next to the exact values.

Both implementations (generator.py's PyTorch path, kernels.py's Triton kernels) compute, from the
same float32 x [n, h, d_s] and delta [h, d_s, kappa, r]:

    basis   w_j(x) of the 3 knots around x's nearest knot, and dw_j/dx (the same formulas)
    phi'    sum_j w_j * (1 + delta_j) + copysign(eps, phi)
    M       parity * min(exp(sum_c log|prod_{d in c} phi'_d|), MODE_MAX)  (chunks c of MODE_CHUNK)
    grads   G = dL/dM * M / phi';  grad_delta = sum_n w_j G;  grad_x = sum_{j,q} dw_j S_jq G_q

Standard model: every float32 operation is exact times (1 + e) with |e| <= u = 2^-24, a log adds
an absolute error of at most (|log| + t) u and an exp a relative error of at most (|arg| + t) u,
with t the ulps of the device's transcendental functions (CPU 4: Sleef and numpy; CUDA 8:
Triton's fast exp2/log2 approximations), and a division a relative error of at most q u (CPU 1:
IEEE division; CUDA 4: Triton's float32 division is div.full, within 2 ulps). Each quantity's
bound E is propagated to first order with the usual rules (E(a + b) = E(a) + E(b) + u|a + b|,
E(ab) = |b|E(a) + |a|E(b) + u|ab|, ...); sums of k terms take gamma_(k-1) * sum |terms|, which
holds for any order of summation (BLAS's, the kernels' blocked `tl.dot`s). The bound is
componentwise: |computed - exact| <= E for every mode and every gradient entry, on either path.
Valid while no chunk product leaves float32's normal range and no mode sits within its error of
MODE_MAX (`check_domain` says so).
"""
from __future__ import annotations

import torch

from megatron_lev.lev import generator as lev

U = 2.0**-24
TRANSCENDENTAL_ULPS = {"cpu": 4.0, "cuda": 8.0}
DIVISION_ULPS = {"cpu": 1.0, "cuda": 4.0}


def _basis64(x32: torch.Tensor, kappa: int, q: float):
    """Exact (float64) weights, derivatives and their bounds at the float32 path's nearest knot."""
    f64 = torch.float64
    # The nearest knot exactly as both paths compute it (float32); the spline is continuous
    # across knots, so a float32 rounding across a half-way point costs nothing.
    center = torch.floor(x32 * (kappa - 1) + 0.5).clamp_(0, kappa - 1).to(f64)
    scaled = x32.to(f64) * (kappa - 1)
    t0 = scaled - center
    e_t0 = U * scaled.abs()  # the rounding of x * (kappa - 1); the subtraction is exact
    low, high = (center > 0).to(f64), (center < kappa - 1).to(f64)
    a, b = 0.5 - t0, 0.5 + t0
    e_a, e_b = e_t0 + U * a.abs(), e_t0 + U * b.abs()
    raw = torch.stack((0.5 * a * a * low, 0.75 - t0 * t0, 0.5 * b * b * high), -1)
    e_raw = torch.stack(((a.abs() * e_a + 0.5 * U * a * a) * low,
                         2 * t0.abs() * e_t0 + U * t0 * t0 + U * (0.75 - t0 * t0).abs(),
                         (b.abs() * e_b + 0.5 * U * b * b) * high), -1)
    total = raw.sum(-1, keepdim=True)
    e_total = e_raw.sum(-1, keepdim=True) + 2 * U * total
    w = raw / total
    e_w = (e_raw + w * e_total) / total + q * U * w
    k1 = kappa - 1
    draw = torch.stack(((t0 - 0.5) * low * k1, -2.0 * t0 * k1, (t0 + 0.5) * high * k1), -1)
    e_draw = torch.stack(((k1 * (e_t0 + U * a.abs())) * low, 2 * k1 * e_t0, (k1 * (e_t0 + U * b.abs())) * high),
                         -1) + U * draw.abs()
    dsum = draw.sum(-1, keepdim=True)
    e_dsum = e_draw.sum(-1, keepdim=True) + 2 * U * draw.abs().sum(-1, keepdim=True)
    num = draw - w * dsum
    e_num = e_draw + e_w * dsum.abs() + w * e_dsum + U * (w * dsum).abs() + U * num.abs()
    dw = num / total
    e_dw = (e_num + dw.abs() * e_total) / total + q * U * dw.abs()
    knots = (center.long().unsqueeze(-1) + torch.arange(-1, 2)).clamp_(0, kappa - 1)  # [n, h, d, 3]
    return knots, w, e_w, dw, e_dw


def mode_product_bounds(x: torch.Tensor, delta: torch.Tensor, grad_modes: torch.Tensor, eps: float,
                        device_type: str = "cpu") -> dict:
    """Exact values and componentwise float32 error bounds, all float64 on the CPU:
    {"modes", "modes_bound", "grad_x", "grad_x_bound", "grad_delta", "grad_delta_bound",
    "log_sums", "log_sum_bound", "chunk_log_magnitudes"}."""
    x, delta, g = (t.detach().cpu() for t in (x, delta, grad_modes))
    t, q = TRANSCENDENTAL_ULPS[device_type], DIVISION_ULPS[device_type]
    n, h, ds = x.shape
    kappa, r = delta.shape[2], delta.shape[3]
    knots, w, e_w, dw, e_dw = _basis64(x.to(torch.float32), kappa, q)  # [n, h, d, 3]
    s32 = 1.0 + delta.to(torch.float32)  # both paths round S = 1 + delta once
    s = s32.to(torch.float64)
    e_s = U * s.abs()
    heads = torch.arange(h).view(1, h, 1, 1)
    coords = torch.arange(ds).view(1, 1, ds, 1)
    s_k = s[heads, coords, knots]  # [n, h, d, 3, r]: S at the 3 knots
    e_s_k = e_s[heads, coords, knots]
    ws = w.unsqueeze(-1) * s_k
    phi = ws.sum(3)  # [n, h, d, r]
    e_phi = (e_w.unsqueeze(-1) * s_k.abs() + w.unsqueeze(-1) * e_s_k).sum(3) + 3 * U * ws.abs().sum(3)
    shifted = torch.where(phi < 0, phi - eps, phi + eps)
    e_shifted = e_phi + U * shifted.abs() + torch.where(phi.abs() <= e_phi, 2 * eps, 0.0)
    rel_shifted = e_shifted / shifted.abs()
    chunk = lev.MODE_CHUNK
    bounds = list(range(0, ds, chunk)) + [ds]
    log_chunks, e_log_chunks = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        log_p = shifted[:, :, lo:hi].abs().log().sum(2)  # [n, h, r]
        rel_p = rel_shifted[:, :, lo:hi].sum(2) + (hi - lo - 1) * U
        log_chunks.append(log_p)
        e_log_chunks.append(rel_p + U * (log_p.abs() + t))
    log_chunks, e_log_chunks = torch.stack(log_chunks), torch.stack(e_log_chunks)  # [K, n, h, r]
    log_sum = log_chunks.sum(0)
    e_log_sum = e_log_chunks.sum(0) + (len(log_chunks) - 1) * U * log_chunks.abs().sum(0)
    negatives = (shifted < 0).sum(2)
    sign = 1.0 - 2.0 * (negatives % 2).to(torch.float64)
    magnitude = log_sum.exp().clamp(max=lev.MODE_MAX)
    modes = sign * magnitude
    e_modes = magnitude * (e_log_sum + U * (log_sum.abs() + t))
    # Backward: G = g M / phi' (0 where the cap binds).
    g64 = g.to(torch.float64)
    uncapped = (log_sum.exp() < lev.MODE_MAX).to(torch.float64)
    gm = g64 * modes * uncapped
    e_gm = (g64.abs() * e_modes + U * gm.abs()) * uncapped
    grad_phi = gm.unsqueeze(2) / shifted  # [n, h, d, r]
    # CPU: 1 / phi' then a product (2 u); the kernel divides (q u).
    e_grad_phi = (e_gm.unsqueeze(2) + grad_phi.abs() * e_shifted) / shifted.abs() + max(2, q) * U * grad_phi.abs()
    # grad_delta[l, d, j, q] = sum_n w_j G: scatter the 3 knots onto the kappa grid, sum over rows.
    dense = torch.zeros(n, h, ds, kappa, dtype=torch.float64)
    dense_abs_e = torch.zeros_like(dense)
    dense.scatter_add_(-1, knots, w)
    dense_abs_e.scatter_add_(-1, knots, e_w)
    grad_delta = torch.einsum("nhdj,nhdq->hdjq", dense, grad_phi)
    terms_abs = torch.einsum("nhdj,nhdq->hdjq", dense, grad_phi.abs())
    e_grad_delta = (torch.einsum("nhdj,nhdq->hdjq", dense_abs_e, grad_phi.abs())
                    + torch.einsum("nhdj,nhdq->hdjq", dense, e_grad_phi) + n * U * terms_abs)
    # grad_x[n, l, d] = sum_{j, q} dw_j S_jq G_q (3 r products of three factors, any association).
    grad_x = torch.einsum("nhdj,nhdjq,nhdq->nhd", dw, s_k, grad_phi)
    prod_abs = torch.einsum("nhdj,nhdjq,nhdq->nhd", dw.abs(), s_k.abs(), grad_phi.abs())
    e_grad_x = (torch.einsum("nhdj,nhdjq,nhdq->nhd", e_dw, s_k.abs(), grad_phi.abs())
                + torch.einsum("nhdj,nhdjq,nhdq->nhd", dw.abs(), e_s_k, grad_phi.abs())
                + torch.einsum("nhdj,nhdjq,nhdq->nhd", dw.abs(), s_k.abs(), e_grad_phi)
                + (3 * r + 1) * U * prod_abs)
    return {"modes": modes, "modes_bound": e_modes, "grad_x": grad_x, "grad_x_bound": e_grad_x,
            "grad_delta": grad_delta, "grad_delta_bound": e_grad_delta, "log_sums": log_sum,
            "log_sum_bound": e_log_sum, "chunk_log_magnitudes": log_chunks}


def check_domain(bounds: dict) -> None:
    """The bound's assumptions hold for these inputs: every chunk product is a normal float32
    and no mode is within its error of the cap."""
    finfo = torch.finfo(torch.float32)
    chunks = bounds["chunk_log_magnitudes"]
    assert chunks.max() < torch.tensor(finfo.max).log() - 1 and chunks.min() > torch.tensor(finfo.tiny).log() + 1
    distance_to_cap = (torch.tensor(lev.MODE_MAX, dtype=torch.float64).log() - bounds["log_sums"]).abs()
    assert (distance_to_cap > 2 * bounds["log_sum_bound"]).all()


def worst_ratio(actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> float:
    """max |actual - exact| / bound (<= 1: within the bound), where the bound is not 0; where it is
    0 the values must be equal."""
    error = (actual.detach().cpu().to(torch.float64) - exact).abs()
    assert (error[bound == 0] == 0).all()
    nonzero = bound > 0
    return (error[nonzero] / bound[nonzero]).max().item()
