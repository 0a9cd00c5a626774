"""Issue 25's release and resume defects, end to end on CPU: one 1-rank launch trains tiny-lev
for 10 steps at --seq-length 128 (its YAML says 64) and saves, then resumes that checkpoint
as a 20-step run with --override-opt_param-scheduler for 2 steps; the checkpoint is then
exported as tools/convert_to_hf.py does.

  - the export records the run's context (128), not the YAML's (config.json, model card,
    tokenizer) and evaluate.py's window on the export follows it;
  - the new schedule's rate is applied from the first resumed step (DeepSpeed restores the
    optimizer's saved param-group rates after the schedule: iteration 11 ran at the old
    schedule's minimum);
  - the model card's snippet loads the folder without a prompt, and names no local path.
"""
import ast
import json
import os
import re
import types

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_train import _train_runs, train_flags, train_records

RUN_SEQ_LENGTH = 128  # tiny-lev.yaml's model and training sections say 64
FIRST_ITERS, LONGER_ITERS = 10, 20


@pytest.fixture(scope="module")
def runs(tiny_dataset, spm_tokenizer, tmp_path_factory) -> dict:
    work = str(tmp_path_factory.mktemp("release_resume"))
    ckpt = os.path.join(work, "lev_run")

    def flags(name, iters, *extra):
        return train_flags(tiny_dataset, spm_tokenizer, work, name, "--config", "tiny-lev", "--seq-length",
                           str(RUN_SEQ_LENGTH), "--train-iters", str(iters), "--eval-interval", "10", *extra)

    argv = {"first": flags("first", FIRST_ITERS, "--save", ckpt, "--save-interval", "10"),
            "longer": flags("longer", LONGER_ITERS, "--load", ckpt, "--override-opt_param-scheduler",
                            "--exit-interval", "12")}
    assert run_distributed(_train_runs, world_size=1, args=(list(argv.values()),), timeout=600) == [[0, 0]]
    export = os.path.join(work, "hf_export")
    from megatron_lev.hf.cli import convert_to_hf_main

    assert convert_to_hf_main(["--load", ckpt, "--output", export]) == 0
    return {"work": work, "ckpt": ckpt, "argv": argv, "export": export, "tmp_roots": [work, str(tiny_dataset),
                                                                                       str(spm_tokenizer)]}


# --------------------------------------------------------------------------- defect 1: context length


def test_export_records_the_runs_context_length(runs):
    with open(os.path.join(runs["export"], "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["max_position_embeddings"] == RUN_SEQ_LENGTH
    assert config["megatron_lev_model"]["seq_length"] == RUN_SEQ_LENGTH  # what an import restores
    card = open(os.path.join(runs["export"], "README.md"), encoding="utf-8").read()
    assert f"| context length | {RUN_SEQ_LENGTH:,} |" in card
    with open(os.path.join(runs["export"], "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["model_max_length"] == RUN_SEQ_LENGTH


def test_evaluate_window_on_the_export_is_the_runs(runs):
    """evaluate.py on an HF folder (no training config) scores windows of max_position_embeddings."""
    from transformers import AutoConfig

    from megatron_lev.evaluate import LoadedModel, build_parser, data_settings

    hf_config = AutoConfig.from_pretrained(runs["export"], trust_remote_code=True)
    model = LoadedModel("export", "hf", runs["export"], types.SimpleNamespace(config=hf_config),
                        hf_config.vocab_size)
    args = build_parser().parse_args(["--model", runs["export"], "--data-path", "unused",
                                      "--output-dir", runs["work"]])
    assert data_settings(args, [model])["seq_length"] == RUN_SEQ_LENGTH


# --------------------------------------------------------------------------- defect 2: override on resume


def test_override_schedule_applies_from_the_first_resumed_step(runs):
    """Iteration 11 (the first resumed step) runs at the 20-step schedule's rate after 10 steps,
    exactly; the 10-step schedule had reached its minimum (1e-4) there."""
    from megatron_lev.training.arguments import parse_args, validate_args
    from megatron_lev.training.optim import build_lr_scheduler

    args = parse_args(runs["argv"]["longer"])
    validate_args(args, world_size=1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    schedule = build_lr_scheduler(optimizer, args)
    expected = {}
    for iteration in range(1, 13):
        expected[iteration] = optimizer.param_groups[0]["lr"]
        schedule.step()
    first, longer = train_records(runs["work"], "first"), train_records(runs["work"], "longer")
    assert sorted(longer) == [11, 12]
    assert first[FIRST_ITERS]["lr"] > args.min_lr  # the old schedule's last step, before its minimum
    assert longer[11]["lr"] == expected[11] and longer[12]["lr"] == expected[12]
    assert expected[11] != args.min_lr


# --------------------------------------------------------------------------- defect 3: the model card


def _snippet(card: str) -> str:
    (code,) = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    return code


def test_model_card_loads_without_prompt_and_names_no_local_path(runs):
    card = open(os.path.join(runs["export"], "README.md"), encoding="utf-8").read()
    code = _snippet(card)
    calls = [node for node in ast.walk(ast.parse(code))
             if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained"]
    assert len(calls) == 2  # the tokenizer and the model
    for call in calls:
        assert {(k.arg, getattr(k.value, "value", None)) for k in call.keywords} == {("trust_remote_code", True)}
    for root in runs["tmp_roots"]:
        for part in {root, os.path.dirname(root), os.path.realpath(root)}:
            assert part not in card, part
    assert not re.search(r"(?<![\w.])/(tmp|home|work|scratch)\b", card)
    assert "training data | `python_text_document` |" in card and "from checkpoint `lev_run/iter_0000010`" in card
    # The snippet itself runs (the folder as the model name): no "[y/N]" question, no error.
    namespace = {}
    exec(code.replace('"hf_export"', repr(runs["export"])), namespace)  # noqa: S102 - our own card
    assert type(namespace["model"]).__name__ == "LevForCausalLM"
    assert namespace["tokenizer"]("def f():").input_ids
