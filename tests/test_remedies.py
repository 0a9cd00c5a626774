"""Issue 49, item 3: the screen of remedies for the modes' shared direction
(experiments/remedies.py). The table is rebuilt from the committed result files and must be what
docs/experiments.md quotes; its figures are the evaluator's and the trainer's own records, and the
bracket rule (each option at its best rate, "open" until both neighbours ran) is the plan's."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "experiments", "results")
RUNS = os.path.join(RESULTS, "issue49", "v8000", "runs")
BASELINE_RUNS = os.path.join(RESULTS, "issue42", "v8000", "runs")


def _remedies():
    spec = importlib.util.spec_from_file_location("remedies", os.path.join(REPO, "experiments", "remedies.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loss(runs: str, run: str) -> float:
    with open(os.path.join(runs, run, "evaluation.json")) as f:
        return json.load(f)["models"][run]["loss"]


def test_the_remedies_table_is_what_the_docs_quote_and_its_figures_are_the_runs(tmp_path):
    result = _remedies().main(["--runs", RUNS, "--baseline-runs", BASELINE_RUNS, "--output", str(tmp_path)])
    table = (tmp_path / "remedies.md").read_text()
    with open(os.path.join(REPO, "docs", "experiments.md")) as f:
        assert table.strip() in f.read(), "docs/experiments.md does not quote experiments/remedies.py's table"
    with open(os.path.join(os.path.dirname(RUNS), "remedies.md")) as f:
        assert f.read() == table
    rows = {r["label"]: r for r in result["rows"]}
    plain = rows["plain LEV"]
    # Plain LEV's seed 1 is this session's run; seeds 2-3 are issue 42's.
    assert plain["loss"]["1"] == _loss(RUNS, "lev-lr2e-3-s1")
    assert plain["loss"]["2"] == _loss(BASELINE_RUNS, "lev-lr2e-3-s2")
    centred = rows["centred modes"]
    run = f"lev-center-lr{centred['rate']}-s1"
    assert centred["minus_plain_lev"]["1"] == pytest.approx(_loss(RUNS, run) - _loss(RUNS, "lev-lr2e-3-s1"))
    assert centred["ahead"] == (centred["minus_plain_lev"]["1"] < -0.017)
    # Step 0's statistics are the mean over its seeds of the trainer's first record.
    firsts = []
    for seed in centred["seeds"]:
        with open(os.path.join(RUNS, f"lev-center-lr{centred['rate']}-s{seed}", "metrics.jsonl")) as f:
            firsts.append(json.loads(f.readline()))
    assert {r["iteration"] for r in firsts} == {0}
    for stat in ("embedding_effective_rank", "embedding_mean_cosine"):
        assert centred["statistics"][0][stat] == pytest.approx(sum(r[stat] for r in firsts) / len(firsts))
    assert centred["statistics"][0]["seeds"] == len(firsts)


def test_each_option_takes_its_best_rate_and_its_bracket_is_open_until_both_neighbours_ran():
    best_rate = _remedies().best_rate

    def found(**losses):
        return {("x", rate.replace("_", "-")): {"1": {"loss": loss}} for rate, loss in losses.items()}

    assert best_rate(found(), "x") == (None, False)
    assert best_rate(found(**{"2e_3": 4.0}), "x") == ("2e-3", False)
    assert best_rate(found(**{"1e_3": 4.1, "2e_3": 4.0, "4e_3": 4.05}), "x") == ("2e-3", True)
    # Best at the top of 1e-3 / 2e-3 / 4e-3: open until 8e-3 ran, then 8e-3 itself is an end.
    assert best_rate(found(**{"1e_3": 4.1, "2e_3": 4.0, "4e_3": 3.9}), "x") == ("4e-3", False)
    assert best_rate(found(**{"1e_3": 4.1, "2e_3": 4.0, "4e_3": 3.9, "8e_3": 3.95}), "x") == ("4e-3", True)
    assert best_rate(found(**{"2e_3": 4.0, "4e_3": 3.9, "8e_3": 3.8}), "x") == ("8e-3", False)
    assert best_rate(found(**{"5e_4": 3.7, "1e_3": 3.8, "2e_3": 4.0}), "x") == ("5e-4", False)


def _remedy_widths():
    spec = importlib.util.spec_from_file_location("remedy_widths", os.path.join(REPO, "experiments",
                                                                                 "remedy_widths.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_widths_table_is_what_the_docs_quote_and_its_differences_are_the_runs(tmp_path):
    """experiments/remedy_widths.py: the table docs/experiments.md quotes, rebuilt from the committed
    runs; each difference is the two runs' own evaluator losses at the same seed."""
    result = _remedy_widths().main(["--runs", RUNS, "--baseline-runs", BASELINE_RUNS, "--output", str(tmp_path)])
    table = (tmp_path / "remedy_widths.md").read_text()
    with open(os.path.join(REPO, "docs", "experiments.md")) as f:
        assert table.strip() in f.read(), "docs/experiments.md does not quote experiments/remedy_widths.py's table"
    with open(os.path.join(os.path.dirname(RUNS), "remedy_widths.md")) as f:
        assert f.read() == table
    for width in result["widths"]:
        rows = {r["label"]: r for r in width["rows"]}
        plain = rows["plain LEV (issue 42)"]
        assert plain["loss"] == {s: _loss(BASELINE_RUNS, f"{plain['run']}-s{s}") for s in plain["seeds"]}
        centred = rows.get("centred modes")
        if centred is None:
            continue
        # The rate is the best seed-1 loss of the bracket that ran.
        assert centred["seed1_by_rate"][centred["rate"]] == min(centred["seed1_by_rate"].values())
        for against, other in (("plain LEV", plain), ("frozen random table", rows.get("frozen random table"))):
            if other is None:
                continue
            expected = {s: _loss(RUNS, f"{centred['run']}-s{s}") - other["loss"][s]
                        for s in centred["seeds"] if s in other["loss"]}
            assert width["centred_minus"][against]["per_seed"] == pytest.approx(expected, abs=1e-12)
