"""Issue 17's analyses: seeds summarised as mean +- std (exact numbers on synthetic runs),
the experiment corpus's hashed document order, and the papers'-vocabulary configs."""
from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np
import pytest

from megatron_lev.evaluation import seeds as sd
from tests.test_evaluate import png_size

# Per seed: overall perplexities (tied, lev, untied, lev-deeper), per-bucket perplexities of
# 2 predicted-token buckets and 2 input-token buckets, and the valid-loss curves.
SEEDS = {
    "1": {"ppl": {"tied": 100.0, "lev": 90.0, "untied": 80.0, "lev-deeper": 76.0},
          "pred": {"tied": [200.0, 10.0], "lev": [100.0, 10.0]}, "input": {"tied": [50.0, 20.0], "lev": [45.0, 18.0]},
          "tied": [5.0, 4.0, 3.0], "lev": [5.0, 3.5, 2.5]},
    "2": {"ppl": {"tied": 100.0, "lev": 80.0, "untied": 80.0, "lev-deeper": 84.0},
          "pred": {"tied": [200.0, 10.0], "lev": [200.0, 11.0]}, "input": {"tied": [50.0, 20.0], "lev": [40.0, 20.0]},
          "tied": [5.0, 4.0, 3.0], "lev": [5.0, 4.0, 3.0]},
    "3": {"ppl": {"tied": 100.0, "lev": 70.0, "untied": 80.0, "lev-deeper": 80.0},
          "pred": {"tied": [100.0, 10.0], "lev": [40.0, 9.0]}, "input": {"tied": [50.0, 20.0], "lev": [35.0, None]},
          "tied": [5.0, 4.0, 3.0], "lev": [5.0, 4.5, 3.5]},
}
TOKENS = [0, 1000, 2000]


def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        if path.endswith(".jsonl"):
            f.writelines(json.dumps(r) + "\n" for r in data)
        else:
            json.dump(data, f)


def _bucket_section(ppls: dict, models) -> dict:
    buckets = [{"label": "rare", "num_types": 900, "train_token_share": 0.25},
               {"label": "common", "num_types": 100, "train_token_share": 0.75}]
    return {"buckets": buckets, "models": {m: [{"eval_tokens": 0 if p is None else 10, "ppl": p,
                                                "nll": None if p is None else math.log(p)}
                                               for p in ppls.get(m, [20.0, 20.0])] for m in models}}


def make_seed_dirs(root) -> dict[str, str]:
    """Seed directories laid out like experiments/run.sh's, from SEEDS."""
    from megatron_lev.evaluation.curves import main as curves_main

    dirs = {}
    for seed, spec in SEEDS.items():
        base = os.path.join(root, f"s{seed}")
        models = list(spec["ppl"])
        report = {"models": {m: {"ppl": p, "loss": math.log(p)} for m, p in spec["ppl"].items()},
                  "frequency": {"bucketings": {"quantile:2": _bucket_section(spec["pred"], models)},
                                "input_bucketings": {"quantile:2": _bucket_section(spec["input"], models)}}}
        _write(os.path.join(base, "ppl", "evaluation.json"), report)
        for name in ("tied", "lev"):
            _write(os.path.join(root, "runs", f"{name}-s{seed}", "metrics.jsonl"),
                   [{"iteration": i, "consumed_tokens": t, "valid_loss": v}
                    for i, (t, v) in enumerate(zip(TOKENS, spec[name]))])
        curves_main(["--run", f"tied={root}/runs/tied-s{seed}", "--run", f"lev={root}/runs/lev-s{seed}",
                     "--baseline", "tied", "--output-dir", os.path.join(base, "curves-lev")])
        dirs[seed] = base
    return dirs


