"""The issue-42 input sides, on built models: the frozen random input table (`untied` with
`freeze_input_embedding: true`) and the factorised input table (`embedding: factorized`, a V x r
table and an r -> D projection). TP=2 equals TP=1 on the same weights (logits, loss, every
gradient); the frozen table gets no gradient, no optimizer state and no decay and stays
bit-identical to its initialisation through AdamW steps; the factorised embeddings start at a
plain table's RMS; parameter counts and the rank planner are exact against hand counts; the
settings table, the flags, the docs and the refusals (Hugging Face without materialising,
Megatron-LM) name the option and the kind. Training, resume, evaluation and export:
tests/test_embedding_variants_train.py."""
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
RANK = 16
FACTORIZED = {**TINY, "embedding": "factorized", "embedding_rank": RANK}
PADDED, HIDDEN = 1024, 64  # tiny: vocab 1000 padded to a multiple of 128 (x TP 1 or 2), width 64
EXPERIMENTS = os.path.join(REPO, "experiments", "configs")
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


@pytest.fixture(scope="module")
def tp_results():
    """Both ranks' results of one 2-rank launch over the frozen and the factorised model."""
    return run_distributed(_tp_variant_outputs, world_size=2, args=({"frozen": FROZEN, "factorized": FACTORIZED},))


def _assert_tp2_equals_tp1(one: dict, two: dict, case: str) -> None:
    """Logits, loss, weights (bit for bit) and every gradient (None for None)."""
    torch.testing.assert_close(two["logits"], one["logits"], atol=1e-5, rtol=0, msg=case)
    assert abs(two["loss"] - one["loss"]) < 1e-5 and 6.0 < one["loss"] < 8.0, case  # ~ln(1000) at init
    assert two["weights"].keys() == one["weights"].keys() == one["grads"].keys(), case
    for name in one["weights"]:
        assert torch.equal(two["weights"][name], one["weights"][name]), f"{case} {name}"
        if one["grads"][name] is None or two["grads"][name] is None:
            assert one["grads"][name] is two["grads"][name] is None, f"{case} {name}"
            continue
        torch.testing.assert_close(two["grads"][name], one["grads"][name], atol=1e-5, rtol=1e-4, msg=f"{case} {name}")


def test_frozen_table_tp2_equals_tp1_gets_no_gradient_state_or_decay_and_stays_at_init(tp_results):
    """The frozen untied model at TP=2 gives TP=1's logits, loss and gradients from the same seed;
    the table has no gradient, is in no optimizer group (so no AdamW state and no weight decay) and
    after AdamW steps is bit-identical to its initialisation at both TPs, while the head moved."""
    for result in tp_results:
        one, two = result[1, "frozen"], result[2, "frozen"]
        _assert_tp2_equals_tp1(one, two, "frozen")
        assert [n for n, g in one["grads"].items() if g is None] == ["embedding.weight"]
        for run in (one, two):
            names = [n for _, group in run["groups"] for n in group]
            assert "embedding.weight" not in names and "embedding.weight" not in run["optimizer_state"]
            assert sorted(names) == sorted(run["optimizer_state"]) == sorted(n for n in one["weights"]
                                                                              if n != "embedding.weight")
            (head_decay,) = [decay for decay, group in run["groups"] if "output_layer.weight" in group]
            assert head_decay == 0.1
            assert torch.equal(run["stepped"]["embedding.weight"], one["weights"]["embedding.weight"])
            assert not torch.equal(run["stepped"]["output_layer.weight"], one["weights"]["output_layer.weight"])


def test_factorized_tp2_equals_tp1_and_every_parameter_trains(tp_results):
    """The factorised model at TP=2 (the V x r table vocab-parallel, the projection replicated) gives
    TP=1's logits, loss and every gradient, the projection's included, on the same weights; both
    of its matrices are in the decayed AdamW group and move."""
    for result in tp_results:
        one, two = result[1, "factorized"], result[2, "factorized"]
        _assert_tp2_equals_tp1(one, two, "factorized")
        assert one["weights"]["embedding.weight"].shape == (PADDED, RANK)
        assert one["weights"]["embedding.projection.weight"].shape == (HIDDEN, RANK)
        assert one["grads"]["embedding.projection.weight"].abs().sum() > 0
        for run in (one, two):
            (decayed,) = [group for decay, group in run["groups"] if decay == 0.1]
            assert {"embedding.weight", "embedding.projection.weight", "output_layer.weight"} <= set(decayed)
            assert sorted(run["optimizer_state"]) == sorted(one["weights"])
            for name in ("embedding.weight", "embedding.projection.weight"):
                assert not torch.equal(run["stepped"][name], one["weights"][name]), name


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


