"""The issue-42 input sides, on built models: the frozen random input table (`untied` with
`freeze_input_embedding: true`). TP=2 equals TP=1 on the same weights (logits, loss, every
gradient), the frozen table gets no gradient, no optimizer state and no decay and stays
bit-identical to its initialisation through AdamW steps, the parameter counts are exact (the
frozen table counted, and reported apart), and the settings table, the flags and the docs carry
the option. Training, resume and evaluation: tests/test_embedding_variants_train.py."""
import os
import re

import pytest
import torch

from megatron_lev.configs import load_config
from megatron_lev.models.config import model_config_from_dict
from tests.distributed import run_distributed
from tests.test_model import _data, single_rank  # noqa: F401 (single_rank: a fixture)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 1000  # tiny's; tests.test_model._data draws ids below it
TINY = load_config("tiny-lev")["model"]
FROZEN = {**TINY, "embedding": "untied", "freeze_input_embedding": True}
PADDED, HIDDEN = 1024, 64  # tiny: vocab 1000 padded to a multiple of 128 (x TP 1 or 2), width 64
ADAM_STEPS = 3


# --------------------------------------------------------------------------- TP = 2 vs TP = 1

def _global(model, tensors: dict) -> dict:
    from megatron_lev.models.decoder import gather_tensor_parallel

    params = dict(model.named_parameters())
    return {n: None if t is None else gather_tensor_parallel(t, params[n]) for n, t in tensors.items()}


def _tp_variant_outputs(rank, world_size, sections: dict):
    """For each section, TP=1 then TP=2: logits, loss, weights and gradients (gathered to global
    tensors) at init, then the weights after ADAM_STEPS AdamW steps over optim.param_groups."""
    from megatron_lev.distributed.state import initialize_model_parallel
    from megatron_lev.models.decoder import build_model, gather_logits
    from megatron_lev.training.optim import param_groups

    input_ids, labels, loss_mask = _data()
    out = {}
    for tp in (1, 2):  # TP=1 first (both ranks compute it, as data-parallel replicas)
        initialize_model_parallel(tensor_model_parallel_size=tp)
        for name, section in sections.items():
            model = build_model(model_config_from_dict(section, tensor_model_parallel_size=tp))
            logits = gather_logits(model(input_ids), VOCAB)
            loss = model(input_ids, labels=labels, loss_mask=loss_mask)
            loss.backward()
            result = {"logits": logits.detach(), "loss": loss.item(),
                      "weights": _global(model, {n: p.detach().clone() for n, p in model.named_parameters()}),
                      "grads": _global(model, {n: None if p.grad is None else p.grad.clone()
                                                       for n, p in model.named_parameters()}),
                      "groups": [(g["weight_decay"], sorted(g["param_names"])) for g in param_groups(model, 0.1)]}
            optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
            for step in range(ADAM_STEPS):
                if step:
                    optimizer.zero_grad()
                    model(input_ids, labels=labels, loss_mask=loss_mask).backward()
                optimizer.step()
            result["stepped"] = _global(model, {n: p.detach() for n, p in model.named_parameters()})
            result["optimizer_state"] = sorted(n for g in optimizer.param_groups for n, p in
                                               zip(g["param_names"], g["params"]) if optimizer.state.get(p))
            out[tp, name] = result
    return out


def test_frozen_table_tp2_equals_tp1_gets_no_gradient_state_or_decay_and_stays_at_init():
    """The frozen untied model at TP=2 gives TP=1's logits, loss and gradients from the same seed;
    the table has no gradient, is in no optimizer group (so no AdamW state and no weight decay) and
    after AdamW steps is bit-identical to its initialisation at both TPs, while the head moved."""
    results = run_distributed(_tp_variant_outputs, world_size=2, args=({"frozen": FROZEN},))
    for result in results:
        one, two = result[1, "frozen"], result[2, "frozen"]
        torch.testing.assert_close(two["logits"], one["logits"], atol=1e-5, rtol=0)
        assert abs(two["loss"] - one["loss"]) < 1e-5 and 6.0 < one["loss"] < 8.0
        assert two["weights"].keys() == one["weights"].keys()
        for name in one["weights"]:
            assert torch.equal(two["weights"][name], one["weights"][name]), name
            if name == "embedding.weight":
                assert one["grads"][name] is None and two["grads"][name] is None
                continue
            torch.testing.assert_close(two["grads"][name], one["grads"][name], atol=1e-5, rtol=1e-4, msg=name)
        for run in (one, two):
            names = [n for _, group in run["groups"] for n in group]
            assert "embedding.weight" not in names and "embedding.weight" not in run["optimizer_state"]
            assert sorted(names) == sorted(run["optimizer_state"]) == sorted(n for n in one["weights"]
                                                                              if n != "embedding.weight")
            (head_decay,) = [decay for decay, group in run["groups"] if "output_layer.weight" in group]
            assert head_decay == 0.1
            assert torch.equal(run["stepped"]["embedding.weight"], one["weights"]["embedding.weight"])
            assert not torch.equal(run["stepped"]["output_layer.weight"], one["weights"]["output_layer.weight"])


# --------------------------------------------------------------------------- single rank

