"""slurm/evaluate.sh's job: a comparison's evaluation and release, run as stages, per seed.

For every seed in SEEDS, RUNS names the training runs ("lev=checkpoints/lev-s{seed}
tied=checkpoints/tied-s{seed}"; `{seed}` is replaced) and the stages write, under OUTPUT_DIR:

    s{seed}/evaluation/   perplexity overall and by token frequency (python -m megatron_lev.evaluate)
    s{seed}/curves/       training curves and tokens to BASELINE's final loss (evaluation.curves)
    s{seed}/hf/NAME/      the Hugging Face export of each run (tools/convert_to_hf.py)
    s{seed}/downstream/   lm-eval's tasks on those exports, with standard errors (evaluation.downstream)
    s{seed}/release/NAME/ each run exported again, its card carrying the downstream scores
    seeds/                the summary over seeds, paired against BASELINE (evaluation.seeds)

Every run is pinned at start to its newest complete checkpoint, so all stages of a seed see the
same weights even while training goes on. A stage writes into `<folder>.partial` and renames it
into place when its command succeeds: a finished stage is complete or absent, and a job stopped
mid-stage redoes only that stage when resubmitted (finished ones are skipped; FORCE=1 redoes
them, replacing the old folder only once the new one is done). Under DRY_RUN=1 the commands are
printed and nothing runs.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Mapping

from megatron_lev.checkpointing.catalog import find_latest, tag_iteration
from megatron_lev.launcher.shell import LaunchError, get, print_cmd, require_int, stamp, switch, words
from megatron_lev.launcher.variables import check_blend

STAGES = ("perplexity", "curves", "export", "downstream", "release", "seeds")
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclass
class Stage:
    """One command and the folder it fills: done when `folder/marker` exists."""
    name: str
    folder: str
    marker: str
    cmd: list[str]
    env: dict = field(default_factory=dict)  # added to the job's environment

    @property
    def partial(self) -> str:
        return self.folder + ".partial"

    def done(self) -> bool:
        return os.path.isfile(os.path.join(self.folder, self.marker))


@dataclass
class Run:
    name: str
    path: str   # the --save folder
    tag: str    # its newest complete checkpoint, fixed at start

    @property
    def iteration(self) -> int:
        return tag_iteration(self.tag)


def parse_runs(value: str) -> list[tuple[str, str]]:
    """RUNS="NAME=PATH NAME=PATH ..." -> [(name, path template)]."""
    runs = []
    for word in words(value):
        name, sep, path = word.partition("=")
        if not sep or not path or not _NAME.match(name):
            raise LaunchError(f"RUNS: '{word}' is not NAME=PATH (a run's name, letters, digits and ._+-, then its "
                              "--save folder; {seed} in PATH is replaced by each seed)")
        if name in (n for n, _ in runs):
            raise LaunchError(f"RUNS: the name '{name}' is given twice")
        runs.append((name, path))
    if not runs:
        raise LaunchError("RUNS is not set: RUNS=\"lev=checkpoints/lev-s{seed} tied=checkpoints/tied-s{seed}\" (each "
                          "run's --save folder)")
    return runs


def pin_run(name: str, path: str) -> Run:
    if not os.path.isdir(path):
        raise LaunchError(f"RUNS: {name}={path}: no such folder")
    tag = find_latest(path)
    if tag is None:
        raise LaunchError(f"RUNS: {name}={path}: no complete checkpoint (a training run's --save folder holds "
                          "iter_NNNNNNN/complete.json)")
    return Run(name, path, tag)


@dataclass
class EvaluationPlan:
    output_dir: str
    seeds: list[str]          # [""] without SEEDS: the stages' folders are then OUTPUT_DIR's own
    runs: dict                # seed -> [Run]
    baseline: str
    stages: list[Stage]
    dry_run: bool
    force: bool


def seed_dir(output_dir: str, seed: str) -> str:
    return os.path.join(output_dir, f"s{seed}") if seed else output_dir


def _perplexity(env, runs: list[Run], baseline: str, out: str) -> Stage:
    cmd = ["python", "-m", "megatron_lev.evaluate"]
    cmd += [w for r in runs for w in ("--model", f"{r.name}={os.path.join(r.path, r.tag)}")]
    cmd += ["--baseline", baseline]
    data = get(env, "EVAL_DATA_PATH", get(env, "VALID_DATA_PATH"))
    if data:
        cmd += ["--data-path", *check_blend("EVAL_DATA_PATH" if env.get("EVAL_DATA_PATH") else "VALID_DATA_PATH",
                                            data)]
    if env.get("EVAL_TOKENS"):
        cmd += ["--eval-tokens", str(require_int("EVAL_TOKENS", env["EVAL_TOKENS"], 1))]
    freq = get(env, "FREQ_DATASET", get(env, "DATA_PATH"))
    if freq:
        cmd += ["--freq-dataset", *check_blend("FREQ_DATASET" if env.get("FREQ_DATASET") else "DATA_PATH", freq)]
        for buckets in words(get(env, "BUCKETS", "quantile:5 log:10")):
            cmd += ["--buckets", buckets]
    if switch("BF16", get(env, "BF16", "1")):
        cmd.append("--bf16")
    folder = os.path.join(out, "evaluation")
    return Stage("perplexity", folder, "evaluation.json", cmd + ["--output-dir", folder + ".partial"])


def _curves(env, runs: list[Run], baseline: str, out: str) -> Stage:
    for r in runs:
        if not os.path.isfile(os.path.join(r.path, "metrics.jsonl")):
            raise LaunchError(f"RUNS: {r.name}={r.path} has no metrics.jsonl (the curves read it): leave 'curves' "
                              "out of STAGES")
    folder = os.path.join(out, "curves")
    cmd = ["python", "-m", "megatron_lev.evaluation.curves",
           *[w for r in runs for w in ("--run", f"{r.name}={r.path}")], "--baseline", baseline,
           "--metric", get(env, "CURVES_METRIC", "valid_loss"), "--output-dir", folder + ".partial"]
    return Stage("curves", folder, "curves.json", cmd)


def _export(env, run: Run, folder: str, card: list[str]) -> list[str]:
    cmd = ["python", os.path.join(env["MEGATRON_LEV_DIR"], "tools", "convert_to_hf.py"), "--load", run.path,
           "--iteration", str(run.iteration), "--output", folder + ".partial",
           "--dtype", get(env, "EXPORT_DTYPE", "bf16")]
    if env.get("LICENSE"):
        cmd += ["--license", env["LICENSE"]]
    if env.get("HF_DATASET"):
        cmd += ["--dataset", env["HF_DATASET"]]
    return cmd + card


def _downstream(env, runs: list[Run], baseline: str, out: str) -> Stage:
    data_dir = env.get("TASK_DATA_DIR")
    if not data_dir:
        raise LaunchError("TASK_DATA_DIR is not set: the folder of <task>.jsonl files the downstream stage reads "
                          "(write it once where there is network: python -m megatron_lev.evaluation.downstream "
                          "--export-data DIR), or leave 'downstream' and 'release' out of STAGES")
    if not os.path.isdir(data_dir):
        raise LaunchError(f"TASK_DATA_DIR={data_dir}: no such folder")
    folder = os.path.join(out, "downstream")
    cmd = ["python", "-m", "megatron_lev.evaluation.downstream",
           *[w for r in runs for w in ("--model", f"{r.name}={os.path.join(out, 'hf', r.name)}")],
           "--baseline", baseline, "--data-dir", data_dir, "--batch-size", get(env, "EVAL_BATCH_SIZE", "16"),
           "--dtype", "bfloat16" if switch("BF16", get(env, "BF16", "1")) else "float32"]
    if env.get("TASKS"):
        cmd += ["--tasks", env["TASKS"]]
    if env.get("NUM_FEWSHOT"):
        cmd += ["--num-fewshot", str(require_int("NUM_FEWSHOT", env["NUM_FEWSHOT"]))]
    if env.get("LIMIT"):
        cmd += ["--limit", str(require_int("LIMIT", env["LIMIT"], 1))]
    # The tasks' data is local: lm-eval and datasets must not reach for the Hub from a compute node.
    return Stage("downstream", folder, "downstream.json", cmd + ["--output-dir", folder + ".partial"],
                 env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})


def seed_stages(env, chosen: list[str], runs: list[Run], baseline: str, out: str) -> list[Stage]:
    stages = []
    if "perplexity" in chosen:
        stages.append(_perplexity(env, runs, baseline, out))
    if "curves" in chosen:
        stages.append(_curves(env, runs, baseline, out))
    for r in runs:
        folder = os.path.join(out, "hf", r.name)
        if "export" in chosen:
            stages.append(Stage("export", folder, "config.json", _export(env, r, folder, [])))
        elif "downstream" in chosen and not os.path.isfile(os.path.join(folder, "config.json")):
            raise LaunchError(f"STAGES has 'downstream' but not 'export', and {folder} does not exist: lm-eval "
                              "scores the exports")
    if "downstream" in chosen or "release" in chosen:
        downstream = _downstream(env, runs, baseline, out)
        if "downstream" in chosen:
            stages.append(downstream)
        elif not downstream.done():
            raise LaunchError(f"STAGES has 'release' but not 'downstream', and {downstream.folder}/downstream.json "
                              "does not exist: the release's card carries the downstream scores")
    if "release" in chosen:
        for r in runs:
            folder = os.path.join(out, "release", r.name)
            card = ["--downstream", f"{os.path.join(out, 'downstream', 'downstream.json')}:{r.name}"]
            stages.append(Stage("release", folder, "README.md", _export(env, r, folder, card)))
    return stages


def resolve_evaluation(env: dict, repo: str) -> EvaluationPlan:
    env["MEGATRON_LEV_DIR"] = repo
    if not env.get("OUTPUT_DIR"):
        raise LaunchError("OUTPUT_DIR is not set: the folder the evaluation writes into (e.g. eval/exp-1.2b)")
    templates = parse_runs(env.get("RUNS", ""))
    names = [n for n, _ in templates]
    baseline = get(env, "BASELINE", names[0])
    if baseline not in names:
        raise LaunchError(f"BASELINE={baseline} is not a run of RUNS ({', '.join(names)})")
    chosen = words(get(env, "STAGES", " ".join(STAGES)))
    for stage in chosen:
        if stage not in STAGES:
            raise LaunchError(f"STAGES: unknown stage '{stage}' (the stages: {' '.join(STAGES)})")
    seeds = words(env.get("SEEDS"))
    for seed in seeds:
        if not _NAME.match(seed):
            raise LaunchError(f"SEEDS: '{seed}' is not a seed label (letters, digits, ._+-)")
    if len(set(seeds)) != len(seeds):
        raise LaunchError(f"SEEDS={env['SEEDS']} repeats a seed")
    uses_seed = any("{seed}" in path for _, path in templates)
    if uses_seed and not seeds:
        raise LaunchError("RUNS has {seed} in a path but SEEDS is not set (e.g. SEEDS=\"1 2 3\")")
    if seeds and not uses_seed:
        raise LaunchError("SEEDS is set but no path of RUNS has {seed}: every seed would evaluate the same runs")
    if "seeds" in chosen and len(seeds) < 2:
        chosen = [s for s in chosen if s != "seeds"]  # one seed: nothing to summarise over
    output_dir = os.path.abspath(env["OUTPUT_DIR"])
    runs, stages = {}, []
    for seed in seeds or [""]:
        runs[seed] = [pin_run(n, path.replace("{seed}", seed)) for n, path in templates]
        stages += seed_stages(env, chosen, runs[seed], baseline, seed_dir(output_dir, seed))
    if "seeds" in chosen:
        folder = os.path.join(output_dir, "seeds")
        cmd = ["python", "-m", "megatron_lev.evaluation.seeds",
               *[w for s in seeds for w in ("--seed-dir", f"{s}={seed_dir(output_dir, s)}")],
               *[w for n in names if n != baseline for w in ("--pair", f"{n}:{baseline}")],
               "--output-dir", folder + ".partial"]
        stages.append(Stage("seeds", folder, "seeds.json", cmd))
    return EvaluationPlan(output_dir, seeds or [""], runs, baseline, stages,
                          dry_run=switch("DRY_RUN", get(env, "DRY_RUN", "0")),
                          force=switch("FORCE", get(env, "FORCE", "0")))


def _describe(stage: Stage, output_dir: str) -> str:
    return f"{stage.name} -> {os.path.relpath(stage.folder, output_dir)}"


def run_stage(stage: Stage, env: Mapping[str, str]) -> int:
    """Runs one stage into its .partial folder and renames it into place; its exit status."""
    if os.path.lexists(stage.partial):
        shutil.rmtree(stage.partial)  # a stopped earlier attempt's: never read
    os.makedirs(os.path.dirname(stage.partial), exist_ok=True)
    sys.stdout.flush()
    rc = subprocess.run(stage.cmd, env={**env, **stage.env}).returncode
    if rc != 0:
        return rc
    if not os.path.isfile(os.path.join(stage.partial, stage.marker)):
        print(f"{stamp()} {stage.name}: the command succeeded but wrote no {stage.marker} in {stage.partial}",
              flush=True)
        return 1
    if os.path.lexists(stage.folder):  # FORCE: the old folder goes only now that the new one is whole
        shutil.rmtree(stage.folder)
    os.replace(stage.partial, stage.folder)
    return 0


def run_evaluation(env: dict, repo: str) -> int:
    plan = resolve_evaluation(env, repo)
    for seed, runs in plan.runs.items():
        label = f"seed {seed}: " if seed else ""
        print(f"{stamp()} {label}" + ", ".join(f"{r.name} = {r.path} at {r.tag}" for r in runs), flush=True)
    todo = []
    for stage in plan.stages:
        if stage.done() and not plan.force:
            print(f"{stamp()} {_describe(stage, plan.output_dir)}: done, skipping (FORCE=1 redoes it)", flush=True)
        else:
            todo.append(stage)
    for number, stage in enumerate(todo, 1):
        print(f"{stamp()} [{number}/{len(todo)}] {_describe(stage, plan.output_dir)}: {print_cmd(stage.cmd)}",
              flush=True)
        if plan.dry_run:
            continue
        rc = run_stage(stage, env)
        if rc != 0:
            print(f"{stamp()} {stage.name} failed (exit status {rc}); the stages before it are kept, and "
                  "resubmitting the job goes on from this one", flush=True)
            return rc
    if not plan.dry_run:
        print(f"{stamp()} done: {plan.output_dir}", flush=True)
    return 0

