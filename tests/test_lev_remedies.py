"""Issue 49: remedies for the modes' shared direction (docs/lev.md, "The modes' shared direction"):
`center_modes` (a learned per-mode offset, initialised to the mean mode), `mode_product:
geometric_mean` (the log-sum divided by its count), `mode_groups` (products over d_s / G
coordinates, averaged). The math against a float64 autograd reference written here, the init,
TP=2 against one rank, the Hugging Face export, an exact resume, the Megatron-LM flags, refusals."""
from __future__ import annotations

import pytest
import torch

from megatron_lev.lev.generator import (LEVConfig, LEVGenerator, calibration_ids, init_lev_parameters, seed_modes,
                                        seed_vectors)
from megatron_lev.lev.parallel import ParallelLEVEmbedding
from tests.distributed import run_distributed
from tests.lev_exports import assert_exports_give_our_logits
from tests.test_lev import TP_CFG, assert_close_at_scale, forward_backward, tp_inputs
from tests.test_lev_knobs import EXPERIMENT
from tests.test_model import single_rank  # noqa: F401  (module-scoped fixture: one in-process rank)

ALL = dict(center_modes=True, mode_product="geometric_mean", mode_groups=4)
OPTIONS = [dict(center_modes=True), dict(mode_product="geometric_mean"), dict(mode_groups=4),
           dict(mode_groups=4, center_modes=True), ALL, dict(ALL, knot_scale_learnable=True, basis_normalize=False)]


