"""Downstream benchmarks with EleutherAI's lm-evaluation-harness (lm-eval 0.4.x).

    python -m megatron_lev.evaluation.downstream \
        --model tied=exports/tied --model lev=exports/lev --baseline tied \
        --tasks lambada_openai,hellaswag,piqa,arc_easy,arc_challenge,winogrande \
        --data-dir eval_data/ --output-dir eval/downstream

Each `--model NAME=DIR` is an HF export (`tools/convert_to_hf.py`), loaded by lm-eval's
`hf` model class. A LEV export's modelling code runs only when it is byte-identical to the
copy this package ships, or with `--trust-remote-code` (docs/security.md).

Offline use. `--data-dir DIR` (or `--task-data TASK=FILE`) supplies a task's documents
as a local JSON-lines file `DIR/<task>.jsonl`, one row per document with the fields of
the task's Hugging Face dataset (lambada_openai: `text`; hellaswag: `ctx_a`, `ctx_b`,
`ctx`, `activity_label`, `endings`, `label`; piqa: `goal`, `sol1`, `sol2`, `label`;
arc_*: `question`, `choices{text,label}`, `answerKey`; winogrande: `sentence`,
`option1`, `option2`, `answer`). For each such task the wrapper writes a task YAML
that `include`s lm-eval's own one (same prompts, metrics, processing) and only swaps
the data source for `dataset_path: json` + `data_files`, on the split lm-eval scores.
Tasks without local data load through `datasets` as usual (the HF cache works offline).
`--export-data DIR` writes those jsonl files from whatever lm-eval can load (run it once
on a machine with network). `--include-path` adds your own task YAMLs.

Output: `downstream.json` (every metric lm-eval reports, per model and task) and
`downstream.md` (one row per task/metric, relative change vs `--baseline`).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import tempfile
from pathlib import Path

from megatron_lev.evaluation.report import ComparisonTable, parse_named
from megatron_lev.utils.files import write_json_atomic, write_text_atomic

PAPER_TASKS = ("lambada_openai", "hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande")
# lm-eval's YAML (relative to lm_eval/tasks) and the split it scores, for the paper's tasks;
# other tasks are looked up in lm-eval's full task index (slower: it parses every YAML).
_KNOWN_TASKS = {
    "lambada_openai": ("lambada/lambada_openai.yaml", "test"),
    "lambada_standard": ("lambada/lambada_standard.yaml", "test"),
    "hellaswag": ("hellaswag/hellaswag.yaml", "validation"),
    "piqa": ("piqa/piqa.yaml", "validation"),
    "arc_easy": ("arc/arc_easy.yaml", "test"),
    "arc_challenge": ("arc/arc_challenge.yaml", "test"),
    "winogrande": ("winogrande/default.yaml", "validation"),
}
LOCAL_SUFFIX = "_local"


def _lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def _full_task_index() -> dict:
    """lm-eval's index of every task it ships (parses all its YAMLs: seconds, so built once)."""
    from lm_eval.tasks import TaskManager

    return TaskManager().task_index


def lm_eval_task_source(task: str) -> tuple[Path, str]:
    """(lm-eval's YAML for `task`, the split it evaluates on)."""
    if task in _KNOWN_TASKS:
        rel, split = _KNOWN_TASKS[task]
        path = _lm_eval_tasks_dir() / rel
        if path.is_file():
            return path, split
    entry = _full_task_index().get(task)
    if entry is None or entry.yaml_path is None or not entry.cfg:
        raise ValueError(f"--tasks {task}: not a YAML task of this lm-eval (local data needs one)")
    split = entry.cfg.get("test_split") or entry.cfg.get("validation_split")
    if not split:
        raise ValueError(f"--tasks {task}: lm-eval's config names no test or validation split")
    return Path(entry.yaml_path), split


def write_local_task_yaml(task: str, data_file: str, out_dir: str) -> str:
    """A task `<task>_local`: lm-eval's `task` with its documents read from `data_file`."""
    if not os.path.isfile(data_file):
        raise FileNotFoundError(f"local data for {task}: {data_file} does not exist")
    source, split = lm_eval_task_source(task)
    config = {
        "include": str(source),
        "task": task + LOCAL_SUFFIX,
        "tag": [],  # don't join the original's tags (e.g. `ai2_arc`)
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {split: os.path.abspath(data_file)}},
        # Only the scored split exists locally; few-shot examples come from it too.
        "training_split": None,
        "validation_split": split if split == "validation" else None,
        "test_split": split if split == "test" else None,
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{task}{LOCAL_SUFFIX}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)  # JSON is YAML; no !function tags needed here
    return path


