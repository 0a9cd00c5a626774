"""The model card (README.md) of a Hugging Face export and where its weights come from."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import yaml

from megatron_lev.models.config import LeviathanConfig


@dataclass
class Provenance:
    """What the model card says about where the weights come from (all optional)."""

    iteration: Optional[int] = None
    tokens: Optional[int] = None  # training tokens seen
    data: Optional[str] = None  # --data-path (or --train-data-path)
    valid_loss: Optional[float] = None  # the run's last validation loss at or before the checkpoint
    source: Optional[str] = None  # the checkpoint folder
    tool: str = "tools/convert_to_hf.py"  # the command that exported it
    trained_with: Optional[str] = None  # the trainer and its layout, e.g. "Megatron-LM, TP 2 x PP 1"
    valid_data: Optional[str] = None  # --valid-data-path, when the validation set is its own files
    valid_iteration: Optional[int] = None  # the iteration whose validation gave valid_loss
    eval_iters: Optional[int] = None  # validation batches behind valid_loss (--eval-iters)
    license: Optional[str] = None  # the weights' licence, a Hub identifier (--license)
    dataset: Optional[str] = None  # the training data's Hub id (--dataset), e.g. monology/pile-uncopyrighted
    downstream: Optional[dict] = None  # one model's lm-eval results (read_downstream)


def _public_names(paths: str) -> str:
    """A released card names files, not where they sat: the base name of every path in a
    space-separated list (blend weights pass through), so no local directory leaks."""
    return " ".join(os.path.basename(p.rstrip("/")) or p for p in paths.split())


def _run_and_tag(checkpoint: str) -> str:
    """`run/iter_0000010` of a checkpoint folder: which run and iteration, not where it sat."""
    path = os.path.normpath(checkpoint)
    return os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))


def run_provenance(info) -> Provenance:
    """A checkpoint's provenance: iteration, tokens (iterations x global batch x sequence),
    data paths and its run's last logged validation loss (metrics.jsonl)."""
    training = info.config.get("training") or {}
    tokens = info.iteration * training["tokens_per_step"] if training.get("tokens_per_step") else None
    data = training.get("data_path") or training.get("train_data_path")
    valid_data = training.get("valid_data_path")
    valid = valid_iteration = None
    metrics = training.get("metrics_file") or os.path.join(info.load_dir, "metrics.jsonl")
    if metrics and os.path.isfile(metrics):
        with open(metrics, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "valid_loss" in record and record.get("iteration", 0) <= info.iteration:
                    valid, valid_iteration = float(record["valid_loss"]), record.get("iteration")
    return Provenance(iteration=info.iteration, tokens=tokens, data=" ".join(map(str, data)) if data else None,
                      valid_loss=valid, source=info.path, valid_data=" ".join(map(str, valid_data)) if valid_data else None,
                      valid_iteration=valid_iteration, eval_iters=training.get("eval_iters"))


# The papers' data (LEV_SPEC.md section 6) and how to cite them and it.
PAPERS_DATA = ("The LEV papers trained on the Pile in its uncopyrighted form (`monology/pile-uncopyrighted` on the "
               "Hub: the Pile without Books3, BookCorpus2, OpenSubtitles, YTSubtitles and OWT2).")
DATA_LICENCE = ("The Pile is a compilation of 22 sources; each document keeps its source's own terms (the Pile's "
                "datasheet, Biderman et al. 2022, lists them). Check them before commercial use.")
CITATION = """@misc{batley2026leviathan,
  title         = {Leviathan: Decoupling Input and Output Representations in Language Models},
  author        = {Batley and Saha},
  year          = {2026},
  eprint        = {2601.22040},
  archivePrefix = {arXiv},
  note          = {v1: A Separable Architecture for Continuous Token Representation in Language Models}
}

@article{gao2020pile,
  title   = {The {P}ile: An 800{GB} Dataset of Diverse Text for Language Modeling},
  author  = {Gao, Leo and Biderman, Stella and Black, Sid and others},
  journal = {arXiv preprint arXiv:2101.00027},
  year    = {2020}
}"""
INTENDED_USE = ("Research on input representations of language models: a base model pre-trained for next-token "
                "prediction, to compare with the tied and untied baselines of the same recipe, to study, or to "
                "fine-tune. It is not instruction-tuned or aligned and was not evaluated for safety: it continues "
                "text, can state falsehoods and reproduce the biases and offensive content of its web-scale "
                "training data, and is unfit for decisions about people or for deployment without further work. "
                "English text only; the context length below is the most it has seen.")


def read_downstream(spec: str) -> dict:
    """`--downstream FILE[:MODEL]`: one model's results from megatron_lev.evaluation.downstream's
    downstream.json (MODEL may be left out when the file holds one model)."""
    path, _, model = spec.rpartition(":") if ":" in spec and not os.path.isfile(spec) else (spec, "", "")
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        models = report["models"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--downstream {path}: not a downstream.json of megatron_lev.evaluation.downstream "
                         f"({type(exc).__name__}: {exc})") from None
    if not model:
        if len(models) != 1:
            raise ValueError(f"--downstream {path}: holds models {', '.join(models)}: name one as {path}:MODEL")
        model = next(iter(models))
    if model not in models:
        raise ValueError(f"--downstream {path}: no model {model!r} (it holds {', '.join(models)})")
    return {"file": os.path.basename(path), "model": model, "tasks": models[model].get("tasks") or {},
            "lm_eval_version": models[model].get("lm_eval_version"), "num_fewshot": report.get("num_fewshot"),
            "limit": report.get("limit")}


def _dataset_names(paths: str) -> str:
    """The files of a path list or blend, without the blend's weights."""
    def weight(word: str) -> bool:
        try:
            float(word)
        except ValueError:
            return False
        return True

    return " ".join(w for w in _public_names(paths).split() if not weight(w))


def validation_dataset(provenance: Provenance) -> tuple[str, str]:
    """(name, where it comes from) of the set behind valid_loss: --valid-data-path's files when the
    run had them, else the validation split --split held out of --data-path."""
    if provenance.valid_data:
        return _dataset_names(provenance.valid_data), "--valid-data-path"
    if provenance.data:
        return _dataset_names(provenance.data), "the validation split of --data-path (--split)"
    return "validation split", "unknown"


def _downstream_metrics(tasks: dict) -> list[tuple[str, str, float, Optional[float], Optional[int]]]:
    rows = []
    for task, metrics in tasks.items():
        for metric, value in metrics.items():
            if metric.endswith("_stderr") or metric == "num_examples":
                continue
            stderr = metrics.get(f"{metric}_stderr")
            rows.append((task, metric, value, stderr if isinstance(stderr, (int, float)) and math.isfinite(stderr)
                         else None, metrics.get("num_examples")))
    return rows


def _evaluations(provenance: Provenance, valid_name: str, valid_source: str) -> list[str]:
    """Which evaluation produced each number of the card."""
    out = []
    if provenance.valid_loss is not None:
        at = f" at iteration {provenance.valid_iteration:,}" if provenance.valid_iteration is not None else ""
        batches = f"{provenance.eval_iters} batches" if provenance.eval_iters else "its batches"
        out.append(f"- validation loss and perplexity: the trainer's validation{at} ({batches} of `{valid_name}`, "
                   f"{valid_source}), from the run's metrics.jsonl; perplexity = exp(loss)")
    if provenance.downstream:
        d = provenance.downstream
        shots = "each task's default number of" if d["num_fewshot"] is None else f"{d['num_fewshot']}"
        limit = f", at most {d['limit']} examples per task" if d.get("limit") else ""
        out.append(f"- downstream: lm-evaluation-harness {d['lm_eval_version'] or '(version unknown)'} on this export "
                   f"(model `{d['model']}` of `{d['file']}`, python -m megatron_lev.evaluation.downstream), "
                   f"{shots} few-shot examples{limit}; standard errors are lm-eval's (bootstrap for perplexity)")
    return out


def model_card(name: str, cfg: LeviathanConfig, parameters: int, dtype: torch.dtype, materialize: bool,
               provenance: Provenance) -> str:
    """README.md: Hub metadata (licence, datasets, model-index with the validation loss and the
    downstream scores when known), then what the model is, its data, intended use, evaluations,
    how to load it with and without remote code, and how to cite it."""
    remote = cfg.embedding == "lev" and not materialize
    kind = ("Leviathan (LEV embedding generator, remote code LevForCausalLM)" if remote else
            "LLaMA-architecture decoder (LlamaForCausalLM)" +
            ({"lev": ", LEV embeddings materialized into a table",
              "factorized": ", factorised embeddings (table x projection) materialized into a table"}.get(
                cfg.embedding, f", {cfg.embedding} embeddings")))
    meta = {"license": provenance.license or "other", "library_name": "transformers",
            "pipeline_tag": "text-generation", "language": ["en"],
            "tags": ["megatron_lev", "leviathan" if cfg.embedding == "lev" else "llama", "llama"]}
    if provenance.dataset:
        meta["datasets"] = [provenance.dataset]
    valid_name, valid_source = validation_dataset(provenance)
    results = []
    if provenance.valid_loss is not None:
        results.append({
            "task": {"type": "text-generation", "name": "Causal language modeling"},
            "dataset": {"type": provenance.dataset or valid_name, "name": valid_name, "split": "validation"},
            "metrics": [{"type": "loss", "name": "validation loss", "value": round(provenance.valid_loss, 4)},
                        {"type": "perplexity", "name": "validation perplexity",
                         "value": round(math.exp(min(provenance.valid_loss, 50.0)), 2)}]})
    downstream = _downstream_metrics(provenance.downstream["tasks"]) if provenance.downstream else []
    for task in dict.fromkeys(row[0] for row in downstream):
        results.append({"task": {"type": "text-generation", "name": task},
                        "dataset": {"type": task, "name": task},
                        "metrics": [{"type": metric, "name": metric, "value": round(value, 4)}
                                    for t, metric, value, _, _ in downstream if t == task]})
    if results:
        meta["model-index"] = [{"name": name, "results": results}]
    # With remote code, AutoTokenizer reads config.json's auto_map too: without the flag it asks "[y/N]".
    trust = ", trust_remote_code=True" if remote else ""
    load = [f'tokenizer = AutoTokenizer.from_pretrained("{name}"{trust})',
            f'model = AutoModelForCausalLM.from_pretrained("{name}"{trust})']
    rows = [("architecture", kind),
            ("parameters", f"{parameters:,}"),
            ("layers x hidden size", f"{cfg.num_layers} x {cfg.hidden_size} ({cfg.num_attention_heads} heads, "
                                     f"{cfg.num_query_groups or cfg.num_attention_heads} kv heads)"),
            ("vocabulary", f"{cfg.vocab_size:,}"), ("context length", f"{cfg.seq_length:,}"),
            ("weights dtype", str(dtype).replace("torch.", "")),
            ("license", provenance.license or "not declared (export with --license)"),
            *((("trained with", provenance.trained_with),) if provenance.trained_with else ()),
            ("training iterations", f"{provenance.iteration:,}" if provenance.iteration is not None else "unknown"),
            ("training tokens", f"{provenance.tokens:,}" if provenance.tokens is not None else "unknown"),
            ("training data", f"`{_public_names(provenance.data)}`" if provenance.data else "unknown"),
            ("validation data", f"`{valid_name}` ({valid_source})" if provenance.valid_loss is not None
             or provenance.valid_data else "not measured"),
            ("validation loss", f"{provenance.valid_loss:.4f} (perplexity {math.exp(min(provenance.valid_loss, 50)):.2f})"
             if provenance.valid_loss is not None else "not measured")]
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "", f"# {name}", "",
             f"Exported by megatron_lev's `{provenance.tool}`"
             + (f" from checkpoint `{_run_and_tag(provenance.source)}`." if provenance.source else "."), "",
             "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows), "",
             "## Training data", "",
             (f"This model: `{_public_names(provenance.data)}`" if provenance.data else "This model: not recorded")
             + (f" (Hub dataset `{provenance.dataset}`)." if provenance.dataset else "."),
             f"{PAPERS_DATA} {DATA_LICENCE}", "",
             "## Intended use and limitations", "", INTENDED_USE, ""]
    if downstream:
        lines += ["## Downstream evaluation", "", "| task | metric | value | standard error | examples |",
                  "| --- | --- | --- | --- | --- |",
                  *(f"| {task} | {metric} | {value:.4f} | {'' if stderr is None else f'{stderr:.4f}'} | "
                    f"{'' if count is None else count} |" for task, metric, value, stderr, count in downstream), ""]
    evaluations = _evaluations(provenance, valid_name, valid_source)
    if evaluations:
        lines += ["## How each number was measured", "", *evaluations, ""]
    lines += ["## Load", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              *load, "```", ""]
    if remote:
        lines += ["The LEV generator is Python code shipped in this folder (`modeling_lev.py`, `lev.py`, "
                  "`lev_config.py`), hence "
                  "`trust_remote_code=True`. Without remote code, export with `--materialize-embeddings`: the "
                  "generated table makes a standard `LlamaForCausalLM` with the same outputs.", ""]
    lines += ["The tokenizer adds no BOS/EOS when encoding (pre-training saw none); documents end with "
              "the EOS token.", "",
              "## Citation", "", "```bibtex", CITATION, "```", ""]
    return "\n".join(lines)
