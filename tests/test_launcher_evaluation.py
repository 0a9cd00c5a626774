"""slurm/evaluate.sh's stages (megatron_lev/launcher/evaluation.py) without a cluster: the
commands each stage runs, the refusals in one line, a finished stage skipped and FORCE, a stage
cut short leaving nothing that counts as done. The whole job under a real Slurm, on a trained
run: tests/test_slurm_cluster.py::test_evaluation_and_release_as_a_job."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lev.launcher.evaluation import Stage, resolve_evaluation, run_stage
from megatron_lev.launcher.shell import LaunchError
from tests.test_slurm import REPO, run_script


def _save_folder(path: Path, iterations=(5, 10)) -> Path:
    """A --save folder with complete checkpoints at `iterations` (`latest` the newest)."""
    for it in iterations:
        tag = path / f"iter_{it:07d}"
        tag.mkdir(parents=True)
        (tag / "complete.json").write_text("{}")
    (path / "latest").write_text(f"iter_{max(iterations):07d}")
    (path / "metrics.jsonl").write_text('{"iteration": 5, "consumed_tokens": 10, "valid_loss": 3.0}\n')
    return path


@pytest.fixture()
def runs(tmp_path):
    for seed in ("1", "2"):
        _save_folder(tmp_path / f"lev-s{seed}", (5, 10))
        _save_folder(tmp_path / f"tied-s{seed}", (5, 10, 15))
    (tmp_path / "tasks").mkdir()
    return tmp_path


def _env(runs, **extra):
    return {"RUNS": f"lev={runs}/lev-s{{seed}} tied={runs}/tied-s{{seed}}", "SEEDS": "1 2", "BASELINE": "tied",
            "OUTPUT_DIR": str(runs / "eval"), "TASK_DATA_DIR": str(runs / "tasks"), **extra}


def _args(cmd: list[str], name: str) -> list[str]:
    return [cmd[i + 1] for i, word in enumerate(cmd) if word == name]


def test_the_stages_commands(runs):
    plan = resolve_evaluation(_env(runs, EVAL_TOKENS="1000", LICENSE="apache-2.0", TASKS="piqa", BF16="0"), str(REPO))
    out = runs / "eval"
    assert [(s.name, os.path.relpath(s.folder, out)) for s in plan.stages] == [
        ("perplexity", "s1/evaluation"), ("curves", "s1/curves"), ("export", "s1/hf/lev"), ("export", "s1/hf/tied"),
        ("downstream", "s1/downstream"), ("release", "s1/release/lev"), ("release", "s1/release/tied"),
        ("perplexity", "s2/evaluation"), ("curves", "s2/curves"), ("export", "s2/hf/lev"), ("export", "s2/hf/tied"),
        ("downstream", "s2/downstream"), ("release", "s2/release/lev"), ("release", "s2/release/tied"),
        ("seeds", "seeds")]
    perplexity, curves, export, _, downstream, release = plan.stages[7:13]
    # Every run pinned to its newest complete checkpoint: the tied runs at 15, lev at 10.
    assert _args(perplexity.cmd, "--model") == [f"lev={runs}/lev-s2/iter_0000010", f"tied={runs}/tied-s2/iter_0000015"]
    assert (_args(perplexity.cmd, "--eval-tokens"), _args(perplexity.cmd, "--baseline")) == (["1000"], ["tied"])
    assert "--bf16" not in perplexity.cmd and _args(perplexity.cmd, "--output-dir") == [f"{out}/s2/evaluation.partial"]
    assert _args(curves.cmd, "--run") == [f"lev={runs}/lev-s2", f"tied={runs}/tied-s2"]
    assert (_args(export.cmd, "--load"), _args(export.cmd, "--iteration"), _args(export.cmd, "--license")) == (
        [f"{runs}/lev-s2"], ["10"], ["apache-2.0"])
    assert _args(downstream.cmd, "--model") == [f"lev={out}/s2/hf/lev", f"tied={out}/s2/hf/tied"]
    assert (_args(downstream.cmd, "--tasks"), _args(downstream.cmd, "--dtype")) == (["piqa"], ["float32"])
    assert downstream.env == {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    assert _args(release.cmd, "--downstream") == [f"{out}/s2/downstream/downstream.json:lev"]
    assert _args(plan.stages[-1].cmd, "--seed-dir") == [f"1={out}/s1", f"2={out}/s2"]
    assert _args(plan.stages[-1].cmd, "--pair") == ["lev:tied"]


def test_one_set_of_runs_and_a_subset_of_stages(runs):
    plan = resolve_evaluation({"RUNS": f"a={runs}/lev-s1 b={runs}/tied-s1", "OUTPUT_DIR": str(runs / "e"),
                               "STAGES": "curves perplexity seeds", "VALID_DATA_PATH": ""}, str(REPO))
    # The stages in their own order; no seeds stage with one seed; the baseline is the first run.
    assert [(s.name, s.folder) for s in plan.stages] == [("perplexity", f"{runs}/e/evaluation"),
                                                          ("curves", f"{runs}/e/curves")]
    assert _args(plan.stages[0].cmd, "--baseline") == ["a"] and "--data-path" not in plan.stages[0].cmd


@pytest.mark.parametrize("change, message", [
    ({"RUNS": ""}, "RUNS is not set: "),
    ({"RUNS": "lev"}, "RUNS: 'lev' is not NAME=PATH "),
    ({"RUNS": "a={p}/lev-s{{seed}} a={p}/tied-s{{seed}}"}, "RUNS: the name 'a' is given twice"),
    ({"BASELINE": "untied"}, "BASELINE=untied is not a run of RUNS (lev, tied)"),
    ({"STAGES": "perplexity export-hf"}, "STAGES: unknown stage 'export-hf' (the stages: perplexity curves export "
                                        "downstream release seeds)"),
    ({"SEEDS": ""}, "RUNS has {{seed}} in a path but SEEDS is not set"),
    ({"SEEDS": "1 2 1"}, "SEEDS=1 2 1 repeats a seed"),
    ({"SEEDS": "1 3"}, "RUNS: lev={p}/lev-s3: no such folder"),
    ({"TASK_DATA_DIR": ""}, "TASK_DATA_DIR is not set: "),
    ({"TASK_DATA_DIR": "{p}/none"}, "TASK_DATA_DIR={p}/none: no such folder"),
    ({"STAGES": "release"}, "STAGES has 'release' but not 'downstream', and {p}/eval/s1/downstream/downstream.json "
                            "does not exist"),
    ({"STAGES": "downstream"}, "STAGES has 'downstream' but not 'export', and {p}/eval/s1/hf/lev does not exist"),
    ({"EVAL_TOKENS": "10M"}, "EVAL_TOKENS=10M is not a non-negative integer"),
    ({"EVAL_DATA_PATH": "{p}/val"}, "EVAL_DATA_PATH: dataset prefix '{p}/val' has no {p}/val.bin / {p}/val.idx"),
    ({"OUTPUT_DIR": ""}, "OUTPUT_DIR is not set"),
])
def test_refusals_name_the_variable(runs, change, message):
    env = _env(runs, **{k: v.format(p=runs) for k, v in change.items()})
    with pytest.raises(LaunchError) as refused:
        resolve_evaluation(env, str(REPO))
    assert str(refused.value).startswith(message.format(p=runs))


def test_a_run_without_a_complete_checkpoint_is_refused(runs):
    (runs / "lev-s2" / "iter_0000005" / "complete.json").unlink()
    (runs / "lev-s2" / "iter_0000010" / "complete.json").unlink()
    with pytest.raises(LaunchError, match=rf"^RUNS: lev={runs}/lev-s2: no complete checkpoint"):
        resolve_evaluation(_env(runs), str(REPO))


def _writer(folder: Path, marker: str, text: str, rc: int = 0) -> list[str]:
    """A stage command that writes `marker` into its .partial folder, then exits with `rc`."""
    code = (f"import os; os.makedirs({str(folder) + '.partial'!r}, exist_ok=True); "
            f"open(os.path.join({str(folder) + '.partial'!r}, {marker!r}), 'w').write({text!r}); raise SystemExit({rc})")
    return [sys.executable, "-c", code]


def test_a_stage_is_complete_or_absent(tmp_path):
    folder = tmp_path / "out" / "evaluation"
    failed = Stage("perplexity", str(folder), "evaluation.json", _writer(folder, "evaluation.json", "cut", rc=3))
    assert run_stage(failed, os.environ) == 3
    assert not folder.exists() and not failed.done()  # the .partial never counts
    stage = Stage("perplexity", str(folder), "evaluation.json", _writer(folder, "evaluation.json", "first"))
    assert run_stage(stage, os.environ) == 0 and stage.done()
    assert (folder / "evaluation.json").read_text() == "first" and not Path(stage.partial).exists()
    # FORCE: the new folder replaces the old one only when whole; a failure leaves the old one.
    again = Stage("perplexity", str(folder), "evaluation.json", _writer(folder, "evaluation.json", "second", rc=1))
    assert run_stage(again, os.environ) == 1 and (folder / "evaluation.json").read_text() == "first"
    redone = Stage("perplexity", str(folder), "evaluation.json", _writer(folder, "evaluation.json", "second"))
    assert run_stage(redone, os.environ) == 0 and (folder / "evaluation.json").read_text() == "second"
    # A command that succeeds without its marker is a failure.
    empty = Stage("curves", str(tmp_path / "out" / "curves"), "curves.json", _writer(tmp_path / "out" / "curves",
                                                                                        "other.json", ""))
    assert run_stage(empty, os.environ) == 1 and not empty.done()


def test_dry_run_marks_finished_stages_and_force_redoes_them(runs):
    (runs / "eval" / "s1" / "evaluation").mkdir(parents=True)
    (runs / "eval" / "s1" / "evaluation" / "evaluation.json").write_text("{}")
    (runs / "eval" / "s2" / "curves.partial").mkdir(parents=True)  # cut short: redone
    env = {k: str(v) for k, v in _env(runs, DRY_RUN="1").items()}
    proc = run_script("evaluate.sh", **env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(f"seed 1: lev = {runs}/lev-s1 at iter_0000010, tied = {runs}/tied-s1 at iter_0000015")
    assert any(line.endswith("perplexity -> s1/evaluation: done, skipping (FORCE=1 redoes it)") for line in lines)
    commands = [line for line in lines if "] [" in line]
    assert len(commands) == 14 and "[1/14] curves -> s1/curves: python -m megatron_lev.evaluation.curves" in commands[0]
    assert any("curves -> s2/curves: " in line for line in commands)
    seeds = shlex.split(commands[-1].split(": ", 1)[1])
    assert seeds[:3] == ["python", "-m", "megatron_lev.evaluation.seeds"]
    forced = run_script("evaluate.sh", **{**env, "FORCE": "1"})
    assert sum("] [" in line for line in forced.stdout.splitlines()) == 15
    assert not (runs / "eval" / "seeds").exists()  # a dry run writes nothing


def test_a_refusal_is_one_line(runs):
    proc = run_script("evaluate.sh", **{k: str(v) for k, v in _env(runs, BASELINE="x").items()})
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        1, "", "slurm: error: BASELINE=x is not a run of RUNS (lev, tied)\n")


def test_the_launcher_runs_the_stages_and_stops_at_a_failure(runs, tmp_path):
    """Through `python -m megatron_lev.launcher evaluate` with a stand-in `python` on PATH whose
    perplexity stage fails: the job's status is the stage's, and no later stage ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f"#!/bin/sh\necho \"ran: $*\" >> {tmp_path}/ran.log\nexit 7\n")
    (bin_dir / "python").chmod(0o755)
    env = {**os.environ, **_env(runs), "PATH": f"{bin_dir}:{os.environ['PATH']}", "MEGATRON_LEV_DIR": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "megatron_lev.launcher", "evaluate"], env=env, cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 7, proc.stderr
    assert (tmp_path / "ran.log").read_text().count("ran: ") == 1
    assert "perplexity failed (exit status 7); the stages before it are kept" in proc.stdout
