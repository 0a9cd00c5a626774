"""LEV's fused Triton kernels (lev/kernels.py, the CUDA path) against lev/generator.py's PyTorch
path and the exact (float64) mode product, within the stated float32 error bound
(tests/lev_error_bound.py, docs/lev.md), at toy and at the 1.2B generator's shapes; the overflow
cap, the same in both paths; the fallback to the PyTorch path when Triton cannot compile or
launch; the loader-ids step has no host sync and launches at most 40 kernels.

On a machine without a GPU the kernels run on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, set by conftest.py); with a GPU (and TRITON_INTERPRET unset or 0, as
benchmarks/gpu_check.sh runs this file) every test runs the compiled kernels on CUDA.
"""
import os
import warnings

import pytest
import torch

# conftest.py sets it before anything imports triton; this covers running the file alone.
os.environ.setdefault("TRITON_INTERPRET", "1")

from megatron_lev.data.datasets import collate_pretraining_batch  # noqa: E402
from megatron_lev.lev import generator as lev  # noqa: E402
from megatron_lev.lev import dispatch as lev_dispatch  # noqa: E402
from megatron_lev.lev import kernels as lev_kernels  # noqa: E402
from megatron_lev.lev.parallel import ParallelLEVEmbedding  # noqa: E402
from megatron_lev.utils.profiling import KernelCounter  # noqa: E402
from tests.lev_error_bound import _basis64, check_domain, mode_product_bounds, worst_ratio  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
# Not powers of two (r, kappa), rows not a multiple of the kernels' block: masks exercised.
CFG = dict(vocab_size=1000, hidden_size=12, seed_dim=5, num_heads=2, num_knots=5, num_modes=3)


