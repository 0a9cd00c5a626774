"""End-to-end training on CPU (gloo, 2 ranks, tiny configs, the tiny_dataset fixture).

The runs call `megatron_lev.train.main(argv)`, the entry point of `python -m
megatron_lev.train`, inside ranks launched by tests/distributed.py: one 2-rank launch
runs every 2-rank training (imports are paid once), one 1-rank launch the reference.
The SIGTERM test runs the real command under torchrun. Losses come from metrics.jsonl.

Every run shares the schedule of a 30-step run (--train-iters 30); runs that only need
3 steps stop there with --exit-interval 3, so their learning rates are the reference's.
"""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megatron_lev.checkpointing.catalog import (COMPLETE_MARKER, CONFIG_FILE, checkpoint_file_sizes, checkpoint_tag,
                                                complete_checkpoints, find_latest, is_complete)
from tests.distributed import free_port, run_distributed

TRAIN_ITERS = 30
# 1 rank vs TP/PP/DP layouts: fp32 sums in another order (DP gradient averaging, ZeRO
# partitions) differ in the last bits; after 3 AdamW steps the losses agree to ~1e-7.
LOSS_ATOL = 1e-5
LAYOUT_RUN = ("--exit-interval", "3", "--eval-interval", "3")  # 3 steps, then a validation pass
WATCHED_EMBEDDING = ("embedding_rms", "embedding_mean_cosine", "embedding_effective_rank")


def train_flags(dataset, tokenizer, workdir, name, *extra):
    """Flags of one run; its metrics go to <workdir>/<name>/metrics.jsonl."""
    return ["--data-path", dataset, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tokenizer,
            "--split", "90,5,5", "--data-cache-path", os.path.join(workdir, "cache"),
            "--train-iters", str(TRAIN_ITERS), "--log-interval", "1", "--eval-interval", "10", "--eval-iters", "1",
            "--seed", "1234", "--metrics-file", os.path.join(workdir, name, "metrics.jsonl"), *extra]