# --------------------------------------------------------------------------- factorised

def test_factorized_init_rms_is_a_plain_tables_and_counts_are_exact(single_rank):
    """At init the factorised embeddings have a plain N(0, init_method_std) table's RMS (the
    projection is N(0, 1/sqrt(r))) and no shared direction; the analytic count is the built
    model's, the input side r (V_padded + D) by hand; --decoupled-lr finds the whole input side."""
    from megatron_lev.models.decoder import build_model
    from megatron_lev.models.init_stats import input_embedding_statistics
    from megatron_lev.models.layers import FactorizedEmbedding, build_embedding
    from megatron_lev.models.param_count import compare_embeddings, count_parameters
    from megatron_lev.training.optim import embedding_or_output_parameters

    config = model_config_from_dict(FACTORIZED)
    embedding = build_embedding(config)
    assert isinstance(embedding, FactorizedEmbedding)
    _, rms, cosine = input_embedding_statistics(embedding, config.vocab_size)
    untied_table = build_embedding(model_config_from_dict({**TINY, "embedding": "untied"}))
    _, plain_rms, _ = input_embedding_statistics(untied_table, config.vocab_size)
    assert abs(rms / 0.02 - 1) < 0.1 and abs(plain_rms / 0.02 - 1) < 0.05 and abs(cosine) < 0.05, (rms, cosine)
    projection = embedding.projection.weight
    assert projection.std().item() == pytest.approx(RANK ** -0.5, rel=0.1)
    assert embedding.weight[VOCAB:].abs().sum() == 0  # padding rows
    counts = count_parameters(config)
    assert counts["embedding"] == PADDED * RANK + RANK * HIDDEN == 17_408
    assert counts["vocab_padding"] == (PADDED - VOCAB) * (RANK + HIDDEN)
    untied = count_parameters(model_config_from_dict({**TINY, "embedding": "untied"}))
    assert counts["total"] == untied["total"] - PADDED * HIDDEN + 17_408 and counts["frozen"] == 0
    model = build_model(config)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert compare_embeddings(FACTORIZED)["factorized"] == counts["total"]
    # --decoupled-lr takes the whole input side (table and projection) and the head, as for a table.
    special = embedding_or_output_parameters(model)
    assert sorted(n for n, p in model.named_parameters() if id(p) in special) == [
        "embedding.projection.weight", "embedding.weight", "output_layer.weight"]
    assert "factorized" not in compare_embeddings({**TINY, "embedding": "untied"})  # no rank to count with
    # bf16: the same weights, rounded (each draw is float32 first).
    bf16 = build_embedding(model_config_from_dict(FACTORIZED, bf16=True))
    assert bf16.projection.weight.dtype == torch.bfloat16
    assert torch.equal(bf16.projection.weight, projection.detach().to(torch.bfloat16))


def test_factorized_flops_count_the_projection():
    from megatron_lev.training.flops import flops_model

    factorized = flops_model(model_config_from_dict(FACTORIZED), 64).transformer_flops_per_token()
    untied = flops_model(model_config_from_dict({**TINY, "embedding": "untied"}), 64).transformer_flops_per_token()
    assert factorized - untied == 6 * RANK * HIDDEN


