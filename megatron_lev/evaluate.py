"""Validation loss / perplexity of checkpoints and HF exports, overall and by token frequency.

    python -m megatron_lev.evaluate \
        --model tied=runs/tied-1.2b --model lev=runs/lev-1.2b/iter_0100000 --model hf=exports/lev \
        --eval-tokens 10000000 --freq-dataset /data/pile_train_text_document \
        --buckets quantile:5 --buckets log --baseline tied --output-dir eval/ppl

Models (`--model NAME=PATH`, repeat to compare; all are scored on the same tokens):
  * a `megatron_lev.train --save` directory (its newest complete checkpoint) or one
    `iter_NNNNNNN` directory in it. Any TP / PP / ZeRO layout: the shards are merged into
    one full state dict (megatron_lev.checkpointing.convert) and run as a TP=1 LeviathanModel.
  * a Hugging Face export (`tools/convert_to_hf.py`; any causal LM whose tokenizer is the
    data's). A folder's own Python code runs only when it is byte-identical to the LEV code
    this package ships, or with `--trust-remote-code` (docs/security.md).

Data. Without `--data-path`, the first checkpoint's own data, split, seed and tokenizer
are used, so `--eval-split valid` (default) scores the very documents of its `valid_loss`.
With `--data-path` the split defaults to 0,1,0 (the whole dataset is the validation
split). Samples are megatron-core GPTDataset samples of `--seq-length` + 1 tokens, taken
in dataset order from sample 0 (training's evaluation does the same); `--eval-tokens N`
scores exactly the first N predicted tokens with loss_mask 1 (default: the whole split).

Per-token NLL comes from the model's own forward: vocab-parallel logits gathered to the
full vocabulary (padding excluded), float32 log-softmax, minus the label's log-prob. Loss
is the token-weighted mean NLL, perplexity exp(loss).

Frequency-stratified perplexity (`--freq-dataset TRAIN_PREFIX ...`): token types are
counted over the training data (megatron_lev.evaluation.frequency, cached; only the
train share of a prefix the evaluation's --split divides, see --freq-split) and bucketed
(`--buckets`: by training-token mass, by number of types, or by order of magnitude; see
megatron_lev.evaluation.buckets). Two stratifications, each with a comparison table vs
`--baseline` and one bar chart per bucketing: by the *predicted* token (a position's NLL
goes to the bucket of its label; JSON `frequency.bucketings`, freq_<bucketing>.png) and by
the *input* token at that position (the bucket of the token LEV embeds there; JSON
`frequency.input_bucketings`, freq_input_<bucketing>.png).

Output (`--output-dir`): evaluation.json, evaluation.md, freq_<bucketing>.png,
freq_input_<bucketing>.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from megatron_lev.evaluation import buckets as bk
from megatron_lev.evaluation.frequency import count_blend_frequencies, frequency_cache_path, train_sequence_range
from megatron_lev.evaluation.report import ComparisonTable, parse_named
from megatron_lev.utils.files import write_json_atomic, write_text_atomic

_TAG_DIR = re.compile(r"^iter_(\d+)$")
_RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


# --------------------------------------------------------------------------- models


@dataclass
class LoadedModel:
    """A model ready to score tokens, with what the report says about it."""

    name: str
    kind: str  # checkpoint | hf
    path: str
    module: torch.nn.Module
    vocab_size: int
    info: dict = field(default_factory=dict)
    training_config: Optional[dict] = None  # checkpoints: the run's effective configuration

    @torch.no_grad()
    def token_nll(self, tokens: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """NLL [b, s] (float32) of predicting `labels` from `tokens`."""
        if self.kind == "checkpoint":
            from megatron_lev.models.decoder import gather_logits

            logits = gather_logits(self.module(tokens, position_ids=position_ids), self.vocab_size)
        else:
            logits = self.module(input_ids=tokens, position_ids=position_ids).logits[..., :self.vocab_size]
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def model_source(path: str, flag: str = "--model") -> tuple[str, str, Optional[int]]:
    """(kind, load_dir, iteration) of a --model path; a clear error when it is neither."""
    path = os.path.abspath(path.rstrip("/"))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{flag} {path}: no such directory")
    from megatron_lev.checkpointing.catalog import CONFIG_FILE, LATEST, complete_checkpoints

    match = _TAG_DIR.match(os.path.basename(path))
    if match and os.path.isfile(os.path.join(path, CONFIG_FILE)):
        return "checkpoint", os.path.dirname(path), int(match.group(1))
    if os.path.isfile(os.path.join(path, LATEST)) or complete_checkpoints(path):
        return "checkpoint", path, None
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path, None
    raise ValueError(f"{flag} {path}: neither a megatron_lev.train --save directory (no 'latest' or complete "
                     "iter_* checkpoint), an iter_* checkpoint, nor a Hugging Face folder (no config.json)")


def nonembedding_counts(counts: dict) -> dict:
    """total, input side, output head and the rest (non-embedding) of count_parameters' counts."""
    return {"total": counts["total"], "embedding": counts["embedding"], "output_layer": counts["output_layer"],
            "nonembedding": counts["total"] - counts["embedding"] - counts["output_layer"]}