def resolve_task_data(tasks, data_dir: str | None, task_data: dict[str, str]) -> dict[str, str]:
    """Task -> local jsonl, from explicit --task-data, then DIR/<task>.jsonl."""
    unknown = set(task_data) - set(tasks)
    if unknown:
        raise ValueError(f"--task-data for {', '.join(sorted(unknown))}: not in --tasks")
    found = dict(task_data)
    if data_dir:
        if not os.path.isdir(data_dir):
            raise FileNotFoundError(f"--data-dir {data_dir}: not a directory")
        for task in tasks:
            path = os.path.join(data_dir, f"{task}.jsonl")
            if task not in found and os.path.isfile(path):
                found[task] = path
    return found


def _task_manager(tasks, local: dict[str, str], include_paths: list[str], work_dir: str):
    from lm_eval.tasks import TaskManager

    yaml_dir = os.path.join(work_dir, "lm_eval_tasks")
    for task, data in local.items():
        write_local_task_yaml(task, data, yaml_dir)
    paths = ([yaml_dir] if local else []) + list(include_paths)
    # lm-eval's own index (every YAML it ships) is only needed for tasks not served locally.
    need_defaults = any(t not in local for t in tasks)
    if not paths and not need_defaults:
        raise ValueError("no tasks to run")
    return TaskManager(include_path=paths or None, include_defaults=need_defaults)


def _metrics_of(task_result: dict) -> dict[str, float]:
    """lm-eval's 'acc,none' keys -> {'acc': .., 'acc_stderr': ..} (filter 'none' dropped)."""
    metrics = {}
    for key, value in task_result.items():
        if "," not in key or not isinstance(value, (int, float)):
            continue
        metric, _, filt = key.partition(",")
        metrics[metric if filt == "none" else f"{metric}[{filt}]"] = float(value)
    return metrics


def evaluate_model(path: str, tasks, task_manager, local: dict[str, str], *, batch_size=8, device=None,
                   dtype="auto", num_fewshot=None, limit=None, max_length=None, log_samples=False,
                   trust_remote_code: bool = False) -> dict:
    """Run lm-eval's `hf` model on one export; returns {task: metrics} (+ raw samples if asked)."""
    from lm_eval import simple_evaluate

    if not os.path.isdir(path):
        raise FileNotFoundError(f"--model {path}: not an HF export directory")
    from megatron_lev.hf.trust import hf_trust_remote_code

    model_args = {"pretrained": path, "trust_remote_code": hf_trust_remote_code(path, trust_remote_code),
                  "dtype": dtype}
    if max_length:
        model_args["max_length"] = max_length
    names = [t + LOCAL_SUFFIX if t in local else t for t in tasks]
    out = simple_evaluate(model="hf", model_args=model_args, tasks=names, task_manager=task_manager,
                          batch_size=batch_size, device=device or _default_device(), num_fewshot=num_fewshot,
                          limit=limit, log_samples=log_samples, bootstrap_iters=1000)
    if out is None:  # non-zero ranks under accelerate
        return {}
    results = {task: _metrics_of(out["results"][name]) for task, name in zip(tasks, names)}
    for task, name in zip(tasks, names):
        results[task]["num_examples"] = int(out["n-samples"][name]["effective"])
    report = {"tasks": results, "lm_eval_version": out.get("lm_eval_version")}
    if log_samples:
        report["samples"] = {task: out["samples"][name] for task, name in zip(tasks, names)}
    return report


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def downstream_table(results: dict[str, dict], baseline: str) -> ComparisonTable:
    """Rows `task / metric`, columns models; each value with lm-eval's standard error (bootstrap or
    analytic, as lm-eval reports it; none for a single example)."""
    models = list(results)
    rows = []
    for model in models:
        for task, metrics in results[model]["tasks"].items():
            for metric in metrics:
                if metric.endswith("_stderr") or metric == "num_examples":
                    continue
                if (task, metric) not in rows:
                    rows.append((task, metric))
    values = {m: [_finite(results[m]["tasks"].get(t, {}).get(k)) for t, k in rows] for m in models}
    errors = {m: [_finite(results[m]["tasks"].get(t, {}).get(f"{k}_stderr")) for t, k in rows] for m in models}
    examples = [results[baseline]["tasks"].get(t, {}).get("num_examples") for t, _ in rows]
    return ComparisonTable("Downstream tasks (lm-eval)", [f"{t} / {k}" for t, k in rows], values, baseline,
                           info_columns={"examples": examples}, metric_name="lm-eval metric ± its standard error",
                           errors=errors)


