"""Issue 50: `matmul_dtype: bfloat16`, the generator's two dense products (z @ W_seed, M @ W_out)
with bfloat16 operands (tensor cores on a GPU, float32 accumulation): what it computes, that it
reaches every path that builds the generator (YAML, Megatron-LM's flags, TP=2, the Hugging Face
export, training), and the bad value's message. The default stays float32 (the spec)."""
from __future__ import annotations

import pytest
import torch

from megatron_lev.lev.generator import LEVConfig, LEVGenerator, dense_product
from megatron_lev.lev.parallel import ParallelLEVEmbedding
from tests.distributed import run_distributed
from tests.test_lev import TP_CFG, assert_close_at_scale, forward_backward, tp_inputs
from tests.test_lev_knobs import EXPERIMENT
from tests.test_model import single_rank  # noqa: F401  (module-scoped fixture: one in-process rank)

BF16 = dict(matmul_dtype="bfloat16")
BF16_ULP = 2.0 ** -7  # bfloat16's spacing relative to a value in [1, 2)


def test_the_bfloat16_product_rounds_its_operands_and_its_result():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(70, 48, generator=g), torch.randn(48, 24, generator=g)
    exact = a.double() @ b.double()
    assert torch.equal(dense_product(a, b), a @ b)  # float32: the spec's product
    got = dense_product(a, b, "bfloat16")
    assert got.dtype == torch.float32 and torch.equal(got, got.bfloat16().float())  # a bfloat16 result
    # Rounded operands, float32 accumulation, one rounding of the sum: within an ulp of that sum ...
    rounded = a.bfloat16().double() @ b.bfloat16().double()
    assert ((got.double() - rounded).abs() <= BF16_ULP * rounded.abs()).all()
    # ... and the operands' rounding shows against the exact product (the option is not float32).
    error = ((got.double() - exact).abs() / exact.abs().clamp_min(1e-3)).median().item()
    assert 1e-4 < error < 3e-2


def test_the_generator_in_bfloat16_is_close_to_float32_and_trains_every_parameter():
    ids = torch.tensor([0, 1, 17, 250, 4999, 123, 42, 7999])
    fp32 = LEVGenerator(LEVConfig(**EXPERIMENT), init_seed=7)
    bf16 = LEVGenerator(LEVConfig(**EXPERIMENT, **BF16), init_seed=7)
    assert all(torch.equal(p, q) for p, q in zip(fp32.parameters(), bf16.parameters()))  # same init
    out32, out16 = fp32(ids), bf16(ids)
    relative = ((out16 - out32).norm() / out32.norm()).item()
    assert 1e-4 < relative < 3e-2  # the modes' product amplifies the seed's rounding a little
    grad_out = torch.randn(out32.shape, generator=torch.Generator().manual_seed(3))
    grads32 = torch.autograd.grad(out32, list(fp32.parameters()), grad_out)
    grads16 = torch.autograd.grad(out16, list(bf16.parameters()), grad_out)
    for (name, _), got, want in zip(bf16.named_parameters(), grads16, grads32):
        assert got.dtype == torch.float32 and torch.isfinite(got).all(), name
        assert ((got - want).norm() / want.norm()).item() < 5e-2, name


def test_the_value_is_checked_and_is_no_size_field():
    with pytest.raises(ValueError, match=r"^LEVConfig\.matmul_dtype='float16' must be one of "
                                         r"\('float32', 'bfloat16'\)$"):
        LEVConfig(**EXPERIMENT, matmul_dtype="float16")
    assert LEVConfig(**EXPERIMENT, **BF16).num_parameters() == LEVConfig(**EXPERIMENT).num_parameters()
    assert LEVConfig(**EXPERIMENT, **BF16).fused_modes  # the mode product keeps its fused path