def load_model(name: str, path: str, device: torch.device, bf16: bool = False,
               trust_remote_code: bool = False) -> LoadedModel:
    kind, load_dir, iteration = model_source(path, f"--model {name}=")
    if kind == "checkpoint":
        from megatron_lev.checkpointing.convert import load_checkpoint_full
        from megatron_lev.checkpointing.layout import load_full_state_dict
        from megatron_lev.models.decoder import LeviathanModel
        from megatron_lev.models.param_count import count_parameters

        full, ckpt = load_checkpoint_full(load_dir, iteration)
        config = ckpt.model_config(bf16=bf16)
        module = LeviathanModel(config)
        load_full_state_dict(module, full, config, tp_rank=0)
        del full
        info = {"iteration": ckpt.iteration, "checkpoint": ckpt.path, "embedding": config.embedding,
                "trained_with": {"tensor_model_parallel_size": ckpt.tensor_model_parallel_size,
                                 "pipeline_model_parallel_size": ckpt.pipeline_model_parallel_size,
                                 "zero_stage": ckpt.zero_stage},
                "parameters": count_parameters(config)["total"],
                # What effective-parameter fits read (megatron_lev.evaluation.scaling): the run's seed and
                # the non-embedding count (without the input side and the output head).
                "seed": (ckpt.config or {}).get("training", {}).get("seed"),
                "parameter_counts": nonembedding_counts(count_parameters(config))}
        return LoadedModel(name, kind, path, module.to(device).eval(), config.vocab_size, info, ckpt.config)
    from transformers import AutoModelForCausalLM

    from megatron_lev.hf.trust import hf_trust_remote_code

    trust = hf_trust_remote_code(load_dir, trust_remote_code)  # refuses code that is not ours
    module = AutoModelForCausalLM.from_pretrained(load_dir, trust_remote_code=trust,
                                                  dtype=torch.bfloat16 if bf16 else torch.float32)
    config = module.config
    info = {"architecture": type(module).__name__, "parameters": sum(p.numel() for p in module.parameters())}
    section = getattr(config, "megatron_lev_model", None)
    if isinstance(section, dict):
        info["embedding"] = section.get("embedding")
    return LoadedModel(name, kind, path, module.to(device).eval(), int(config.vocab_size), info)


# --------------------------------------------------------------------------- data


