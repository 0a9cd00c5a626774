"""Issue 32: the generator's own knobs on the LEV side (lev/generator.py, lev/parallel.py):
knot coverage by the LayerNorm gain at init, and the RMSNorm of the generated embedding
(one rank and TP=2 alike, counted, named, exported)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_lev.lev.generator import LEVConfig, LEVGenerator, calibration_ids, init_lev_parameters, seed_vectors
from megatron_lev.lev.parallel import ParallelLEVEmbedding
from tests.distributed import run_distributed
from tests.lev_exports import assert_exports_give_our_logits
from tests.test_lev import TP_CFG, assert_close_at_scale, forward_backward, tp_inputs
from tests.test_model import single_rank  # noqa: F401  (module-scoped fixture: one in-process rank)

EXPERIMENT = dict(vocab_size=8000, hidden_size=128, seed_dim=64, num_heads=4, num_knots=16, num_modes=32)


def nearest_knot_histogram(config: LEVConfig) -> torch.Tensor:
    """How often each knot is the nearest one of x = sigmoid(u / 2) at init (calibration ids)."""
    params = init_lev_parameters(config, torch.Generator().manual_seed(1234))
    z = seed_vectors(config, params["codebooks"], calibration_ids(config.vocab_size))
    h, ds = params["w_seed"].shape[:2]
    u = (z @ params["w_seed"].reshape(h * ds, ds).t()).view(-1, h, ds)
    u = F.layer_norm(u, (ds,), eps=config.layernorm_eps) * params["ln_gamma"] + params["ln_beta"]
    x = torch.sigmoid(0.5 * u)
    nearest = torch.floor(x * (config.num_knots - 1) + 0.5).long()
    return torch.bincount(nearest.flatten(), minlength=config.num_knots)


def test_the_spec_gain_leaves_the_outer_knots_idle_and_the_coverage_gain_reaches_every_knot():
    spec = nearest_knot_histogram(LEVConfig(**EXPERIMENT))
    # With gamma = 1, x stays inside about [0.13, 0.87]: knots 0-1 and 14-15 are never the nearest
    # (their Delta rows get no gradient), and the middle ones take nearly everything.
    assert spec[[0, 1, 14, 15]].sum() == 0
    covered = nearest_knot_histogram(LEVConfig(**EXPERIMENT, ln_gain_init=3.63))
    assert (covered > 0).all()
    # sigmoid(gamma z / 2) of a standard normal z is near uniform on [0, 1] for gamma / 2 ~ pi / sqrt(3):
    # every knot's share is within a factor 2.5 of the uniform 1/15 (the end knots cover half a cell).
    share = covered.double() / covered.sum()
    cell = torch.full((16,), 1 / 15, dtype=torch.float64)
    cell[[0, 15]] /= 2
    assert ((share / cell) > 0.4).all() and ((share / cell) < 2.5).all()


def test_the_default_gain_is_the_spec_init_bit_for_bit():
    default = init_lev_parameters(LEVConfig(**EXPERIMENT), torch.Generator().manual_seed(5))
    explicit = init_lev_parameters(LEVConfig(**EXPERIMENT, ln_gain_init=1.0), torch.Generator().manual_seed(5))
    assert torch.equal(default["ln_gamma"], torch.ones(4, 64))
    for name, tensor in default.items():
        assert torch.equal(tensor, explicit[name]), name
    gained = init_lev_parameters(LEVConfig(**EXPERIMENT, ln_gain_init=3.63), torch.Generator().manual_seed(5))
    assert torch.equal(gained["ln_gamma"], torch.full((4, 64), 3.63))
    assert torch.equal(gained["w_out"], default["w_out"]) and torch.equal(gained["delta"], default["delta"])


def test_output_norm_gives_each_embedding_the_table_rms_and_counts_its_gain():
    config = LEVConfig(**EXPERIMENT, output_norm=True)
    generator = LEVGenerator(config, init_seed=3)
    ids = calibration_ids(config.vocab_size)
    e = generator.embed(ids)
    rms = e.pow(2).mean(-1).sqrt()
    # 0.02 up to the eps of RMSNorm (1e-5 against a mean square of about 0.02 at the spec's init).
    torch.testing.assert_close(rms, torch.full_like(rms, 0.02), rtol=1e-3, atol=0)
    # It is RMSNorm of the spec's embedding (the same weights without the norm), times the gain.
    plain = LEVGenerator(LEVConfig(**EXPERIMENT), init_seed=3).embed(ids)
    expected = plain * torch.rsqrt(plain.pow(2).mean(-1, keepdim=True) + 1e-5) * 0.02
    torch.testing.assert_close(e, expected, rtol=1e-6, atol=0)
    names = dict(generator.named_parameters())
    assert names["out_norm_weight"].shape == (128,)
    assert config.num_parameters() == LEVConfig(**EXPERIMENT).num_parameters() + 128 == \
        sum(p.numel() for p in generator.parameters())
    assert config.parameter_names() == ("codebooks", "out_norm_weight", "w_seed", "ln_gamma", "ln_beta", "delta",
                                        "w_out")
    assert "out_norm_weight" not in LEVConfig(**EXPERIMENT).parameter_names()
    # The gain trains: its gradient is that of e = g * n.
    e.sum().backward()
    assert names["out_norm_weight"].grad.abs().max() > 0


def _tp2_output_norm(rank, world_size):
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

    from megatron_lev.distributed.state import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=2)
    ids, grad_out = tp_inputs()
    layer = ParallelLEVEmbedding(LEVConfig(**TP_CFG, output_norm=True, output_norm_init=0.5), init_seed=99)
    out, grads = forward_backward(layer, ids, grad_out)
    weight = layer.generator.out_norm_weight
    return out, grads, (weight.tensor_model_parallel, param_is_not_tensor_parallel_duplicate(weight))


def test_output_norm_under_tensor_parallelism_equals_one_rank():
    ranks = run_distributed(_tp2_output_norm, world_size=2)
    ids, grad_out = tp_inputs()
    layer = ParallelLEVEmbedding(LEVConfig(**TP_CFG, output_norm=True, output_norm_init=0.5), init_seed=99)
    ref_out, ref_grads = forward_backward(layer, ids, grad_out)
    assert ref_out.pow(2).mean(-1).sqrt().sub(0.5).abs().max() < 1e-3  # normalised after the sum over heads
    for out, grads, _ in ranks:
        assert_close_at_scale(out, ref_out, atol=1e-6)
        # The gain is replicated and sees every position: each rank's gradient is the whole one.
        assert_close_at_scale(grads["out_norm_weight"], ref_grads["out_norm_weight"], atol=1e-6)
        assert_close_at_scale(grads["codebooks"], ref_grads["codebooks"], atol=1e-6)
    for name in ("w_seed", "delta", "w_out"):
        merged = torch.cat([r[1][name] for r in ranks], dim=0)
        assert_close_at_scale(merged, ref_grads[name], atol=1e-6)
    assert ranks[0][2] == (False, True) and ranks[1][2] == (False, False)  # counted once in the grad norm


@pytest.mark.parametrize("field,value,match", [
    ("ln_gain_init", 0.0, r"ln_gain_init=0.0 must be a finite number > 0"),
    ("output_norm_init", -1.0, r"output_norm_init=-1.0 must be a finite number > 0"),
    ("output_norm", "yes", r"output_norm='yes' must be true or false"),
    ("init_embedding_rms", math.inf, r"init_embedding_rms=inf must be a finite number > 0 or None"),
])
def test_bad_knob_values_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=r"LEVConfig\." + match):
        LEVConfig(**{**EXPERIMENT, field: value})


def test_knobbed_generator_exports_to_hugging_face_with_equal_logits(single_rank, spm_tokenizer, tmp_path):  # noqa: F811
    """A model with output_norm and the knot-coverage gain: its checkpoint names, the remote-code
    export and the materialized (plain LLaMA) export give our logits."""
    def trained_looking_gain(generator):  # not the constant init
        generator.out_norm_weight.uniform_(0.01, 0.1, generator=torch.Generator().manual_seed(0))

    full = assert_exports_give_our_logits({"output_norm": True, "output_norm_init": 0.05, "ln_gain_init": 3.63},
                                          spm_tokenizer, tmp_path, trained_looking_gain)
    assert "embedding.generator.out_norm_weight" in full
