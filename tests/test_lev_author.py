"""Issue 42: the generator as its author trains it (docs/lev.md, "The author's training"): a
learnable per-dimension knot scale (initialised to kappa - 1), an unnormalised basis, kappa 32,
and no weight decay on the generator. The math against a float64 autograd reference, TP=2
against one rank, the Hugging Face export, an exact resume, the optimizer groups and refusals."""
from __future__ import annotations

import pytest
import torch

from megatron_lev.lev.generator import LEVConfig, LEVGenerator, general_basis
from megatron_lev.lev.parallel import ParallelLEVEmbedding
from tests.distributed import run_distributed
from tests.lev_exports import assert_exports_give_our_logits
from tests.test_lev import TP_CFG, assert_close_at_scale, forward_backward, tp_inputs
from tests.test_lev_knobs import EXPERIMENT
from tests.test_model import single_rank  # noqa: F401  (module-scoped fixture: one in-process rank)

AUTHOR = dict(knot_scale_learnable=True, basis_normalize=False)


def reference_embedding(gen: LEVGenerator, ids: torch.Tensor) -> torch.Tensor:
    """The generator's math in float64 plain autograd ops, from its own parameters: the seed,
    per head the LayerNorm and sigmoid, every knot's B-spline at t = |x - g_j| * s (normalised
    or not), phi = B @ (1 + delta), the mode product prod_d (phi + copysign(eps, phi)), W_out."""
    c, f64 = gen.config, torch.float64
    digits = torch.stack([(ids // c.base ** (c.num_coordinates - 1 - r)) % c.base for r in range(c.num_coordinates)], -1)
    z = sum(gen.codebooks.to(f64)[r][digits[:, r]] for r in range(c.num_coordinates))
    e = 0
    for l in range(gen.num_local_heads):
        u = torch.nn.functional.layer_norm(z @ gen.w_seed.to(f64)[l].t(), (c.seed_dim,), eps=c.layernorm_eps)
        x = torch.sigmoid(0.5 * (u * gen.ln_gamma.to(f64)[l] + gen.ln_beta.to(f64)[l]))  # [n, d]
        scale = gen.knot_scale.to(f64)[l] if c.knot_scale_learnable else torch.full((c.seed_dim,), c.num_knots - 1.0,
                                                                                       dtype=f64)
        grid = torch.arange(c.num_knots, dtype=f64) / (c.num_knots - 1)
        t = (x.unsqueeze(-1) - grid).abs() * scale[:, None]  # [n, d, kappa]
        b = torch.where(t < 0.5, 0.75 - t * t, torch.where(t < 1.5, 0.5 * (1.5 - t) ** 2, torch.zeros_like(t)))
        if c.basis_normalize:
            b = b / b.sum(-1, keepdim=True)
        phi = torch.einsum("ndj,djq->ndq", b, 1 + gen.delta.to(f64)[l])
        modes = torch.where(phi < 0, phi - c.log_eps, phi + c.log_eps).prod(1)  # [n, r]
        e = e + modes @ gen.w_out.to(f64)[l]
    return e


def _trained_looking(gen: LEVGenerator, seed: int = 0) -> LEVGenerator:
    """Scales moved off kappa - 1 (some wider, some narrower), so every term of the math is exercised."""
    with torch.no_grad():
        gen.knot_scale.mul_(torch.empty_like(gen.knot_scale).uniform_(0.5, 1.6, generator=torch.Generator().manual_seed(seed)))
    return gen


@pytest.mark.parametrize("options", [AUTHOR, dict(knot_scale_learnable=True), dict(basis_normalize=False),
                                     dict(**AUTHOR, num_knots=32)])
def test_the_authors_basis_is_the_float64_reference_values_and_gradients(options):
    config = LEVConfig(**{**EXPERIMENT, "vocab_size": 500, "hidden_size": 32, "seed_dim": 16, **options})
    gen = LEVGenerator(config, init_seed=7)
    if config.knot_scale_learnable:
        _trained_looking(gen)
    ids = torch.tensor([0, 1, 17, 250, 499, 123, 42])
    out = gen(ids)
    ref = reference_embedding(gen, ids)
    assert_close_at_scale(out, ref.to(torch.float32), atol=2e-5)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, list(gen.parameters()), grad_out)
    ref_grads = torch.autograd.grad(ref, list(gen.parameters()), grad_out.to(torch.float64))
    for (name, _), got, want in zip(gen.named_parameters(), grads, ref_grads):
        assert_close_at_scale(got, want.to(torch.float32), atol=5e-5), name
    if config.knot_scale_learnable:
        assert grads[[n for n, _ in gen.named_parameters()].index("knot_scale")].abs().max() > 0  # it trains


def test_at_the_spec_scale_the_learnable_scale_is_the_spec_and_unnormalised_differs_at_the_ends():
    ids = torch.arange(0, 8000, 37)
    spec = LEVGenerator(LEVConfig(**EXPERIMENT), init_seed=3)
    learnable = LEVGenerator(LEVConfig(**EXPERIMENT, knot_scale_learnable=True), init_seed=3)
    assert torch.equal(learnable.knot_scale, torch.full((4, 64), 15.0))
    # The same random draws (the scale is a constant drawn last), the same embedding up to rounding.
    for name, param in spec.named_parameters():
        assert torch.equal(param, dict(learnable.named_parameters())[name]), name
    assert_close_at_scale(learnable(ids), spec(ids), atol=1e-5)
    # The quadratic B-splines on uniform knots sum to 1 away from the ends: unnormalised changes
    # only the weights of x within half a knot spacing of 0 or 1.
    x = torch.tensor([[[0.0, 0.02, 0.5, 0.99, 1.0, 0.3]]])  # [n=1, h=1, d=6]
    normalised, raw = general_basis(x, 16), general_basis(x, 16, normalize=False)
    sums = raw.sum(-1).flatten()
    assert torch.allclose(sums[[2, 5]], torch.ones(2)) and (sums[[0, 1, 3, 4]] < 0.99).all()
    assert torch.allclose(normalised.sum(-1), torch.ones(6))


def test_counts_names_and_bad_values():
    config = LEVConfig(**EXPERIMENT, **AUTHOR)
    gen = LEVGenerator(config)
    assert config.num_parameters() == LEVConfig(**EXPERIMENT).num_parameters() + 4 * 64 == \
        sum(p.numel() for p in gen.parameters())
    assert config.parameter_names() == ("codebooks", "w_seed", "ln_gamma", "ln_beta", "delta", "w_out", "knot_scale")
    assert "knot_scale" not in LEVConfig(**EXPERIMENT).parameter_names()
    assert not config.spec_basis and LEVConfig(**EXPERIMENT).spec_basis
    for field in ("knot_scale_learnable", "basis_normalize"):
        with pytest.raises(ValueError, match=rf"LEVConfig\.{field}='no' must be true or false"):
            LEVConfig(**{**EXPERIMENT, field: "no"})


def _tp2_author(rank, world_size):
    from megatron_lev.distributed.state import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=2)
    ids, grad_out = tp_inputs()
    layer = ParallelLEVEmbedding(LEVConfig(**{**TP_CFG, **AUTHOR, "num_knots": 32}), init_seed=99)
    _trained_looking(layer.generator, seed=rank)  # each rank's own heads: seeded by rank, gathered below
    scales = layer.generator.knot_scale.detach().clone()
    out, grads = forward_backward(layer, ids, grad_out)
    return out, grads, scales, layer.generator.knot_scale.tensor_model_parallel


def test_tensor_parallel_equals_one_rank():
    ranks = run_distributed(_tp2_author, world_size=2)
    ids, grad_out = tp_inputs()
    layer = ParallelLEVEmbedding(LEVConfig(**{**TP_CFG, **AUTHOR, "num_knots": 32}), init_seed=99)
    with torch.no_grad():
        layer.generator.knot_scale.copy_(torch.cat([r[2] for r in ranks]))
    ref_out, ref_grads = forward_backward(layer, ids, grad_out)
    for out, grads, _, sharded in ranks:
        assert sharded  # head-sharded: partition dim 0, like ln_gamma
        assert_close_at_scale(out, ref_out, atol=1e-6)
        assert_close_at_scale(grads["codebooks"], ref_grads["codebooks"], atol=1e-6)
    for name in ("w_seed", "delta", "w_out", "knot_scale"):
        assert_close_at_scale(torch.cat([r[1][name] for r in ranks]), ref_grads[name], atol=1e-6)


def test_the_authors_generator_exports_to_hugging_face_with_equal_logits(single_rank, spm_tokenizer, tmp_path):  # noqa: F811
    full = assert_exports_give_our_logits({**AUTHOR, "num_knots": 32}, spm_tokenizer, tmp_path, _trained_looking)
    assert "embedding.generator.knot_scale" in full


def test_no_weight_decay_moves_the_generator_out_of_the_decayed_groups(single_rank):  # noqa: F811
    from megatron_lev.models.decoder import build_model
    from megatron_lev.training.optim import LEV_GROUP_KEY, param_groups
    from megatron_lev.training.validation import build_model_config
    from tests.test_train_setup import args_for

    model = build_model(build_model_config(args_for("--embedding", "lev", world_size=1)))
    decayed = {n for g in param_groups(model, 0.1) if g["weight_decay"] > 0 for n in g["param_names"]}
    assert {"embedding.generator.w_seed", "embedding.generator.delta", "embedding.generator.w_out"} <= decayed
    groups = param_groups(model, 0.1, lev_no_decay=True)
    assert {n for g in groups if g["weight_decay"] > 0 for n in g["param_names"]} == \
        {n for n in decayed if not n.startswith("embedding.generator.")}
    assert len(groups) == 2 and not any(g.get(LEV_GROUP_KEY) for g in groups)  # the plain two groups
    # With groups of its own as well (--lev-lr-mult): the generator's group carries no decay.
    apart = param_groups(model, 0.1, lev_separate=True, lev_no_decay=True)
    assert all(g["weight_decay"] == 0 for g in apart if g.get(LEV_GROUP_KEY))


def test_no_weight_decay_flag_is_checked_and_a_resume_cannot_toggle_it():
    from megatron_lev.training.arguments import effective_config
    from megatron_lev.training.validation import check_resume_schedule
    from megatron_lev.utils.errors import ConfigError
    from tests.test_decoupled_lr import SCHEDULE
    from tests.test_train_setup import args_for

    with pytest.raises(ConfigError, match=r"^--lev-no-weight-decay: the model has no LEV generator \(embedding: tied\)$"):
        args_for(*SCHEDULE, "--embedding", "tied", "--lev-no-weight-decay", world_size=1)
    base = (*SCHEDULE, "--embedding", "lev")
    then = effective_config(args_for(*base, world_size=1))
    now = args_for(*base, "--lev-no-weight-decay", "--load", "/ckpt", world_size=1)
    assert effective_config(now)["training"]["lev_no_weight_decay"] is True
    with pytest.raises(ConfigError, match=r"saved without --lev-no-weight-decay and this run sets it.*--no-load-optim$"):
        check_resume_schedule(now, then, effective_config(now))
    weights_only = args_for(*base, "--lev-no-weight-decay", "--load", "/ckpt", "--no-load-optim", world_size=1)
    check_resume_schedule(weights_only, then, effective_config(weights_only))


def _train(rank, world_size, runs):
    from megatron_lev.train import main

    return [main(argv) for argv in runs]


def test_the_authors_generator_trains_without_decay_and_resumes_exactly(tiny_dataset, spm_tokenizer, tmp_path):
    """Every option at once: 8 steps uninterrupted == 4, a checkpoint, --load, 4 more, bit for
    bit; the knot scale moves and the generator's matrices follow no weight decay."""
    from tests.test_train import read_metrics, train_flags, train_records

    config = tmp_path / "author.yaml"
    config.write_text("base: tiny-lev\nmodel:\n  lev:\n    knot_scale_learnable: true\n"
                      "    basis_normalize: false\n    num_knots: 32\n")
    ckpt, work = str(tmp_path / "ckpt"), str(tmp_path)

    def flags(name, *extra):
        return train_flags(tiny_dataset, spm_tokenizer, work, name, "--config", str(config), "--train-iters", "8",
                           "--eval-interval", "4", "--lev-no-weight-decay", "--weight-decay", "0.5", *extra)

    runs = [flags("full"), flags("a", "--save", ckpt, "--save-interval", "4", "--exit-interval", "4"),
            flags("b", "--save", ckpt, "--load", ckpt, "--save-interval", "4")]
    assert run_distributed(_train, world_size=1, args=(runs,), timeout=600) == [[0, 0, 0]]
    full, resumed = train_records(work, "full"), {**train_records(work, "a"), **train_records(work, "b")}
    assert sorted(full) == sorted(resumed) == list(range(1, 9))
    assert [resumed[i]["loss"] for i in full] == [full[i]["loss"] for i in full]
    assert [resumed[i]["grad_norm"] for i in full] == [full[i]["grad_norm"] for i in full]
    assert [r["valid_loss"] for r in read_metrics(work, "b") if "valid_loss" in r] == \
        [r["valid_loss"] for r in read_metrics(work, "full") if "valid_loss" in r and r["iteration"] > 4]
    from megatron_lev.checkpointing.convert import find_checkpoint, read_checkpoint

    scale = read_checkpoint(find_checkpoint(ckpt))["embedding.generator.knot_scale"]
    assert scale.shape == (4, 16) and not torch.equal(scale, torch.full_like(scale, 31.0))  # it trained


def test_megatron_lm_arguments_of_an_older_checkpoint_build_the_spec_basis():
    """Megatron-LM's saved `args` from before these fields existed lack --lev-knot-scale-learnable
    and --lev-basis-normalize: they build the generator that checkpoint trained (the spec's); a
    namespace without any --lev-* flag is still refused."""
    import argparse

    from megatron_lev.megatron_lm.arguments import add_lev_args, lev_config_from_args

    args = add_lev_args(argparse.ArgumentParser()).parse_args(["--lev-knot-scale-learnable", "--no-lev-basis-normalize"])
    args.hidden_size = 64
    assert not lev_config_from_args(args, 1000).spec_basis
    del args.lev_knot_scale_learnable, args.lev_basis_normalize
    assert lev_config_from_args(args, 1000).spec_basis
    with pytest.raises(ValueError, match=r"missing from Megatron-LM's arguments"):
        lev_config_from_args(argparse.Namespace(hidden_size=64), 1000)