def data_settings(args, models: list[LoadedModel]) -> dict:
    """Data, split, seed, tokenizer and sequence length: flags first, then the first checkpoint's
    training configuration, then (tokenizer, sequence length) the first HF export."""
    trained = next((m.training_config.get("training", {}) for m in models if m.training_config), {})
    if args.data_path:
        data = {"data_path": args.data_path, "split": args.split or "0,1,0"}
    elif trained.get("data_path") or trained.get("train_data_path"):
        data = {k: trained.get(k) for k in ("data_path", "train_data_path", "valid_data_path", "test_data_path")}
        data["split"] = args.split or trained.get("split")
    else:
        raise ValueError("--data-path is required (no checkpoint among the --model's to take it from)")
    given = args.tokenizer_model or args.vocab_file
    tokenizer_type = args.tokenizer_type or (None if given else trained.get("tokenizer_type"))
    tokenizer_model = args.tokenizer_model or (None if given else trained.get("tokenizer_model"))
    gpt2_files = {k: getattr(args, k) or (None if given else trained.get(k)) for k in ("vocab_file", "merge_file")}
    hf = next((m for m in models if m.kind == "hf"), None)
    # Megatron's GPT-2 BPE reads --vocab-file and --merge-file; the other types a --tokenizer-model.
    if tokenizer_model is None and tokenizer_type != "GPT2BPETokenizer":
        if hf is not None:
            from megatron_lev.hf.export import check_hf_tokenizer

            tokenizer_model = check_hf_tokenizer(hf.path, hf.vocab_size)
        if tokenizer_model is None:
            raise ValueError("--tokenizer-model is required (no checkpoint or HF folder names one)")
    if tokenizer_type is None:
        from megatron_lev.hf.export import infer_tokenizer_type

        tokenizer_type = infer_tokenizer_type(tokenizer_model)
    seq_length = args.seq_length or trained.get("seq_length")
    if seq_length is None and hf is not None:
        seq_length = getattr(hf.module.config, "max_position_embeddings", None)
    if not seq_length:
        raise ValueError("--seq-length is required")
    return {**data, "tokenizer_type": tokenizer_type, "tokenizer_model": tokenizer_model, **gpt2_files,
            "seq_length": int(seq_length), "seed": args.seed if args.seed is not None else trained.get("seed", 1234),
            "data_cache_path": args.data_cache_path or trained.get("data_cache_path"),
            "eval_split": args.eval_split}


