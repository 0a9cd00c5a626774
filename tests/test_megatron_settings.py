"""The model settings Megatron-LM's flags carry (models/settings.py): --rotary-percent, --qk-layernorm,
--use-rope-scaling, --kv-channels, --num-query-groups, --norm-epsilon give the same logits in
megatron-core's GPTModel with LEV, in this project's LeviathanModel (the same weights) and in the
Hugging Face export (LevForCausalLM), and each changes the model. Exports that cannot express a
setting are refused in one line. TP = 1 here; tests/test_megatron_gpt.py runs qk_layernorm and
rotary_percent at TP = 2."""
import os

import pytest
import torch

from megatron_lev.configs import load_config
from megatron_lev.models.config import model_config_from_dict
from tests.distributed import one_in_process_rank
from tests.mcore_cpu import causal_mask, copy_weights_to_gpt, patch_mcore_for_cpu

VOCAB, BATCH, SEQ = 1024, 2, 16
BASE = {**load_config("tiny-lev")["model"], "vocab_size": VOCAB}
VARIANTS = {
    "rotary_percent 0.5, kv_channels 8, one kv head per query head": {"rotary_percent": 0.5, "kv_channels": 8,
                                                                       "num_query_groups": 4},
    "qk_layernorm, LLaMA 3 rope scaling, norm epsilon 1e-6": {"qk_layernorm": True, "rope_scaling": True,
                                                              "rotary_base": 500000.0, "layernorm_epsilon": 1e-6},
    "qk_layernorm with rotary_percent 0.25": {"qk_layernorm": True, "rotary_percent": 0.25},
}
RTOL = 1e-5


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()


def _ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def rank():
    with pytest.MonkeyPatch.context() as monkeypatch, one_in_process_rank():
        patch_mcore_for_cpu(monkeypatch)
        yield


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megatron_lev.hf.tokenizers import load_tokenizer

    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, VOCAB)}},
                                     unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(path)
    return load_tokenizer("HuggingFaceTokenizer", path, VOCAB)


