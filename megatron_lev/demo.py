"""The Python side of `tools/quickstart.sh` (the one-command demo): where its files go, the
step-0 validation loss, text generation from the Hugging Face export, and the summary.

    python -m megatron_lev.demo layout --out demo                # the file layout, as shell variables
    python -m megatron_lev.demo valid-loss --run lev=demo/runs/lev --run tied=demo/runs/tied \
        --output demo/eval/valid_loss.json
    python -m megatron_lev.demo generate --hf demo/hf/lev --load demo/runs/lev --output demo/generation.json
    python -m megatron_lev.demo seeds --out demo                 # lev vs tied over the seeds trained (--publish)
    python -m megatron_lev.demo summary --out demo

Everything else the demo runs is the project's own command line (corpus, tokenizer,
preprocessing, training, evaluation, export); see tools/quickstart.sh.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass, fields
from typing import Optional

DEFAULT_PROMPTS = ("The for statement", "Return a new")
# The perplexity report scores at most this many validation tokens (bounded time on CPU
# whatever the size of --input; Python's documentation has about 23k).
REPORT_EVAL_TOKENS = 32768


@dataclass(frozen=True)
class Layout:
    """Every path the demo writes, under one output folder."""

    out: str
    inputs_file: str  # what the corpus was built from (a re-run with other data refuses this folder)
    corpus: str  # the default corpus: Python's own text, Pile format
    tokenizer: str  # SentencePiece model
    dataset: str  # indexed dataset prefix (.bin/.idx)
    data_cache: str  # megatron-core GPTDataset index cache
    run_lev: str  # --save of the LEV run (checkpoints, metrics.jsonl, train.log)
    run_tied: str  # --save of the tied run
    valid_loss: str  # step-0 and final validation loss of both runs
    eval_ppl: str  # megatron_lev.evaluate output: evaluation.{json,md}, freq_*.png
    eval_curves: str  # megatron_lev.evaluation.curves output: curves.{json,md}, loss_vs_tokens.png
    hf_lev: str  # Hugging Face export of the LEV run
    generation: str  # generated text (transformers) and the check against our own decoding
    timings: str  # seconds per stage, appended by quickstart.sh
    seed_runs: str  # --publish: lev-sN / tied-sN, the demo's two runs at more seeds
    seed_timings: str  # seconds per seed run (not part of the demo's own wall time)
    seeds: str  # lev vs tied over every seed trained
    summary_json: str
    summary_md: str

    @classmethod
    def under(cls, out: str) -> "Layout":
        out = os.path.abspath(out)

        def p(*parts):
            return os.path.join(out, *parts)

        return cls(out=out, inputs_file=p("inputs.txt"), corpus=p("data", "python.jsonl.zst"),
                   tokenizer=p("tokenizer", "spm.model"), dataset=p("data", "corpus_text_document"),
                   data_cache=p("cache"), run_lev=p("runs", "lev"), run_tied=p("runs", "tied"),
                   valid_loss=p("eval", "valid_loss.json"), eval_ppl=p("eval", "ppl"),
                   eval_curves=p("eval", "curves"), hf_lev=p("hf", "lev"), generation=p("generation.json"),
                   timings=p("timings.tsv"), seed_runs=p("seeds"), seed_timings=p("timings-seeds.tsv"),
                   seeds=p("eval", "seeds.json"), summary_json=p("summary.json"), summary_md=p("summary.md"))

    def shell(self) -> str:
        return "\n".join(f"{f.name}={shlex.quote(getattr(self, f.name))}" for f in fields(self))


# --------------------------------------------------------------------------- step-0 validation loss


def _start_single_process():
    """One gloo rank with TP = PP = 1 (the model's layers need megatron-core's groups)."""
    import torch.distributed as dist

    from megatron_lev.distributed.launch import init_distributed
    from megatron_lev.distributed.state import initialize_model_parallel

    started = not dist.is_initialized()
    init_distributed(backend="gloo")
    initialize_model_parallel(1, 1)
    return started


def run_validation_losses(run_dir: str) -> dict:
    """The run's validation loss with its initial weights and with its final ones, on the
    very batches its trainer evaluates (the first --eval-iters global batches of the valid
    split), as the trainer computes it (the mean of per-micro-batch mean losses).

    Initialisation does not depend on the parallel layout (models/layers.py), so a TP=1 model built
    from the run's config and seed holds the run's step-0 weights whatever its TP/DP.
    `final_logged` is the trainer's own last valid_loss (metrics.jsonl): `final` must
    reproduce it, which shows `initial` is measured the same way.
    """
    import torch

    from megatron_lev.checkpointing.convert import find_checkpoint, read_checkpoint
    from megatron_lev.checkpointing.layout import load_full_state_dict
    from megatron_lev.data.tokenizer import build_tokenizer
    from megatron_lev.models.decoder import LeviathanModel
    from megatron_lev.training.batches import build_datasets

    info = find_checkpoint(run_dir)
    training = info.config["training"]
    args = argparse.Namespace(**training)
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    _, valid, _ = build_datasets(args, tokenizer)
    if valid is None or len(valid) == 0:
        raise ValueError(f"{run_dir}: the run has no validation split")
    config = info.model_config()
    device = torch.device("cpu")
    micro_per_eval = args.eval_iters * (args.global_batch_size // args.micro_batch_size)

    def loss_of(model) -> float:
        from megatron_lev.training.batches import micro_batches

        batches = micro_batches(valid, 0, args, device)
        model.eval()
        with torch.no_grad():
            losses = [float(model(b["tokens"], position_ids=b["position_ids"], labels=b["labels"],
                                  loss_mask=b["loss_mask"])) for b in (next(batches) for _ in range(micro_per_eval))]
        return sum(losses) / len(losses)

    initial = loss_of(LeviathanModel(config))
    trained = LeviathanModel(config)
    load_full_state_dict(trained, read_checkpoint(info), config, tp_rank=0)
    final = loss_of(trained)
    logged = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "valid_loss" in r]
    return {"checkpoint": info.path, "iteration": info.iteration, "embedding": config.embedding,
            "eval_tokens": micro_per_eval * args.micro_batch_size * args.seq_length,
            "valid_split_tokens": valid_split_tokens(training),
            "initial": initial, "final": final,
            "final_logged": logged[-1]["valid_loss"] if logged else None,
            "logged_at_iteration": logged[-1]["iteration"] if logged else None}


def valid_split_tokens(training: dict) -> int:
    """Tokens in one epoch of the run's validation split (what megatron_lev.evaluate scores)."""
    from megatron_lev.evaluate import build_eval_dataset

    settings = {k: training.get(k) for k in ("data_path", "train_data_path", "valid_data_path", "test_data_path",
                                             "split", "tokenizer_type", "tokenizer_model", "seq_length", "seed",
                                             "data_cache_path")}
    dataset, samples = build_eval_dataset({**settings, "eval_split": "valid"}, None)
    return samples * settings["seq_length"]