def build_eval_dataset(settings: dict, eval_tokens: Optional[int]):
    """The GPTDataset of the evaluated split, and how many of its samples to score."""
    from megatron_lev.data.datasets import build_train_valid_test_datasets, parse_blend
    from megatron_lev.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(settings["tokenizer_type"], settings["tokenizer_model"], settings.get("vocab_file"),
                                settings.get("merge_file"))
    seq = settings["seq_length"]
    needed = None if eval_tokens is None else -(-eval_tokens // seq)
    split_index = ("train", "valid", "test").index(settings["eval_split"])
    paths = {k: settings.get(k) for k in ("data_path", "train_data_path", "valid_data_path", "test_data_path")}
    # A weighted blend is sampled by count, so it needs sizes; one epoch otherwise.
    blends = [parse_blend(p) for p in paths.values() if p]
    weighted = any(b is not None and b[1] is not None for b in blends)
    if weighted and needed is None:
        raise ValueError("--eval-tokens is required for a weighted --data-path blend")
    sizes = [(needed if i == split_index else 1) if weighted else None for i in range(3)]
    datasets = build_train_valid_test_datasets(
        **paths, split=settings["split"], seq_length=seq, seed=settings["seed"], train_samples=sizes[0],
        valid_samples=sizes[1], test_samples=sizes[2], tokenizer=tokenizer, cache_dir=settings["data_cache_path"])
    dataset = datasets[split_index]
    if dataset is None or len(dataset) == 0:
        raise ValueError(f"--eval-split {settings['eval_split']}: the split {settings['split']!r} gives it no data")
    if needed is not None and needed > len(dataset):
        raise ValueError(f"--eval-tokens {eval_tokens}: the {settings['eval_split']} split has only "
                         f"{len(dataset) * seq} tokens ({len(dataset)} samples of {seq})")
    return dataset, needed or len(dataset)


def eval_batches(dataset, num_samples: int, micro_batch_size: int, eval_tokens: Optional[int], device):
    """Micro-batches of the first `num_samples` samples; loss_mask is cut after `eval_tokens`
    counted tokens so exactly that many are scored."""
    from megatron_lev.data.datasets import build_pretraining_data_loader

    loader = build_pretraining_data_loader(dataset, 0, micro_batch_size, 0, 1, drop_last=False)
    seen_samples, budget = 0, eval_tokens
    for batch in loader:
        if seen_samples >= num_samples:
            return
        keep = min(num_samples - seen_samples, batch["tokens"].shape[0])
        batch = {k: v[:keep] for k, v in batch.items()}
        seen_samples += keep
        if budget is not None:
            mask = batch["loss_mask"].flatten()
            counted = torch.cumsum(mask > 0, 0)
            batch["loss_mask"] = (mask * (counted <= budget)).view_as(batch["loss_mask"])
            budget -= int((batch["loss_mask"] > 0).sum())
        yield {k: v.to(device) for k, v in batch.items()}


# --------------------------------------------------------------------------- scoring


@dataclass
class ModelScore:
    nll_sum: float = 0.0
    tokens: int = 0
    by_bucket: dict[tuple[str, str], bk.BucketNLL] = field(default_factory=dict)  # (stratum, spec)

    @property
    def loss(self) -> float:
        return self.nll_sum / max(self.tokens, 1)


def score_models(models: list[LoadedModel], batches, bucketings: dict[str, bk.Bucketing],
                 token_nll: Optional[dict] = None) -> dict[str, ModelScore]:
    """Every model on every batch (the same tokens for all); NLL sums in float64, per bucket
    of the predicted token and of the input token (bk.STRATA). With `token_nll` (a dict), every
    scored position is also appended to it: "input_ids", "label_ids" and each model's NLL."""
    scores = {m.name: ModelScore(by_bucket={(stratum, k): bk.BucketNLL.zeros(b.num_buckets)
                                            for stratum in bk.STRATA for k, b in bucketings.items()})
              for m in models}
    for batch in batches:
        mask = batch["loss_mask"] > 0
        ids = {"predicted": batch["labels"][mask].cpu().numpy(), "input": batch["tokens"][mask].cpu().numpy()}
        if token_nll is not None:
            token_nll.setdefault("input_ids", []).append(ids["input"])
            token_nll.setdefault("label_ids", []).append(ids["predicted"])
        for model in models:
            nll = model.token_nll(batch["tokens"], batch["position_ids"], batch["labels"])[mask]
            score = scores[model.name]
            score.nll_sum += float(nll.double().sum())
            score.tokens += int(nll.numel())
            values = nll.cpu().numpy()
            if token_nll is not None:
                token_nll.setdefault(f"nll/{model.name}", []).append(values)
            for stratum in bk.STRATA:
                for key, bucketing in bucketings.items():
                    score.by_bucket[stratum, key].add(bucketing, ids[stratum], values)
    return scores


# --------------------------------------------------------------------------- report


def write_token_nll(path: str, token_nll: dict, counts: Optional[np.ndarray]) -> dict:
    """token_nll.npz (compressed): input_ids and label_ids (uint16 or uint32), nll/<model> in float16
    (a per-token rounding of at most 2^-8 relative, unbiased: a bin of n tokens moves by about
    loss * 2^-8 / sqrt(n)), and train_counts when frequencies were counted. Returns its summary."""
    from megatron_lev.utils.files import atomic_path

    arrays = {k: np.concatenate(v) for k, v in token_nll.items()}
    top = max(int(arrays["input_ids"].max(initial=0)), int(arrays["label_ids"].max(initial=0)))
    id_type = np.uint16 if top < 2 ** 16 else np.uint32
    out = {k: (v.astype(id_type) if k.endswith("_ids") else v.astype(np.float16)) for k, v in arrays.items()}
    if counts is not None:
        out["train_counts"] = np.asarray(counts, dtype=np.int64)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **out)
    return {"path": os.path.abspath(path), "positions": int(arrays["input_ids"].size),
            "models": [k.split("/", 1)[1] for k in arrays if k.startswith("nll/")]}



