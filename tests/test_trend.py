"""Issue 42: the gap against width (megatron_lev.evaluation.trend) on synthetic evaluations whose
gaps lie exactly on known lines: slopes, their t-interval, the crossing, the pre-stated readings."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from megatron_lev.evaluation import trend

WIDTHS = (64, 128, 256)


def write_eval(path, gap: float, params: int, tokens: int = 1000, baseline_tokens: int | None = None):
    path.mkdir(parents=True)
    models = {"lev": {"loss": 4.0 + gap, "parameters": params, "tokens": tokens},
              "tied": {"loss": 4.0, "parameters": params - 100, "tokens": baseline_tokens or tokens}}
    (path / "evaluation.json").write_text(json.dumps({"models": models}))


def points(tmp_path, lines: dict[str, tuple[float, float]]):
    """--point flags of gaps a + b log2(width) for each seed: lines {seed: (a, b)}."""
    flags = []
    for seed, (a, b) in lines.items():
        for w in WIDTHS:
            d = tmp_path / f"w{w}-s{seed}"
            write_eval(d, a + b * math.log2(w), params=1000 * w)
            flags += ["--point", f"{w}:{seed}={d}"]
    return flags


def test_slopes_interval_crossing_and_confound(tmp_path):
    lines = {"1": (0.70, -0.080), "2": (0.76, -0.090), "3": (0.64, -0.070)}
    result = trend.main(points(tmp_path, lines) + ["--model", "lev", "--baseline", "tied", "--train-tokens", "2.4e6",
                                                   "--output-dir", str(tmp_path / "out")])
    for seed, (a, b) in lines.items():
        assert result["per_seed"][seed]["slope"] == pytest.approx(b, abs=1e-12)
        assert result["per_seed"][seed]["intercept"] == pytest.approx(a, abs=1e-12)
    slopes = [b for _, b in lines.values()]
    half = stats.t.ppf(0.975, 2) * np.std(slopes, ddof=1) / math.sqrt(3)
    assert result["slope"]["mean"] == pytest.approx(-0.08)
    assert result["slope"]["ci95"] == pytest.approx([-0.08 - half, -0.08 + half])
    assert result["slope"]["p"] == pytest.approx(stats.ttest_1samp(slopes, 0).pvalue)
    # The mean line 0.70 - 0.08 log2(w) crosses 0 at log2(w) = 8.75; parameters are 1000 w exactly.
    assert result["crossing"]["width"] == pytest.approx(2 ** 8.75)
    assert result["crossing"]["model_parameters"] == pytest.approx(1000 * 2 ** 8.75, rel=1e-9)
    assert result["crossing"]["note"] == "extrapolated beyond the measured widths"
    assert result["by_width"][256]["tokens_per_parameter"] == pytest.approx(2.4e6 / 256000)
    # Gap at 256 = 0.06 <= 0.10 and every slope negative.
    assert result["reading"] == "narrowing with width"
    md = (tmp_path / "out" / "trend.md").read_text()
    assert "Reading: narrowing with width." in md and (tmp_path / "out" / "trend.png").stat().st_size > 0


@pytest.mark.parametrize("lines, expected", [
    ({"1": (0.20, 0.010), "2": (0.22, -0.015), "3": (0.18, 0.000)}, "flat: scale gives no support in range"),
    ({"1": (0.00, 0.050), "2": (0.02, 0.060), "3": (0.01, 0.055)}, "growing: evidence against the mechanism in range"),
    ({"1": (0.60, -0.030), "2": (0.70, 0.020), "3": (0.90, -0.100)}, "undecided"),
])
def test_the_readings_stated_before_the_runs(tmp_path, lines, expected):
    result = trend.main(points(tmp_path, lines) + ["--model", "lev", "--baseline", "tied",
                                                   "--output-dir", str(tmp_path / "out")])
    assert result["reading"] == expected
    if result["slope"]["mean"] >= 0:
        assert result["crossing"]["width"] is None and result["crossing"]["note"].startswith("nowhere")


def test_bad_points_are_refused_in_one_line(tmp_path):
    write_eval(tmp_path / "a", 0.1, 1000, tokens=1000, baseline_tokens=999)
    with pytest.raises(SystemExit, match=r"--point 64:1: lev and tied scored different tokens"):
        trend.main(["--point", f"64:1={tmp_path / 'a'}", "--model", "lev", "--baseline", "tied", "--output-dir",
                    str(tmp_path / "o")])
    write_eval(tmp_path / "b", 0.1, 1000)
    with pytest.raises(SystemExit, match=r"seed 1: gaps at \[64\] only; a slope needs at least 2 widths"):
        trend.main(["--point", f"64:1={tmp_path / 'b'}", "--model", "lev", "--baseline", "tied", "--output-dir",
                    str(tmp_path / "o")])
    with pytest.raises(SystemExit, match=r"no evaluation.json below it scores \['untied'\]"):
        trend.main(["--point", f"64:1={tmp_path / 'b'}", "--model", "lev", "--baseline", "untied", "--output-dir",
                    str(tmp_path / "o")])
