"""The capacity test (megatron_lev/evaluation/capacity.py, issue 49) and `model.lev_init_from`:
the fit recovers a table the generator can represent, the controls are exact, the targets are the
runs' own tables, and a model started from a fit holds the fitted table exactly."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import yaml

from megatron_lev.configs import load_config
from megatron_lev.evaluation import capacity
from megatron_lev.lev.generator import LEVConfig, LEVGenerator
from megatron_lev.models.config import model_config_from_dict
from megatron_lev.models.layers import derive_seed
from tests.distributed import one_in_process_rank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = load_config("tiny-lev")["model"]
SMALL = LEVConfig(vocab_size=1000, hidden_size=32, num_coordinates=3, seed_dim=16, num_heads=2, num_knots=8,
                  num_modes=8)


def _perturbed(generator: LEVGenerator, scale: float, seed: int) -> LEVGenerator:
    """A copy of `generator` at other weights: every parameter moved by `scale` of its own RMS."""
    other = LEVGenerator(generator.config, init_seed=generator.init_seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for (name, p), (_, q) in zip(generator.named_parameters(), other.named_parameters()):
            q.copy_(p + scale * p.pow(2).mean().sqrt() * torch.randn(p.shape, generator=g))
    return other


def test_w_out_least_squares_is_exact_for_a_table_in_the_span_of_the_modes():
    """The embedding is modes @ W_out: for a target modes @ W (W random) the solve leaves no residual,
    and generator_modes' flattening is the one the generator multiplies by."""
    generator = LEVGenerator(SMALL, init_seed=3)
    modes = capacity.generator_modes(generator, SMALL.vocab_size)
    assert modes.shape == (1000, 2 * 8)
    torch.testing.assert_close(modes @ generator.w_out.reshape(16, 32), capacity.generator_table(generator, 1000),
                               atol=1e-6, rtol=1e-5)
    target = modes @ torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    assert capacity.relative_residual(capacity.generator_table(generator, 1000), target) > 0.9
    capacity.solve_w_out(generator, target)
    assert capacity.relative_residual(capacity.generator_table(generator, 1000), target) < 1e-5


def test_the_fit_recovers_the_generators_own_output_at_other_weights():
    """A representable target (the same generator, every weight moved by half its RMS): Adam plus
    the W_out solve brings the residual from its start to a tenth of it and under 0.05 (below the
    factorised table of equal parameters), while a target the generator cannot hold (an N(0, 0.02)
    table) stays near 1."""
    start = LEVGenerator(SMALL, init_seed=5)
    target = capacity.generator_table(_perturbed(start, 0.5, seed=9), SMALL.vocab_size)
    settings = capacity.FitSettings(lr=3e-3, max_steps=1500, eval_every=100, patience=4, tolerance=1e-3)
    report, fitted = capacity.capacity_report(SMALL, target, 5, settings, log=lambda line: None)
    assert report["lev_init"]["relative_residual"] > 0.4
    assert report["lev"]["relative_residual"] < min(0.05, report["lev_init"]["relative_residual"] / 10)
    assert report["lev"]["relative_residual"] <= report["lev_adam"]["relative_residual"] + 1e-6  # lstsq only helps
    assert report["lev"]["relative_residual"] < report["factorized"]["relative_residual"]
    assert report["rank_bound"]["relative_residual"] < 1e-6  # the target is h * r = 16 modes wide
    assert report["lev"]["relative_residual"] == pytest.approx(
        capacity.relative_residual(capacity.generator_table(fitted, 1000), target), rel=1e-6)
    history = report["training"]["history"]
    assert history[0]["relative_residual"] == pytest.approx(report["lev_init"]["relative_residual"], rel=1e-5)
    noise = torch.randn(1000, 32, generator=torch.Generator().manual_seed(2)) * 0.02
    report, _ = capacity.capacity_report(SMALL, noise, 5, settings, log=lambda line: None)
    assert report["lev"]["relative_residual"] > 0.8
    # the controls: factorised rank = parameters // (V + D), rank bound = h * r modes
    assert report["factorized"]["rank"] == SMALL.num_parameters() // 1032
    assert report["rank_bound"]["rank"] == 16


