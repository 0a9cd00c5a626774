"""Issue 23's learning-rate sweep: the table ranks each kind's learning rates by final
validation loss (exact numbers on synthetic runs), and the driver refuses bad flags."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from megatron_lev.evaluation import lr_sweep

REPO = os.path.join(os.path.dirname(__file__), "..")

# kind -> lr -> seed -> validation losses at iterations 50 and 100
RUNS = {"tied": {"1e-3": {1: [6.0, 5.50], 2: [6.0, 5.70]}, "2e-3": {1: [5.9, 5.40], 2: [5.9, 5.60]},
                 "4e-3": {1: [6.1, 5.80], 2: [6.1, 5.90]}},
        "lev-deeper": {"0.001": {1: [6.0, 5.30]}, "0.002": {1: [6.0, 5.20]}}}


def write_run(root, kind, lr, seed, losses, steps=(50, 100)):
    run = os.path.join(root, f"{kind}-lr{lr}-s{seed}")
    os.makedirs(run)
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        for step, loss in zip(steps, losses):
            f.write(json.dumps({"iteration": step, "consumed_tokens": step * 2048, "loss": loss + 0.1}) + "\n")
            f.write(json.dumps({"iteration": step, "consumed_tokens": step * 2048, "valid_loss": loss}) + "\n")
    return run


def test_sweep_ranks_each_kind_by_mean_final_validation_loss(tmp_path):
    for kind, by_lr in RUNS.items():
        for lr, by_seed in by_lr.items():
            for seed, losses in by_seed.items():
                write_run(tmp_path, kind, lr, seed, losses)
    os.makedirs(tmp_path / "not-a-run")  # other folders are ignored
    summary = lr_sweep.summarise(str(tmp_path), 100, str(tmp_path / "table"))
    tied = summary["kinds"]["tied"]
    assert [(r["lr"], round(r["valid_loss"], 6), r["seeds"]) for r in tied["rows"]] == [
        (2e-3, 5.5, 2), (1e-3, 5.6, 2), (4e-3, 5.85, 2)]
    assert tied["best_lr"] == 2e-3 and not tied["best_at_edge"]
    deeper = summary["kinds"]["lev-deeper"]
    assert deeper["best_lr"] == 2e-3 and deeper["best_at_edge"]  # the largest lr of its grid won
    assert len(summary["runs"]) == 8
    table = (tmp_path / "table" / "sweep.md").read_text()
    assert "| 0.002 | 5.5000 | +0.0000 | 2 |" in table and "| 0.004 | 5.8500 | +0.3500 | 2 |" in table
    assert "best peak learning rate 0.002 (best at the grid's edge" in table
    assert json.loads((tmp_path / "table" / "sweep.json").read_text())["kinds"]["tied"]["best_lr"] == 2e-3


def test_sweep_refuses_an_unfinished_run(tmp_path):
    run = write_run(tmp_path, "lev", "2e-3", 1, [6.0])
    with pytest.raises(ValueError, match=f"{run}: last validation at iteration 50, not --steps 100"):
        lr_sweep.summarise(str(tmp_path), 100)


def test_run_names_parse_to_kind_lr_seed():
    assert lr_sweep.parse_run_name("lev-init-lr4e-3-s12") == ("lev-init", 4e-3, 12)
    assert lr_sweep.parse_run_name("tied-lr0.0005-s1") == ("tied", 5e-4, 1)
    assert lr_sweep.parse_run_name("tied-s1") is None and lr_sweep.parse_run_name("tied-lr0-s1") is None


@pytest.mark.parametrize("args, message", [
    (["--kinds", "tied", "--lrs", "1e-3", "--steps", "10"], "--config-pattern is required"),
    (["--config-pattern", "experiments/configs/exp-tied.yaml", "--kinds", "tied", "--lrs", "1e-3", "--steps", "10"],
     "--config-pattern needs {} (the kind), got 'experiments/configs/exp-tied.yaml'"),
    (["--config-pattern", "experiments/configs/exp-{}.yaml", "--kinds", "tied", "--lrs", "fast", "--steps", "10"],
     "--lrs needs numbers like 2e-3, got 'fast'"),
    (["--config-pattern", "experiments/configs/exp-{}.yaml", "--kinds", "tide", "--lrs", "1e-3", "--steps", "10"],
     "--kinds tide: no config experiments/configs/exp-tide.yaml"),
])
def test_sweep_script_refuses_bad_flags_in_one_line(tmp_path, args, message):
    out = tmp_path / "sweep"
    proc = subprocess.run(["bash", "experiments/lr_sweep.sh", "--out", str(out), *args], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip() == f"experiments/lr_sweep.sh: {message}"
    assert not out.exists()