def test_seeds_mean_std_of_overall_bucket_and_curve_changes(tmp_path):
    dirs = make_seed_dirs(str(tmp_path))
    out = tmp_path / "seeds"
    summary = sd.main([*(a for s, d in dirs.items() for a in ("--seed-dir", f"{s}={d}")), "--pair", "lev:tied",
                       "--pair", "lev-deeper:untied", "--output-dir", str(out), "--plot-width", "700",
                       "--plot-height", "400"])
    lev, deeper = summary["pairs"]
    # Overall: -10, -20, -30 % -> mean -20, sample std 10; lev-deeper: -5, +5, 0 -> 0 +- 5.
    assert lev["ppl_change_pct"]["per_seed"] == pytest.approx({"1": -10.0, "2": -20.0, "3": -30.0})
    assert (lev["ppl_change_pct"]["mean"], lev["ppl_change_pct"]["std"], lev["ppl_change_pct"]["n"]) == \
        pytest.approx((-20.0, 10.0, 3))
    assert (deeper["ppl_change_pct"]["mean"], deeper["ppl_change_pct"]["std"]) == pytest.approx((0.0, 5.0))
    assert lev["loss_difference"]["mean"] == pytest.approx(np.mean([math.log(0.9), math.log(0.8), math.log(0.7)]))
    # Predicted-token buckets: rare -50, 0, -60 -> mean -36.667, std 32.146; common 0, +10, -10.
    rare, common = lev["buckets"]["predicted"]["quantile:2"]["ppl_change_pct"]
    assert rare["mean"] == pytest.approx(-110 / 3) and rare["std"] == pytest.approx(np.std([-50, 0, -60], ddof=1))
    assert (common["mean"], common["std"]) == pytest.approx((0.0, 10.0))
    # Input-token buckets: rare -10, -20, -30; common -10, 0 and a bucket without tokens (n=2).
    rare, common = lev["buckets"]["input"]["quantile:2"]["ppl_change_pct"]
    assert (rare["mean"], rare["std"], rare["n"]) == pytest.approx((-20.0, 10.0, 3))
    assert (common["mean"], common["std"], common["n"]) == pytest.approx((-5.0, math.sqrt(50), 2))
    assert common["per_seed"]["3"] is None
    # Curves: tied ends at 3.0 after 2000 tokens. Seed 1 reaches 3.0 at 1500 tokens (1.333x),
    # seed 2 at 2000 (1x), seed 3 never (n=2).
    curves = lev["curves"]
    assert curves["tokens_to_target"]["per_seed"] == pytest.approx({"1": 1500.0, "2": 2000.0, "3": None})
    assert (curves["tokens_to_target"]["mean"], curves["tokens_to_target"]["n"]) == pytest.approx((1750.0, 2))
    assert curves["speedup"]["mean"] == pytest.approx((2000 / 1500 + 1) / 2)
    assert curves["final_loss_difference"]["mean"] == pytest.approx(0.0)
    assert "curves" not in deeper  # no curves.json with baseline untied
    # Mean curves with a +-std band: lev at 1000 tokens: 3.5, 4.0, 4.5 -> 4.0 +- 0.5.
    bands = sd.mean_curves(curves["metrics_files"], ["tied", "lev"])
    assert bands["lev"][0] == TOKENS and bands["lev"][1] == pytest.approx([5.0, 4.0, 3.0])
    assert bands["lev"][2] == pytest.approx([0.0, 0.5, 0.5]) and bands["tied"][2] == pytest.approx([0, 0, 0])

    saved = json.load(open(out / "seeds.json"))
    assert saved["pairs"][0]["ppl_change_pct"]["mean"] == pytest.approx(-20.0)
    md = (out / "seeds.md").read_text()
    assert "| validation perplexity change | -20.0 ± 10.0% (n=3) | -10.00, -20.00, -30.00 |" in md
    assert "| rare | 900 | 0.250 | -20.0 ± 10.0% (n=3) | +0.0 ± 0.0% (n=3) |" in md  # input stratum, both pairs
    assert "| speed-up (tied tokens / lev tokens) | 1.17 ± 0.24x (n=2) | 1.33x, 1.00x, n/a |" in md
    for name in ("changes_predicted_quantile_2.png", "changes_input_quantile_2.png", "loss_lev_vs_tied.png"):
        assert png_size(out / name) == (700, 400)

    with pytest.raises(SystemExit, match="no evaluation.json scores both 'lev' and 'small'"):
        sd.main(["--seed-dir", f"1={dirs['1']}", "--pair", "lev:small", "--output-dir", str(out)])
    with pytest.raises(SystemExit, match="--pair 'lev': expected MODEL:BASELINE"):
        sd.main(["--seed-dir", f"1={dirs['1']}", "--pair", "lev", "--output-dir", str(out)])
    with pytest.raises(SystemExit, match="--seed-dir 9=.*nowhere: no such directory"):
        sd.main(["--seed-dir", f"9={tmp_path / 'nowhere'}", "--pair", "lev:tied", "--output-dir", str(out)])
    assert sd.mean_std([4.0]) == {"mean": 4.0, "std": None, "n": 1}
    # The paired t-test of the loss differences (3 seeds, 2 degrees of freedom: two-sided
    # p = 1 - |t| / sqrt(2 + t^2) in closed form).
    diffs = [math.log(0.9), math.log(0.8), math.log(0.7)]
    t = np.mean(diffs) / (np.std(diffs, ddof=1) / math.sqrt(3))
    test = lev["loss_difference"]["paired_t_test"]
    assert (test["t"], test["p"], test["n"]) == pytest.approx((t, 1 - abs(t) / math.sqrt(2 + t * t), 3))
    assert f"| t = {t:+.2f}, p = {1 - abs(t) / math.sqrt(2 + t * t):.3f} (n=3) |" in md
    # The curves here differ by a constant per seed: every slope is 0.
    assert curves["difference_slope"]["per_seed"] == pytest.approx({"1": 0.0, "2": 0.0, "3": 0.0}, abs=1e-12)
    assert "| slope of the loss difference vs ln(tokens) (nats per e-fold) | +0.0000 ± 0.0000 (n=3) |" in md