def test_truncated_svd_is_eckart_young():
    g = torch.Generator().manual_seed(4)
    low_rank = torch.randn(300, 5, generator=g) @ torch.randn(5, 24, generator=g)
    assert capacity.relative_residual(capacity.truncated_svd(low_rank, [5])[5], low_rank) < 1e-5
    full = torch.randn(300, 24, generator=g)
    singular = torch.linalg.svdvals(full.double())
    for rank, approx in capacity.truncated_svd(full, [3, 10, 24]).items():
        expected = math.sqrt(singular[rank:].pow(2).sum().item() / singular.pow(2).sum().item())
        assert capacity.relative_residual(approx, full) == pytest.approx(expected, abs=1e-5), rank


def test_init_table_is_the_frozen_models_table(tmp_path):
    """--target-init draws the very table the frozen-table run trains beside (same seed)."""
    path = tmp_path / "frozen.yaml"
    path.write_text(yaml.safe_dump({"model": {**TINY, "embedding": "untied", "freeze_input_embedding": True}}))
    table = capacity.init_table(str(path), seed=7)
    from megatron_lev.models.decoder import build_model

    with one_in_process_rank():
        model = build_model(model_config_from_dict(load_config(str(path))["model"], init_seed=7))
    assert table.shape == (1000, 64)
    assert torch.equal(table, model.embedding.weight.detach()[:1000].float())
    assert not torch.equal(table, capacity.init_table(str(path), seed=8))


def _fit_file(tmp_path, lev: LEVConfig, init_seed: int) -> tuple[str, LEVGenerator]:
    fitted = _perturbed(LEVGenerator(lev, init_seed=init_seed), 0.5, seed=11)
    path = str(tmp_path / "fit.pt")
    capacity.save_fit(path, fitted, {"lev": {"relative_residual": 0.5}})
    return path, fitted


def test_lev_init_from_starts_the_generator_at_the_fit_and_the_body_at_its_seed(tmp_path):
    from megatron_lev.models.decoder import build_model
    from megatron_lev.models.layers import start_lev_from_fit
    from megatron_lev.models.pipeline import LEVEmbeddingPipe

    plain_config = model_config_from_dict(TINY, init_seed=3)
    path, fitted = _fit_file(tmp_path, plain_config.lev_config(), derive_seed(3, "embedding"))
    with one_in_process_rank():
        config = model_config_from_dict({**TINY, "lev_init_from": path}, init_seed=3)
        model, plain = build_model(config), build_model(plain_config)
        pipe = LEVEmbeddingPipe(config)
        assert torch.equal(model.embedding.generator.w_out, plain.embedding.generator.w_out)  # not at build
        assert start_lev_from_fit(model, config) == 1 and start_lev_from_fit(pipe, config) == 1
        assert start_lev_from_fit(plain, plain_config) == 0
    assert config.to_dict()["lev_init_from"] == path
    ids = torch.arange(1000)
    expected = capacity.generator_table(fitted, 1000)
    assert torch.equal(model.embedding.generator(ids), expected)
    assert torch.equal(pipe.generator(ids), expected)
    assert not torch.equal(plain.embedding.generator(ids), expected)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        if not name.startswith("embedding."):
            assert torch.equal(p, q), name


def test_lev_init_from_refusals_name_the_file_and_what_differs(tmp_path):
    from megatron_lev.models.decoder import build_model
    from megatron_lev.models.layers import start_lev_from_fit

    config = model_config_from_dict(TINY)
    path, _ = _fit_file(tmp_path, config.lev_config(), 1)
    other = {**TINY, "lev": {**TINY["lev"], "num_modes": 8}}
    not_a_fit = tmp_path / "other.pt"
    torch.save({"format": "something else"}, not_a_fit)
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a torch file")
    cases = [({**other, "lev_init_from": path}, f"model.lev_init_from {path}: fitted for another generator: "
                                                "num_modes 16 (model: 8)"),
             ({**TINY, "lev_init_from": str(not_a_fit)}, "format 'something else', expected 'megatron_lev.lev_fit/1'"),
             ({**TINY, "lev_init_from": str(garbage)}, f"model.lev_init_from {garbage}: not a fitted-generator file"),
             ({**TINY, "lev_init_from": str(tmp_path / "absent.pt")}, "absent.pt: no such file")]
    with one_in_process_rank():
        for section, message in cases:
            with pytest.raises(ValueError) as error:
                model_config = model_config_from_dict(section)
                start_lev_from_fit(build_model(model_config), model_config)
            assert message in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ValueError, match="lev_init_from: a fitted generator's file, only for embedding: lev"):
        model_config_from_dict({**TINY, "embedding": "tied", "lev_init_from": path})