def test_megatron_lm_flag_builds_it():
    import argparse

    from megatron_lev.megatron_lm.arguments import add_lev_args, lev_config_from_args

    parser = add_lev_args(argparse.ArgumentParser())
    args = parser.parse_args(["--lev-matmul-dtype", "bfloat16"])
    args.hidden_size = 64
    assert lev_config_from_args(args, 1000).matmul_dtype == "bfloat16"
    del args.lev_matmul_dtype  # an older checkpoint's arguments: the spec's float32
    assert lev_config_from_args(args, 1000).matmul_dtype == "float32"
    with pytest.raises(SystemExit):
        parser.parse_args(["--lev-matmul-dtype", "float16"])


def _tp2_bf16(rank, world_size):
    from megatron_lev.distributed.state import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=2)
    ids, grad_out = tp_inputs()
    return {unique: forward_backward(ParallelLEVEmbedding(LEVConfig(**TP_CFG, **BF16, unique_ids=unique),
                                                          init_seed=99), ids, grad_out)
            for unique in (True, False)}


def test_tensor_parallel_equals_one_rank_to_bfloat16_rounding():
    """Each rank's M @ W_out over its heads is rounded to bfloat16 before the all-reduce sums the
    two; one rank rounds the whole sum once: the same up to about one bfloat16 ulp of the output."""
    ranks = run_distributed(_tp2_bf16, world_size=2)
    ids, grad_out = tp_inputs()
    ref_out, ref_grads = forward_backward(ParallelLEVEmbedding(LEVConfig(**TP_CFG, **BF16), init_seed=99), ids,
                                          grad_out)
    fp32_out, _ = forward_backward(ParallelLEVEmbedding(LEVConfig(**TP_CFG), init_seed=99), ids, grad_out)
    assert not torch.equal(ref_out, fp32_out)  # the option reached the TP module
    for r in ranks:
        assert torch.equal(r[True][0], r[False][0])  # unique-id == per-position evaluation, bit for bit
        out, grads = r[True]
        assert_close_at_scale(out, ref_out, atol=2 * BF16_ULP * ref_out.abs().max().item())
        assert_close_at_scale(grads["codebooks"], ref_grads["codebooks"], atol=3e-2 * ref_grads["codebooks"].abs().max().item())
    for name in ("w_seed", "delta", "w_out"):
        merged = torch.cat([r[True][1][name] for r in ranks])
        assert ((merged - ref_grads[name]).norm() / ref_grads[name].norm()).item() < 3e-2, name


def test_the_hugging_face_export_computes_in_bfloat16_too(single_rank, spm_tokenizer, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from megatron_lev.checkpointing.layout import is_extra_state
    from megatron_lev.configs import load_config
    from megatron_lev.hf.export import save_hf_model
    from megatron_lev.data.tokenizer import build_tokenizer
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.decoder import LeviathanModel, gather_logits

    tokens = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(1))
    logits = {}
    for dtype in ("float32", "bfloat16"):
        section = load_config("tiny-lev")["model"]
        section["lev"] = {**section["lev"], "matmul_dtype": dtype}
        cfg = model_config_from_dict(section)
        torch.manual_seed(0)
        model = LeviathanModel(cfg).eval()
        with torch.no_grad():
            logits[dtype] = gather_logits(model(tokens), 1000)
    assert not torch.equal(logits["float32"], logits["bfloat16"])
    full = {k: v for k, v in model.state_dict().items() if not is_extra_state(k)}
    full["output_layer.weight"] = full["output_layer.weight"][:1000]
    tokenizer = build_tokenizer("SentencePieceTokenizer", spm_tokenizer)
    for materialize in (False, True):  # the generator's code, and the table it computed in bfloat16
        folder = save_hf_model(full, cfg, str(tmp_path / f"hf{int(materialize)}"), tokenizer, materialize=materialize)
        hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=not materialize).eval()
        if not materialize:
            assert hf.config.lev["matmul_dtype"] == "bfloat16"
        with torch.no_grad():
            torch.testing.assert_close(hf(tokens).logits, logits["bfloat16"], rtol=0, atol=1e-5)