def read_metrics(workdir, name):
    with open(os.path.join(workdir, name, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def train_records(workdir, name):
    """iteration -> the training record of that iteration."""
    return {r["iteration"]: r for r in read_metrics(workdir, name) if "loss" in r}


def _train_runs(rank, world_size, runs):
    """Rank body: run main(argv) for each run, in order; return the exit codes."""
    from megatron_lev.train import main

    return [main(argv) for argv in runs]


@pytest.fixture(scope="module")
def two_rank_runs(tiny_dataset, spm_tokenizer, tmp_path_factory):
    """Every 2-rank training of this file, in one launch. Returns the work directory."""
    work = str(tmp_path_factory.mktemp("train2"))
    resume_dir = os.path.join(work, "ckpt_resume")
    workers_dir = os.path.join(work, "ckpt_workers")

    def flags(name, *extra):
        return train_flags(tiny_dataset, spm_tokenizer, work, name, *extra)

    runs = {
        # DP=2, ZeRO-1: the full 30 steps (loss decreases; the uninterrupted run of the resume test).
        "lev_dp2_z1": flags("lev_dp2_z1", "--config", "tiny-lev", "--zero-stage", "1",
                            "--tensorboard-dir", os.path.join(work, "tb")),
        "tied_dp2_z1": flags("tied_dp2_z1", "--config", "tiny-tied", "--zero-stage", "1"),
        # Resume: 15 steps, stop (checkpoint), --load, 15 more; same topology as lev_dp2_z1.
        "resume_a": flags("resume_a", "--config", "tiny-lev", "--zero-stage", "1", "--save", resume_dir,
                          "--save-interval", "5", "--keep-last-checkpoints", "2", "--exit-interval", "15"),
        "resume_b": flags("resume_b", "--config", "tiny-lev", "--zero-stage", "1", "--save", resume_dir,
                          "--load", resume_dir, "--save-interval", "5", "--keep-last-checkpoints", "2"),
        # Resume with data-loader worker processes (issue 43): 6 steps, stop, --load, 6 more.
        "workers_a": flags("workers_a", "--config", "tiny-lev", "--zero-stage", "1", "--num-workers", "2",
                           "--save", workers_dir, "--save-interval", "6", "--exit-interval", "6"),
        "workers_b": flags("workers_b", "--config", "tiny-lev", "--zero-stage", "1", "--num-workers", "2",
                           "--save", workers_dir, "--load", workers_dir, "--exit-interval", "12"),
        # Layouts: 3 steps and an evaluation each.
        "lev_tp2": flags("lev_tp2", "--config", "tiny-lev", "--tensor-model-parallel-size", "2", *LAYOUT_RUN),
        "lev_pp2": flags("lev_pp2", "--config", "tiny-lev", "--pipeline-model-parallel-size", "2", *LAYOUT_RUN),
        "lev_dp2_z2": flags("lev_dp2_z2", "--config", "tiny-lev", "--zero-stage", "2", *LAYOUT_RUN),
        "lev_dp2_z3": flags("lev_dp2_z3", "--config", "tiny-lev", "--zero-stage", "3", *LAYOUT_RUN),
        # A wall-time budget already spent: checkpoint and exit 0 after the first step.
        "out_of_time": flags("out_of_time", "--config", "tiny-tied", "--exit-duration-in-mins", "0",
                             "--save", os.path.join(work, "ckpt_out_of_time")),
        # lr 1e30: step 1 blows the weights up, every later loss is NaN.
        # No warmup: Megatron's schedule runs step 1 of a warmup at lr 0.
        "nonfinite": flags("nonfinite", "--config", "tiny-lev", "--lr", "1e30", "--lr-warmup-iters", "0",
                           "--max-skipped-steps", "3",
                           "--save", os.path.join(work, "ckpt_nonfinite")),
    }
    codes = run_distributed(_train_runs, world_size=2, args=(list(runs.values()),), timeout=900)
    expected = [1 if name == "nonfinite" else 0 for name in runs]  # 1: too many non-finite steps
    assert codes[0] == codes[1] == expected, dict(zip(runs, codes[0]))
    return work


def test_layouts_match_one_rank(two_rank_runs, tiny_dataset, spm_tokenizer, tmp_path):
    """TP=2, PP=2 and DP=2 under ZeRO-1/2/3 give the 1-rank losses and grad norms (same global
    batch 8, micro-batch 4, seed) for 3 steps, and the same validation loss after them; the
    grad norm is DeepSpeed's clipping norm, so equal norms mean replicated parameters are
    counted once and shards summed."""
    work = str(tmp_path)
    ref_flags = train_flags(tiny_dataset, spm_tokenizer, work, "ref", "--config", "tiny-lev", *LAYOUT_RUN)
    assert run_distributed(_train_runs, world_size=1, args=([ref_flags],)) == [[0]]
    ref = train_records(work, "ref")
    assert sorted(ref) == [1, 2, 3]
    assert ref[1]["grad_norm"] > 1.0  # clipping (--clip-grad 1.0) is active in step 1
    (ref_valid,) = [r["valid_loss"] for r in read_metrics(work, "ref") if "valid_loss" in r]
    for name in ("lev_tp2", "lev_pp2", "lev_dp2_z1", "lev_dp2_z2", "lev_dp2_z3"):
        got = train_records(two_rank_runs, name)
        for it in (1, 2, 3):
            assert got[it]["loss"] == pytest.approx(ref[it]["loss"], abs=LOSS_ATOL, rel=0), (name, it)
            assert got[it]["grad_norm"] == pytest.approx(ref[it]["grad_norm"], rel=1e-5), (name, it)
            assert got[it]["consumed_tokens"] == it * 8 * 64
        if name != "lev_dp2_z1":  # that one evaluates at 10, 20, 30
            (valid,) = [r for r in read_metrics(two_rank_runs, name) if "valid_loss" in r]
            assert valid["iteration"] == 3 and valid["valid_loss"] == pytest.approx(ref_valid, abs=LOSS_ATOL), name
    assert train_records(two_rank_runs, "lev_tp2")[3]["lr"] == ref[3]["lr"]
    # The watched embedding (issue 43): the two families' gradient norms and the embedding's statistics
    # over its fixed ids are the whole model's in every layout, before the first step and after each.
    (ref_start,) = [r for r in read_metrics(work, "ref") if "loss" not in r and "valid_loss" not in r]
    assert ref_start["iteration"] == 0 and ref_start["consumed_tokens"] == 0
    for it in (1, 2, 3):
        assert math.hypot(ref[it]["embedding_grad_norm"], ref[it]["body_grad_norm"]) == pytest.approx(
            ref[it]["grad_norm"], rel=1e-5)
        assert ref[it]["clipped_fraction"] == float(ref[it]["grad_norm"] > 1.0)  # --clip-grad 1.0, one step each
    for name in ("lev_tp2", "lev_pp2", "lev_dp2_z1", "lev_dp2_z2", "lev_dp2_z3"):
        got = train_records(two_rank_runs, name)
        (start,) = [r for r in read_metrics(two_rank_runs, name) if r["iteration"] == 0]
        for key in WATCHED_EMBEDDING:
            assert start[key] == pytest.approx(ref_start[key], rel=1e-6), (name, key)
            for it in (1, 2, 3):
                assert got[it][key] == pytest.approx(ref[it][key], rel=1e-5), (name, it, key)
        for it in (1, 2, 3):
            for key in ("embedding_grad_norm", "body_grad_norm"):
                assert got[it][key] == pytest.approx(ref[it][key], rel=1e-5), (name, it, key)


def test_loss_decreases_lev_and_tied(two_rank_runs):
    for name in ("lev_dp2_z1", "tied_dp2_z1"):
        records = train_records(two_rank_runs, name)
        assert sorted(records) == list(range(1, TRAIN_ITERS + 1))
        losses = [records[i]["loss"] for i in range(1, TRAIN_ITERS + 1)]
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        assert last < first - 0.3, (name, losses)
        valid = [r for r in read_metrics(two_rank_runs, name) if "valid_loss" in r]
        assert [r["iteration"] for r in valid] == [10, 20, 30]
        assert valid[-1]["valid_loss"] < valid[0]["valid_loss"]
        assert records[TRAIN_ITERS]["tokens_per_s"] > 0 and records[TRAIN_ITERS]["skipped_steps"] == 0
        for record in records.values():  # every log interval (--log-interval 1)
            assert math.hypot(record["embedding_grad_norm"], record["body_grad_norm"]) == pytest.approx(
                record["grad_norm"], rel=1e-5)  # DeepSpeed sums its norm in float32
            assert record["clipped_fraction"] in (0.0, 1.0) and 1 < record["embedding_effective_rank"] <= 512
        # The embedding moves: its statistics after 30 steps are not those at iteration 0.
        (start,) = [r for r in read_metrics(two_rank_runs, name) if r["iteration"] == 0]
        assert records[TRAIN_ITERS]["embedding_rms"] != pytest.approx(start["embedding_rms"], rel=1e-3)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(two_rank_runs, "tb"))
    events.Reload()
    lev = train_records(two_rank_runs, "lev_dp2_z1")
    for tag, key in (("embedding-grad-norm", "embedding_grad_norm"), ("body-grad-norm", "body_grad_norm"),
                     ("clipped-fraction", "clipped_fraction"), ("embedding-rms", "embedding_rms"),
                     ("embedding-mean-cosine", "embedding_mean_cosine"),
                     ("embedding-effective-rank", "embedding_effective_rank")):
        points = {e.step: e.value for e in events.Scalars(tag)}
        assert sorted(points) == ([0] if key.startswith("embedding_") and "grad" not in key else []) + sorted(lev), tag
        assert [points[i] for i in sorted(lev)] == pytest.approx([lev[i][key] for i in sorted(lev)], rel=1e-6), tag


def test_exact_resume(two_rank_runs):
    """15 steps, stop, --load, 15 more == 30 uninterrupted steps, bit for bit."""
    full = train_records(two_rank_runs, "lev_dp2_z1")
    first, second = train_records(two_rank_runs, "resume_a"), train_records(two_rank_runs, "resume_b")
    assert sorted(first) == list(range(1, 16)) and sorted(second) == list(range(16, TRAIN_ITERS + 1))
    resumed = {**first, **second}
    assert [resumed[i]["loss"] for i in full] == [full[i]["loss"] for i in full]
    assert [resumed[i]["grad_norm"] for i in full] == [full[i]["grad_norm"] for i in full]
    assert [resumed[i]["lr"] for i in full] == [full[i]["lr"] for i in full]
    # The resumed run's statistics before its first step are those of the weights it resumed (to
    # rounding: before the first step LEV's CPU mode product runs uncompiled, after it compiled).
    (start,) = [r for r in read_metrics(two_rank_runs, "resume_b") if r["iteration"] == 15 and "loss" not in r]
    assert [start[key] for key in WATCHED_EMBEDDING] == pytest.approx([full[15][key] for key in WATCHED_EMBEDDING],
                                                                      rel=1e-7)
    assert [resumed[i]["embedding_grad_norm"] for i in full] == [full[i]["embedding_grad_norm"] for i in full]
    valid = [r["valid_loss"] for r in read_metrics(two_rank_runs, "resume_b") if "valid_loss" in r]
    assert valid == [r["valid_loss"] for r in read_metrics(two_rank_runs, "lev_dp2_z1")
                     if "valid_loss" in r and r["iteration"] > 15]
    # Checkpoints every 5 steps, the newest 2 kept, `latest` on the last one.
    ckpt = os.path.join(two_rank_runs, "ckpt_resume")
    assert [tag for _, tag in complete_checkpoints(ckpt)] == ["iter_0000025", "iter_0000030"]
    assert find_latest(ckpt) == "iter_0000030"
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "iter_0000030"
    with open(os.path.join(ckpt, "iter_0000030", CONFIG_FILE)) as f:
        saved = json.load(f)
    assert saved["model"]["embedding"] == "lev" and saved["training"]["data_parallel_size"] == 2
    assert os.path.isfile(os.path.join(ckpt, "config.yaml"))
    assert sorted(os.listdir(os.path.join(ckpt, "iter_0000030", "rng"))) == ["rank_00000.pt", "rank_00001.pt"]


def test_resume_with_loader_workers_is_exact(two_rank_runs):
    """--num-workers 2 (the loader in worker processes), stopped after 6 steps and resumed: the
    losses and gradient norms of the uninterrupted in-process-loader run, bit for bit."""
    full = train_records(two_rank_runs, "lev_dp2_z1")
    first, second = train_records(two_rank_runs, "workers_a"), train_records(two_rank_runs, "workers_b")
    assert sorted(first) == list(range(1, 7)) and sorted(second) == list(range(7, 13))
    resumed = {**first, **second}
    assert [resumed[i]["loss"] for i in resumed] == [full[i]["loss"] for i in resumed]
    assert [resumed[i]["grad_norm"] for i in resumed] == [full[i]["grad_norm"] for i in resumed]


def test_exit_duration_checkpoints_and_exits_zero(two_rank_runs):
    assert sorted(train_records(two_rank_runs, "out_of_time")) == [1]
    assert find_latest(os.path.join(two_rank_runs, "ckpt_out_of_time")) == "iter_0000001"


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(two_rank_runs):
    records = train_records(two_rank_runs, "nonfinite")
    assert sorted(records) == [1, 2, 3, 4]  # exit after 3 skipped steps in a row
    assert records[1]["loss"] == pytest.approx(6.92, abs=0.05) and records[1]["skipped_steps"] == 0
    for it in (2, 3, 4):
        assert records[it]["loss"] == "nan" and records[it]["grad_norm"] == "inf"
        assert records[it]["skipped_steps"] == it - 1
        # A skipped step does not advance the schedule (cosine decay would lower it): every
        # skipped step runs at the rate after the one applied step.
        assert records[it]["lr"] == records[2]["lr"] < records[1]["lr"] == 1e30
    ckpt = os.path.join(two_rank_runs, "ckpt_nonfinite")
    assert find_latest(ckpt) == "iter_0000004"


def _main_error(monkeypatch, capsys, *argv, world_size=2):
    """Run main() as rank 0 of a `world_size` job; these errors come before torch.distributed."""
    import torch.distributed as dist

    from megatron_lev.train import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing may try to connect
    code = main(list(argv))
    assert not dist.is_initialized()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


def test_clear_errors(two_rank_runs, tiny_dataset, spm_tokenizer, tmp_path, monkeypatch, capsys):
    flags = train_flags(tiny_dataset, spm_tokenizer, str(tmp_path), "err")
    err = _main_error(monkeypatch, capsys, *flags, "--config", "tiny-lev", "--global-batch-size", "12")
    assert err == ("megatron_lev.train: error: --global-batch-size 12 must be a multiple of --micro-batch-size 4 x "
                   "data-parallel size 2 (= world 2 / (--tensor-model-parallel-size 1 x "
                   "--pipeline-model-parallel-size 1)) = 8")
    err = _main_error(monkeypatch, capsys, *flags, "--config", "tiny-lev", "--pipeline-model-parallel-size", "2",
                      "--zero-stage", "2")
    assert "--pipeline-model-parallel-size 2 needs ZeRO stage <= 1, got stage 2" in err and "use --zero-stage 1" in err
    missing = str(tmp_path / "no_such_text_document")
    err = _main_error(monkeypatch, capsys, *flags, "--config", "tiny-lev", "--data-path", missing)
    assert err == f"megatron_lev.train: error: --data-path {missing}: {missing}.bin does not exist"
    small = tmp_path / "small-vocab.yaml"
    small.write_text("base: tiny-lev\nmodel: {vocab_size: 500}\n")
    err = _main_error(monkeypatch, capsys, *flags, "--config", str(small))
    assert err == (f"megatron_lev.train: error: {small}: model.vocab_size 500 is smaller than the 1000 tokens of "
                   f"--tokenizer-model {spm_tokenizer}: remove vocab_size (the tokenizer sets it) or raise it")
    # The resume test's checkpoints hold a lev model: a tied run must not load them.
    ckpt = os.path.join(two_rank_runs, "ckpt_resume")
    err = _main_error(monkeypatch, capsys, *flags, "--config", "tiny-tied", "--load", ckpt)
    assert err.startswith(f"megatron_lev.train: error: --load {ckpt}: checkpoint iter_0000030 was saved with a "
                          "different model config (embedding: 'lev' in the checkpoint, 'tied' now; lev: {")


def test_sigterm_checkpoints_and_exits_zero(tiny_dataset, spm_tokenizer, tmp_path):
    """Under torchrun: SIGTERM to the trainer processes (what Slurm does on preemption) ->
    a complete checkpoint at the next step boundary, `latest` on it, exit code 0. A later,
    half-written checkpoint is never picked."""
    import psutil

    work, save = str(tmp_path), str(tmp_path / "ckpt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "megatron_lev.train", *train_flags(tiny_dataset, spm_tokenizer, work, "run", "--config", "tiny-tied",
                                                     "--train-iters", "100000", "--save", save,
                                                     "--save-interval", "100000", "--eval-interval", "100000")]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    log = open(os.path.join(work, "log.txt"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        metrics = os.path.join(work, "run", "metrics.jsonl")
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, open(os.path.join(work, "log.txt")).read()[-3000:]
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) == 2
        for w in workers:
            w.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    out = open(os.path.join(work, "log.txt")).read()
    assert code == 0, out[-3000:]
    last = max(train_records(work, "run"))
    assert f"exiting at iteration {last} (signal)" in out
    # Megatron's iteration line (timestamp first, ETA last), rank 0 only, one per --log-interval 1;
    # a config summary instead of the whole config; no third-party import warnings.
    logged = [re.fullmatch(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(\d+)/ +100000 \| consumed samples: +(\d+) "
                           r"\| elapsed time per iteration \(ms\): [\d.]+ \| learning rate: (\S+) \| global batch size: +8 "
                           r"\| lm loss: (\S+) \| grad norm: [\d.]+ \| embedding grad norm: [\d.]+ \| body grad norm: [\d.]+ "
                           r"\| clipped: (?:0|100)\.0% \| embedding RMS: [\d.]+ \| embedding cosine: -?[\d.]+ \| "
                           r"embedding eff\. rank: [\d.]+ \| rank time \(ms\) min/max: [\d.]+ \(rank [01]\) / [\d.]+ "
                           r"\(rank [01], \S+\) \| number of skipped iterations: +0 \| number of nan "
                           r"iterations: +0 \| tokens per second: [\d.]+ \| mem: [\d.]+ GB \| ETA: (?:\d+ days?, )?\d+:\d\d:\d\d \|"
                           r"( time to first step \(s\): [\d.]+ \|)?", line)
              for line in out.splitlines() if "] iteration " in line]
    records = train_records(work, "run")
    assert [m is not None for m in logged] == [True] * last, out[-3000:]
    assert [m[5] is not None for m in logged] == [True] + [False] * (last - 1)  # the first line only
    # The start-up breakdown counts from the process start (imports first); no third-party warnings.
    assert re.search(r"^ > start-up \(seconds\): imports [\d.]+, validation [\d.]+, distributed [\d.]+, data [\d.]+, "
                     r"model and engine [\d.]+; [\d.]+ in all before the first step$", out, re.M), out[:3000]
    assert "UserWarning" not in out, out[:3000]
    assert [(int(m[1]), int(m[2]), m[3], m[4]) for m in logged] == [
        (i, 8 * i, f"{records[i]['lr']:.6E}", f"{records[i]['loss']:.6E}") for i in range(1, last + 1)]
    assert f"full configuration: {save}/config.yaml" in out and "Transformer Engine and Apex" not in out
    tag = checkpoint_tag(last)
    assert is_complete(save, tag) and find_latest(save) == tag
    with open(os.path.join(save, tag, COMPLETE_MARKER)) as f:
        marker = json.load(f)
    assert {k: marker[k] for k in ("iteration", "world_size", "consumed_samples")} == \
        {"iteration": last, "world_size": 2, "consumed_samples": 8 * last}
    assert marker["files"] == checkpoint_file_sizes(os.path.join(save, tag))  # every file, its size

    # A save that died half-way: files of a newer tag, no marker; `latest` even points at it.
    newer = checkpoint_tag(last + 1)
    shutil.copytree(os.path.join(save, tag), os.path.join(save, newer))
    os.remove(os.path.join(save, newer, COMPLETE_MARKER))
    with open(os.path.join(save, "latest"), "w") as f:
        f.write(newer)
    with pytest.warns(UserWarning, match="not a complete checkpoint"):
        assert find_latest(save) == tag