def reference_embedding(gen: LEVGenerator, ids: torch.Tensor) -> torch.Tensor:
    """The generator's math in float64 plain autograd ops, from its own parameters: the seed, per
    head LayerNorm and sigmoid, every knot's B-spline, phi = B @ (1 + delta), per group of d_s / G
    coordinates the product of (phi + copysign(eps, phi)) (with geometric_mean its |.|^(G / d_s)
    with the product's sign), the mean over groups, less the offset, then W_out."""
    c, f64 = gen.config, torch.float64
    digits = torch.stack([(ids // c.base ** (c.num_coordinates - 1 - r)) % c.base for r in range(c.num_coordinates)], -1)
    z = sum(gen.codebooks.to(f64)[r][digits[:, r]] for r in range(c.num_coordinates))
    e = 0
    for l in range(gen.num_local_heads):
        u = torch.nn.functional.layer_norm(z @ gen.w_seed.to(f64)[l].t(), (c.seed_dim,), eps=c.layernorm_eps)
        x = torch.sigmoid(0.5 * (u * gen.ln_gamma.to(f64)[l] + gen.ln_beta.to(f64)[l]))  # [n, d]
        scale = gen.knot_scale.to(f64)[l][:, None] if c.knot_scale_learnable else c.num_knots - 1.0
        t = (x.unsqueeze(-1) - torch.arange(c.num_knots, dtype=f64) / (c.num_knots - 1)).abs() * scale
        b = torch.where(t < 0.5, 0.75 - t * t, torch.where(t < 1.5, 0.5 * (1.5 - t) ** 2, torch.zeros_like(t)))
        if c.basis_normalize:
            b = b / b.sum(-1, keepdim=True)
        phi = torch.einsum("ndj,djq->ndq", b, 1 + gen.delta.to(f64)[l])
        shifted = torch.where(phi < 0, phi - c.log_eps, phi + c.log_eps).unflatten(1, (c.mode_groups, -1))
        products = shifted.prod(2)  # [n, G, r]
        if c.mode_product == "geometric_mean":
            products = products.sign() * products.abs() ** (c.mode_groups / c.seed_dim)
        modes = products.mean(1)
        if c.center_modes:
            modes = modes - gen.mode_offset.to(f64)[l]
        e = e + modes @ gen.w_out.to(f64)[l]
    return e


def _trained_looking(gen: LEVGenerator, seed: int = 0) -> LEVGenerator:
    """delta moved to a wider spread (where the product has negative factors), the offset off its
    init. The geometric mean's derivative carries 1 / phi' undamped by the other factors, so a
    factor near 0 turns float32's rounding of phi into a large gradient error: its spread stays
    where the factors keep away from 0."""
    g = torch.Generator().manual_seed(seed)
    spread = 0.15 if gen.config.mode_product == "geometric_mean" else 0.5
    with torch.no_grad():
        gen.delta.add_(torch.randn(gen.delta.shape, generator=g) * spread)
        if gen.config.center_modes:
            gen.mode_offset.add_(torch.randn(gen.mode_offset.shape, generator=g) * 0.1)
    return gen


@pytest.mark.parametrize("options", OPTIONS)
def test_the_remedies_are_the_float64_reference_values_and_gradients(options):
    config = LEVConfig(**{**EXPERIMENT, "vocab_size": 500, "hidden_size": 32, "seed_dim": 16, **options})
    gen = _trained_looking(LEVGenerator(config, init_seed=7))
    ids = torch.tensor([0, 1, 17, 250, 499, 123, 42])
    out = gen(ids)
    ref = reference_embedding(gen, ids)
    assert_close_at_scale(out, ref.to(torch.float32), atol=2e-5)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, list(gen.parameters()), grad_out)
    ref_grads = torch.autograd.grad(ref, list(gen.parameters()), grad_out.to(torch.float64))
    for (name, _), got, want in zip(gen.named_parameters(), grads, ref_grads):
        assert_close_at_scale(got, want.to(torch.float32), atol=5e-5), name
        assert got.abs().max() > 0, name  # every parameter trains


def test_centred_modes_start_from_the_spec_draws_with_the_mean_mode_removed():
    spec, centred = (init_lev_parameters(LEVConfig(**EXPERIMENT, **o), torch.Generator().manual_seed(5))
                     for o in ({}, dict(center_modes=True)))
    assert sorted(centred) == sorted([*spec, "mode_offset"])
    for name, value in spec.items():
        assert torch.equal(centred[name], value), name  # the same random draws: the offset draws nothing
    config = LEVConfig(**EXPERIMENT, center_modes=True)
    ids = calibration_ids(config.vocab_size)
    z = seed_vectors(config, spec["codebooks"], ids)
    raw = seed_modes(LEVConfig(**EXPERIMENT), spec, z)
    torch.testing.assert_close(centred["mode_offset"], raw.mean(0), rtol=0, atol=0)
    modes = seed_modes(config, centred, z)
    assert raw.mean().item() > 0.9 and modes.mean(0).abs().max().item() < 1e-6  # centred over the sample
    # The embedding's shared direction at init: the mean cosine between tokens, off for centred modes.
    def mean_cosine(gen):
        e = torch.nn.functional.normalize(gen(ids).detach(), dim=1)
        return ((e @ e.t()).sum() - len(ids)).item() / (len(ids) * (len(ids) - 1))
    assert mean_cosine(LEVGenerator(LEVConfig(**EXPERIMENT), init_seed=5)) > 0.7
    assert abs(mean_cosine(LEVGenerator(config, init_seed=5))) < 0.02


def test_the_geometric_mean_and_the_groups_reduce_to_the_product_where_they_should():
    base = LEVConfig(**{**EXPERIMENT, "vocab_size": 500, "hidden_size": 32, "seed_dim": 16})
    ids = torch.arange(0, 500, 7)
    spec = _trained_looking(LEVGenerator(base, init_seed=2))
    full = {n: p.detach() for n, p in spec.named_parameters()}
    for options in (dict(mode_groups=1), dict(mode_groups=16, mode_product="geometric_mean")):
        # One group is the spec's product (a different code path: the autograd one); 16 groups of one
        # coordinate make the geometric mean of each group its only factor, so both are the mean of phi'.
        other = LEVGenerator(LEVConfig(**{**base.to_dict(), **options, "basis_normalize": True,
                                          "mode_product": options.get("mode_product", "product")}), init_seed=2)
        other.load_full_parameters(full)
        if options["mode_groups"] == 1:
            assert_close_at_scale(other(ids), spec(ids), atol=1e-6)
    sixteen = LEVGenerator(LEVConfig(**{**base.to_dict(), "mode_groups": 16}), init_seed=2)
    geometric = LEVGenerator(LEVConfig(**{**base.to_dict(), "mode_groups": 16, "mode_product": "geometric_mean"}),
                             init_seed=2)
    for gen in (sixteen, geometric):
        gen.load_full_parameters(full)
    assert_close_at_scale(geometric(ids), sixteen(ids), atol=1e-6)  # a product of one factor is its own geometric mean


def test_counts_names_and_bad_values():
    config = LEVConfig(**EXPERIMENT, **ALL)
    gen = LEVGenerator(config)
    assert config.num_parameters() == LEVConfig(**EXPERIMENT).num_parameters() + 4 * 32 == \
        sum(p.numel() for p in gen.parameters())
    assert config.parameter_names() == ("codebooks", "w_seed", "ln_gamma", "ln_beta", "delta", "w_out", "mode_offset")
    assert not config.fused_modes and config.spec_basis and LEVConfig(**EXPERIMENT).fused_modes
    assert not LEVConfig(**EXPERIMENT, mode_groups=2).spec_product
    with pytest.raises(ValueError, match=r"^LEVConfig\.mode_product='mean' must be one of \('product', 'geometric_mean'\)$"):
        LEVConfig(**EXPERIMENT, mode_product="mean")
    for bad in (0, 3, 2.0, True):
        with pytest.raises(ValueError, match=rf"^LEVConfig\.mode_groups={bad!r} must be a positive integer dividing "
                                             r"seed_dim 64"):
            LEVConfig(**EXPERIMENT, mode_groups=bad)
    with pytest.raises(ValueError, match=r"^LEVConfig\.center_modes='yes' must be true or false$"):
        LEVConfig(**EXPERIMENT, center_modes="yes")


def _tp2_remedies(rank, world_size):
    from megatron_lev.distributed.state import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=2)
    ids, grad_out = tp_inputs()
    layer = ParallelLEVEmbedding(LEVConfig(**{**TP_CFG, **ALL}), init_seed=99)
    offset = layer.generator.mode_offset.detach().clone()
    out, grads = forward_backward(layer, ids, grad_out)
    return out, grads, offset, layer.generator.mode_offset.tensor_model_parallel


def test_tensor_parallel_equals_one_rank():
    ranks = run_distributed(_tp2_remedies, world_size=2)
    ids, grad_out = tp_inputs()
    layer = ParallelLEVEmbedding(LEVConfig(**{**TP_CFG, **ALL}), init_seed=99)
    assert torch.equal(torch.cat([r[2] for r in ranks]), layer.generator.mode_offset.detach())  # the init's split
    ref_out, ref_grads = forward_backward(layer, ids, grad_out)
    for out, grads, _, sharded in ranks:
        assert sharded  # head-sharded: partition dim 0
        assert_close_at_scale(out, ref_out, atol=1e-6)
        assert_close_at_scale(grads["codebooks"], ref_grads["codebooks"], atol=1e-6)
    for name in ("w_seed", "delta", "w_out", "mode_offset"):
        assert_close_at_scale(torch.cat([r[1][name] for r in ranks]), ref_grads[name], atol=1e-6)


@pytest.mark.parametrize("options", [ALL, dict(init_remove_shared=True, init_embedding_rms=0.02)])
def test_the_remedies_export_to_hugging_face_with_equal_logits(options, single_rank, spm_tokenizer, tmp_path):  # noqa: F811
    """The offset's init (and the init options', which also evaluate the generator) runs on CPU
    when transformers builds the model under torch.device("meta"): both failed there before."""
    full = assert_exports_give_our_logits(options, spm_tokenizer, tmp_path, _trained_looking)
    assert ("embedding.generator.mode_offset" in full) == options.get("center_modes", False)


def _train(rank, world_size, runs):
    from megatron_lev.train import main

    return [main(argv) for argv in runs]


def test_the_remedies_train_and_resume_exactly(tiny_dataset, spm_tokenizer, tmp_path):
    """Every option at once (and output_norm): 8 steps uninterrupted == 4, a checkpoint, --load,
    4 more, bit for bit; the offset moves."""
    from megatron_lev.checkpointing.convert import find_checkpoint, read_checkpoint
    from tests.test_train import read_metrics, train_flags, train_records

    config = tmp_path / "remedies.yaml"
    config.write_text("base: tiny-lev\nmodel:\n  lev:\n    center_modes: true\n    mode_product: geometric_mean\n"
                      "    mode_groups: 4\n    output_norm: true\n")
    ckpt, work = str(tmp_path / "ckpt"), str(tmp_path)

    def flags(name, *extra):
        return train_flags(tiny_dataset, spm_tokenizer, work, name, "--config", str(config), "--train-iters", "8",
                           "--eval-interval", "4", *extra)

    runs = [flags("full"), flags("a", "--save", ckpt, "--save-interval", "4", "--exit-interval", "4"),
            flags("b", "--save", ckpt, "--load", ckpt, "--save-interval", "4")]
    assert run_distributed(_train, world_size=1, args=(runs,), timeout=600) == [[0, 0, 0]]
    full, resumed = train_records(work, "full"), {**train_records(work, "a"), **train_records(work, "b")}
    assert sorted(full) == sorted(resumed) == list(range(1, 9))
    assert [resumed[i]["loss"] for i in full] == [full[i]["loss"] for i in full]
    assert [resumed[i]["grad_norm"] for i in full] == [full[i]["grad_norm"] for i in full]
    assert [r["valid_loss"] for r in read_metrics(work, "b") if "valid_loss" in r] == \
        [r["valid_loss"] for r in read_metrics(work, "full") if "valid_loss" in r and r["iteration"] > 4]
    offsets = [read_checkpoint(find_checkpoint(ckpt, i))["embedding.generator.mode_offset"] for i in (4, 8)]
    assert offsets[0].shape == (4, 16) and not torch.equal(*offsets)  # head x mode, and it trains


def test_megatron_lm_flags_build_the_remedies_and_refuse_a_bad_product():
    import argparse

    from megatron_lev.megatron_lm.arguments import add_lev_args, lev_config_from_args

    parser = add_lev_args(argparse.ArgumentParser())
    args = parser.parse_args(["--lev-center-modes", "--lev-mode-product", "geometric_mean", "--lev-mode-groups", "4"])
    args.hidden_size = 64
    config = lev_config_from_args(args, 1000)
    assert (config.center_modes, config.mode_product, config.mode_groups) == (True, "geometric_mean", 4)
    del args.lev_center_modes, args.lev_mode_product, args.lev_mode_groups  # an older checkpoint's arguments
    assert lev_config_from_args(args, 1000).fused_modes
    with pytest.raises(SystemExit):
        parser.parse_args(["--lev-mode-product", "mean"])
    args = parser.parse_args(["--lev-mode-groups", "3"])
    args.hidden_size = 64
    with pytest.raises(ValueError, match=r"^--lev-\*: LEVConfig\.mode_groups=3 must be a positive integer dividing"):
        lev_config_from_args(args, 1000)