def _finite(value):
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def export_task_data(tasks, out_dir: str, task_manager=None) -> dict[str, str]:
    """Write each task's scored split (the raw dataset rows) as `out_dir/<task>.jsonl`."""
    from lm_eval.tasks import TaskManager

    task_manager = task_manager or TaskManager()
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    for task in tasks:
        loaded = task_manager.load([task])["tasks"]
        task_obj = next(iter(loaded.values()))
        split = task_obj.config.test_split or task_obj.config.validation_split
        rows = task_obj.dataset[split]
        path = os.path.join(out_dir, f"{task}.jsonl")
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        write_text_atomic(path, text)
        written[task] = path
    return written


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Run lm-eval on HF exports and compare them.")
    parser.add_argument("--model", action="append", metavar="NAME=DIR", help="HF export dir; repeat per model")
    parser.add_argument("--baseline", help="model the table compares against (default: the first --model)")
    parser.add_argument("--tasks", default=",".join(PAPER_TASKS), help="comma-separated lm-eval task names")
    parser.add_argument("--data-dir", help="directory of local <task>.jsonl files (offline)")
    parser.add_argument("--task-data", action="append", default=[], metavar="TASK=FILE",
                        help="local jsonl for one task (overrides --data-dir)")
    parser.add_argument("--include-path", action="append", default=[], help="extra lm-eval task YAML directory")
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--limit", type=float, default=None, help="at most this many examples per task (testing)")
    parser.add_argument("--batch-size", default="8", help="int or 'auto'")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:0 (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto")
    parser.add_argument("--max-length", type=int, default=None, help="context length lm-eval uses")
    parser.add_argument("--log-samples", action="store_true", help="keep per-example results in the JSON")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the folders' own Python code even when it is not byte-identical to ours")
    parser.add_argument("--output-dir", help="where downstream.json / downstream.md go")
    parser.add_argument("--export-data", metavar="DIR", help="write the tasks' data as DIR/<task>.jsonl and exit")
    args = parser.parse_args(argv)
    if not args.export_data and not (args.model and args.output_dir):
        parser.error("--model and --output-dir are required (unless --export-data)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks is empty")
    if args.export_data:
        written = export_task_data(tasks, args.export_data)
        print(json.dumps(written, indent=2))
        return written
    models = parse_named(args.model, "--model")
    baseline = args.baseline or next(iter(models))
    if baseline not in models:
        raise ValueError(f"--baseline {baseline!r} is not one of the models: {', '.join(models)}")
    local = resolve_task_data(tasks, args.data_dir, parse_named(args.task_data, "--task-data", allow_bare=False))
    batch_size = args.batch_size if args.batch_size == "auto" else int(args.batch_size)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    with tempfile.TemporaryDirectory() as work_dir:
        task_manager = _task_manager(tasks, local, args.include_path, work_dir)
        results = {
            name: {"path": os.path.abspath(path),
                   **evaluate_model(path, tasks, task_manager, local, batch_size=batch_size, device=args.device,
                                    dtype=args.dtype, num_fewshot=args.num_fewshot, limit=limit,
                                    max_length=args.max_length, log_samples=args.log_samples,
                                    trust_remote_code=args.trust_remote_code)}
            for name, path in models.items()
        }
    table = downstream_table(results, baseline)
    report = {"baseline": baseline, "tasks": tasks, "local_data": {t: os.path.abspath(p) for t, p in local.items()},
              "num_fewshot": args.num_fewshot, "limit": limit, "models": results, "table": table.to_json()}
    write_json_atomic(os.path.join(args.output_dir, "downstream.json"), report)
    markdown = table.to_markdown()
    write_text_atomic(os.path.join(args.output_dir, "downstream.md"), markdown)
    print(markdown)
    return report


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as exc:  # refused folders, bad flags: one line
        raise SystemExit(f"megatron_lev.evaluation.downstream: error: {exc}") from None