def report_eval_tokens(valid_loss_file: str) -> int:
    """--eval-tokens of the demo's perplexity report: the whole validation split, at most
    REPORT_EVAL_TOKENS."""
    runs = _read_json(valid_loss_file)
    if not runs:
        raise ValueError(f"{valid_loss_file}: missing or empty (run `valid-loss` first)")
    return min([REPORT_EVAL_TOKENS] + [r["valid_split_tokens"] for r in runs.values()])


def read_metrics(path: str) -> list[dict]:
    """metrics.jsonl records (a missing file: none)."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- generation


def greedy_decode(model, prompt_ids: list[int], max_new_tokens: int, eod: Optional[int], vocab_size: int) -> list[int]:
    """Our own greedy decoding with a LeviathanModel (no KV cache: the whole sequence each
    step), stopping after `eod` as transformers' generate() stops after its eos."""
    import torch

    from megatron_lev.models.decoder import gather_logits

    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = gather_logits(model(torch.tensor([ids])), vocab_size)[0, -1]
            ids.append(int(logits.float().argmax()))
            if ids[-1] == eod:
                break
    return ids[len(prompt_ids):]


def generate(hf_dir: str, run_dir: str, prompts, max_new_tokens: int, sample_seed: int = 1234,
             trust_remote_code: bool = False) -> dict:
    """Continuations of `prompts` by the HF export loaded with plain transformers (its LEV
    code only when byte-identical to ours, or with `trust_remote_code`): greedy ones, checked
    against our own model's greedy decoding on the run's checkpoint, and seeded samples
    (temperature 0.8, top-k 40)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_lev.checkpointing.convert import find_checkpoint, read_checkpoint
    from megatron_lev.checkpointing.layout import load_full_state_dict
    from megatron_lev.data.tokenizer import build_tokenizer
    from megatron_lev.hf.trust import hf_trust_remote_code
    from megatron_lev.models.decoder import LeviathanModel

    trust = hf_trust_remote_code(hf_dir, trust_remote_code)  # refuses code that is not ours
    hf_tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=trust)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=trust).eval()
    info = find_checkpoint(run_dir)
    config = info.model_config()
    ours = LeviathanModel(config)
    load_full_state_dict(ours, read_checkpoint(info), config, tp_rank=0)
    ours.eval()
    training = info.config["training"]
    our_tokenizer = build_tokenizer(training["tokenizer_type"], training["tokenizer_model"])
    eos = hf_model.generation_config.eos_token_id

    samples = []
    for prompt in prompts:
        prompt_ids = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids)),
                                    max_new_tokens=max_new_tokens, do_sample=False)
        new_ids = out[0, len(prompt_ids):].tolist()
        our_ids = greedy_decode(ours, prompt_ids, max_new_tokens, eos, config.vocab_size)
        # Greedy decoding of a small model loops; a seeded sample reads more like text.
        torch.manual_seed(sample_seed)
        with torch.no_grad():
            sampled = hf_model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids)),
                                        max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=40)
        samples.append({
            "prompt": prompt, "prompt_ids": prompt_ids,
            "prompt_ids_match_training_tokenizer": our_tokenizer.tokenize(prompt) == prompt_ids,
            "new_ids": new_ids, "text": hf_tokenizer.decode(new_ids, skip_special_tokens=True),
            "our_greedy_ids": our_ids, "matches_our_greedy": new_ids == our_ids,
            "our_text": our_tokenizer.detokenize([i for i in our_ids if i != eos]),
            "sampled_text": hf_tokenizer.decode(sampled[0, len(prompt_ids):].tolist(), skip_special_tokens=True),
        })
    return {"hf_model": os.path.abspath(hf_dir), "architecture": type(hf_model).__name__,
            "checkpoint": info.path, "max_new_tokens": max_new_tokens,
            "sampling": {"temperature": 0.8, "top_k": 40, "seed": sample_seed}, "samples": samples}


# --------------------------------------------------------------------------- summary


def _read_json(path: str):
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_text(path: str) -> Optional[str]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def _timings(path: str) -> list[dict]:
    rows = []
    for line in (_read_text(path) or "").splitlines():
        stage, seconds, status = line.split("\t")
        rows.append({"stage": stage, "seconds": float(seconds), "status": status})
    return rows


def artefacts(layout: Layout) -> dict[str, str]:
    """What the demo produced, name -> path (only the ones that exist)."""
    candidates = {
        "corpus (Pile-format .jsonl.zst)": layout.corpus,
        "tokenizer (SentencePiece)": layout.tokenizer,
        "indexed dataset (.bin/.idx)": layout.dataset + ".bin",
        "LEV run: checkpoints, metrics.jsonl, train.log": layout.run_lev,
        "tied run: checkpoints, metrics.jsonl, train.log": layout.run_tied,
        "step-0 and final validation loss": layout.valid_loss,
        "perplexity report (overall + by token frequency)": os.path.join(layout.eval_ppl, "evaluation.md"),
        "frequency plot (quantile buckets)": os.path.join(layout.eval_ppl, "freq_quantile_5.png"),
        "frequency plot (log buckets)": os.path.join(layout.eval_ppl, "freq_log_10.png"),
        "training curves report": os.path.join(layout.eval_curves, "curves.md"),
        "loss-vs-tokens plot": os.path.join(layout.eval_curves, "loss_vs_tokens.png"),
        "Hugging Face export of the LEV model": layout.hf_lev,
        "generated text": layout.generation,
        "stage timings": layout.timings,
    }
    return {name: path for name, path in candidates.items() if os.path.exists(path)}


def _code_block(text: str) -> list[str]:
    return ["  ```", *("  " + line for line in text.splitlines()), "  ```", ""]


def _display_path(path: str) -> str:
    """Relative to the working directory when inside it, else absolute."""
    rel = os.path.relpath(path)
    return path if rel.startswith(os.pardir) else rel


def build_summary(layout: Layout) -> tuple[dict, str]:
    losses = _read_json(layout.valid_loss) or {}
    generation = _read_json(layout.generation) or {}
    found = artefacts(layout)
    timings = _timings(layout.timings)
    summary = {"out": layout.out, "artefacts": found, "valid_loss": losses,
               "generation": generation.get("samples", []), "timings": timings}
    lines = ["# megatron_lev demo", ""]
    if losses:
        lines += ["**Validation loss** (the trainer's validation batches)", "",
                  "| run | step 0 | final | final ppl | iteration |", "|---|---|---|---|---|"]
        for name, r in losses.items():
            lines.append(f"| {name} | {r['initial']:.4f} | {r['final']:.4f} | {math.exp(r['final']):.2f} "
                         f"| {r['iteration']} |")
        lines.append("")
    for path in (os.path.join(layout.eval_ppl, "evaluation.md"), os.path.join(layout.eval_curves, "curves.md")):
        text = _read_text(path)
        if text:
            lines += [text.rstrip(), ""]
    if generation.get("samples"):
        lines += [f"**Generated by the Hugging Face export** ({generation['architecture']} under plain "
                  f"transformers, at most {generation['max_new_tokens']} new tokens)", ""]
        for s in generation["samples"]:
            check = "the same tokens as" if s["matches_our_greedy"] else "NOT the same tokens as"
            lines += [f"- {s['prompt']!r}, sampled (temperature 0.8, top-k 40):", "",
                      *_code_block(s["prompt"] + s["sampled_text"]),
                      f"  greedy ({check} megatron_lev's own greedy decoding):", "",
                      *_code_block(s["prompt"] + s["text"])]
    lines += ["**Where everything is**", "", "| what | path |", "|---|---|"]
    lines += [f"| {name} | `{_display_path(path)}` |" for name, path in found.items()]
    if timings:
        total = sum(t["seconds"] for t in timings)
        lines += ["", "**Stages** (seconds; 'reused' = output already there)", "",
                  "| stage | seconds | |", "|---|---|---|"]
        lines += [f"| {t['stage']} | {t['seconds']:.0f} | {t['status']} |" for t in timings]
        lines.append(f"| total | {total:.0f} | |")
    return summary, "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- seeds


def seed_comparison(layout: Layout) -> dict:
    """lev vs tied at every seed the demo trained: its own two runs and layout.seed_runs'
    lev-sN / tied-sN (megatron_lev.evaluation.seeds.final_loss_by_seed)."""
    from megatron_lev.evaluation.seeds import final_loss_by_seed

    pairs = [(layout.run_lev, layout.run_tied)]
    if os.path.isdir(layout.seed_runs):
        pairs += [(os.path.join(layout.seed_runs, name), os.path.join(layout.seed_runs, "tied-" + name[len("lev-"):]))
                  for name in sorted(os.listdir(layout.seed_runs)) if name.startswith("lev-s")]
    return final_loss_by_seed(pairs, "lev", "tied")


# --------------------------------------------------------------------------- published results


# The files `publish` writes into docs/ (README.md quotes demo_results.json's numbers).
PUBLISHED_PLOTS = {"demo_freq_quantile_5.png": ("eval_ppl", "freq_quantile_5.png"),
                   "demo_loss_vs_tokens.png": ("eval_curves", "loss_vs_tokens.png")}


def _git_commit() -> Optional[str]:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def demo_results(layout: Layout) -> dict:
    """The numbers the README quotes, from a finished demo: validation loss at step 0 and at
    the end, perplexity (overall, relative change of lev vs tied), and the tokens LEV needs to
    reach tied's final validation loss."""
    import datetime

    losses = _read_json(layout.valid_loss)
    evaluation = _read_json(os.path.join(layout.eval_ppl, "evaluation.json"))
    curves = _read_json(os.path.join(layout.eval_curves, "curves.json"))
    if not (losses and evaluation and curves):
        raise ValueError(f"{layout.out}: the demo has not finished (valid loss, evaluation and curves are needed)")
    overall = evaluation["table"]["rows"]
    ppl = next(r for r in overall if r["label"] == "perplexity")
    timings = _timings(layout.timings)
    return {
        "commit": _git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "valid_loss": {name: {"initial": r["initial"], "final": r["final"], "iteration": r["iteration"]}
                       for name, r in losses.items()},
        "perplexity": {"eval_tokens": evaluation["eval_tokens"], "baseline": evaluation["baseline"],
                       "values": ppl["values"], "relative_change_pct": ppl["relative_change_pct"]},
        "tokens_to_baseline_final": {name: {"tokens": r["tokens_to_target"], "final_tokens": r.get("final_tokens"),
                                            "speedup": r["speedup_vs_baseline"]}
                                     for name, r in curves["runs"].items()},
        "target_loss": curves["target_loss"],
        "wall_minutes": round(sum(t["seconds"] for t in timings) / 60, 1),
        "stages": timings,
        # --publish: lev vs tied over 3 seeds (the runs above are the first), and their training time
        "seeds": _read_json(layout.seeds),
        "seed_runs_minutes": round(sum(t["seconds"] for t in _timings(layout.seed_timings)) / 60, 1),
    }