def frequency_split(prefixes: list[str], freq_split: str, settings: dict) -> Optional[str]:
    """The split whose train share is counted: --freq-split, or with 'auto' the evaluation's
    split when every --freq-dataset prefix is one of the evaluated --data-path prefixes (so
    validation documents never count as training data)."""
    if freq_split == "none":
        return None
    if freq_split != "auto":
        return freq_split
    from megatron_lev.data.datasets import parse_blend

    blend = parse_blend(settings.get("data_path")) if settings.get("data_path") else None
    evaluated = {os.path.abspath(p) for p in blend[0]} if blend else set()
    if settings.get("split") and all(os.path.abspath(p) in evaluated for p in prefixes):
        return settings["split"]
    return None


def frequency_section(args, settings: dict, vocab_size: int) -> tuple[np.ndarray, dict[str, bk.Bucketing], dict]:
    """Counts over the --freq-dataset prefixes (a blend's weights are ignored: raw counts)."""
    from megatron_lev.data.datasets import parse_blend

    prefixes = parse_blend(args.freq_dataset, "--freq-dataset")[0]
    split = frequency_split(prefixes, args.freq_split, settings)
    counts = count_blend_frequencies(prefixes, vocab_size, split=split, cache_dir=args.freq_cache_dir)
    bucketings = {spec: bk.build_bucketing(spec, counts) for spec in args.buckets}
    ranges = [train_sequence_range(p, split) if split else None for p in prefixes]
    meta = {"datasets": prefixes, "train_split_of": split,
            "sequences": [list(r) if r else "all" for r in ranges], "vocab_size": vocab_size,
            "train_tokens": int(counts.sum()), "unseen_types": int((counts == 0).sum()),
            "counts_cache": [frequency_cache_path(p, vocab_size, args.freq_cache_dir, r)
                             for p, r in zip(prefixes, ranges)]}
    return counts, bucketings, meta


def build_report(models: list[LoadedModel], scores: dict[str, ModelScore], settings: dict, baseline: str,
                 counts, bucketings: dict[str, bk.Bucketing], freq_meta: Optional[dict], output_dir: str,
                 plot_size: tuple[int, int]) -> tuple[dict, str]:
    from megatron_lev.evaluation.plots import plot_bucket_comparison

    names = [m.name for m in models]
    report = {"data": settings, "eval_tokens": scores[names[0]].tokens, "baseline": baseline, "models": {}}
    for m in models:
        s = scores[m.name]
        report["models"][m.name] = {"kind": m.kind, "path": os.path.abspath(m.path), **m.info,
                                    "tokens": s.tokens, "loss": s.loss, "ppl": math.exp(s.loss)}
    overall = ComparisonTable("Validation perplexity", ["loss", "perplexity"],
                              {n: [scores[n].loss, math.exp(scores[n].loss)] for n in names}, baseline,
                              metric_name=f"{scores[names[0]].tokens:,} tokens, {settings['eval_split']} split")
    report["table"] = overall.to_json()
    markdown = [overall.to_markdown()]
    if bucketings:
        report["frequency"] = {**freq_meta, "bucketings": {}, "input_bucketings": {}}
    for stratum, spec in ((stratum, spec) for stratum in bk.STRATA for spec in bucketings):
        bucketing = bucketings[spec]  # one table, plot and JSON section per (stratum, bucketing)
        per_model = {n: bk.stratified_report(bucketing, counts, scores[n].by_bucket[stratum, spec])
                     for n in names}
        rows = per_model[names[0]]["buckets"]
        table = ComparisonTable(
            f"Perplexity by training-frequency bucket of the {stratum} token ({bucketing.description})",
            [r["label"] for r in rows], {n: [r["ppl"] for r in per_model[n]["buckets"]] for n in names},
            baseline, info_columns={"types": [r["num_types"] for r in rows],
                                    "train share": [round(r["train_token_share"], 4) for r in rows],
                                    "eval tokens": [r["eval_tokens"] for r in rows]}, metric_name="perplexity")
        slug = ("" if stratum == "predicted" else f"{stratum}_") + re.sub(r"[^A-Za-z0-9]+", "_", spec).strip("_")
        plot = plot_bucket_comparison(table.row_labels, table.values, os.path.join(output_dir, f"freq_{slug}.png"),
                                      baseline=baseline if len(names) > 1 else None,
                                      title=f"Perplexity by frequency of the {stratum} token "
                                            f"({bucketing.kind} buckets)",
                                      xlabel=f"frequency bucket of the {stratum} token (rarest first)",
                                      size_px=plot_size)
        section = "bucketings" if stratum == "predicted" else f"{stratum}_bucketings"
        report["frequency"][section][spec] = {
            "stratified_by": stratum, "description": bucketing.description, "plot": plot,
            "buckets": [{k: v for k, v in r.items() if k not in ("eval_tokens", "nll", "ppl")} for r in rows],
            "models": {n: [{k: r[k] for k in ("eval_tokens", "nll", "ppl")} for r in per_model[n]["buckets"]]
                       for n in names},
            "table": table.to_json()}
        markdown.append(table.to_markdown())
    return report, "\n".join(markdown)