def test_difference_slope_against_log_tokens(tmp_path):
    """MODEL - BASELINE = -0.1 ln(tokens / 1000) + c: slope -0.1 per e-fold of tokens, read on the
    baseline's tokens (the model logs at other steps and is interpolated), the 0-token point left out."""
    tokens = [0, 1000, 2000, 4000, 8000]
    base = [9.0] + [5.0 - 0.3 * math.log(t / 1000) for t in tokens[1:]]
    _write(str(tmp_path / "base" / "metrics.jsonl"),
           [{"iteration": i, "consumed_tokens": t, "valid_loss": v} for i, (t, v) in enumerate(zip(tokens, base))])
    model_tokens = [0, 1000, 4000, 8000]  # no point at 2000: interpolated there
    model = [9.0] + [5.2 - 0.4 * math.log(t / 1000) for t in model_tokens[1:]]
    _write(str(tmp_path / "model" / "metrics.jsonl"),
           [{"iteration": i, "consumed_tokens": t, "valid_loss": v}
            for i, (t, v) in enumerate(zip(model_tokens, model))])
    interpolated = 5.2 - 0.4 * math.log(4) * 1 / 3  # linear between 1000 and 4000 tokens, at 2000
    diffs = [0.2, interpolated - base[2], 0.2 - 0.1 * math.log(4), 0.2 - 0.1 * math.log(8)]
    expected = np.polyfit(np.log(tokens[1:]), diffs, 1)[0]
    assert sd.difference_slope(str(tmp_path / "model"), str(tmp_path / "base")) == pytest.approx(expected, rel=1e-12)
    assert -0.12 < expected < -0.1  # -0.1, pulled by the interpolated point
    assert sd.paired_t_test({"1": -0.1, "2": -0.1}) == {"t": None, "p": None, "n": 2}
    test = sd.paired_t_test({"1": -0.1, "2": -0.2, "3": None})
    assert (test["t"], test["n"]) == pytest.approx((-3.0, 2))  # mean -0.15 / (0.0707 / sqrt 2)


