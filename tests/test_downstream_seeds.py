"""Issue 51: downstream scores with their standard errors, and aggregated over seeds with the CPU
experiments' rules (paired t-test of the per-seed differences, Holm over the pair's rows)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from megatron_lev.evaluation import seeds
from megatron_lev.evaluation.downstream import downstream_table

SCORES = {  # seed -> model -> task -> metrics, as megatron_lev.evaluation.downstream writes them
    "1": {"tied": {"piqa": {"acc": 0.60, "acc_stderr": 0.011, "num_examples": 1838}},
          "lev": {"piqa": {"acc": 0.62, "acc_stderr": 0.012, "num_examples": 1838}}},
    "2": {"tied": {"piqa": {"acc": 0.61, "acc_stderr": 0.013, "num_examples": 1838}},
          "lev": {"piqa": {"acc": 0.615, "acc_stderr": 0.010, "num_examples": 1838}}},
    "3": {"tied": {"piqa": {"acc": 0.59, "acc_stderr": 0.012, "num_examples": 1838}},
          "lev": {"piqa": {"acc": 0.605, "acc_stderr": 0.011, "num_examples": 1838}}},
}


def _seed_dirs(tmp_path) -> dict:
    dirs = {}
    for seed, models in SCORES.items():
        folder = tmp_path / f"s{seed}"
        (folder / "evaluation").mkdir(parents=True)
        (folder / "downstream").mkdir()
        loss = {"tied": 3.0, "lev": 3.0 + 0.01 * int(seed)}
        (folder / "evaluation" / "evaluation.json").write_text(json.dumps(
            {"models": {m: {"loss": v, "ppl": math.exp(v)} for m, v in loss.items()}}))
        (folder / "downstream" / "downstream.json").write_text(json.dumps(
            {"models": {m: {"tasks": tasks} for m, tasks in models.items()}}))
        dirs[seed] = str(folder)
    return dirs


def test_downstream_over_seeds_is_the_paired_test_of_the_per_seed_differences(tmp_path):
    summary = seeds.summarise(_seed_dirs(tmp_path), [("lev", "tied")], str(tmp_path / "out"))
    (row,) = summary["pairs"][0]["downstream"]["rows"]
    assert (row["task"], row["metric"]) == ("piqa", "acc")
    differences = [SCORES[s]["lev"]["piqa"]["acc"] - SCORES[s]["tied"]["piqa"]["acc"] for s in "123"]
    assert list(row["difference"]["per_seed"].values()) == pytest.approx(differences)
    assert row["difference"]["mean"] == pytest.approx(np.mean(differences))
    assert row["difference"]["std"] == pytest.approx(np.std(differences, ddof=1))
    assert row["difference"]["paired_t_test"]["p"] == pytest.approx(stats.ttest_1samp(differences, 0).pvalue)
    assert row["difference"]["p_holm"] == pytest.approx(row["difference"]["paired_t_test"]["p"])  # one row
    assert row["lev_stderr"]["mean"] == pytest.approx(np.mean([0.012, 0.010, 0.011]))
    assert row["tied"]["mean"] == pytest.approx(0.60)
    markdown = (tmp_path / "out" / "seeds.md").read_text()
    assert "| piqa / acc | 1838 | 0.6000 ± 0.0100 (stderr 0.0120) | 0.6133 ± 0.0076 (stderr 0.0110) |" in markdown


def test_the_downstream_table_shows_each_score_with_its_standard_error():
    results = {m: {"tasks": SCORES["1"][m]} for m in ("tied", "lev")}
    table = downstream_table(results, "tied")
    assert table.to_json()["rows"][0]["stderr"] == {"tied": 0.011, "lev": 0.012}
    assert "| piqa / acc | 1,838 | 0.6000 ± 0.0110 | 0.6200 ± 0.0120 | +3.3% |" in table.to_markdown()