# --------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_lev.evaluate",
                                description="Validation loss/perplexity (overall and by token frequency) of "
                                            "checkpoints and HF exports on the same tokens.")
    p.add_argument("--model", action="append", required=True, metavar="NAME=PATH",
                   help="--save dir, iter_* checkpoint dir or HF folder; repeat to compare")
    p.add_argument("--baseline", help="model the tables compare against (default: the first --model)")
    g = p.add_argument_group("data (default: the first checkpoint's training data)")
    g.add_argument("--data-path", nargs="+", help="indexed dataset prefix(es) or a 'w1 p1 w2 p2' blend")
    g.add_argument("--split", help="e.g. 969,30,1 (default: the checkpoint's; 0,1,0 with --data-path)")
    g.add_argument("--eval-split", choices=("train", "valid", "test"), default="valid")
    g.add_argument("--eval-tokens", type=int, help="score exactly this many tokens (default: the whole split)")
    g.add_argument("--seq-length", type=int)
    g.add_argument("--seed", type=int, help="dataset shuffling seed (default: the checkpoint's --seed)")
    g.add_argument("--tokenizer-type")
    g.add_argument("--tokenizer-model")
    g.add_argument("--vocab-file", help="GPT2BPETokenizer: GPT-2's vocab.json")
    g.add_argument("--merge-file", help="GPT2BPETokenizer: GPT-2's merges.txt")
    g.add_argument("--data-cache-path")
    g.add_argument("--micro-batch-size", type=int, default=8)
    g = p.add_argument_group("frequency-stratified perplexity")
    g.add_argument("--freq-dataset", nargs="+", metavar="TRAIN_PREFIX",
                   help="training data to count token frequencies on: prefixes (summed) or a --data-path "
                        "blend (weights ignored)")
    g.add_argument("--buckets", action="append", metavar="KIND[:N]",
                   help="quantile[:N buckets] (equal token mass), types[:N buckets] (equal type count) or "
                        "log[:base]; repeat (default: quantile:5 and log:10)")
    g.add_argument("--freq-split", default="auto",
                   help="count only each prefix's train share of this split (e.g. 969,30,1); 'auto' (default): "
                        "the evaluation's split when the --freq-dataset prefixes are the evaluated data; "
                        "'none': whole prefixes")
    g.add_argument("--freq-cache-dir", help="where counts are cached (default: cache/token_counts beside the data)")
    g = p.add_argument_group("run")
    g.add_argument("--output-dir", required=True)
    g.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda when available)")
    g.add_argument("--bf16", action="store_true", help="run the models in bf16 (log-softmax stays float32)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="run HF folders' own Python code even when it is not byte-identical to ours (docs/security.md)")
    g.add_argument("--save-token-nll", action="store_true",
                   help="also write token_nll.npz: every scored position's input and label ids, each model's NLL "
                        "(float16) and, with --freq-dataset, the training counts (megatron_lev.evaluation.bins reads it)")
    g.add_argument("--plot-width", type=int, default=1200)
    g.add_argument("--plot-height", type=int, default=800)
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"megatron_lev.evaluate: error: {exc}") from exc


