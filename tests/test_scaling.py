"""Issue 32: v1's effective parameters (megatron_lev.evaluation.scaling) recover known
multipliers from synthetic runs, flag a model outside the dense range, and refuse too few sizes."""
from __future__ import annotations

import csv
import json
import math
import os

import numpy as np
import pytest

from megatron_lev.evaluation import scaling as sc
from tests.test_evaluate import png_size

E, A, ALPHA = 2.0, 60.0, 0.3  # the synthetic dense family: L(N) = E + A N^-alpha
SIZES = [500_000, 800_000, 1_250_000, 2_000_000, 3_200_000, 5_000_000]
SPREAD = (-0.004, 0.0, 0.004)  # three seeds around the law, mean exactly on it


def law(n):
    return E + A * n ** -ALPHA


def synthetic_runs(models: dict[str, tuple[int, float]], sizes=SIZES, spread=SPREAD) -> list[sc.Run]:
    """Dense 'untied' runs on the law, and each model NAME: (N, multiplier) with its mean loss
    that of a dense model of multiplier * N parameters."""
    runs = [sc.Run("untied", n, seed, law(n) + d, n // 2) for n in sizes for seed, d in enumerate(spread, 1)]
    for kind, (n, multiplier) in models.items():
        runs += [sc.Run(kind, n, seed, law(multiplier * n) + d, n // 3) for seed, d in enumerate(spread, 1)]
    return runs


def test_known_multipliers_are_recovered_with_intervals_that_hold_them():
    result = sc.analyse(synthetic_runs({"lev-deeper": (1_000_000, 2.0), "lev": (1_500_000, 0.6)}), "untied",
                        bootstrap=300, seed=1)
    fit = result["fit"]
    assert fit["E"] == pytest.approx(E, abs=1e-5)
    assert fit["A"] == pytest.approx(A, rel=1e-4)
    assert fit["alpha"] == pytest.approx(ALPHA, abs=1e-6)
    assert fit["chi2"] == pytest.approx(0.0, abs=1e-8)
    deeper, lev = result["models"]["lev-deeper"], result["models"]["lev"]
    assert deeper["multiplier"] == pytest.approx(2.0, rel=1e-5)
    assert deeper["n_eff"] == pytest.approx(2_000_000, rel=1e-5)
    assert lev["multiplier"] == pytest.approx(0.6, rel=1e-5)
    for m, true in ((deeper, 2.0), (lev, 0.6)):
        lo, hi = m["ci95"]
        assert lo < true < hi and hi / lo < 3  # the interval holds the truth and is finite
        assert m["extrapolated"] is False
        # Every dense mean lies on the law: leaving a size out changes nothing.
        assert m["sensitivity"]["leave_one_out_range"] == pytest.approx([true, true], rel=1e-4)
        # Log-linear interpolation between the bracketing sizes is close, not exact (the law is curved).
        assert m["sensitivity"]["interpolated"] == pytest.approx(true, rel=0.03)
    # With E forced to 0 the power law must bend to the data: a different multiplier.
    assert abs(deeper["sensitivity"]["E_zero"] - 2.0) > 0.05


def test_a_pure_power_law_gives_the_same_multiplier_with_e_zero():
    runs = [sc.Run("dense", n, s, 40.0 * n ** -0.25 * (1 + d)) for n in SIZES for s, d in ((1, -1e-3), (2, 1e-3))]
    runs += [sc.Run("lev", 1_000_000, s, 40.0 * 1_700_000 ** -0.25 * (1 + d)) for s, d in ((1, -1e-3), (2, 1e-3))]
    result = sc.analyse(runs, "dense", bootstrap=200)
    m = result["models"]["lev"]
    assert m["multiplier"] == pytest.approx(1.7, rel=2e-3)
    assert m["sensitivity"]["E_zero"] == pytest.approx(1.7, rel=1e-6)


def test_a_model_outside_the_dense_range_is_flagged_extrapolated():
    # Better than the largest dense size: its N_eff lies beyond every fitted point.
    result = sc.analyse(synthetic_runs({"lev-big": (4_000_000, 3.0), "lev-in": (1_000_000, 1.5)}), "untied",
                        bootstrap=200)
    big, inside = result["models"]["lev-big"], result["models"]["lev-in"]
    assert big["extrapolated"] is True and big["sensitivity"]["interpolated"] is None
    assert big["multiplier"] == pytest.approx(3.0, rel=1e-4)
    assert inside["extrapolated"] is False


def test_a_loss_below_the_irreducible_loss_has_an_infinite_n_eff():
    runs = synthetic_runs({}) + [sc.Run("lev", 1_000_000, s, E - 0.1) for s in (1, 2)]
    m = sc.analyse(runs, "untied", bootstrap=100)["models"]["lev"]
    assert math.isinf(m["n_eff"]) and math.isinf(m["multiplier"]) and m["extrapolated"] is True


def test_weights_pooled_per_size_and_none():
    runs = synthetic_runs({"lev": (1_000_000, 2.0)})
    pooled = sc.analyse(runs, "untied", weights="pooled", bootstrap=50)["fit"]
    # Pooled: every size has 3 seeds of spread 0.004 -> sigma = 0.004 / sqrt(3).
    assert [s["sigma"] for s in pooled["sizes"]] == pytest.approx([0.004 / math.sqrt(3)] * len(SIZES))
    assert pooled["pooled_seed_std"] == pytest.approx(0.004)
    per_size = sc.analyse(runs, "untied", weights="per-size", bootstrap=50)["fit"]
    assert [s["sigma"] for s in per_size["sizes"]] == pytest.approx([0.004 / math.sqrt(3)] * len(SIZES))
    none = sc.analyse(runs, "untied", weights="none", bootstrap=50)["fit"]
    assert [s["sigma"] for s in none["sizes"]] == [1.0] * len(SIZES)
    one_seed = [r for r in runs if r.seed == 1]
    with pytest.raises(ValueError, match="needs a size with 2 or more seeds"):
        sc.analyse(one_seed, "untied", bootstrap=10)


def test_one_seed_everywhere_gives_no_interval():
    """With one seed per size and model (--weights none) the bootstrap has no noise to draw: its
    "interval" would be the point estimate twice. None is reported, and the table says why."""
    runs = [r for r in synthetic_runs({"lev": (1_000_000, 2.0)}) if r.seed == 1]
    result = sc.analyse(runs, "untied", weights="none", bootstrap=50)
    m = result["models"]["lev"]
    assert m["multiplier"] == pytest.approx(2.0, rel=0.05) and m["ci95"] is None
    assert m["ci95_missing"] == "no seed spread for the dense sizes or lev (one seed each): no interval"
    table = sc.scaling_markdown(result, "Effective parameters")
    assert "| none (1 seed) |" in table and "lev: no seed spread for the dense sizes or lev" in table
    # Seeds on the dense side only: the model's single seed takes the pooled variance, an interval.
    dense3 = synthetic_runs({}) + [r for r in runs if r.kind == "lev"]
    lo, hi = sc.analyse(dense3, "untied", bootstrap=200, seed=1)["models"]["lev"]["ci95"]
    assert lo < 2.0 < hi


def test_fewer_than_four_dense_sizes_are_refused_in_one_line(tmp_path):
    runs = synthetic_runs({"lev": (1_000_000, 2.0)}, sizes=SIZES[:3])
    path = tmp_path / "runs.csv"
    sc.write_runs(str(path), runs)
    with pytest.raises(SystemExit) as exc:
        sc.main(["--runs", str(path), "--dense", "untied", "--output", str(tmp_path / "out")])
    message = str(exc.value)
    assert message == "megatron_lev.evaluation.scaling: error: --dense untied: 3 sizes, the fit needs at least 4"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--bootstrap", "100"], "--bootstrap 100: at least 2000 draws"),
    (["--dense", "tied"], "--dense 'tied': no runs of that kind"),
])
def test_bad_flags_are_refused_in_one_line(tmp_path, args, message):
    path = tmp_path / "runs.csv"
    sc.write_runs(str(path), synthetic_runs({"lev": (1_000_000, 2.0)}))
    argv = ["--runs", str(path), "--dense", "untied", "--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exc:
        sc.main(argv + args)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_bad_csv_lines_name_the_file_and_line(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("kind,params,seed,loss\nuntied,1000,1,3.5\nuntied,abc,2,3.4\n")
    with pytest.raises(ValueError, match=r"runs.csv line 3: invalid literal"):
        sc.read_runs(str(path))
    path.write_text("kind,params,loss\nuntied,1000,3.5\n")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['seed'\]"):
        sc.read_runs(str(path))
    path.write_text("kind,params,seed,loss\nuntied,1000,1,3.5\nuntied,1000,1,3.6\n")
    with pytest.raises(ValueError, match="line 3: kind 'untied', params 1000, seed 1 appears twice"):
        sc.read_runs(str(path))


def test_the_command_builds_runs_csv_from_evaluations_and_writes_json_md_and_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(sc, "MIN_BOOTSTRAP", 200)  # the 2,000-draw floor has its own test; this one is about files
    # Evaluations as megatron_lev.evaluate writes them: names -> kinds, seeds and counts recorded.
    runs = synthetic_runs({"lev-deeper": (1_000_000, 2.0)})
    evaluations = []
    for seed in (1, 2, 3):
        models = {}
        for r in (r for r in runs if r.seed == seed):
            width = f"-w{r.params // 1000}" if r.kind == "untied" else ""
            name = f"{r.kind}{width}-lr4e-3-s{seed}"
            models[name] = {"kind": "checkpoint", "path": f"/runs/{name}", "checkpoint": f"/runs/{name}/iter_0001200",
                            "seed": seed, "tokens": 65536, "loss": r.loss,
                            "parameter_counts": {"total": r.params, "nonembedding": r.nonembedding_params}}
        path = tmp_path / f"eval{seed}.json"
        path.write_text(json.dumps({"models": models}))
        evaluations.append(str(path))
    out = tmp_path / "out"
    report = sc.main(["--evaluation", *evaluations, "--runs", str(tmp_path / "runs.csv"), "--dense", "untied",
                      "--output", str(out), "--bootstrap", "200"])
    with open(tmp_path / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(runs)
    assert {r["kind"] for r in rows} == {"untied", "lev-deeper"}
    assert sorted(int(r["params"]) for r in rows if r["kind"] == "lev-deeper") == [1_000_000] * 3
    saved = json.loads((out / "scaling.json").read_text())
    assert saved["fit"]["alpha"] == pytest.approx(ALPHA, abs=1e-6)
    m = saved["models"]["lev-deeper"]
    assert set(m) >= {"params", "loss_mean", "n_eff", "multiplier", "ci95", "extrapolated"}
    assert m["multiplier"] == pytest.approx(2.0, rel=1e-5) and m["bootstrap_draws"] == 200
    # The second count: non-embedding halves the dense sizes and thirds the model's.
    nonemb = saved["nonembedding"]["models"]["lev-deeper"]
    assert nonemb["params"] == 1_000_000 // 3
    assert nonemb["n_eff"] == pytest.approx(1_000_000, rel=1e-4)
    assert report["models"]["lev-deeper"]["multiplier"] == m["multiplier"]
    md = (out / "scaling.md").read_text()
    assert "| lev-deeper | 1.000M | 3 |" in md and "2.000x" in md and "1.47-2.11x" in md
    assert png_size(str(out / "scaling.png")) == (1200, 800)
    assert png_size(str(out / "scaling_nonembedding.png")) == (1200, 800)


def test_kind_from_run_names():
    assert sc.kind_of("untied-w64-lr4e-3-s2", []) == "untied"
    assert sc.kind_of("untied-lr4e-3-s1", []) == "untied"
    assert sc.kind_of("lev-deeper-lr2e-3-s3", []) == "lev-deeper"
    assert sc.kind_of("lev-deeper", []) == "lev-deeper"
    assert sc.kind_of("untied-w64-lr4e-3-s2", [("untied-w64*", "small")]) == "small"


def test_n_eff_inverts_the_law():
    pl = sc.PowerLaw(E=1.5, A=30.0, alpha=0.25)
    for n in (1e5, 3e6, 2e9):
        assert pl.n_eff(float(pl.loss(n))) == pytest.approx(n, rel=1e-9)
    assert np.isinf(pl.n_eff(1.5))
