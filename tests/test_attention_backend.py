"""Issue 50: SDPA's backends by Megatron-LM's --attention-backend (models/transformer.py): "auto"
prefers cuDNN's attention on Hopper and later, the others name one backend. Every choice gives the
math backend's logits and gradients, the choice reaches the kernel dispatch inside the layer (also
compiled), and the check's record of the backend that ran names it."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from megatron_lev.models import transformer
from megatron_lev.models.transformer import (HOPPER_PRIORITY, compile_decoder_layers, sdpa_backend_used,
                                             sdpa_backends, set_attention_backend)
from tests.distributed import run_distributed
from tests.test_model import single_rank  # noqa: F401  (module-scoped fixture: one in-process rank)


def tiny_model(seed: int = 0):
    from megatron_lev.configs import load_config
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.decoder import LeviathanModel

    section = load_config("tiny-lev")["model"]
    torch.manual_seed(seed)
    return LeviathanModel(model_config_from_dict(section)), section["vocab_size"]


def logits_and_grads(model, vocab: int, tokens: torch.Tensor):
    from megatron_lev.models.decoder import gather_logits

    model.zero_grad(set_to_none=True)
    logits = gather_logits(model(tokens), vocab)
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_choice_by_name_and_device(monkeypatch):
    assert sdpa_backends("auto", "cpu") is None  # torch's own order off CUDA
    assert sdpa_backends("flash", "cpu") == (SDPBackend.FLASH_ATTENTION,)
    assert sdpa_backends("unfused", "cpu") == sdpa_backends("local", "cpu") == (SDPBackend.MATH,)
    with pytest.raises(ValueError, match=r"^--attention-backend fused: cuDNN attention needs CUDA \(this run is on cpu\)$"):
        sdpa_backends("fused", "cpu")
    with pytest.raises(ValueError, match=r"^--attention-backend 'te': must be one of auto, flash, fused, unfused, local$"):
        sdpa_backends("te", "cpu")
    # On CUDA (the capability read is patched: no GPU here): cuDNN first from Hopper (9.0) on.
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    for capability, expected in (((9, 0), HOPPER_PRIORITY), ((10, 0), HOPPER_PRIORITY), ((8, 0), None)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert sdpa_backends("auto", "cuda") == expected
    assert HOPPER_PRIORITY[0] == SDPBackend.CUDNN_ATTENTION and sdpa_backends("fused", "cuda") == (SDPBackend.CUDNN_ATTENTION,)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert sdpa_backends("auto", "cuda") is None  # no cuDNN in this torch: its own order


def test_every_backend_gives_the_math_backends_logits_and_gradients(single_rank, monkeypatch):  # noqa: F811
    model, vocab = tiny_model()
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    assert set_attention_backend(model, "unfused", "cpu") == (SDPBackend.MATH,)
    reference = logits_and_grads(model, vocab, tokens)
    # What the dispatcher picks inside the layer, for each choice (a wrapper over SDPA records it).
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append(SDPBackend(torch._fused_sdp_choice(q, k, v, **kwargs)).name)
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(transformer.F, "scaled_dot_product_attention", recording)
    for name, ran in (("unfused", "MATH"), ("local", "MATH"), ("flash", "FLASH_ATTENTION"), ("auto", "FLASH_ATTENTION")):
        seen.clear()
        set_attention_backend(model, name, "cpu")
        logits, grads = logits_and_grads(model, vocab, tokens)
        assert set(seen) == {ran} and len(seen) == model.config.num_layers, name
        assert sdpa_backend_used(model, 2, 16, torch.float32, "cpu") == ran
        torch.testing.assert_close(logits, reference[0], rtol=0, atol=1e-5)
        for key, grad in grads.items():
            torch.testing.assert_close(grad, reference[1][key], rtol=0, atol=1e-5 * max(1.0, grad.abs().max().item()))
    assert sorted(grads) == sorted(reference[1])


def test_a_compiled_layer_keeps_the_choice(single_rank):  # noqa: F811
    model, vocab = tiny_model()
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(2))
    set_attention_backend(model, "unfused", "cpu")
    eager = logits_and_grads(model, vocab, tokens)
    set_attention_backend(model, "flash", "cpu")
    assert compile_decoder_layers(model) == model.config.num_layers
    compiled = logits_and_grads(model, vocab, tokens)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=1e-5)
    for key, grad in compiled[1].items():
        torch.testing.assert_close(grad, eager[1][key], rtol=0, atol=1e-5 * max(1.0, grad.abs().max().item()))


def _train(rank, world_size, runs):
    from megatron_lev.train import main

    return [main(argv) for argv in runs]


def test_the_trainer_flag_reaches_the_layers(tiny_dataset, spm_tokenizer, tmp_path):
    """--attention-backend unfused (SDPA's math backend) trains the losses of the default (torch's
    own order on CPU: its flash kernel) to float32 rounding, is saved with the run's configuration,
    and fused (cuDNN's) is refused on CPU."""
    import yaml

    from tests.test_train import train_flags, train_records

    work = str(tmp_path)
    runs = [train_flags(tiny_dataset, spm_tokenizer, work, name, "--config", "tiny-lev", "--train-iters", "3",
                        *extra) for name, extra in (("default", ()), ("unfused", ("--attention-backend", "unfused",
                                                                                  "--save", str(tmp_path / "ckpt"))),
                                                    ("fused", ("--attention-backend", "fused")))]
    codes = run_distributed(_train, world_size=1, args=(runs,), timeout=600)[0]
    assert codes[:2] == [0, 0] and codes[2] != 0
    default, unfused = train_records(work, "default"), train_records(work, "unfused")
    assert sorted(default) == sorted(unfused) == [1, 2, 3]
    assert default[1]["loss"] == pytest.approx(unfused[1]["loss"], abs=1e-5)
    for i in (1, 2, 3):
        assert abs(default[i]["loss"] - unfused[i]["loss"]) < 1e-4 and default[i]["loss"] != 0
    saved = yaml.safe_load((tmp_path / "ckpt" / "config.yaml").read_text())
    assert saved["training"]["attention_backend"] == "unfused"
