"""The model card (megatron_lev/hf/card.py): the validation set's name, the licence, the data,
intended use, the downstream table with standard errors, which evaluation gave each number, and
the citation."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml

from megatron_lev.hf.card import CITATION, Provenance, model_card, read_downstream, run_provenance

TRAIN = [f"/scratch/pile_tok/train/pile_{i:02d}_text_document" for i in range(30)]
VALID = ["/scratch/pile_tok/val/pile_val_text_document"]


def _cfg(embedding="lev"):
    return SimpleNamespace(embedding=embedding, num_layers=2, hidden_size=64, num_attention_heads=4,
                           num_query_groups=None, vocab_size=1000, seq_length=128)


def _card(provenance, embedding="lev"):
    text = model_card("lev-tiny", _cfg(embedding), 12345, torch.float32, False, provenance)
    return text, yaml.safe_load(text.split("---")[1])


def _info(tmp_path, training):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for record in ({"iteration": 5, "valid_loss": 3.5}, {"iteration": 10, "loss": 3.0},
                       {"iteration": 10, "valid_loss": 3.25}, {"iteration": 15, "valid_loss": 2.0}):
            f.write(json.dumps(record) + "\n")
    return SimpleNamespace(config={"training": training}, iteration=10, load_dir=str(tmp_path),
                           path=str(tmp_path / "iter_0000010"))


def test_validation_set_is_valid_data_path_not_the_last_training_shard(tmp_path):
    """The launcher passes --train-data-path / --valid-data-path when VALID_DATA_PATH is set: the
    card names the validation files, not pile_29 (the old card's dataset)."""
    info = _info(tmp_path, {"train_data_path": TRAIN, "valid_data_path": VALID, "tokens_per_step": 100,
                            "eval_iters": 7})
    provenance = run_provenance(info)
    assert (provenance.valid_loss, provenance.valid_iteration, provenance.eval_iters) == (3.25, 10, 7)
    assert provenance.valid_data == VALID[0] and provenance.tokens == 1000
    card, meta = _card(provenance)
    (result,) = meta["model-index"][0]["results"]
    assert result["dataset"] == {"type": "pile_val_text_document", "name": "pile_val_text_document",
                                 "split": "validation"}
    assert result["metrics"][0] == {"type": "loss", "name": "validation loss", "value": 3.25}
    assert "| validation data | `pile_val_text_document` (--valid-data-path) |" in card
    assert ("- validation loss and perplexity: the trainer's validation at iteration 10 (7 batches of "
            "`pile_val_text_document`, --valid-data-path), from the run's metrics.jsonl") in card
    assert "/scratch" not in card


def test_validation_split_of_a_blend_names_its_files_without_weights(tmp_path):
    info = _info(tmp_path, {"data_path": ["0.3", "/d/a_text_document", "0.7", "/d/b_text_document"]})
    card, meta = _card(run_provenance(info))
    dataset = meta["model-index"][0]["results"][0]["dataset"]
    assert dataset["name"] == "a_text_document b_text_document"
    assert "| validation data | `a_text_document b_text_document` (the validation split of --data-path " \
           "(--split)) |" in card
    assert "| training data | `0.3 a_text_document 0.7 b_text_document` |" in card


def _downstream_json(tmp_path, models):
    path = tmp_path / "downstream.json"
    path.write_text(json.dumps({"baseline": "tied", "tasks": ["piqa", "lambada_openai"], "num_fewshot": 0,
                                "limit": None, "models": models}))
    return str(path)


LEV_TASKS = {"piqa": {"acc": 0.625, "acc_stderr": 0.0113, "acc_norm": 0.63, "acc_norm_stderr": 0.0112,
                      "num_examples": 1838},
             "lambada_openai": {"perplexity": 41.5, "perplexity_stderr": 1.25, "acc": 0.31,
                                "acc_stderr": 0.0064, "num_examples": 5153}}


def test_card_licence_data_use_downstream_and_citation(tmp_path):
    spec = _downstream_json(tmp_path, {"tied": {"path": "/x/tied", "tasks": {}, "lm_eval_version": "0.4.9"},
                                       "lev": {"path": "/x/lev", "tasks": LEV_TASKS, "lm_eval_version": "0.4.9"}})
    downstream = read_downstream(spec + ":lev")
    provenance = Provenance(iteration=10, data=" ".join(TRAIN), valid_data=VALID[0], valid_loss=3.25,
                            license="apache-2.0", dataset="monology/pile-uncopyrighted", downstream=downstream)
    card, meta = _card(provenance)
    assert meta["license"] == "apache-2.0" and meta["datasets"] == ["monology/pile-uncopyrighted"]
    assert meta["language"] == ["en"]
    results = meta["model-index"][0]["results"]
    assert [r["task"]["name"] for r in results] == ["Causal language modeling", "piqa", "lambada_openai"]
    assert results[0]["dataset"]["type"] == "monology/pile-uncopyrighted"
    assert results[1]["metrics"] == [{"type": "acc", "name": "acc", "value": 0.625},
                                     {"type": "acc_norm", "name": "acc_norm", "value": 0.63}]
    table = card.split("## Downstream evaluation")[1].split("##")[0]
    assert [line for line in table.splitlines() if line.startswith("| ") and "---" not in line] == [
        "| task | metric | value | standard error | examples |",
        "| piqa | acc | 0.6250 | 0.0113 | 1838 |",
        "| piqa | acc_norm | 0.6300 | 0.0112 | 1838 |",
        "| lambada_openai | perplexity | 41.5000 | 1.2500 | 5153 |",
        "| lambada_openai | acc | 0.3100 | 0.0064 | 5153 |"]
    assert ("- downstream: lm-evaluation-harness 0.4.9 on this export (model `lev` of `downstream.json`, "
            "python -m megatron_lev.evaluation.downstream), 0 few-shot examples") in card
    assert "| license | apache-2.0 |" in card
    data = card.split("## Training data")[1].split("##")[0]
    assert "uncopyrighted" in data and "monology/pile-uncopyrighted" in data and "own terms" in data
    assert "## Intended use and limitations" in card and "not instruction-tuned" in card
    citation = re.search(r"```bibtex\n(.*?)```", card, flags=re.S).group(1)
    assert citation.strip() == CITATION and "eprint        = {2601.22040}" in citation
    assert "Batley and Saha" in citation


def test_card_without_results_or_licence():
    card, meta = _card(Provenance())
    assert meta["license"] == "other" and "model-index" not in meta and "datasets" not in meta
    assert "| license | not declared (export with --license) |" in card
    assert "## Downstream evaluation" not in card and "## How each number was measured" not in card
    assert "| validation data | not measured |" in card


def test_read_downstream_refuses_in_one_line(tmp_path):
    spec = _downstream_json(tmp_path, {"tied": {"tasks": {}}, "lev": {"tasks": LEV_TASKS}})
    with pytest.raises(ValueError, match=r"^--downstream .*downstream.json: holds models tied, lev: name one as "):
        read_downstream(spec)
    with pytest.raises(ValueError, match=r"^--downstream .*downstream.json: no model 'x' \(it holds tied, lev\)$"):
        read_downstream(spec + ":x")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^--downstream .*bad.json: not a downstream.json"):
        read_downstream(str(tmp_path / "bad.json"))
    one = _downstream_json(tmp_path, {"lev": {"tasks": LEV_TASKS, "lm_eval_version": "0.4.9"}})
    assert read_downstream(one)["model"] == "lev" and read_downstream(one)["tasks"] == LEV_TASKS


def test_convert_to_hf_refuses_a_bad_downstream_file_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "..", "tools", "convert_to_hf.py"),
                           "--load", str(tmp_path), "--output", str(tmp_path / "out"),
                           "--downstream", str(tmp_path / "missing.json")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__)))})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"convert_to_hf: error: --downstream {tmp_path}/missing.json: not a downstream.json of "
        f"megatron_lev.evaluation.downstream (FileNotFoundError: [Errno 2] No such file or directory: "
        f"'{tmp_path}/missing.json')"]