@pytest.fixture
def fused_here(monkeypatch):
    """The fused path on DEVICE (CPU tensors take it only under the interpreter)."""
    monkeypatch.setattr(lev_dispatch, "FUSED_MODES_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(lev_dispatch, "fused_modes_failure", None)
    assert lev_dispatch.uses_fused_modes(DEVICE)


def fused_modes(x, delta, eps=1e-9):
    return lev_kernels.separable_modes(x, delta, eps, chunk=lev.MODE_CHUNK, mode_max=lev.MODE_MAX)


def both_paths(x, delta, grad):
    """{"fused" | "torch": (modes, grad_x, grad_delta)} on DEVICE, moved back to the CPU."""
    results = {}
    for name in ("fused", "torch"):
        xi, di = x.to(DEVICE, copy=True).requires_grad_(), delta.to(DEVICE, copy=True).requires_grad_()
        modes = fused_modes(xi, di) if name == "fused" else lev._SeparableModes.apply(xi, 1.0 + di, 1e-9)
        modes.backward(grad.to(DEVICE))
        results[name] = tuple(t.detach().cpu() for t in (modes, xi.grad, di.grad))
    return results


def assert_within_bound(results, bounds):
    """Each path's modes and gradients within the float32 error bound of the exact values;
    returns the worst |error| / bound per path and tensor (recorded in the tests' comments)."""
    ratios = {}
    for path, (modes, grad_x, grad_delta) in results.items():
        for name, value in (("modes", modes), ("grad_x", grad_x), ("grad_delta", grad_delta)):
            ratios[path, name] = worst_ratio(value, bounds[name], bounds[name + "_bound"])
    assert max(ratios.values()) <= 1.0, ratios
    return ratios


def test_fused_and_pytorch_paths_within_the_float32_bound_at_toy_shapes():
    g = torch.Generator().manual_seed(0)
    n, h, ds, kappa, r = 37, 2, 5, 5, 3
    x = torch.rand(n, h, ds, generator=g)
    x[0, 0, 0], x[1, 0, 1], x[2, 1, 2] = 0.0, 1.0, 0.5  # both ends of the grid and a knot midpoint
    delta = 0.6 * torch.randn(h, ds, kappa, r, generator=g)
    grad = torch.randn(n, h, r, generator=g)
    bounds = mode_product_bounds(x, delta, grad, 1e-9, DEVICE.type)
    check_domain(bounds)
    results = both_paths(x, delta, grad)
    assert (bounds["modes"] < 0).sum() >= 5 and results["fused"][0].dtype == torch.float32  # parity: 7 of 222
    # Measured on CPU: worst error / bound 0.072 (fused modes) and 0.061 (PyTorch modes), 0.03 and
    # below for the gradients (errors 1e-7 to 5e-7 of each tensor's largest value). The paths
    # are not bit-identical (3 knots vs the dense basis's bmm).
    assert_within_bound(results, bounds)
    assert not torch.equal(results["fused"][1], results["torch"][1])
    # Each row depends on its own x only: any subset of rows, in any order, gives the same
    # rows bit for bit (so unique-id and per-position evaluation agree exactly on this path).
    rows = torch.tensor([36, 5, 5, 0])
    assert torch.equal(fused_modes(x[rows].to(DEVICE), delta.to(DEVICE)).cpu(), results["fused"][0][rows])


def test_fused_and_pytorch_paths_within_the_float32_bound_at_the_1_2b_shapes():
    # lev-1.2b's generator: d_s 128, kappa 16, r 64, 70 distinct ids (two row blocks and a
    # partial one), 8 heads; heads are independent programs, so the interpreter runs 2 of them
    # (about a minute on one CPU core; the backward in 3 row splits) and a GPU all 8 (1 split).
    h = 8 if DEVICE.type == "cuda" else 2
    n, ds, kappa, r = 70, 128, 16, 64
    g = torch.Generator().manual_seed(1)
    x = torch.rand(n, h, ds, generator=g)
    delta = 0.3 * torch.randn(h, ds, kappa, r, generator=g)  # 3x the init: some negative factors
    grad = torch.randn(n, h, r, generator=g)
    bounds = mode_product_bounds(x, delta, grad, 1e-9, DEVICE.type)
    check_domain(bounds)
    assert (bounds["modes"] < 0).any() and bounds["log_sums"].abs().max() > 10  # parity; far from 1
    results = both_paths(x, delta, grad)
    # Measured on CPU (interpreter): worst error / bound 0.046 (modes), 0.008 (grad_x), 0.084
    # (grad_delta) on both paths; the errors are 1.0e-6 to 1.1e-6 (fused) and 1.5e-6 to 1.9e-6
    # (PyTorch) of each tensor's largest value, so two paths can differ by more than the old
    # fixed 2e-6, while the bound, which grows with d_s and the log-sums, is 3e-4 to 5e-4.
    assert_within_bound(results, bounds)


def mode_max_inputs():
    """Coefficients whose products leave float32 with the spec's plain log-sum: mode q=0 of
    row 0 has every factor 4 (4^128 = 2^256), q=1 a chunk past float32 (300^16) next to one
    under it (1e-3^16), q=2 ordinary factors (the product stays far from the cap)."""
    n, h, ds, kappa, r = 3, 1, 128, 4, 3
    x = torch.full((n, h, ds), 0.5)
    delta = torch.zeros(h, ds, kappa, r)
    delta[..., 0] = 3.0
    delta[:, :16, :, 1], delta[:, 16:32, :, 1] = 299.0, 1e-3 - 1.0
    delta[..., 2] = 0.01 * torch.randn(h, ds, kappa, generator=torch.Generator().manual_seed(0))
    return x, delta


def test_modes_past_float32_are_capped_the_same_way_in_both_paths(fused_here):
    x, delta = mode_max_inputs()
    phi = 1.0 + delta[0, :, 1]  # [d_s, r]: delta is the same at every knot, so phi = S at any x
    assert torch.isinf(torch.exp(torch.log(phi.abs() + 1e-9).sum(0)))[0]  # the spec's form overflows
    grad = torch.ones(3, 1, 3)
    results = both_paths(x, delta, grad)
    fused, pytorch = results["fused"], results["torch"]
    for got, want in zip(fused, pytorch):
        assert torch.isfinite(got).all() and torch.isfinite(want).all()
    assert torch.equal(fused[0][:, 0, 0], torch.full((3,), lev.MODE_MAX))  # capped
    assert torch.equal(fused[0][:, 0, 1], pytorch[0][:, 0, 1]) and (fused[0][:, 0, 1] == 0).all()  # inf * 0: 0
    assert 0.5 < fused[0][0, 0, 2] < 2.0
    # Where the cap binds the mode is constant: no gradient through modes 0 and 1 (1 is 0 there).
    only_capped = torch.zeros(3, 1, 3)
    only_capped[..., 0] = 1.0
    for grad_x, grad_delta in (both_paths(x, delta, only_capped)[path][1:] for path in ("fused", "torch")):
        assert (grad_x == 0).all() and (grad_delta == 0).all()


def test_a_triton_failure_warns_once_and_takes_the_pytorch_path(fused_here, monkeypatch):
    """No C compiler or Python.h for Triton's launcher (or any launch error): one warning, then
    the PyTorch path, which gives what it would have given without the fused path."""
    cfg = lev.LEVConfig(**CFG)
    ids = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    layer = ParallelLEVEmbedding(cfg, init_seed=3).to(DEVICE)
    monkeypatch.setattr(lev_dispatch, "FUSED_MODES_DEVICES", ())
    expected = layer(ids)
    monkeypatch.setattr(lev_dispatch, "FUSED_MODES_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(lev_kernels, "_compiles", lambda device: True)  # the first-use check, as on CUDA
    monkeypatch.setattr(lev_kernels, "_BACKWARD_CHECKED", set())
    calls = []

    def backward_kernel_without_a_compiler(*args):
        calls.append(1)
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    # The backward kernel's compile fails: the first forward finds out (it runs it once).
    monkeypatch.setattr(lev_kernels, "modes_backward_op", backward_kernel_without_a_compiler)
    with pytest.warns(UserWarning) as caught:
        out = layer(ids)
    messages = [str(w.message) for w in caught if "LEV" in str(w.message)]
    assert messages == [f"LEV: the fused Triton kernels failed on {DEVICE.type}, using the PyTorch path (same math, "
                        "slower): RuntimeError: Failed to find C compiler. Please specify via CC environment variable."]
    assert torch.equal(out, expected)
    assert lev_dispatch.fused_modes_failure.startswith("RuntimeError: Failed to find C compiler")
    assert not lev_dispatch.uses_fused_modes(DEVICE)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="LEV")  # once: later steps go straight to the PyTorch path
        out.sum().backward()
        assert torch.equal(layer(ids), expected)
    assert calls == [1]


def test_fused_generator_matches_pytorch_path_under_autocast_and_counts(fused_here, monkeypatch):
    cfg = lev.LEVConfig(**CFG)
    ids = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(1))
    ids[1, :20] = ids[0, :20]
    grad_out = torch.randn(40, 2, 12, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    batch = collate_pretraining_batch([{"tokens": row, "labels": row, "loss_mask": torch.ones(40),
                                        "position_ids": torch.arange(40)} for row in ids], cfg.vocab_size)
    ids, lev_ids, lev_inverse = ids.to(DEVICE), batch["lev_ids"].to(DEVICE), batch["lev_inverse"].to(DEVICE)
    fused = ParallelLEVEmbedding(cfg, init_seed=3).to(DEVICE)
    fused(ids, lev_ids, lev_inverse)  # the first use of a shape also runs the backward kernel once
    launches = dict(lev_kernels.LAUNCHES)
    with KernelCounter() as forward:
        with torch.autocast(DEVICE.type, torch.bfloat16):  # float32 inside regardless
            out = fused(ids, lev_ids, lev_inverse)
    with KernelCounter() as backward:
        out.backward(grad_out)
    assert forward.ops["megatron_lev::lev_modes_forward"] == 1
    assert backward.ops["megatron_lev::lev_modes_backward"] == 1
    assert lev_kernels.LAUNCHES["forward"] == launches.get("forward", 0) + 1
    assert lev_kernels.LAUNCHES["backward"] == launches.get("backward", 0) + 1
    # The CUDA path's budget (issue 16): <= 40 kernels forward + backward, no host sync.
    # Measured 19 + 15 here (19 + 16 before the cap), 756 on the per-head PyTorch path (bench_kernels.py).
    assert forward.kernels + backward.kernels <= 40, (forward.summary()["ops"], backward.summary()["ops"])
    assert forward.host_syncs == backward.host_syncs == 0
    monkeypatch.setattr(lev_dispatch, "FUSED_MODES_DEVICES", ())
    reference = ParallelLEVEmbedding(cfg, init_seed=3).to(DEVICE)
    with KernelCounter() as in_step:
        ref = reference(ids)  # ids found in the step: unique (a sync on CUDA)
    ref.backward(grad_out)
    assert in_step.syncs["aten::_unique2"] == 1
    assert out.dtype == torch.float32
    # The generator around the mode product (seed, LayerNorm, output matmul) is the same code on
    # both paths; the mode product's difference is bounded above (measured 4e-7 of the scale).
    assert (out - ref).abs().max() <= 2e-6 * ref.abs().max()
    for (name, p), p_ref in zip(fused.named_parameters(), reference.parameters()):
        assert (p.grad - p_ref.grad).abs().max() <= 2e-5 * p_ref.grad.abs().max(), name


# --- the backward's row splits (grid (h * d_s, splits), a workspace summed over the splits) ---

def test_row_splits_rule():
    target, block = lev_kernels.TARGET_BACKWARD_PROGRAMS, lev_kernels.BLOCK_ROWS
    assert (target, block) == (4 * 132, 32)
    row_splits = lev_kernels.row_splits
    assert row_splits(0, 10) == row_splits(5, 10) == row_splits(32, 10) == (1, 32)  # one block: one split
    assert row_splits(33, 10) == (2, 32) and row_splits(100, 10) == (4, 32)  # a split per block, n short
    assert row_splits(70, 256) == (3, 32)  # the 1.2B-shape test below, 2 heads
    assert row_splits(30_000, 1024) == (1, 30_016)  # lev-1.2b (8 x 128 columns): already 1,024 programs
    assert row_splits(30_000, 512) == (2, 15_008)  # its heads over TP = 2
    assert row_splits(100_000, 10) == (54, 1856)  # toy columns, many rows: 540 programs
    assert row_splits(90, 14, 3) == (3, 32) and row_splits(100, 14, 2) == (2, 64)  # forced counts
    assert row_splits(100, 14, 3) == (4, 32) and row_splits(100, 14, 1) == (1, 128)  # whole blocks
    for columns in (1, 10, 100, 256, 527, 528, 1024, 4096):
        wanted = -(-target // columns)
        for n in (0, 1, 31, 32, 33, 64, 65, 1000, 4097, 30_000, 250_000):
            splits, rows = row_splits(n, columns)
            assert rows % block == 0 and rows >= block
            assert splits * rows >= n and (splits - 1) * rows < max(n, 1)  # every row, no empty split
            assert splits <= max(1, -(-n // block))  # at least one block of rows per split
            if n >= wanted * block:
                assert splits * columns >= target  # the GPU filled...
            assert splits < 2 * wanted and splits * columns < 4 * target + columns  # ...a bounded workspace
            if columns >= target:
                assert splits == 1


def fused_grads(x, delta, grad, splits):
    """The backward op's body at a forced split count: (grad_x, grad_delta, splits launched)."""
    x, delta, grad = (t.to(DEVICE) for t in (x, delta, grad))
    modes = lev_kernels.modes_forward_op(x, delta, 1e-9, lev.MODE_CHUNK, lev.MODE_MAX)
    grad_x, grad_delta, launched = lev_kernels._modes_backward(x, delta, grad, modes, 1e-9, lev.MODE_MAX,
                                                               splits=splits)
    return grad_x.cpu(), grad_delta.cpu(), launched


def small_inputs(n, seed):
    """h 2, d_s 7, kappa 6, r 5: 14 columns, so row_splits wants 38 splits (all the blocks there are)."""
    g = torch.Generator().manual_seed(seed)
    h, ds, kappa, r = 2, 7, 6, 5
    return (torch.rand(n, h, ds, generator=g), 0.5 * torch.randn(h, ds, kappa, r, generator=g),
            torch.randn(n, h, r, generator=g))


@pytest.mark.parametrize("n, force, splits", [(100, None, 4), (100, 1, 1), (100, 2, 2), (90, 3, 3), (5, None, 1)])
def test_row_split_backward_within_the_float32_bound(monkeypatch, n, force, splits):
    """Rows not a multiple of the block (100, 90), several splits (of one block, of two) and one,
    fewer rows than a block (5): the gradients of x and delta within the float32 bound, as the
    PyTorch path's."""
    x, delta, grad = small_inputs(n, seed=n)
    assert lev_kernels.row_splits(n, 14, force)[0] == splits
    monkeypatch.setattr(lev_kernels, "FORCE_ROW_SPLITS", force)
    sums = lev_kernels.LAUNCHES["backward_sum"]
    bounds = mode_product_bounds(x, delta, grad, 1e-9, DEVICE.type)
    check_domain(bounds)
    results = both_paths(x, delta, grad)
    assert lev_kernels.LAUNCHES["backward_sum"] == sums + (splits > 1)  # the second stage only when needed
    # Measured on CPU (interpreter), either path: worst error / bound 0.17 (modes), 0.023 (grad_x),
    # 0.23 (grad_delta, 5 rows; 0.019 and below at 90 and 100); the gradients' errors 1.2e-7 to
    # 4.0e-7 of each tensor's largest value.
    assert_within_bound(results, bounds)


def test_row_split_backward_without_rows():
    x, delta, grad = small_inputs(0, seed=0)
    for splits in (None, 3):
        grad_x, grad_delta, launched = fused_grads(x, delta, grad, splits)
        assert launched == 1 and grad_x.shape == x.shape and torch.equal(grad_delta, torch.zeros_like(delta))
    xi, di = x.to(DEVICE).requires_grad_(), delta.to(DEVICE).requires_grad_()
    modes = fused_modes(xi, di)
    assert modes.shape == (0, 2, 5)
    modes.sum().backward()
    assert xi.grad.shape == x.shape and not di.grad.any()


def test_the_first_use_check_runs_the_second_stage_too(monkeypatch):
    """The first forward of a shape (on a GPU) launches the backward and the sum over splits once,
    even where this step's rows need one split: a later step's may need several."""
    monkeypatch.setattr(lev_kernels, "_compiles", lambda device: True)
    monkeypatch.setattr(lev_kernels, "_BACKWARD_CHECKED", set())
    x, delta, _ = small_inputs(5, seed=3)
    before = dict(lev_kernels.LAUNCHES)
    for _ in range(2):  # the second forward checks nothing
        fused_modes(x.to(DEVICE), delta.to(DEVICE))
    assert lev_kernels.LAUNCHES["forward"] == before.get("forward", 0) + 2
    assert lev_kernels.LAUNCHES["backward"] == before.get("backward", 0) + 1
    assert lev_kernels.LAUNCHES["backward_sum"] == before.get("backward_sum", 0) + 1


def grad_delta_terms_abs(x, delta, grad, eps=1e-9):
    """sum_n |w_j G_q| [h, d_s, kappa, r] in float64: the scale of grad_delta's summation error."""
    kappa = delta.shape[2]
    knots, w, *_ = _basis64(x, kappa, 1.0)  # [n, h, d_s, 3]
    heads, coords = torch.arange(x.shape[1]).view(1, -1, 1, 1), torch.arange(x.shape[2]).view(1, 1, -1, 1)
    s_k = (1.0 + delta).to(torch.float64)[heads, coords, knots]  # [n, h, d_s, 3, r]
    phi = (w.unsqueeze(-1) * s_k).sum(3)
    shifted = torch.where(phi < 0, phi - eps, phi + eps)
    modes = mode_product_bounds(x, delta, grad, eps)["modes"]  # exact
    grad_phi = (grad.to(torch.float64) * modes).unsqueeze(2) / shifted  # [n, h, d_s, r]
    dense = torch.zeros(*knots.shape[:3], kappa, dtype=torch.float64).scatter_add_(-1, knots, w)
    return torch.einsum("nhdj,nhdq->hdjq", dense, grad_phi.abs())


@pytest.mark.parametrize("n, splits", [(90, 3), (100, 2), (100, 4)])
def test_row_split_result_depends_on_the_split_count_only_through_summation_order(n, splits):
    """grad_x bit for bit at any split count; grad_delta within 2 (n - 1) u sum_n |w_j G_q| of the
    one-split result (two orders of the same float32 sum), and the same bits run to run."""
    x, delta, grad = small_inputs(n, seed=7)
    one = fused_grads(x, delta, grad, 1)
    split = fused_grads(x, delta, grad, splits)
    assert (one[2], split[2]) == (1, splits)
    assert torch.equal(split[0], one[0])
    bound = 2 * (n - 1) * 2.0**-24 * grad_delta_terms_abs(x, delta, grad)
    difference = (split[1] - one[1]).to(torch.float64).abs()
    assert (difference <= bound).all(), (difference / bound).max()
    again = fused_grads(x, delta, grad, splits)
    assert torch.equal(again[0], split[0]) and torch.equal(again[1], split[1])
    # Measured on CPU (interpreter): 3 splits of 90 rows and 4 of 100 add the blocks in the
    # one-split order (equal bits); 2 splits of 100 differ by 4.8e-7 (6e-8 of the largest
    # entry, 0.0056 of this bound). A compiled kernel may fuse `+= tl.dot` into the dot's
    # accumulator, so on a GPU the bits can differ at any split count.
