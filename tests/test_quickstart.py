"""The one-command demo, `bash tools/quickstart.sh --quick`, end to end (the suite's most
expensive test, about 2-3 minutes on 2 cores): Python's documentation as a Pile corpus, a
SentencePiece tokenizer, preprocessing, tiny-lev at TP=2 and tiny-tied at DP=2 under
torchrun, step-0 vs final validation loss, the frequency-stratified perplexity report,
curves, plots, the Hugging Face export and generation with transformers.

The demo runs with this interpreter (PYTHON=sys.executable: no venv is built), into a
temporary folder; a second run must reuse every stage.
"""
import json
import math
import os
import subprocess
import sys

import pytest

from megatron_lev.demo import Layout, readme_figures

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_STEPS = 30  # tools/quickstart.sh --quick


def quickstart(*flags, timeout=900):
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", os.path.join(REPO, "tools", "quickstart.sh"), *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def timings(layout):
    with open(layout.timings, encoding="utf-8") as f:
        return {stage: status for stage, _, status in (line.rstrip("\n").split("\t") for line in f)}


def git_status():
    """The repository's `git status` (None outside a git checkout, e.g. an unpacked sdist)."""
    proc = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                          text=True)
    return proc.stdout if proc.returncode == 0 else None


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The quick demo, run once for this file; returns (layout, the run's stdout)."""
    out = str(tmp_path_factory.mktemp("quickstart") / "demo")
    before = git_status()
    proc = quickstart("--quick", "--out", out)
    assert proc.returncode == 0, f"quickstart.sh --quick failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert git_status() == before  # everything went under --out
    return Layout.under(out), proc.stdout


def test_every_artefact_exists_and_is_printed(demo):
    layout, stdout = demo
    ppl, curves = layout.eval_ppl, layout.eval_curves
    expected = [
        layout.corpus, layout.tokenizer, layout.dataset + ".bin", layout.dataset + ".idx",
        os.path.join(layout.run_lev, "latest"), os.path.join(layout.run_tied, "latest"),
        os.path.join(layout.run_lev, "metrics.jsonl"), os.path.join(layout.run_tied, "metrics.jsonl"),
        os.path.join(layout.run_lev, "train.log"), layout.valid_loss,
        os.path.join(ppl, "evaluation.json"), os.path.join(ppl, "evaluation.md"),
        os.path.join(ppl, "freq_quantile_5.png"), os.path.join(ppl, "freq_log_10.png"),
        os.path.join(curves, "curves.json"), os.path.join(curves, "loss_vs_tokens.png"),
        os.path.join(layout.hf_lev, "config.json"), os.path.join(layout.hf_lev, "model.safetensors"),
        os.path.join(layout.hf_lev, "modeling_lev.py"), os.path.join(layout.hf_lev, "tokenizer.json"),
        layout.generation, layout.summary_json, layout.summary_md,
    ]
    missing = [p for p in expected if not os.path.isfile(p) or os.path.getsize(p) == 0]
    assert not missing, f"missing or empty artefacts: {missing}"
    # The summary names every artefact's location.
    summary = read_json(layout.summary_json)
    for path in (layout.corpus, layout.tokenizer, layout.run_lev, layout.run_tied, layout.hf_lev, layout.generation,
                 os.path.join(ppl, "evaluation.md"), os.path.join(curves, "loss_vs_tokens.png")):
        assert path in summary["artefacts"].values(), path
        assert path in stdout, path
    # Both runs trained to the end with the requested layouts (TP=2 for LEV, DP=2 for tied).
    for run, tp, dp in ((layout.run_lev, 2, 1), (layout.run_tied, 1, 2)):
        with open(os.path.join(run, "latest"), encoding="utf-8") as f:
            assert f.read().strip() == f"iter_{QUICK_STEPS:07d}"
        training = read_json(os.path.join(run, f"iter_{QUICK_STEPS:07d}", "config.json"))["training"]
        assert (training["tensor_model_parallel_size"], training["data_parallel_size"]) == (tp, dp)


def test_lev_validation_loss_falls_below_step_zero(demo):
    layout, _ = demo
    losses = read_json(layout.valid_loss)
    for name, r in losses.items():
        assert r["iteration"] == QUICK_STEPS
        # The step-0 number is measured as the trainer measures valid_loss: recomputing the
        # final one the same way reproduces the trainer's logged value.
        assert r["logged_at_iteration"] == QUICK_STEPS
        assert r["final"] == pytest.approx(r["final_logged"], abs=1e-4), name
        # Untrained: about ln(vocab size) = ln(1000) = 6.91 (uniform predictions).
        assert r["initial"] == pytest.approx(math.log(1000), abs=0.1), name
    lev = losses["lev"]
    assert lev["final"] < lev["initial"] - 0.3, lev
    # metrics.jsonl falls too, and the perplexity report scores the same model.
    valid = [r["valid_loss"] for r in map(json.loads, open(os.path.join(layout.run_lev, "metrics.jsonl")))
             if "valid_loss" in r]
    assert len(valid) == 3 and valid[-1] < valid[0]
    report = read_json(os.path.join(layout.eval_ppl, "evaluation.json"))
    assert set(report["models"]) == {"lev", "tied"} and report["baseline"] == "tied"
    assert report["models"]["lev"]["loss"] < lev["initial"] - 0.3
    bucketings = report["frequency"]["bucketings"]
    assert set(bucketings) == {"quantile:5", "log:10"}
    # Bucket NLLs weighted by their token counts give the overall loss.
    rows = bucketings["quantile:5"]["models"]["lev"]
    total = sum(r["eval_tokens"] for r in rows)
    assert total == report["eval_tokens"]
    weighted = sum(r["nll"] * r["eval_tokens"] for r in rows if r["eval_tokens"]) / total
    assert weighted == pytest.approx(report["models"]["lev"]["loss"], abs=1e-6)


def test_hf_export_generates_our_greedy_text(demo):
    layout, _ = demo
    generation = read_json(layout.generation)
    assert generation["architecture"] == "LevForCausalLM"
    assert len(generation["samples"]) == 2
    for sample in generation["samples"]:
        assert sample["prompt_ids_match_training_tokenizer"], sample
        assert 1 <= len(sample["new_ids"]) <= 16
        assert sample["text"], sample  # decoded, non-empty
        # transformers' generate() on the export == our own greedy decoding on the checkpoint.
        assert sample["new_ids"] == sample["our_greedy_ids"]
        assert sample["matches_our_greedy"]


def test_rerun_reuses_everything_and_other_input_is_refused(demo, tmp_path):
    layout, _ = demo
    proc = quickstart("--quick", "--out", layout.out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = timings(layout)
    assert stages.pop("environment") == "given"
    assert set(stages.values()) == {"reused"}, stages
    assert len(stages) == 10
    other = tmp_path / "mine.jsonl"
    other.write_text('{"text": "hello"}\n')
    proc = quickstart("--quick", "--out", layout.out, "--input", str(other))
    assert proc.returncode == 2
    assert f"{layout.out} was built from 'python documentation" in proc.stderr


def test_publish_writes_the_demo_numbers_into_docs(demo, tmp_path):
    """`demo publish` (`quickstart.sh --publish`) copies the demo's own numbers and plots into
    docs/, where README.md quotes them (tests/test_readme.py), and lists the figures the README
    does not quote yet."""
    layout, _ = demo
    readme = tmp_path / "README.md"
    readme.write_text("old figures\n")
    proc = subprocess.run([sys.executable, "-m", "megatron_lev.demo", "publish", "--out", layout.out, "--docs",
                           str(tmp_path), "--readme", str(readme)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = read_json(tmp_path / "demo_results.json")
    figures = ", ".join(readme_figures(results))
    assert proc.stdout.splitlines()[-1] == (f"{readme} does not quote these published figures yet "
                                            f"(tests/test_readme.py fails until it does): {figures}")
    losses = read_json(layout.valid_loss)
    assert {n: r["final"] for n, r in results["valid_loss"].items()} == {n: r["final"] for n, r in losses.items()}
    evaluation = read_json(os.path.join(layout.eval_ppl, "evaluation.json"))
    assert results["perplexity"]["values"] == {n: m["ppl"] for n, m in evaluation["models"].items()}
    change = 100 * (evaluation["models"]["lev"]["ppl"] / evaluation["models"]["tied"]["ppl"] - 1)
    assert results["perplexity"]["relative_change_pct"]["lev"] == pytest.approx(change, rel=1e-9)
    curves = read_json(os.path.join(layout.eval_curves, "curves.json"))
    assert results["tokens_to_baseline_final"]["lev"]["speedup"] == curves["runs"]["lev"]["speedup_vs_baseline"]
    markdown = (tmp_path / "demo_results.md").read_text()
    assert f"{losses['lev']['final']:.4f}" in markdown and f"{losses['tied']['final']:.4f}" in markdown
    for name, (folder, file) in {"demo_freq_quantile_5.png": (layout.eval_ppl, "freq_quantile_5.png"),
                                 "demo_loss_vs_tokens.png": (layout.eval_curves, "loss_vs_tokens.png")}.items():
        assert (tmp_path / name).read_bytes() == open(os.path.join(folder, file), "rb").read()


def test_mistyped_input_writes_nothing(tmp_path):
    """A --input that names nothing fails in one line before the folder records its input, so
    the corrected command can use the same --out."""
    out = tmp_path / "demo"
    proc = quickstart("--quick", "--out", str(out), "--input", str(tmp_path / "typo.jsonl"))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == f"quickstart.sh: --input {tmp_path / 'typo.jsonl'}: no such file or directory"
    assert not os.path.exists(Layout.under(str(out)).inputs_file)


RECORDING_PYTHON = """#!/usr/bin/env bash
# Runs what quickstart.sh reads back (its layout, config values) with the real interpreter and
# records every other command without running it.
if [[ $1 == -c || "$1 $2 $3" == "-m megatron_lev.demo layout" ]]; then exec {python} "$@"; fi
printf '%s\\n' "$*" >> {log}
"""


def recorded_quickstart(tmp_path, *flags):
    """quickstart.sh's default (full-size) run with every stage recorded, not run: the commands it
    issues, in seconds."""
    log = tmp_path / "commands.log"
    log.unlink(missing_ok=True)
    shim = tmp_path / "python"
    shim.write_text(RECORDING_PYTHON.format(python=sys.executable, log=log))
    shim.chmod(0o755)
    env = {**os.environ, "PYTHON": str(shim)}
    proc = subprocess.run(["bash", os.path.join(REPO, "tools", "quickstart.sh"), "--out", str(tmp_path / "demo"),
                           *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return proc, log.read_text().splitlines() if log.exists() else []


def test_default_demo_publishes_only_when_asked(tmp_path):
    """A plain default run writes nothing into docs/ (defect: it rewrote docs/demo_results.* and
    tests/test_readme.py then failed); --publish is the maintainer's explicit step, and refuses a
    run that is not the default one."""
    before = git_status()
    proc, commands = recorded_quickstart(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any("-m megatron_lev.train --config demo-lev" in c for c in commands)  # the stages were issued
    assert not [c for c in commands if "megatron_lev.demo publish" in c]
    assert git_status() == before
    proc, commands = recorded_quickstart(tmp_path, "--publish")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "demo"
    assert commands[-1] == (f"-m megatron_lev.demo publish --out {out} --docs {REPO}/docs "
                            f"--readme {REPO}/README.md")
    assert commands[-2] == f"-m megatron_lev.demo seeds --out {out}"
    seed_runs = [c for c in commands if "-m megatron_lev.train" in c and f"{out}/seeds/" in c]
    assert [(c.split("--config ")[1].split()[0], c.split("--seed ")[1].split()[0]) for c in seed_runs] == [
        ("demo-lev", "1"), ("demo-tied", "1"), ("demo-lev", "2"), ("demo-tied", "2")]
    proc, commands = recorded_quickstart(tmp_path, "--publish", "--quick")
    assert proc.returncode == 2 and commands == []
    assert proc.stderr.strip() == ("quickstart.sh: --publish publishes the default demo only: drop --input, --steps "
                                   "and --quick")