def run(args) -> dict:
    from megatron_lev.distributed.launch import default_device, detect_launch_env, init_distributed
    from megatron_lev.distributed.state import destroy_parallel, initialize_model_parallel

    if args.eval_tokens is not None and args.eval_tokens < 1:
        raise ValueError(f"--eval-tokens {args.eval_tokens}: must be positive")
    if args.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size {args.micro_batch_size}: must be positive")
    args.buckets = args.buckets or ["quantile:5", "log:10"]
    named = parse_named(args.model, "--model")
    baseline = args.baseline or next(iter(named))
    if baseline not in named:
        raise ValueError(f"--baseline {baseline!r} is not one of the models: {', '.join(named)}")
    for spec in args.buckets:  # a bad spec fails now, not after the models are loaded
        bk.build_bucketing(spec, np.ones(2, dtype=np.int64))

    launch = detect_launch_env()
    if launch.world_size > 1:
        raise ValueError(f"run megatron_lev.evaluate as one process (world size {launch.world_size}): "
                         "checkpoints of any TP/PP are merged and evaluated on one device")
    started = not torch.distributed.is_initialized()
    # init_distributed exports the rendezvous variables; a run started here (also in-process
    # from tests or notebooks) takes them away again when it ends.
    saved_env = {k: os.environ.get(k) for k in _RENDEZVOUS_ENV}
    init_distributed()
    try:
        initialize_model_parallel(1, 1)
        device = torch.device(args.device) if args.device else default_device()
        models = [load_model(name, path, device, args.bf16, args.trust_remote_code) for name, path in named.items()]
        vocab = {m.name: m.vocab_size for m in models}
        if len(set(vocab.values())) > 1:
            raise ValueError(f"the models' vocabularies differ ({vocab}): they must share a tokenizer")
        settings = data_settings(args, models)
        dataset, num_samples = build_eval_dataset(settings, args.eval_tokens)
        counts, bucketings, freq_meta = (None, {}, None)
        if args.freq_dataset:
            counts, bucketings, freq_meta = frequency_section(args, settings, models[0].vocab_size)
        from megatron_lev.utils.progress import progress_bar

        batches = progress_bar(eval_batches(dataset, num_samples, args.micro_batch_size, args.eval_tokens, device),
                               "scoring", total=math.ceil(num_samples / args.micro_batch_size), unit="batch")
        token_nll = {} if args.save_token_nll else None
        scores = score_models(models, batches, bucketings, token_nll)
        report, markdown = build_report(models, scores, settings, baseline, counts, bucketings, freq_meta,
                                        args.output_dir, (args.plot_width, args.plot_height))
    finally:
        if started:
            destroy_parallel()
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    if token_nll is not None:
        report["token_nll"] = write_token_nll(os.path.join(args.output_dir, "token_nll.npz"), token_nll, counts)
    write_json_atomic(os.path.join(args.output_dir, "evaluation.json"), report)
    write_text_atomic(os.path.join(args.output_dir, "evaluation.md"), markdown)
    print(markdown)
    print(json.dumps({n: {"loss": r["loss"], "ppl": r["ppl"], "tokens": r["tokens"]}
                      for n, r in report["models"].items()}))
    return report


if __name__ == "__main__":
    main()