def test_rank_planner_matches_the_isoparametric_lev_by_hand(tmp_path, capsys):
    """The factorised model at exp-lev-deeper's backbone (8 layers, ffn 416) matched to
    exp-lev-deeper's total: by hand, the model without its input side has head 8064 x 128 +
    8 x (49,152 + 3 x 128 x 416 + 256) + 128 = 2,705,536 parameters, each unit of rank 8064 + 128
    = 8,192 more, so r = (2,873,728 - 2,705,536) / 8,192 = 20.53 -> 21 (2,877,568, +3,840;
    rank 20 would be -4,352)."""
    from megatron_lev.models.param_count import main, plan_embedding_rank

    lev_deeper = os.path.join(EXPERIMENTS, "exp-lev-deeper.yaml")
    factorized = tmp_path / "exp-factorized.yaml"
    factorized.write_text(f"base: {lev_deeper}\nmodel:\n  embedding: factorized\n")
    section = load_config(str(factorized))["model"]
    plan = plan_embedding_rank(section, 2_873_728)
    assert (plan["embedding_rank"], plan["total"], plan["parameters_per_rank"]) == (21, 2_877_568, 8_192)
    assert plan["exact_rank"] == pytest.approx(168_192 / 8_192)
    assert plan["model"] == {**section, "embedding_rank": 21}
    assert main(["--config", str(factorized), "--match-params", lev_deeper]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"embedding_rank for {factorized} matching {lev_deeper} (2,873,728 parameters):\n"
                          "  embedding_rank 21 (exact 20.53; each unit of rank is 8,192 parameters, a table column "
                          "and a projection column)\n  factorized total 2,877,568 (+0.134% vs the target)\n")
    assert f"{factorized} at embedding_rank 21: embedding=factorized (rank 21)," in out
    assert re.search(r"^  table \(8,064 x 21\) +169,344 *$", out, re.M)
    assert re.search(r"^  projection \(21 x 128\) +2,688 *$", out, re.M)
    # Refused: a target below the backbone alone, a config that is not factorised, two planners.
    with pytest.raises(ValueError) as error:
        plan_embedding_rank(section, 2_000_000)
    assert str(error.value) == ("--match-params: no embedding_rank comes within 1.0% (--tolerance) of the target's "
                                "2,000,000 parameters: the backbone without its input side already has 2,705,536, "
                                "and each unit of rank adds 8,192 (closest: rank 1, 2,713,728, +35.69%)")
    assert main(["--config", lev_deeper, "--match-params", lev_deeper]) == 2
    assert capsys.readouterr().err == ("error: --match-params: the --config model is embedding: lev; the rank planner "
                                       "sets the embedding_rank of a factorized model (embedding: factorized)\n")
    with pytest.raises(SystemExit):
        main(["--match-params", lev_deeper, "--match-baseline", lev_deeper])
    assert "--match-params sets the embedding_rank of the factorized --config" in capsys.readouterr().err


@pytest.mark.parametrize("section, message", [
    ({"embedding_rank": None}, "embedding_rank: embedding: factorized needs the rank r of its V x r table, a positive "
                               "integer (--embedding-rank), got None"),
    ({"embedding_rank": 0}, "embedding_rank: embedding: factorized needs the rank r of its V x r table, a positive "
                            "integer (--embedding-rank), got 0"),
    ({"embedding_rank": "16"}, "embedding_rank: embedding: factorized needs the rank r of its V x r table, a positive "
                               "integer (--embedding-rank), got '16'"),
    ({"embedding": "untied"}, "embedding_rank: only for embedding: factorized (this model's input side is untied)"),
    ({"embedding": "shared"}, "embedding: unknown embedding kind 'shared' (expected one of lev, tied, untied, "
                              "factorized)"),
    ({"freeze_input_embedding": True}, "freeze_input_embedding: only for embedding: untied (this model's input side "
                                       "is factorized; a frozen tied table would freeze the output head too)"),
])
def test_factorized_bad_configs_name_the_field(section, message):
    with pytest.raises(ValueError) as error:
        model_config_from_dict({**FACTORIZED, **section})
    assert str(error.value) == message


def test_factorized_flags_setting_and_docs(capsys):
    """--embedding factorized --embedding-rank r select it; a bad --embedding is refused in one line
    naming the flag; the settings table has the rows; docs/model.md states the init and the planner."""
    from megatron_lev.models.settings import SETTING_BY_FIELD
    from megatron_lev.training.arguments import parse_args

    row = SETTING_BY_FIELD["embedding_rank"]
    assert (row.flag, row.type, row.hf, row.trainer) == ("--embedding-rank", int, None, True)
    assert SETTING_BY_FIELD["embedding"].choices == ("lev", "tied", "untied", "factorized")
    model = parse_args(["--config", "tiny-untied", "--embedding", "factorized", "--embedding-rank", "16"]).model
    assert (model["embedding"], model["embedding_rank"]) == ("factorized", 16)
    assert model_config_from_dict(model).embedding_rank == 16
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", "tiny-untied", "--embedding", "albert"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("python -m megatron_lev.train: error: argument --embedding: invalid choice: "
                                       "'albert' (choose from 'lev', 'tied', 'untied', 'factorized')\n")
    with open(os.path.join(REPO, "docs", "model.md"), encoding="utf-8") as f:
        page = " ".join(f.read().split())
    assert "| `embedding_rank` | `--embedding-rank` | none |" in page
    assert "the projection N(0, 1/sqrt(r))" in page and "--match-params experiments/configs/exp-lev-deeper.yaml" in page
    with open(os.path.join(REPO, "docs", "training.md"), encoding="utf-8") as f:
        assert "`--embedding-rank`" in f.read()


