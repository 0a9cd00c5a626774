"""Issue 42: the generator screen and the frozen table (experiments/screen.py). The table is
rebuilt from the committed result files and must be what docs/experiments.md quotes; its figures
are checked against the evaluator's and the trainer's own records."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from megatron_lev.evaluation.seeds import holm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, "experiments", "results", "issue42", "v8000", "runs")


def _screen():
    spec = importlib.util.spec_from_file_location("screen", os.path.join(REPO, "experiments", "screen.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loss(run: str) -> float:
    with open(os.path.join(RUNS, run, "evaluation.json")) as f:
        return json.load(f)["models"][run]["loss"]


def test_the_screen_is_what_the_docs_quote_and_its_figures_are_the_runs(tmp_path):
    result = _screen().main(["--runs", RUNS, "--output", str(tmp_path)])
    table = (tmp_path / "screen.md").read_text().strip()
    with open(os.path.join(REPO, "docs", "experiments.md")) as f:
        assert table in f.read(), "docs/experiments.md does not quote experiments/screen.py's table"
    with open(os.path.join(os.path.dirname(RUNS), "screen.md")) as f:
        assert f.read() == (tmp_path / "screen.md").read_text()
    rows = {r["run"]: r for r in result["rows"]}
    # kappa 32 against plain LEV, seed by seed, from the evaluator's files themselves.
    k32 = rows["lev-k32-lr2e-3"]
    for seed in k32["seeds"]:
        assert k32["minus_plain_lev"][seed] == pytest.approx(_loss(f"lev-k32-lr2e-3-s{seed}") - _loss(f"lev-lr2e-3-s{seed}"))
    # Holm over the author's options that got seeds (tables, the frozen one and the clipping run are
    # not among them).
    tested = {r["run"]: r["test"]["p"] for r in result["rows"]
              if r["test"] and r["run"] in ("lev-nowd-lr2e-3", "lev-kscale-lr2e-3", "lev-unnorm-lr2e-3",
                                            "lev-k32-lr2e-3", "lev-author-lr2e-3")}
    assert set(tested) >= {"lev-k32-lr2e-3", "lev-author-lr2e-3"}
    assert {k: rows[k]["p_holm"] for k in tested} == pytest.approx(holm(tested))
    # The statistics at step 0 are the trainer's first record (seed 1 of plain LEV alone: one seed).
    with open(os.path.join(RUNS, "lev-nowd-lr2e-3-s1", "metrics.jsonl")) as f:
        first = json.loads(f.readline())
    assert rows["lev-nowd-lr2e-3"]["statistics"][0]["embedding_mean_cosine"] == first["embedding_mean_cosine"]
