"""Issue 32: loss differences by training-count bin (megatron_lev.evaluation.bins): exact
differences, token mass, paired bootstrap intervals and signs over seeds on synthetic NLLs."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from megatron_lev.evaluation import bins

# 8 token types; training counts put them in bins 0 | 1-9 | 10-99 | 100-999 | >=1000.
COUNTS = np.array([0, 3, 50, 50, 500, 5000, 9000, 0], dtype=np.int64)
TYPE_BIN = [0, 1, 2, 2, 3, 4, 4, 0]


def seed_file(path, seed: int, shift: float):
    """A token_nll.npz: 400 positions cycling through the types; the model is better by 0.5 nats
    where the input token is in bin 0, worse by 0.2 elsewhere, plus a per-seed shift."""
    rng = np.random.default_rng(0)  # the same positions and baseline for every seed
    input_ids = np.arange(400) % 8
    label_ids = (np.arange(400) + 3) % 8
    base = rng.uniform(1.0, 6.0, size=400)
    model = base + np.where(np.isin(input_ids, [0, 7]), -0.5, 0.2) + shift
    path.mkdir(parents=True)
    np.savez_compressed(path / "token_nll.npz", input_ids=input_ids.astype(np.uint16),
                        label_ids=label_ids.astype(np.uint16), train_counts=COUNTS,
                        **{"nll/lev": model.astype(np.float16), "nll/untied": base.astype(np.float16)})


def test_bins_exact_differences_mass_intervals_and_signs(tmp_path):
    for seed, shift in ((1, -0.01), (2, 0.0), (3, 0.04)):
        seed_file(tmp_path / f"s{seed}" / "eval", seed, shift)
    result = bins.main(["--seed-dir", f"1={tmp_path / 's1'}", "--seed-dir", f"2={tmp_path / 's2'}",
                        "--seed-dir", f"3={tmp_path / 's3'}", "--pair", "lev:untied", "--bootstrap", "500",
                        "--output-dir", str(tmp_path / "out")])
    assert result["bins"] == ["0", "1-9", "10-99", "100-999", ">=1000"]
    by_input = {r["bin"]: r for r in result["pairs"]["lev:untied"]["input"]}
    # Mass: types per bin, their training share, and evaluated positions (400 cycling over 8 types).
    assert [by_input[b]["types"] for b in result["bins"]] == [2, 1, 2, 1, 2]
    assert by_input[">=1000"]["train_token_share"] == pytest.approx(14000 / 14603)
    assert [by_input[b]["eval_tokens"] for b in result["bins"]] == [100, 50, 100, 50, 100]
    assert by_input["0"]["eval_token_share"] == pytest.approx(0.25)
    # The difference is exact up to float16 rounding of the NLLs; the mean shift over seeds is +0.01.
    assert by_input["0"]["difference"] == pytest.approx(-0.5 + 0.01, abs=3e-3)
    assert by_input["100-999"]["difference"] == pytest.approx(0.2 + 0.01, abs=3e-3)
    assert by_input["0"]["ppl_change_pct"] == pytest.approx(100 * math.expm1(by_input["0"]["difference"]))
    assert by_input["0"]["per_seed"]["3"] == pytest.approx(-0.5 + 0.04, abs=3e-3)
    assert (by_input["0"]["seeds_below_zero"], by_input["0"]["seeds_above_zero"]) == (3, 0)
    # The t-test over seeds: per-seed differences near -0.51, -0.50, -0.46 against 0.
    expected = stats.ttest_1samp(list(by_input["0"]["per_seed"].values()), 0.0)
    assert by_input["0"]["t_test"]["p"] == pytest.approx(expected.pvalue) and by_input["0"]["t_test"]["p"] < 0.01
    assert by_input["0"]["t_test"]["t"] == pytest.approx(expected.statistic) and by_input["0"]["t_test"]["n"] == 3
    # Constant differences within a bin: the bootstrap interval collapses onto them.
    lo, hi = by_input["0"]["ci95"]
    assert lo <= by_input["0"]["difference"] <= hi and hi - lo < 5e-3
    # By predicted token the bins mix both effects: a real interval around the mean.
    by_label = {r["bin"]: r for r in result["pairs"]["lev:untied"]["predicted"]}
    delta = np.where(np.isin(np.arange(400) % 8, [0, 7]), -0.5, 0.2) + 0.01
    members = np.isin((np.arange(400) + 3) % 8, [0, 7])
    assert by_label["0"]["difference"] == pytest.approx(delta[members].mean(), abs=3e-3)
    assert by_label["all"]["eval_tokens"] == 400
    saved = json.loads((tmp_path / "out" / "bins.json").read_text())
    assert saved["pairs"]["lev:untied"]["input"][0]["eval_tokens"] == 100
    text = (tmp_path / "out" / "bins.md").read_text()
    assert "### lev vs untied, by training count of the input token" in text and "| 0 | 2 |" in text
    assert f"| 3 / 0 | {by_input['0']['t_test']['p']:.3f} |" in text


def split_models(path, out_a, out_b):
    """Move one seed's models into two files, as when a model was evaluated apart."""
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    shared = {k: arrays[k] for k in bins.SHARED_KEYS}
    for out, model in ((out_a, "lev"), (out_b, "untied")):
        out.mkdir(parents=True)
        np.savez_compressed(out / "token_nll.npz", **shared, **{f"nll/{model}": arrays[f"nll/{model}"]})