def test_hashed_corpus_order_is_a_sha1_sorted_permutation(tmp_path):
    from megatron_lev.data.corpus import build_python_corpus, read_documents
    from megatron_lev.data.python_text import ordered_documents

    docs = [("a", "zeta"), ("b", "alpha"), ("a", "mid")]
    assert ordered_documents(docs, "source") == docs
    assert ordered_documents(docs, "hashed") == sorted(docs, key=lambda d: hashlib.sha1(d[1].encode()).digest())
    with pytest.raises(ValueError, match="unknown document order 'random'"):
        ordered_documents(docs, "random")
    # The corpus writer passes the order through: the same documents, sorted by SHA-1 of their text.
    texts = {}
    for order in ("source", "hashed"):
        path = str(tmp_path / f"{order}.jsonl")
        build_python_corpus(path, sources=["pydoc_topics"], order=order)
        texts[order] = [r.texts[0] for r in read_documents(path)]
    assert len(texts["source"]) > 50 and texts["hashed"] != texts["source"]
    assert texts["hashed"] == sorted(texts["source"], key=lambda t: hashlib.sha1(t.encode()).digest())


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps needs a positive integer, got '0'"),
    (["--lanes", "two"], "--lanes needs a positive integer, got 'two'"),
    (["--seeds", "1 x"], "--seeds needs integers, got 'x'"),
    (["--frobnicate"], "unknown argument '--frobnicate'"),
    (["--models", "lev levv"], "--models: no model 'levv' (one of: tied untied lev lev-init lev-deeper)"),
])
def test_experiment_script_refuses_bad_flags_in_one_line(tmp_path, args, message):
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "experiments", "run.sh")
    proc = subprocess.run(["bash", script, "--out", str(tmp_path / "out"), *args], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip() == f"experiments/run.sh: {message}" + (
        " (see --help)" if "unknown" in message else "")
    assert not (tmp_path / "out").exists()  # nothing built before the flags are checked


def _training_run(path, seed, valid_losses):
    """A --save folder as far as final_loss_by_seed reads it: config.yaml and metrics.jsonl."""
    os.makedirs(path)
    with open(os.path.join(path, "config.yaml"), "w") as f:
        f.write(f"config: demo-lev\ntraining:\n  seed: {seed}\n")
    _write(os.path.join(path, "metrics.jsonl"),
           [{"iteration": 50 * (i + 1), "consumed_tokens": 1000 * (i + 1), "valid_loss": v}
            for i, v in enumerate(valid_losses)])
    return str(path)


def test_demo_seeds_pair_final_losses_with_a_paired_t_test(tmp_path):
    """`python -m megatron_lev.demo seeds`: lev vs tied per seed from the runs' last logged
    validation loss, mean +- std over seeds and the paired t-test, from the demo's layout."""
    from scipy import stats

    from megatron_lev import demo

    layout = demo.Layout.under(str(tmp_path / "demo"))
    finals = {1234: (5.0, 5.3), 1: (5.1, 5.2), 2: (4.9, 5.35)}  # seed: (lev, tied)
    _training_run(layout.run_lev, 1234, [6.0, 5.0])
    _training_run(layout.run_tied, 1234, [6.0, 5.3])
    for seed in (1, 2):
        _training_run(os.path.join(layout.seed_runs, f"lev-s{seed}"), seed, [6.0, finals[seed][0]])
        _training_run(os.path.join(layout.seed_runs, f"tied-s{seed}"), seed, [6.0, finals[seed][1]])
    assert demo.main(["seeds", "--out", layout.out]) == 0
    result = json.load(open(layout.seeds))
    differences = [finals[s][0] - finals[s][1] for s in (1234, 1, 2)]
    assert list(result["per_seed"]) == ["1234", "1", "2"]
    assert [r["difference"] for r in result["per_seed"].values()] == pytest.approx(differences, abs=1e-12)
    assert result["difference"]["mean"] == pytest.approx(np.mean(differences))
    assert result["difference"]["std"] == pytest.approx(np.std(differences, ddof=1))
    assert result["per_seed"]["1"]["ppl_change_pct"] == pytest.approx(100 * (math.exp(-0.1) - 1))
    assert result["paired_t_test"]["p"] == pytest.approx(stats.ttest_1samp(differences, 0.0).pvalue)
    # a pair whose runs have different seeds is refused
    _training_run(os.path.join(layout.seed_runs, "lev-s3"), 3, [5.0])
    _training_run(os.path.join(layout.seed_runs, "tied-s3"), 4, [5.0])
    assert demo.main(["seeds", "--out", layout.out]) == 2
