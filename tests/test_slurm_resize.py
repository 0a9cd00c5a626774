"""Resume at another layout without a timeout (issue 43 item 1), through the srun/scontrol shims
(tests/slurm_shims/): a DP=1 job checkpoints at iteration 6; the same CHECKPOINT_DIR submitted on 2
nodes (DP=2) is converted to DeepSpeed's universal form by a step of the job that ends before any
trainer process starts (a test-only hook, tests/process_hooks/, slows it and records when each
process started), so no collective can wait on it whatever its length, and the run continues with the uninterrupted run's learning rates and losses. A conversion killed
half-way leaves nothing the trainers would load, and the next one starts clean and gives the same
files."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_slurm import REPO, script_env
from tests.test_slurm_jobs import BatchJob, _free_port_below, _training_records

HOOK = Path(__file__).resolve().parent / "process_hooks"
TRAIN_ITERS, STOP_AT = 12, 6
# The conversion's extra time: trainers started beside it (not after it) would start inside it. The
# test proves the order rather than outlasting --distributed-timeout-minutes 1 (a 75 s sleep before).
SLOW_SECONDS = 4


def _job_env(tmp_path, name, ckpt, nodes, tiny_dataset, spm_tokenizer, **extra):
    port = _free_port_below(60000)
    return script_env(
        SLURM_JOB_ID=port - 10000, SLURM_JOB_NUM_NODES=nodes,
        SLURM_JOB_NODELIST=",".join(["localhost", "127.0.0.1"][:nodes]), SLURM_JOB_NAME=name, OMP_NUM_THREADS=1,
        CONFIG="tiny-lev", GPUS_PER_NODE=1, GLOBAL_BATCH=4, TRAIN_ITERS=TRAIN_ITERS, SAVE_INTERVAL=3, LOG_INTERVAL=1,
        BF16=0, GPU_TYPE="h100", COMPILE_LAYERS=0, DATA_PATH=tiny_dataset, TOKENIZER_MODEL=spm_tokenizer,
        CHECKPOINT_DIR=ckpt, LOG_ROOT=tmp_path / "logs",
        EXTRA_ARGS="--split 90,8,2 --eval-interval 100000 --eval-iters 1 --distributed-timeout-minutes 1", **extra)


def _run(env, out: Path, timeout: float = 900) -> tuple[int, BatchJob]:
    job = BatchJob(env, out)
    try:
        return job.finish(timeout), job
    finally:
        job.kill()


@pytest.fixture(scope="module")
def resized(tmp_path_factory, tiny_dataset, spm_tokenizer):
    tmp_path = tmp_path_factory.mktemp("resize")
    ckpt = tmp_path / "ckpt"
    result = {"tmp_path": tmp_path, "ckpt": ckpt}
    rc, job = _run(_job_env(tmp_path, "dp1", ckpt, 1, tiny_dataset, spm_tokenizer, EXIT_INTERVAL=STOP_AT),
                   tmp_path / "dp1.out")
    assert rc == 0, job.logs()
    shutil.copytree(ckpt, tmp_path / "ckpt_copy", symlinks=True)  # for the interrupted conversion
    # On 2 nodes: DP 1 -> 2. The hook slows the conversion in every process (the trainers too, were
    # they to convert).
    env = _job_env(tmp_path, "dp2", ckpt, 2, tiny_dataset, spm_tokenizer, PYTHONPATH=HOOK,
                   MEGATRON_LEV_TEST_SLOW_CONVERSION=SLOW_SECONDS,
                   MEGATRON_LEV_TEST_PROCESS_LOG=tmp_path / "dp2_processes.log")
    result["rc"], job = _run(env, tmp_path / "dp2.out")
    result["out"], result["logs"] = (tmp_path / "dp2.out").read_text(), job.logs()
    result["node_logs"] = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("dp2-*/restart0-node*.log")))
    result["records"] = _training_records(ckpt / "metrics.jsonl")
    result["processes"] = (tmp_path / "dp2_processes.log").read_text().splitlines()
    rc, job = _run(_job_env(tmp_path, "ref", tmp_path / "ref", 1, tiny_dataset, spm_tokenizer), tmp_path / "ref.out")
    assert rc == 0, job.logs()
    result["reference"] = _training_records(tmp_path / "ref" / "metrics.jsonl")
    return result


def test_the_conversion_ends_before_any_trainer_starts_and_the_run_resumes_at_another_dp_size(resized):
    """The conversion (slowed by SLOW_SECONDS) runs as a step of the job that returns before the first
    trainer process (torchrun or its workers) starts, so no rank waits for it in a collective (one
    that outlasts --distributed-timeout-minutes ends the job, and a requeue starts it over); the DP=2
    run continues from iteration 6 with the uninterrupted DP=1 run's samples and learning rates, and
    its losses within fp32 summation order (1e-5)."""
    out = resized["out"]
    assert resized["rc"] == 0, resized["logs"]
    done = [float(line.split()[0]) for line in resized["processes"] if line.endswith(" conversion done")]
    trainers = [float(line.split()[0]) for line in resized["processes"] if "megatron_lev.train " in line]
    assert len(done) == 1 and len(trainers) >= 4, resized["processes"]  # 2 nodes: torchrun + a worker each
    assert min(trainers) > done[0], resized["processes"]
    ckpt = resized["ckpt"]
    assert ("resume: checkpoint iter_0000006 was saved under another layout (data_parallel_size: 1 -> 2); the job "
            "converts it before the trainers start: python -m megatron_lev.checkpointing.universal --load "
            f"{ckpt} --tag iter_0000006 --pipeline-model-parallel-size 1") in out, resized["logs"]
    assert f"test hook: the conversion sleeps {SLOW_SECONDS} s (start)" in out
    assert f"converted {ckpt}/iter_0000006 in " in out
    # The trainers found the conversion done: they loaded it, and did not convert (DeepSpeed's line).
    node_logs = resized["node_logs"]
    assert f"loading it through DeepSpeed's universal checkpoint in {ckpt}/iter_0000006/universal" in node_logs
    assert "Convert DeepSpeed Checkpoint to Universal Checkpoint" not in node_logs
    assert "test hook" not in node_logs
    assert f"resumed from {ckpt}/iter_0000006 at iteration 6" in node_logs
    records, reference = resized["records"], {r["iteration"]: r for r in resized["reference"]}
    assert [r["iteration"] for r in records] == list(range(1, TRAIN_ITERS + 1))
    for r in records:
        assert (r["consumed_samples"], r["lr"]) == (reference[r["iteration"]]["consumed_samples"],
                                                    reference[r["iteration"]]["lr"]), r["iteration"]
    assert [r["loss"] for r in records[:STOP_AT]] == [reference[i]["loss"] for i in range(1, STOP_AT + 1)]
    for r in records[STOP_AT:]:
        assert abs(r["loss"] - reference[r["iteration"]]["loss"]) < 1e-5, (r, reference[r["iteration"]])


def test_a_conversion_killed_half_way_restarts_clean(resized):
    """SIGKILL after the extraction, before the merge: only universal.tmp/.input remain, which no
    trainer loads (no complete.json); the next conversion removes them, starts again, and writes the
    very tensors of the uninterrupted conversion."""
    import torch

    copy = resized["tmp_path"] / "ckpt_copy"
    cmd = [sys.executable, "-m", "megatron_lev.checkpointing.universal", "--load", str(copy), "--workers", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HOOK)]), "DS_ACCELERATOR": "cpu",
           "MEGATRON_LEV_TEST_SLOW_CONVERSION": "600", "MEGATRON_LEV_TEST_SLOW_PHASE": "merge"}
    log = resized["tmp_path"] / "killed.out"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while "test hook: the conversion sleeps 600 s (merge)" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    folder = copy / "iter_0000006"
    assert sorted(p.name for p in folder.glob("universal*")) == ["universal.input", "universal.tmp"]
    # The extraction's fragments (universal.tmp/tmp/<parameter>/<tp>/fp32.00, ...): half-way indeed.
    assert any(p.name.startswith("fp32.") for p in (folder / "universal.tmp" / "tmp").rglob("*"))
    env.pop("MEGATRON_LEV_TEST_SLOW_CONVERSION")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (f"removing the leftovers of an interrupted conversion: {folder}/universal.tmp, {folder}/universal.input"
            in proc.stdout)
    assert sorted(p.name for p in folder.glob("universal*")) == ["universal"]
    converted, reference = folder / "universal", resized["ckpt"] / "iter_0000006" / "universal"
    files = sorted(p.relative_to(reference) for p in reference.rglob("*.pt"))
    assert files and files == sorted(p.relative_to(converted) for p in converted.rglob("*.pt"))
    for rel in files:
        if rel.parts[0] != "zero":
            continue
        a, b = (torch.load(root / rel, weights_only=False) for root in (converted, reference))
        if isinstance(a, dict):  # {"param": tensor, ...}
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k])), rel
        else:
            assert torch.equal(a, b), rel


def test_the_dry_run_says_when_the_job_will_convert(tmp_path):
    """A checkpoint of another layout in CHECKPOINT_DIR: the dry run names the conversion step (none
    when the layout is the same, or when its universal folder is complete already)."""
    import json

    from tests.test_slurm import run_script

    for suffix in (".bin", ".idx"):
        (tmp_path / f"d{suffix}").touch()
    (tmp_path / "t.model").touch()
    ckpt = tmp_path / "ckpt"
    tag = ckpt / "iter_0000040"
    tag.mkdir(parents=True)
    (tag / "complete.json").write_text(json.dumps({"iteration": 40, "files": {}}))
    (ckpt / "latest").write_text("iter_0000040")

    def resume_lines(dp: int, **env):
        (tag / "config.json").write_text(json.dumps({
            "training": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": dp},
            "deepspeed": {"zero_optimization": {"stage": 2}}}))
        proc = run_script("train_lev_1b.sh", DRY_RUN=1, DATA_PATH=tmp_path / "d", TOKENIZER_MODEL=tmp_path / "t.model",
                          CHECKPOINT_DIR=ckpt, **env)
        assert proc.returncode == 0, proc.stderr
        return [line for line in proc.stdout.splitlines() if line.startswith("# Resume: ")]

    assert resume_lines(32, NODES=2) == [
        "# Resume: checkpoint iter_0000040 was saved under another layout (data_parallel_size: 32 -> 16); the job "
        f"converts it before the trainers start: python -m megatron_lev.checkpointing.universal --load {ckpt} --tag "
        "iter_0000040 --pipeline-model-parallel-size 1"]
    assert resume_lines(16, NODES=2) == []
    assert resume_lines(16, NODES=1, PP=2, GLOBAL_BATCH=512)[0].endswith(
        "(pipeline_model_parallel_size: 1 -> 2; data_parallel_size: 16 -> 4; zero stage: 2 -> 1); the job converts it "
        f"before the trainers start: python -m megatron_lev.checkpointing.universal --load {ckpt} --tag iter_0000040 "
        "--pipeline-model-parallel-size 2")
    (tag / "universal").mkdir()
    (tag / "universal" / "complete.json").write_text("{}")
    assert resume_lines(32, NODES=2) == ["# Resume: checkpoint iter_0000040 was saved under another layout "
                                         "(data_parallel_size: 32 -> 16); its universal conversion is there already"]


def test_conversion_workers_follow_the_cores_and_the_memory(tmp_path):
    """One worker per core, as many as the memory holds (3 x the largest rank's optimizer file each)."""
    from megatron_lev.checkpointing.universal import conversion_workers

    (tmp_path / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 1000)
    (tmp_path / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"x" * 1500)
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"x" * 9000)  # not an optimizer file
    assert conversion_workers(str(tmp_path), cores=32, available=45_000) == 10
    assert conversion_workers(str(tmp_path), cores=8, available=45_000) == 8
    assert conversion_workers(str(tmp_path), cores=8, available=1_000) == 1
    assert conversion_workers(str(tmp_path), cores=8, available=0) == 8  # unknown memory: the cores decide
