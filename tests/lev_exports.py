"""One check that LEV's generator options export exactly, shared by the tests of each option
(test_lev_knobs, test_lev_author, test_lev_remedies): a tiny-lev model with the options, its
checkpoint names, and both Hugging Face exports (remote code, and materialised as a plain LLaMA)
giving our logits."""
from __future__ import annotations

from typing import Callable, Optional

import torch

VOCAB = 1000  # the SentencePiece fixture's vocabulary: the export's unpadded rows


def assert_exports_give_our_logits(lev_options: dict, tokenizer_path: str, folder,
                                   perturb: Optional[Callable[[torch.nn.Module], object]] = None) -> dict:
    """Build tiny-lev with `lev_options`, move its generator off the init with `perturb` (so that
    every parameter matters), export it both ways into `folder` and compare the logits to 1e-5.
    Returns the full state dict the exports were made from."""
    from transformers import AutoModelForCausalLM

    from megatron_lev.checkpointing.layout import expected_parameter_names, is_extra_state
    from megatron_lev.configs import load_config
    from megatron_lev.data.tokenizer import build_tokenizer
    from megatron_lev.hf.export import save_hf_model
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.decoder import LeviathanModel, gather_logits

    section = load_config("tiny-lev")["model"]
    section["lev"] = {**section["lev"], **lev_options}
    cfg = model_config_from_dict(section)
    model = LeviathanModel(cfg).eval()
    if perturb is not None:
        with torch.no_grad():
            perturb(model.embedding.generator)
    full = {k: v for k, v in model.state_dict().items() if not is_extra_state(k)}
    assert sorted(full) == sorted(expected_parameter_names(cfg))
    full["output_layer.weight"] = full["output_layer.weight"][:VOCAB]  # as a merged checkpoint holds it: unpadded
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = gather_logits(model(tokens), VOCAB)
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_path)
    for materialize in (False, True):
        saved = save_hf_model(full, cfg, str(folder / f"hf{int(materialize)}"), tokenizer, materialize=materialize)
        hf = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=not materialize).eval()
        assert type(hf).__name__ == ("LlamaForCausalLM" if materialize else "LevForCausalLM")
        with torch.no_grad():
            theirs = hf(tokens).logits
        assert theirs.shape == ours.shape == (2, 12, VOCAB)
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    return full
