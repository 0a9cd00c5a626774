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
    valid = None
    metrics = training.get("metrics_file") or os.path.join(info.load_dir, "metrics.jsonl")
    if metrics and os.path.isfile(metrics):
        with open(metrics, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "valid_loss" in record and record.get("iteration", 0) <= info.iteration:
                    valid = float(record["valid_loss"])
    return Provenance(iteration=info.iteration, tokens=tokens, data=" ".join(map(str, data)) if data else None,
                      valid_loss=valid, source=info.path)


def model_card(name: str, cfg: LeviathanConfig, parameters: int, dtype: torch.dtype, materialize: bool,
               provenance: Provenance) -> str:
    """README.md: Hub metadata (model-index with the validation loss when known), then what
    the model is and how to load it, with and without remote code."""
    remote = cfg.embedding == "lev" and not materialize
    kind = ("Leviathan (LEV embedding generator, remote code LevForCausalLM)" if remote else
            "LLaMA-architecture decoder (LlamaForCausalLM)" +
            ({"lev": ", LEV embeddings materialized into a table",
              "factorized": ", factorised embeddings (table x projection) materialized into a table"}.get(
                cfg.embedding, f", {cfg.embedding} embeddings")))
    meta = {"library_name": "transformers", "pipeline_tag": "text-generation",
            "tags": ["megatron_lev", "leviathan" if cfg.embedding == "lev" else "llama", "llama"]}
    if provenance.valid_loss is not None:
        dataset = os.path.basename(provenance.data.split()[-1]) if provenance.data else "validation split"
        meta["model-index"] = [{"name": name, "results": [{
            "task": {"type": "text-generation", "name": "Causal language modeling"},
            "dataset": {"type": dataset, "name": dataset, "split": "validation"},
            "metrics": [{"type": "loss", "name": "validation loss", "value": round(provenance.valid_loss, 4)},
                        {"type": "perplexity", "name": "validation perplexity",
                         "value": round(math.exp(min(provenance.valid_loss, 50.0)), 2)}]}]}]
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
            *((("trained with", provenance.trained_with),) if provenance.trained_with else ()),
            ("training iterations", f"{provenance.iteration:,}" if provenance.iteration is not None else "unknown"),
            ("training tokens", f"{provenance.tokens:,}" if provenance.tokens is not None else "unknown"),
            ("training data", f"`{_public_names(provenance.data)}`" if provenance.data else "unknown"),
            ("validation loss", f"{provenance.valid_loss:.4f} (perplexity {math.exp(min(provenance.valid_loss, 50)):.2f})"
             if provenance.valid_loss is not None else "not measured")]
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "", f"# {name}", "",
             f"Exported by megatron_lev's `{provenance.tool}`"
             + (f" from checkpoint `{_run_and_tag(provenance.source)}`." if provenance.source else "."), "",
             "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows), "",
             "## Load", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
             *load, "```", ""]
    if remote:
        lines += ["The LEV generator is Python code shipped in this folder (`modeling_lev.py`, `lev.py`), hence "
                  "`trust_remote_code=True`. Without remote code, export with `--materialize-embeddings`: the "
                  "generated table makes a standard `LlamaForCausalLM` with the same outputs.", ""]
    lines += ["The tokenizer adds no BOS/EOS when encoding (pre-training saw none); documents end with "
              "the EOS token.", ""]
    return "\n".join(lines)
