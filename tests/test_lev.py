"""LEV layer: exactness against a plain float64 reference, TP=2 vs TP=1, unique-id vs
per-position evaluation, parameter count, errors, bf16."""
import math

import pytest
import torch

from megatron_lev.lev.generator import LEVConfig, LEVGenerator, bspline_basis, token_digits
from megatron_lev.lev.parallel import ParallelLEVEmbedding
from tests.distributed import run_distributed

PARAM_NAMES = ("codebooks", "w_seed", "ln_gamma", "ln_beta", "delta", "w_out")


def assert_close_at_scale(actual, expected, atol):
    """|actual - expected| <= atol * max(1, max|expected|): an absolute bound for unit-scale
    tensors, relative for larger ones (float32 rounding is relative; a codebook gradient
    sums over every position, so it is well above 1)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol * max(1.0, expected.abs().max().item()))


# ---------------------------------------------------------------- float64 reference


def reference_bspline(x, num_knots: int) -> list:
    """The spec's basis written out: every knot, piecewise polynomial, normalised.
    `x` is a float or a 0-d tensor (then autograd follows the branch taken)."""
    weights = []
    for j in range(num_knots):
        t = abs(x - j / (num_knots - 1)) * (num_knots - 1)
        weights.append(0.75 - t * t if t < 0.5 else 0.5 * (1.5 - t) ** 2 if t < 1.5 else 0.0 * t)
    total = sum(weights)
    return [w / total for w in weights]


def reference_embedding(cfg: LEVConfig, p: dict, token: int, stats: dict) -> torch.Tensor:
    """One token's embedding from LEV_SPEC.md section 1, in float64, one step at a time."""
    k, b, kappa = cfg.num_coordinates, cfg.base, cfg.num_knots
    digits = [(token // b ** (k - 1 - j)) % b for j in range(k)]  # most significant first
    z = sum(p["codebooks"][j, digits[j]] for j in range(k))
    e = torch.zeros(cfg.hidden_size, dtype=torch.float64)
    for l in range(cfg.num_heads):
        u = p["w_seed"][l] @ z
        mean = u.mean()
        var = ((u - mean) ** 2).mean()
        u = (u - mean) / torch.sqrt(var + cfg.layernorm_eps) * p["ln_gamma"][l] + p["ln_beta"][l]
        x = 1.0 / (1.0 + torch.exp(-u / 2))
        modes = torch.ones(cfg.num_modes, dtype=torch.float64)
        for d in range(cfg.seed_dim):
            if torch.is_grad_enabled():  # differentiate through the basis
                basis = torch.stack(reference_bspline(x[d], kappa))
            else:  # plain floats are much faster
                basis = torch.tensor(reference_bspline(x[d].item(), kappa), dtype=torch.float64)
            phi = basis @ (1.0 + p["delta"][l, d])  # [r]
            modes = modes * phi
            stats["edge"] += int(x[d].item() < 0.5 / (kappa - 1) or x[d].item() > 1 - 0.5 / (kappa - 1))
        stats["negative_modes"] += int((modes < 0).sum())
        e = e + modes @ p["w_out"][l]
    return e


def random_full_parameters(cfg: LEVConfig, seed: int) -> dict:
    """Weights far from the spec init so every branch matters: O(1) outputs, LayerNorm
    affine in play, saturated coordinates (edge knots), negative mode factors."""
    g = torch.Generator().manual_seed(seed)
    h, ds, kappa, r, d = cfg.num_heads, cfg.seed_dim, cfg.num_knots, cfg.num_modes, cfg.hidden_size

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    # Large coefficients make factors negative; at d_s=128 only a few coordinates get
    # them, or the product of 128 factors would leave the float32 range.
    delta = 0.6 * randn(h, ds, kappa, r)
    if ds > 16:
        delta[:, 3:] *= 0.15
    return {
        "codebooks": randn(cfg.num_coordinates, cfg.base, ds),
        "w_seed": randn(h, ds, ds) / math.sqrt(ds),
        "ln_gamma": 0.5 + 3.0 * torch.rand(h, ds, generator=g, dtype=torch.float64),
        "ln_beta": 0.5 * randn(h, ds),
        "delta": delta,
        "w_out": randn(h, r, d) / math.sqrt(h * r),
    }


@pytest.mark.parametrize("cfg", [
    LEVConfig(vocab_size=1000, hidden_size=16, seed_dim=6, num_heads=4, num_knots=5, num_modes=3),
    # The spec's generator hyper-parameters (k=3, d_s=128, h=8, kappa=16, r=64) at a small V, D.
    LEVConfig(vocab_size=5000, hidden_size=24),
], ids=["small", "spec-defaults"])
def test_layer_matches_float64_reference(cfg):
    # Gradients too where the reference is cheap to differentiate (the small config
    # reaches the same branches: edge knots and negative factors are asserted below).
    with_grads = cfg.seed_dim < 16
    full = random_full_parameters(cfg, seed=7)
    layer = ParallelLEVEmbedding(cfg)
    layer.generator.load_full_parameters({name: t.to(torch.float32) for name, t in full.items()})
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    ids[0, 0], ids[1, 4] = 0, cfg.vocab_size - 1
    grad_out = torch.randn(5, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = layer(ids)  # [s, b, D]
    for t in full.values():
        t.requires_grad_(with_grads)
    stats = {"edge": 0, "negative_modes": 0}
    with torch.set_grad_enabled(with_grads):
        ref = torch.stack([torch.stack([reference_embedding(cfg, full, int(ids[b, s]), stats) for b in range(2)])
                           for s in range(5)])
    assert out.shape == (5, 2, cfg.hidden_size) and out.dtype == torch.float32
    assert ref.abs().max() > 0.3  # O(1) outputs, so atol 1e-5 is a tight bound
    assert stats["edge"] > 0 and stats["negative_modes"] > 0  # edge knots and sign parity exercised
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-5, rtol=0)
    if with_grads:
        (out.double() * grad_out).sum().backward()
        (ref * grad_out).sum().backward()
        for name, param in layer.generator.named_parameters():
            assert_close_at_scale(param.grad.double(), full[name].grad, atol=1e-5)


def test_digits_and_basis_helpers():
    cfg = LEVConfig(vocab_size=200_064, hidden_size=8)
    assert cfg.base == 59 and 58 ** 3 < 200_064 <= 59 ** 3
    ids = torch.tensor([0, 59 * 59 * 3 + 59 * 7 + 11, 200_063])
    msb = token_digits(ids, 59, 3)
    assert msb.tolist() == [[0, 0, 0], [3, 7, 11], [57, 27, 53]]
    assert token_digits(ids, 59, 3, "lsb_first").tolist() == [[0, 0, 0], [11, 7, 3], [53, 27, 57]]
    # Closed-form three-knot basis == the dense 16-knot definition, ends and knots included.
    x = torch.tensor([0.0, 1e-4, 1 / 30, 1 / 15, 0.1234, 0.5, 0.97, 1 - 1 / 30, 1.0], dtype=torch.float64)
    center, weights = bspline_basis(x, 16)
    dense = torch.zeros(len(x), 16, dtype=torch.float64)
    dense.scatter_add_(1, (center[:, None] + torch.arange(-1, 2)).clamp(0, 15), weights)
    expected = torch.tensor([reference_bspline(v.item(), 16) for v in x], dtype=torch.float64)
    torch.testing.assert_close(dense, expected, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- TP=2 vs TP=1

TP_CFG = dict(vocab_size=3000, hidden_size=32, seed_dim=16, num_heads=4, num_knots=8, num_modes=8)


def tp_inputs():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 3000, (2, 24), generator=g)
    ids[1, :12] = ids[0, :12]  # repeated ids across the batch
    return ids, torch.randn(24, 2, 32, generator=g)


def forward_backward(layer, ids, grad_out):
    out = layer(ids)
    out.backward(grad_out)
    return out.detach(), {n.split(".")[-1]: p.grad.clone() for n, p in layer.named_parameters()}


def _tp2_rank(rank, world_size):
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

    from megatron_lev.distributed.state import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=2)
    ids, grad_out = tp_inputs()
    result = {}
    for unique in (True, False):
        layer = ParallelLEVEmbedding(LEVConfig(**TP_CFG, unique_ids=unique), init_seed=99)
        result[unique] = forward_backward(layer, ids, grad_out)
    params = dict(layer.named_parameters())
    result["tp_attrs"] = {n.split(".")[-1]: (p.tensor_model_parallel, p.partition_dim,
                                             param_is_not_tensor_parallel_duplicate(p))
                          for n, p in params.items()}
    sharded = layer.sharded_state_dict(prefix="emb.")
    result["sharded"] = {key: (tuple(t.global_shape), tuple(t.global_offset)) for key, t in sharded.items()}
    errors = {}
    for name, make in {
        "heads": lambda: ParallelLEVEmbedding(LEVConfig(**{**TP_CFG, "num_heads": 3})),
        "sp_cpu": lambda: ParallelLEVEmbedding(LEVConfig(**TP_CFG), sequence_parallel=True)(ids),
    }.items():
        try:
            make()
        except (ValueError, RuntimeError) as exc:
            errors[name] = str(exc)
    result["errors"] = errors
    return result


def test_tensor_parallel_2_equals_tp1_outputs_and_every_gradient():
    ranks = run_distributed(_tp2_rank, world_size=2)
    ids, grad_out = tp_inputs()
    ref_out, ref_grads = forward_backward(ParallelLEVEmbedding(LEVConfig(**TP_CFG), init_seed=99), ids, grad_out)
    assert ref_out.abs().max() > 1e-3
    for unique in (True, False):
        for r in ranks:
            out, grads = r[unique]
            assert_close_at_scale(out, ref_out, atol=1e-6)
            # Codebooks are replicated: each rank's gradient is the whole one.
            assert_close_at_scale(grads["codebooks"], ref_grads["codebooks"], atol=1e-6)
        for name in PARAM_NAMES[1:]:
            merged = torch.cat([r[unique][1][name] for r in ranks], dim=0)  # head shards, dim 0
            assert merged.shape == ref_grads[name].shape
            assert_close_at_scale(merged, ref_grads[name], atol=1e-6)
    # Unique-id and per-position evaluation agree to the last bit under TP too.
    for r in ranks:
        assert torch.equal(r[True][0], r[False][0])
    r0, r1 = ranks
    assert r0["tp_attrs"]["w_out"] == (True, 0, True) and r1["tp_attrs"]["w_out"] == (True, 0, True)
    assert r0["tp_attrs"]["codebooks"] == (False, -1, True) and r1["tp_attrs"]["codebooks"] == (False, -1, False)
    assert r1["sharded"]["emb.generator.delta"] == ((4, 16, 8, 8), (2, 0, 0, 0))
    assert r1["sharded"]["emb.generator.codebooks"] == ((3, 15, 16), (0, 0, 0))
    assert "num_heads=3 must be divisible by the tensor-parallel size 2" in r0["errors"]["heads"]
    assert "--sequence-parallel LEV embedding needs CUDA" in r0["errors"]["sp_cpu"]


# ---------------------------------------------------------------- unique-id evaluation


def zipf_ids(vocab_size, shape, seed):
    """Token ids with a realistic (Zipf-like) frequency profile: many repeats."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
    return torch.multinomial(weights, math.prod(shape), replacement=True, generator=g).view(shape)


def test_unique_id_evaluation_equals_per_position():
    cfg = dict(vocab_size=50_257, hidden_size=64, num_heads=4, num_modes=16)
    ids = zipf_ids(50_257, (4, 64), seed=5)
    assert ids.unique().numel() < 0.8 * ids.numel()
    grad_out = torch.randn(64, 4, 64, generator=torch.Generator().manual_seed(1))
    unique_out, unique_grads = forward_backward(ParallelLEVEmbedding(LEVConfig(**cfg)), ids, grad_out)
    position_out, position_grads = forward_backward(
        ParallelLEVEmbedding(LEVConfig(**cfg, unique_ids=False)), ids, grad_out)
    assert torch.equal(unique_out, position_out)  # float32, to the last bit
    # Gradients are sums over the 256 positions; unique evaluation adds the repeats of an
    # id before the generator's backward instead of after, so the summation order differs
    # and they agree to float32 rounding of such sums (1e-5 of the tensor's scale), not
    # bit for bit.
    for name in PARAM_NAMES:
        assert_close_at_scale(unique_grads[name], position_grads[name], atol=1e-5)
    # Few distinct ids in 96 positions: small matrices, where BLAS switches kernels.
    unique_layer = ParallelLEVEmbedding(LEVConfig(**cfg))
    position_layer = ParallelLEVEmbedding(LEVConfig(**cfg, unique_ids=False))
    g = torch.Generator().manual_seed(0)
    for k in (1, 3, 5, 7, 9, 11):
        few = torch.randperm(50_257, generator=g)[:k].repeat(96 // k + 1)[:96].view(4, 24)
        with torch.no_grad():
            assert torch.equal(unique_layer(few), position_layer(few)), k
    # The HF-side entry point (batch-major, no TP) gives the same numbers.
    gen = LEVGenerator(LEVConfig(**cfg))
    with torch.no_grad():
        assert torch.equal(gen.embed(ids).transpose(0, 1), unique_out)
        assert torch.equal(gen.embed(ids, unique=False).transpose(0, 1), unique_out)


# ---------------------------------------------------------------- the compiled CPU mode product


def _modes_and_gradients(lev_module, x, delta):
    x, delta = x.clone().requires_grad_(), delta.clone().requires_grad_()
    modes = lev_module.separable_modes(x, delta)
    loss = (modes * torch.linspace(-1, 1, modes.numel()).view_as(modes)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()  # the saved derivative factor was consumed in place: loud, not wrong
    return modes.detach(), x.grad, delta.grad


def compile_without_a_compiler(function, **kwargs):
    """torch.compile as it fails on a machine without a C++ compiler: at the first call."""
    def run(*args):
        raise RuntimeError("InductorError: no C++ compiler found")
    return run


def test_cpu_mode_product_compiled_equals_eager_and_falls_back_to_eager(monkeypatch):
    from megatron_lev.lev import generator as lev
    from megatron_lev.lev import dispatch as lev_dispatch

    g = torch.Generator().manual_seed(5)
    x = torch.rand(70, 3, 16, generator=g)
    x[0, 0, :2] = torch.tensor([0.0, 1.0])  # both ends of the knot grid
    delta = 0.4 * torch.randn(3, 16, 8, 6, generator=g)  # S = 1 + delta: some negative factors
    monkeypatch.setattr(lev_dispatch, "COMPILE_CPU_MODE_PRODUCT", False)
    eager = _modes_and_gradients(lev, x, delta)
    assert (eager[0] < 0).any() and (eager[0] > 0).any()  # sign parity exercised
    monkeypatch.setattr(lev_dispatch, "COMPILE_CPU_MODE_PRODUCT", True)
    monkeypatch.setattr(lev_dispatch, "_cpu_mode_product", None)
    compiled = _modes_and_gradients(lev, x, delta)
    assert callable(lev_dispatch._cpu_mode_product.compiled)  # compiled, not the fallback
    for got, want in zip(compiled, eager):  # inductor's log and its order of the sum over d_s
        assert_close_at_scale(got, want, atol=1e-5)
    monkeypatch.setattr(lev_dispatch, "_cpu_mode_product", None)

    monkeypatch.setattr(torch, "compile", compile_without_a_compiler)
    with pytest.warns(UserWarning, match=r"torch.compile of the CPU mode product failed.*no C\+\+ compiler"):
        fallback = _modes_and_gradients(lev, x, delta)
    assert lev_dispatch._cpu_mode_product.compiled is False
    for got, want in zip(fallback, eager):
        assert torch.equal(got, want)


# ---------------------------------------------------------------- size, errors, bf16


def spec_formula(k, b, ds, h, kappa, r, d):
    return k * b * ds + h * (ds * ds + 2 * ds) + h * ds * kappa * r + h * r * d


def test_parameter_count_is_the_spec_formula():
    counts = {}
    for vocab, base in ((50_257, 37), (200_064, 59)):
        cfg = LEVConfig(vocab_size=vocab, hidden_size=2048)
        layer = ParallelLEVEmbedding(cfg)
        counts[vocab] = sum(p.numel() for p in layer.parameters())
        assert cfg.base == base
        assert counts[vocab] == cfg.num_parameters() == spec_formula(3, base, 128, 8, 16, 64, 2048)
    # Only the codebook term k*b*d_s depends on V.
    assert counts[200_064] - counts[50_257] == 3 * (59 - 37) * 128
    assert counts[50_257] == 3 * 37 * 128 + 8 * (128 * 128 + 256) + 8 * 128 * 16 * 64 + 8 * 64 * 2048 == 2_244_480


def test_initialisation_follows_the_spec():
    cfg = LEVConfig(vocab_size=50_257, hidden_size=2048)
    params = dict(LEVGenerator(cfg, init_seed=3).named_parameters())
    expected_std = {"codebooks": 0.02, "w_seed": 0.02, "delta": 0.1, "w_out": 0.02 / math.sqrt(8)}
    for name, std in expected_std.items():
        t = params[name].detach().double()
        stderr = std / math.sqrt(t.numel())
        assert abs(t.mean().item()) < 5 * stderr, name
        assert abs(t.std().item() / std - 1) < 5 * math.sqrt(2 / t.numel()) + 1e-3, (name, t.std().item())
    assert torch.equal(params["ln_gamma"], torch.ones(8, 128)) and torch.equal(params["ln_beta"], torch.zeros(8, 128))
    # The same seed gives the same weights; head slices are slices of the full tensors.
    half = LEVGenerator(cfg, 4, 8, init_seed=3)
    assert torch.equal(half.delta, params["delta"][4:]) and torch.equal(half.codebooks, params["codebooks"])


@pytest.mark.parametrize("field,value,match", [
    ("vocab_size", 0, r"vocab_size=0 must be a positive integer"),
    ("hidden_size", -4, r"hidden_size=-4 must be a positive integer"),
    ("num_coordinates", 0, r"num_coordinates=0 must be a positive integer"),
    ("seed_dim", 0, r"seed_dim=0 must be a positive integer"),
    ("num_heads", 0, r"num_heads=0 must be a positive integer"),
    ("num_modes", 2.5, r"num_modes=2.5 must be a positive integer"),
    ("num_knots", 1, r"num_knots=1 must be an integer >= 2"),
    ("init_std", -0.1, r"init_std=-0.1 must be a finite number >= 0"),
    ("layernorm_eps", 0.0, r"layernorm_eps=0.0 must be a finite number > 0"),
    ("log_eps", float("nan"), r"log_eps=nan must be a finite number > 0"),
    ("digit_order", "middle_first", r"digit_order='middle_first' must be one of"),
    ("digit_base", 36, r"digit_base=36: 36\*\*3 = 46656 < vocab_size 50257"),
])
def test_bad_config_raises_naming_the_field(field, value, match):
    with pytest.raises(ValueError, match=r"LEVConfig\." + match):
        LEVConfig(**{"vocab_size": 50_257, "hidden_size": 64, field: value})


def test_bad_tp_split_and_ids_raise():
    cfg = LEVConfig(vocab_size=1000, hidden_size=16, seed_dim=8, num_heads=8, num_knots=4, num_modes=4)
    with pytest.raises(ValueError, match=r"num_heads=8 must be divisible by the tensor-parallel size 3"):
        cfg.validate(tp_size=3)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['heads'\]"):
        LEVConfig.from_dict({**cfg.to_dict(), "heads": 4})
    assert LEVConfig.from_dict(cfg.to_dict()) == cfg
    assert LEVConfig(vocab_size=1000, hidden_size=16, digit_base=12).base == 12  # pinned base, 12**3 >= 1000
    for unique in (True, False):
        layer = ParallelLEVEmbedding(LEVConfig(**{**cfg.to_dict(), "unique_ids": unique}))
        with pytest.raises(ValueError, match=r"token id 1000 is out of range \[0, 1000\)"):
            layer(torch.tensor([[1, 999, 1000]]))
        with pytest.raises(ValueError, match=r"token id -1 is out of range \[0, 1000\)"):
            layer(torch.tensor([[-1, 5]]))
    with pytest.raises(ValueError, match=r"expects int64/int32 token ids of shape \[batch, seq\]"):
        layer(torch.tensor([1, 2, 3]))


def test_bf16_params_output_finite_and_close_to_float32():
    cfg = LEVConfig(vocab_size=50_257, hidden_size=64)
    ids = zipf_ids(50_257, (2, 32), seed=2)
    ref = ParallelLEVEmbedding(cfg, init_seed=5)
    layer = ParallelLEVEmbedding(cfg, init_seed=5, params_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in layer.parameters())
    out = layer(ids)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    with torch.no_grad():
        expected = ref(ids)
    # Tolerance: bf16 keeps 8 significant bits (relative step 2^-8 = 0.4%) in the stored
    # weights and the output; the mode products are float32 inside. Measured: 1.0% of the
    # largest magnitude; the same layer with its mode products in bf16 is off by 5%.
    err = (out.float() - expected).abs().max().item()
    assert err <= 0.02 * expected.abs().max().item(), err
    out.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()
               for p in layer.parameters())


def test_trains_a_step_under_bf16_autocast_with_float32_inside():
    """torch.autocast would run the generator's matmuls and mode product in bf16 (2% off)
    and crashed its backward; LEV turns autocast off inside, so a step under autocast is
    the float32 step bit for bit when backward runs outside autocast (PyTorch's advice),
    and close to it when backward runs inside too (autocast then applies to the matmuls'
    backward, which autograd dispatches under the caller's autocast state)."""
    cfg = LEVConfig(vocab_size=5000, hidden_size=24, seed_dim=16, num_heads=4, num_knots=8, num_modes=8)
    ids = zipf_ids(5000, (2, 16), seed=4)
    target = torch.randn(16, 2, 24, generator=torch.Generator().manual_seed(1))
    results = {}
    for mode in ("float32", "autocast", "autocast_backward"):
        layer = ParallelLEVEmbedding(cfg, init_seed=7)
        optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=mode != "float32"):
            out = layer(ids)
            loss = (out - target).square().mean()
            if mode == "autocast_backward":
                loss.backward()
        if mode != "autocast_backward":
            loss.backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        optimizer.step()
        results[mode] = out.detach(), grads, [p.detach().clone() for p in layer.parameters()]
    out, grads, params = results["autocast"]
    ref_out, ref_grads, ref_params = results["float32"]
    assert out.dtype == torch.float32 and torch.equal(out, ref_out)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    assert all(torch.equal(p, r) for p, r in zip(params, ref_params))
    assert not torch.equal(params[-1], ParallelLEVEmbedding(cfg, init_seed=7).generator.w_out)  # it stepped
    # Backward inside autocast: finite, within bf16 rounding (measured: 0.3% of the scale).
    for g, r in zip(results["autocast_backward"][1], ref_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, rtol=0, atol=0.02 * r.abs().max().item())