def test_factorized_refusals_name_the_kind(single_rank, tmp_path):
    """Hugging Face without --materialize-embeddings, a materialised tied model, and Megatron-LM's
    GPTModel+LEV builder and checkpoint reader: one line each, naming the kind; nothing written."""
    from megatron_lev.checkpointing.mcore import read_mcore_checkpoint
    from megatron_lev.hf.export import save_hf_model
    from megatron_lev.models.decoder import build_model
    from megatron_lev.models.gpt_lev import build_lev_gpt_model_from_config
    from megatron_lev.utils.errors import CheckpointError, ExportError

    config = model_config_from_dict(FACTORIZED)
    full = {n: p.detach() for n, p in build_model(config).named_parameters()}
    with pytest.raises(ExportError) as error:
        save_hf_model(full, config, str(tmp_path / "hf"), tokenizer=None)
    assert str(error.value) == ("embedding: factorized: no transformers architecture has a factorised input side (a "
                                "V x r table and an r -> hidden projection); export with --materialize-embeddings, "
                                "which writes their product as the table of an untied LlamaForCausalLM")
    with pytest.raises(ExportError) as error:
        save_hf_model(full, model_config_from_dict({**TINY, "embedding": "tied"}), str(tmp_path / "hf"),
                      tokenizer=None, materialize=True)
    assert str(error.value) == ("--materialize-embeddings: only for embedding: lev or factorized models (this one is "
                                "tied)")
    assert not os.listdir(tmp_path)
    with pytest.raises(ValueError) as error:
        build_lev_gpt_model_from_config(config)
    assert str(error.value) == "embedding: 'factorized': build_lev_gpt_model_from_config builds LEV models only"
    with pytest.raises(CheckpointError) as error:
        read_mcore_checkpoint(str(tmp_path / "megatron"), config)
    assert str(error.value) == "model embedding 'factorized': Megatron-LM conversion is for LEV models"


def test_factorized_layout_for_conversion_and_universal_checkpoints():
    """The full-state-dict names and TP partitions (checkpointing/layout.py) the converters and
    DeepSpeed's universal checkpoints use: the V x r table split over the vocabulary and padded,
    the projection replicated, in the plain and the pipeline form."""
    from deepspeed.checkpoint import constants as ds

    from megatron_lev.checkpointing.layout import REPLICATED, expected_parameter_names, partition_of
    from megatron_lev.checkpointing.universal import universal_checkpoint_info
    from megatron_lev.utils.errors import CheckpointError

    names = expected_parameter_names(model_config_from_dict(FACTORIZED))
    assert names[:2] == ["embedding.weight", "embedding.projection.weight"] and names[-1] == "output_layer.weight"
    assert partition_of("embedding.weight", "factorized").vocab
    assert partition_of("embedding.projection.weight", "factorized") == REPLICATED
    with pytest.raises(CheckpointError, match=r"^unknown parameter 'embedding.projection.weight' for an "
                                              r"embedding='untied' model"):
        partition_of("embedding.projection.weight", "untied")
    for pp, prefix in ((1, "embedding."), (2, "0.")):
        info = universal_checkpoint_info({"model": FACTORIZED, "training": {"pipeline_model_parallel_size": pp}})
        assert rf"{re.escape(prefix + 'projection.weight')}$" in info[ds.TP_REPLICATED_PARAMETER_PATTERNS]
        assert rf"{re.escape(prefix + 'weight')}$" in info[ds.VOCABULARY_PARAMETER_PATTERNS]