def test_a_seed_evaluated_apart_gives_the_same_bins(tmp_path):
    for seed, shift in ((1, -0.01), (2, 0.03)):
        seed_file(tmp_path / f"s{seed}", seed, shift)
    whole = bins.main(["--seed-dir", f"1={tmp_path / 's1'}", "--seed-dir", f"2={tmp_path / 's2'}",
                       "--pair", "lev:untied", "--bootstrap", "200", "--output-dir", str(tmp_path / "whole")])
    # seed 1 in two folders (named with a comma), seed 2 in two files below one folder
    split_models(tmp_path / "s1" / "token_nll.npz", tmp_path / "a1", tmp_path / "b1")
    split_models(tmp_path / "s2" / "token_nll.npz", tmp_path / "two" / "lev", tmp_path / "two" / "untied")
    apart = bins.main(["--seed-dir", f"1={tmp_path / 'a1'},{tmp_path / 'b1'}", "--seed-dir", f"2={tmp_path / 'two'}",
                       "--pair", "lev:untied", "--bootstrap", "200", "--output-dir", str(tmp_path / "apart")])
    assert apart["pairs"] == whole["pairs"]
    # a model in two files, files that score different tokens, and a missing folder are refused
    split_models(tmp_path / "s1" / "token_nll.npz", tmp_path / "c1", tmp_path / "d1")
    with pytest.raises(SystemExit, match="model 'lev' is in both"):
        bins.main(["--seed-dir", f"1={tmp_path / 'a1'},{tmp_path / 'c1'}", "--pair", "lev:untied",
                   "--output-dir", str(tmp_path / "o")])
    with np.load(tmp_path / "b1" / "token_nll.npz") as data:
        arrays = {k: data[k] for k in data.files}
    arrays["label_ids"] = arrays["label_ids"][::-1].copy()
    np.savez_compressed(tmp_path / "b1" / "token_nll.npz", **arrays)
    with pytest.raises(SystemExit, match="differ in label_ids: a seed's files must score the same"):
        bins.main(["--seed-dir", f"1={tmp_path / 'a1'},{tmp_path / 'b1'}", "--pair", "lev:untied",
                   "--output-dir", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="nowhere: no such directory"):
        bins.main(["--seed-dir", f"1={tmp_path / 'a1'},{tmp_path / 'nowhere'}", "--pair", "lev:untied",
                   "--output-dir", str(tmp_path / "o")])


def test_bootstrap_interval_matches_the_standard_error_on_a_large_sample():
    rng = np.random.default_rng(3)
    values = rng.normal(0.3, 2.0, size=20_000)
    lo, hi = bins.bootstrap_mean_interval(values, 2000, np.random.default_rng(1))
    se = values.std() / math.sqrt(values.size)
    assert (hi - lo) == pytest.approx(2 * 1.96 * se, rel=0.1)
    assert lo < values.mean() < hi


def test_block_bootstrap_widens_the_interval_by_the_repetition_inside_blocks():
    """Issue 42: positions that share a block (a token repeated inside one document piece) are one
    draw, not many. 1,000 blocks of 20 positions, each block's value repeated 20 times: the token
    bootstrap's interval is the naive standard error over 20,000 values, sqrt(20) too narrow; the
    block bootstrap's is the standard error over the 1,000 independent blocks."""
    rng = np.random.default_rng(5)
    per_block = rng.normal(0.1, 1.0, size=1000)
    values = np.repeat(per_block, 20)
    members = np.ones(values.size, dtype=bool)
    lo, hi = bins.block_bootstrap_mean_interval(values, members, 20, 2000, np.random.default_rng(1))
    assert (hi - lo) == pytest.approx(2 * 1.96 * per_block.std() / math.sqrt(1000), rel=0.1)
    token_lo, token_hi = bins.bootstrap_mean_interval(values, 2000, np.random.default_rng(1))
    assert (hi - lo) / (token_hi - token_lo) == pytest.approx(math.sqrt(20), rel=0.15)
    # Block size 1 is the token bootstrap; a bin of a few members keeps its exact mean inside.
    members = np.zeros(values.size, dtype=bool)
    members[[3, 4, 500, 9000]] = True
    lo, hi = bins.block_bootstrap_mean_interval(values, members, 20, 2000, np.random.default_rng(1))
    assert lo <= values[members].mean() <= hi


def test_bins_block_size_is_in_the_result_and_checked(tmp_path):
    seed_file(tmp_path / "s1", 1, 0.0)
    seed_file(tmp_path / "s2", 2, 0.1)
    args = ["--seed-dir", f"1={tmp_path / 's1'}", "--seed-dir", f"2={tmp_path / 's2'}", "--pair", "lev:untied",
            "--output-dir", str(tmp_path / "o")]
    token = bins.main(args + ["--bootstrap", "500"])
    block = bins.main(args + ["--bootstrap", "500", "--block-size", "40"])
    assert (token["bootstrap_block_size"], block["bootstrap_block_size"]) == (1, 40)
    # The same differences; only the intervals change.
    t_all, b_all = token["pairs"]["lev:untied"]["input"][-1], block["pairs"]["lev:untied"]["input"][-1]
    assert t_all["difference"] == b_all["difference"] and t_all["ci95"] != b_all["ci95"]
    assert "block (40 consecutive positions a block)" in (tmp_path / "o" / "bins.md").read_text()
    with pytest.raises(SystemExit, match="--block-size 0: at least 1 position"):
        bins.main(args + ["--block-size", "0"])


def test_seeds_must_score_the_same_tokens(tmp_path):
    seed_file(tmp_path / "s1", 1, 0.0)
    seed_file(tmp_path / "s2", 2, 0.0)
    data = np.load(tmp_path / "s2" / "token_nll.npz")
    arrays = {k: data[k] for k in data.files}
    arrays["input_ids"] = arrays["input_ids"][::-1].copy()
    np.savez_compressed(tmp_path / "s2" / "token_nll.npz", **arrays)
    with pytest.raises(SystemExit, match="seed 2 .* and seed 1 .* differ in input_ids"):
        bins.main(["--seed-dir", f"1={tmp_path / 's1'}", "--seed-dir", f"2={tmp_path / 's2'}",
                   "--pair", "lev:untied", "--output-dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="no model 'tied'"):
        bins.main(["--seed-dir", f"1={tmp_path / 's1'}", "--pair", "tied:untied", "--output-dir", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="--edges '10,5'"):
        bins.main(["--seed-dir", f"1={tmp_path / 's1'}", "--pair", "lev:untied", "--edges", "10,5",
                   "--output-dir", str(tmp_path / "o")])


def test_bin_labels_and_assignment():
    assert bins.bin_labels((1, 10, 100, 1000)) == ["0", "1-9", "10-99", "100-999", ">=1000"]
    np.testing.assert_array_equal(bins.bin_of_counts(COUNTS, (1, 10, 100, 1000)), TYPE_BIN)