def readme_figures(results: dict) -> list[str]:
    """The figures README.md quotes from demo_results.json, as the README writes them
    (tests/test_readme.py checks that it quotes every one)."""
    figures = [f"{results['valid_loss'][name][when]:.4f}" for when in ("final", "initial") for name in ("lev", "tied")]
    figures.append(f"{results['perplexity']['relative_change_pct']['lev']:+.1f}%")
    figures.append(f"{results['tokens_to_baseline_final']['lev']['speedup']:.2f}x")
    figures += [f"{results['perplexity']['values'][name]:.1f}" for name in ("lev", "tied")]
    seeds = results.get("seeds")
    if seeds:
        difference, change = seeds["difference"], seeds["ppl_change_pct"]
        figures.append(f"{difference['mean']:+.4f} ± {difference['std']:.4f}")
        figures.append(f"{change['mean']:+.1f}% ± {change['std']:.1f}%")
        figures.append(f"p = {seeds['paired_t_test']['p']:.3f}")
    return figures


def unquoted_figures(results: dict, readme: str) -> list[str]:
    """readme_figures(results) that the README's text does not contain."""
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    return [figure for figure in readme_figures(results) if figure not in text]


def publish(layout: Layout, docs: str) -> dict:
    """docs/demo_results.{json,md} and the two plots, from a finished default demo (a maintainer's
    step, `tools/quickstart.sh --publish`: a plain demo run writes only under its --out)."""
    import shutil

    from megatron_lev.utils.files import atomic_path, write_json_atomic, write_text_atomic

    results = demo_results(layout)
    _, summary = build_summary(layout)
    body = summary.split("**Generated by the Hugging Face export**")[0].split("**Where everything is**")[0]
    header = [f"# Demo results", "",
              f"Written by `bash tools/quickstart.sh --publish` (commit {results['commit']}, {results['date']}, "
              f"{results['wall_minutes']} minutes wall time on this machine); README.md quotes "
              f"`demo_results.json`.", ""]
    if results["seeds"]:
        from megatron_lev.evaluation.seeds import final_loss_markdown

        seeds = results["seeds"]
        header += [f"**lev vs tied over {len(seeds['per_seed'])} seeds** (seeds {', '.join(seeds['per_seed'])}: the "
                   f"demo's runs below, then the same two runs at the other seeds, {results['seed_runs_minutes']} "
                   "minutes; final validation loss on each seed's validation batches)", "",
                   final_loss_markdown(seeds)]
    write_text_atomic(os.path.join(docs, "demo_results.md"),
                      "\n".join(header) + body.replace("# megatron_lev demo\n", "", 1).rstrip() + "\n")
    write_json_atomic(os.path.join(docs, "demo_results.json"), results)
    for name, (folder, file) in PUBLISHED_PLOTS.items():
        source = os.path.join(getattr(layout, folder), file)
        if os.path.isfile(source):
            with atomic_path(os.path.join(docs, name)) as tmp:
                shutil.copyfile(source, tmp)
    return results


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_lev.demo", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("layout", help="print the demo's paths as shell variable assignments")
    s.add_argument("--out", required=True)
    s = sub.add_parser("valid-loss", help="step-0 and final validation loss of training runs")
    s.add_argument("--run", action="append", required=True, metavar="NAME=SAVE_DIR")
    s.add_argument("--output", required=True)
    s = sub.add_parser("report-tokens", help="print the --eval-tokens of the demo's perplexity report")
    s.add_argument("--valid-loss", required=True, help="the valid-loss output")
    s = sub.add_parser("generate", help="greedy text from a HF export, checked against our own decoding")
    s.add_argument("--hf", required=True, help="Hugging Face folder (tools/convert_to_hf.py)")
    s.add_argument("--load", required=True, help="the training run it was exported from")
    s.add_argument("--prompt", action="append", help=f"repeatable (default: {list(DEFAULT_PROMPTS)})")
    s.add_argument("--max-new-tokens", type=int, default=48)
    s.add_argument("--trust-remote-code", action="store_true",
                   help="run the folder's Python code even when it is not byte-identical to ours")
    s.add_argument("--output", required=True)
    s = sub.add_parser("seeds", help="lev vs tied over every seed the demo trained -> eval/seeds.json")
    s.add_argument("--out", required=True)
    s = sub.add_parser("summary", help="print (and write) what the demo produced and where")
    s.add_argument("--out", required=True)
    s = sub.add_parser("publish", help="write docs/demo_results.{json,md} and the plots from a finished demo")
    s.add_argument("--out", required=True)
    s.add_argument("--docs", required=True, help="the docs/ folder")
    s.add_argument("--readme", help="README.md: list the published figures it does not quote yet")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "layout":
        print(Layout.under(args.out).shell())
        return 0
    if args.command == "report-tokens":
        print(report_eval_tokens(args.valid_loss))
        return 0
    if args.command == "publish":
        try:
            results = publish(Layout.under(args.out), args.docs)
        except ValueError as exc:
            print(f"megatron_lev.demo publish: error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {os.path.join(args.docs, 'demo_results.md')} (valid loss "
              + ", ".join(f"{n} {r['final']:.4f}" for n, r in results["valid_loss"].items()) + ")")
        stale = unquoted_figures(results, args.readme) if args.readme else []
        if stale:
            print(f"{args.readme} does not quote these published figures yet (tests/test_readme.py fails until "
                  f"it does): {', '.join(stale)}")
        return 0
    if args.command == "seeds":
        from megatron_lev.evaluation.seeds import final_loss_markdown
        from megatron_lev.utils.files import write_json_atomic

        layout = Layout.under(args.out)
        try:
            seeds = seed_comparison(layout)
        except (ValueError, FileNotFoundError) as exc:
            print(f"megatron_lev.demo seeds: error: {exc}", file=sys.stderr)
            return 2
        write_json_atomic(layout.seeds, seeds)
        print(final_loss_markdown(seeds), end="")
        return 0
    if args.command == "summary":
        from megatron_lev.utils.files import write_json_atomic, write_text_atomic

        layout = Layout.under(args.out)
        summary, markdown = build_summary(layout)
        write_json_atomic(layout.summary_json, summary)
        write_text_atomic(layout.summary_md, markdown)
        print(markdown)
        return 0

    from megatron_lev.distributed.state import destroy_parallel
    from megatron_lev.evaluation.report import parse_named
    from megatron_lev.utils.files import write_json_atomic

    try:
        if args.command == "generate" and args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
        started = _start_single_process()
        try:
            if args.command == "valid-loss":
                result = {name: run_validation_losses(path)
                          for name, path in parse_named(args.run, "--run", allow_bare=False).items()}
            else:
                result = generate(args.hf, args.load, args.prompt or list(DEFAULT_PROMPTS), args.max_new_tokens,
                                  trust_remote_code=args.trust_remote_code)
        finally:
            if started:
                destroy_parallel()
    except (ValueError, FileNotFoundError) as exc:
        print(f"megatron_lev.demo {args.command}: error: {exc}", file=sys.stderr)
        return 2
    write_json_atomic(args.output, result)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