def test_frozen_table_is_untied_with_one_parameter_frozen(single_rank):
    """The same parameters as untied, from the same seed; only the table has requires_grad off."""
    from megatron_lev.models.decoder import build_model

    frozen = build_model(model_config_from_dict(FROZEN))
    untied = build_model(model_config_from_dict({**TINY, "embedding": "untied"}))
    assert frozen.state_dict().keys() == untied.state_dict().keys()
    for (name, p_frozen), (_, p_untied) in zip(frozen.named_parameters(), untied.named_parameters()):
        assert torch.equal(p_frozen, p_untied), name
        assert p_frozen.requires_grad == (name != "embedding.weight"), name
    input_ids, labels, loss_mask = _data()
    torch.testing.assert_close(frozen(input_ids, labels=labels, loss_mask=loss_mask),
                               untied(input_ids, labels=labels, loss_mask=loss_mask), atol=0, rtol=0)


def test_frozen_parameter_counts_report_the_table_apart(single_rank, capsys):
    """total = untied's (the table is the model's); frozen = the padded V x D table (hand count);
    trainable = what the optimizer sees on a built model. The planner's breakdown prints both."""
    from megatron_lev.models.decoder import build_model
    from megatron_lev.models.param_count import compare_embeddings, count_parameters, main

    config = model_config_from_dict(FROZEN)
    counts = count_parameters(config)
    untied = count_parameters(model_config_from_dict({**TINY, "embedding": "untied"}))
    assert counts["total"] == untied["total"] and untied["frozen"] == 0
    assert counts["frozen"] == PADDED * HIDDEN == 65_536
    model = build_model(config)
    assert counts["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    # The other input sides of the same backbone (no freeze for them: it is untied's option).
    assert compare_embeddings(FROZEN) == compare_embeddings({**TINY, "embedding": "untied"})
    assert main(["--config", "tiny-untied"]) == 0
    assert "frozen" not in capsys.readouterr().out


def test_frozen_breakdown_and_planner_on_the_experiment_config(capsys):
    """exp-frozen.yaml is exp-untied.yaml with the table frozen; the breakdown names the frozen table
    and the trainable rest: 8064 x 128 = 1,032,192 of exp-untied's 2,851,968 parameters."""
    from megatron_lev.models.param_count import main, plan_isoparametric

    frozen = load_config(os.path.join(REPO, "experiments", "configs", "exp-frozen.yaml"))
    untied = load_config(os.path.join(REPO, "experiments", "configs", "exp-untied.yaml"))
    assert frozen["model"] == {**untied["model"], "freeze_input_embedding": True}
    assert frozen["training"] == untied["training"]
    assert main(["--config", os.path.join(REPO, "experiments", "configs", "exp-frozen.yaml")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^embedding \(table, frozen\) +1,032,192 +36\.19%$", out, re.M)
    assert re.search(r"^total +2,851,968 +100\.00%$", out, re.M)
    assert "\nfrozen (never trained): 1,032,192; trainable: 1,819,776\n" in out
    assert "embedding=untied (input table frozen)," in out
    # The isoparametric LEV of a frozen baseline is a trainable LEV (the option is untied's).
    plan = plan_isoparametric(frozen["model"])
    assert plan == plan_isoparametric(untied["model"]) and "freeze_input_embedding" not in plan["model"]


@pytest.mark.parametrize("section, message", [
    ({"embedding": "tied"}, "freeze_input_embedding: only for embedding: untied (this model's input side is tied; "
                            "a frozen tied table would freeze the output head too)"),
    ({"embedding": "lev"}, "freeze_input_embedding: only for embedding: untied (this model's input side is lev; "
                           "a frozen tied table would freeze the output head too)"),
    ({"freeze_input_embedding": "yes"}, "freeze_input_embedding: must be true or false, got 'yes'"),
])
def test_frozen_bad_configs_name_the_field(section, message):
    with pytest.raises(ValueError) as error:
        model_config_from_dict({**FROZEN, **section})
    assert str(error.value) == message


def test_frozen_flag_setting_and_docs():
    """--freeze-input-embedding (and --no-...) override the YAML; the settings table has the row
    (no Hugging Face key: the export is an untied LLaMA); docs/model.md and docs/training.md name it."""
    from megatron_lev.models.settings import SETTING_BY_FIELD
    from megatron_lev.training.arguments import parse_args

    row = SETTING_BY_FIELD["freeze_input_embedding"]
    assert (row.flag, row.type, row.hf, row.trainer) == ("--freeze-input-embedding", bool, None, True)
    assert parse_args(["--config", "tiny-untied", "--freeze-input-embedding"]).model["freeze_input_embedding"] is True
    assert "freeze_input_embedding" not in parse_args(["--config", "tiny-untied"]).model
    exp = os.path.join(REPO, "experiments", "configs", "exp-frozen.yaml")
    assert parse_args(["--config", exp, "--no-freeze-input-embedding"]).model["freeze_input_embedding"] is False
    with open(os.path.join(REPO, "docs", "model.md"), encoding="utf-8") as f:
        page = f.read()
    assert "| `freeze_input_embedding` | `--freeze-input-embedding` | none |" in page
    with open(os.path.join(REPO, "docs", "training.md"), encoding="utf-8") as f:
        assert "`--freeze-input-embedding`" in f.read()