def test_the_command_line_writes_a_report_and_a_fit_a_model_loads(tmp_path, capsys):
    config = tmp_path / "lev.yaml"
    config.write_text(yaml.safe_dump({"model": TINY}))
    out, fit = tmp_path / "report.json", tmp_path / "fit.pt"
    capacity.main(["--config", str(config), "--target-random", "0.02", "--max-steps", "20", "--eval-every", "10",
                   "--batch-ids", "256", "--save", str(fit), "--out", str(out)])
    report = json.loads(out.read_text())
    printed = json.loads(capsys.readouterr().out)
    assert printed["lev"] == report["lev"] and report["training"]["steps"] == 20
    assert report["lev_config"] == model_config_from_dict(TINY).lev_config().to_dict()
    assert report["target_source"] == "N(0, 0.02) at seed 1"
    saved = torch.load(fit, weights_only=True)
    generator = LEVGenerator(LEVConfig.from_dict(saved["lev"]))
    generator.load_full_parameters(saved["parameters"])
    target = torch.randn(1000, 64, generator=torch.Generator().manual_seed(1)) * 0.02
    assert capacity.relative_residual(capacity.generator_table(generator, 1000), target) == pytest.approx(
        report["lev"]["relative_residual"], rel=1e-6)
    with pytest.raises(SystemExit, match="only with --target-random"):
        capacity.main(["--config", str(config), "--target-init", str(config), "--vocab-size", "50"])


def test_a_configs_relative_lev_init_from_is_relative_to_that_file(tmp_path, monkeypatch):
    """The experiment's config names its fit relative to itself, so a run started from any folder
    (experiments/queue.sh runs from a code snapshot) loads the same file; a path set on the
    command line stays the user's."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "lev.yaml").write_text(yaml.safe_dump({"model": TINY}))
    (tmp_path / "configs" / "fit.yaml").write_text(yaml.safe_dump(
        {"base": "lev.yaml", "model": {"lev_init_from": "../fits/fit.pt"}}))
    monkeypatch.chdir("/")
    model = load_config(str(tmp_path / "configs" / "fit.yaml"))["model"]
    assert model["lev_init_from"] == str(tmp_path / "fits" / "fit.pt")
    assert model["num_layers"] == TINY["num_layers"]
    packaged = load_config(os.path.join(REPO, "experiments", "configs", "exp-lev-fit.yaml"))["model"]
    assert packaged["lev_init_from"] == os.path.join(REPO, "experiments", "results", "issue49", "capacity",
                                                     "fit-tied-w128.pt")
    assert os.path.isfile(packaged["lev_init_from"])


def _train(rank, world_size, runs):
    from megatron_lev.train import main

    return [main(argv) for argv in runs]


def test_the_trainer_starts_from_the_fit_at_tp2_and_a_resume_never_reads_it(tiny_dataset, spm_tokenizer, tmp_path):
    """`--lev-init-from` through the trainer on 2 TP ranks (each loads its heads): at learning rate
    0 the saved generator is the fit exactly; a resume with the fit file gone goes on from the
    checkpoint (resumes, evaluations and exports never read it)."""
    from megatron_lev.checkpointing.convert import find_checkpoint, read_checkpoint
    from tests.distributed import run_distributed
    from tests.test_train import train_flags

    lev = model_config_from_dict(TINY).lev_config()
    path, fitted = _fit_file(tmp_path, lev, init_seed=5)
    ckpt, work = str(tmp_path / "ckpt"), str(tmp_path)

    def flags(name, *extra):
        return train_flags(tiny_dataset, spm_tokenizer, work, name, "--config", "tiny-lev", "--train-iters", "2",
                           "--tensor-model-parallel-size", "2", "--lr", "0", "--min-lr", "0", "--save", ckpt,
                           "--save-interval", "1", "--eval-interval", "100", "--lr-warmup-iters", "0", *extra)

    assert run_distributed(_train, world_size=2, args=([flags("a", "--lev-init-from", path, "--exit-interval", "1")],),
                           timeout=600) == [[0], [0]]
    saved = read_checkpoint(find_checkpoint(ckpt, 1))
    for name, value in fitted.state_dict().items():
        assert torch.equal(saved[f"embedding.generator.{name}"], value), name
    os.remove(path)
    assert run_distributed(_train, world_size=2, args=([flags("b", "--lev-init-from", path, "--load", ckpt)],),
                           timeout=600) == [[0], [0]]
    assert find_checkpoint(ckpt).iteration == 2