def _models(section: dict):
    from megatron_lev.models.decoder import LeviathanModel
    from megatron_lev.models.gpt_lev import build_lev_gpt_model_from_config

    config = model_config_from_dict(section)
    ours = LeviathanModel(config).eval()
    with torch.no_grad():  # norm scales away from 1, so that each matters
        for name, param in ours.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    gpt = build_lev_gpt_model_from_config(config).eval()
    copy_weights_to_gpt(ours, gpt)
    return config, ours, gpt


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_setting_gives_equal_logits_in_gptmodel_ours_and_the_export(variant, rank, tokenizer, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from megatron_lev.hf.export import read_hf_model, save_hf_model
    from megatron_lev.models.decoder import gather_logits

    config, ours, gpt = _models({**BASE, **VARIANTS[variant]})
    ids, positions = _ids(), torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        logits_gpt = gpt(ids, positions, causal_mask(SEQ))[..., :VOCAB]
        logits_ours = gather_logits(ours(ids, positions), VOCAB)
    full = {name: param.detach() for name, param in ours.named_parameters()}
    out = str(tmp_path / "hf")
    save_hf_model(full, config, out, tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, trust_remote_code=True).eval()
    with torch.no_grad():
        logits_hf = hf(ids).logits
        greedy = hf.generate(ids[:1, :8], max_new_tokens=6, do_sample=False)  # with the KV cache
        manual = ids[:1, :8]
        for _ in range(6):  # without it
            manual = torch.cat([manual, hf(manual, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    # The same weights read as the default model (the setting dropped) give other logits.
    default = {k: v for k, v in {**BASE, **VARIANTS[variant]}.items() if k not in ("qk_layernorm", "rotary_percent",
                                                                                    "rope_scaling")}
    _, plain, _ = _models(default)
    plain.load_state_dict({k: v for k, v in ours.state_dict().items() if "attention.q_norm" not in k
                           and "attention.k_norm" not in k}, strict=False)
    with torch.no_grad():
        logits_plain = gather_logits(plain(ids, positions), VOCAB)
    diffs = {"GPTModel vs ours": _rel(logits_gpt, logits_ours), "export vs GPTModel": _rel(logits_gpt, logits_hf),
             "without the setting": _rel(logits_gpt, logits_plain)}
    with capsys.disabled():
        print(f"{variant}: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert diffs["GPTModel vs ours"] < RTOL and diffs["export vs GPTModel"] < RTOL, diffs
    assert diffs["without the setting"] > 1e-4, diffs
    assert torch.equal(greedy, manual)
    section, imported = read_hf_model(out)  # convert_from_hf's reading: the same model back
    assert section == config.to_dict()
    assert all(torch.equal(imported[name], tensor) for name, tensor in full.items())


def test_rope_frequencies_are_megatron_cores_and_transformers(rank):
    """Our RoPE frequencies (partial, LLaMA 3 scaling) are megatron-core RotaryEmbedding's and the export's."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig

    from megatron_lev.hf.modeling_lev import LevRotaryEmbedding
    from megatron_lev.models.layers import rotary_inverse_frequencies
    from megatron_lev.models.settings import hf_rope_parameters

    for percent, scaling in ((1.0, True), (0.5, False), (0.5, True), (0.25, True)):
        config = model_config_from_dict({**BASE, "rotary_percent": percent, "rope_scaling": scaling,
                                         "rotary_base": 500000.0, "kv_channels": 32})
        ours = rotary_inverse_frequencies(32, 500000.0, percent, scaling)
        mcore = RotaryEmbedding(32, percent, rotary_base=500000, rope_scaling=scaling, use_cpu_initialization=True)
        hf = LevRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                                            max_position_embeddings=64, rope_parameters=hf_rope_parameters(config)))
        rotary = int(32 * percent) // 2
        assert ours.shape == (rotary,) and torch.equal(ours, mcore.inv_freq)
        assert torch.allclose(hf.inv_freq[:rotary], ours, rtol=1e-6, atol=0) and not hf.inv_freq[rotary:].any()
        if scaling:
            assert not torch.equal(ours, rotary_inverse_frequencies(32, 500000.0, percent, False))


@pytest.mark.parametrize("section, materialize, message", [
    ({"qk_layernorm": True}, True, "qk_layernorm: a LlamaForCausalLM export cannot express it; export without "
                                   "--materialize-embeddings (LevForCausalLM has both)"),
    ({"rotary_percent": 0.5, "embedding": "tied"}, False, "rotary_percent 0.5: a LlamaForCausalLM export cannot "
                                                          "express it; no standard transformers architecture has both"),
])
def test_exports_that_cannot_express_a_setting_are_refused(section, materialize, message, rank, tokenizer, tmp_path):
    from megatron_lev.hf.export import save_hf_model
    from megatron_lev.models.decoder import LeviathanModel
    from megatron_lev.utils.errors import ExportError

    config = model_config_from_dict({**BASE, **section})
    full = {n: p.detach() for n, p in LeviathanModel(config).named_parameters()}
    with pytest.raises(ExportError) as error:
        save_hf_model(full, config, str(tmp_path / "hf"), tokenizer, materialize=materialize)
    assert str(error.value) == message
    assert not os.listdir(tmp_path)  # nothing written


def test_checkpoints_from_before_the_new_settings_resume(tmp_path):
    """A checkpoint's model section written before rotary_percent / rope_scaling / qk_layernorm existed
    was built with their defaults: it resumes under the same model, and not under one that sets them."""
    from megatron_lev.models.config import FIELD_DEFAULTS
    from megatron_lev.training.validation import check_resume_compatible
    from megatron_lev.utils.errors import ConfigError

    now = model_config_from_dict(BASE).to_dict()
    before = {k: v for k, v in now.items() if k not in FIELD_DEFAULTS}
    check_resume_compatible(str(tmp_path), "iter_0000010", {"model": before}, {"model": now})
    with pytest.raises(ConfigError, match=r"\(rotary_percent: 1.0 in the checkpoint, 0.5 now\)"):
        check_resume_compatible(str(tmp_path), "iter_0000010", {"model": before},
                                {"model": model_config_from_dict({**BASE, "rotary_percent": 0.5}).to_dict()})
