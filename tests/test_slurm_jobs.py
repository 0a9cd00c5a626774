"""The Slurm scripts run for real on CPU through srun/scontrol shims (tests/slurm_shims/): a
2-node x 1-process run of slurm/train_lev_1b.sh, including USR1 -> checkpoint -> requeue ->
resume, then a resume on 1 node; plain srun and mpirun launches; one preprocessing task."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_slurm import REPO, SLURM, _import_make_blend, run_script, script_env

# --------------------------------------------------------------------------- a real run


def _free_port_below(limit: int) -> int:
    from tests.distributed import free_port

    for _ in range(100):
        port = free_port()
        if 10000 <= port < limit:
            return port
    raise RuntimeError(f"no free port in [10000, {limit})")


def _training_records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    records = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line being written
            continue
        if "loss" in record:
            records.append(record)
    return records


class BatchJob:
    """slurm/train_lev_1b.sh started the way sbatch starts it: bash running the script
    with the job's environment, its output in a file."""

    def __init__(self, env: dict, out: Path):
        self.out, self.log_root = out, Path(env["LOG_ROOT"])
        with open(out, "w") as f:
            self.proc = subprocess.Popen(["bash", str(SLURM / "train_lev_1b.sh")], env=env, cwd=REPO,
                                         stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def logs(self) -> str:
        """The batch output and the tail of each node log, for failure messages."""
        text = f"--- batch output\n{self.out.read_text()}"
        for path in sorted(self.log_root.glob("*/restart*-node*.log")):
            text += f"\n--- {path.name} (tail)\n" + "\n".join(path.read_text().splitlines()[-30:])
        return text

    def wait_until(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if self.proc.poll() is not None:
                pytest.fail(f"the batch script exited ({self.proc.returncode}) before {what}\n{self.logs()}")
            time.sleep(0.2)
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{self.logs()}")

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the batch script did not exit within {timeout:.0f}s of USR1\n{self.logs()}")

    def kill(self) -> None:
        """Failure path: stop the whole job (TERM reaches the trainer through torchrun)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def two_node_job(tmp_path_factory, tiny_dataset, spm_tokenizer):
    """slurm/train_lev_1b.sh on 2 "nodes" x 1 CPU process (DP=2 across the nodes) through
    the srun/scontrol shims: each node's srun task runs its own torchrun (node rank 0 and
    1), rendezvous on the first host. USR1 to the batch shell -> checkpoint at the next
    step, exit 0, `scontrol requeue`; the requeued job (same id, SLURM_RESTART_COUNT=1)
    resumes from that checkpoint on the same two nodes; SIGTERM then stops it with a
    checkpoint and no requeue. Returns what the tests check."""
    from megatron_lev.checkpointing.catalog import find_latest

    tmp_path = tmp_path_factory.mktemp("two_node_job")
    port = _free_port_below(60000)
    job_id = port - 10000  # common.sh derives MASTER_PORT = 10000 + job id % 50000
    ckpt, logs, requeues = tmp_path / "ckpt", tmp_path / "logs", tmp_path / "requeues"
    train_iters, save_interval = 2000, 5  # far more steps than the test lets it take
    env = script_env(
        SLURM_JOB_ID=job_id, SLURM_JOB_NUM_NODES=2, SLURM_JOB_NODELIST="localhost,127.0.0.1",
        SLURM_JOB_NAME="lev-test", SLURM_SUBMIT_DIR=REPO, SCONTROL_SHIM_LOG=requeues,
        DS_ACCELERATOR="cpu", OMP_NUM_THREADS=1, CONFIG="tiny-lev", GPUS_PER_NODE=1, GLOBAL_BATCH=4,
        TRAIN_ITERS=train_iters, SAVE_INTERVAL=save_interval, LOG_INTERVAL=1, BF16=0, GPU_TYPE="h100",
        DATA_PATH=tiny_dataset, TOKENIZER_MODEL=spm_tokenizer, CHECKPOINT_DIR=ckpt, LOG_ROOT=logs,
        # torch.compile of each layer would take most of the test's time on 2 CPU cores.
        COMPILE_LAYERS=0, EXTRA_ARGS="--split 90,8,2 --eval-interval 100000 --eval-iters 1")
    metrics = ckpt / "metrics.jsonl"
    job = {"env": env, "ckpt": ckpt, "metrics": metrics, "job_id": job_id, "requeues": requeues,
           "job_logs": logs / f"lev-test-{job_id}", "tmp_path": tmp_path}

    # First run: a few steps and a periodic checkpoint, then the time-limit signal.
    batch = BatchJob(env, tmp_path / "run0.out")
    try:
        batch.wait_until(lambda: find_latest(str(ckpt)) is not None, 400, "the first checkpoint")
        batch.proc.send_signal(signal.SIGUSR1)
        job["rc0"] = batch.finish(300)
    finally:
        batch.kill()
    job["out0"], job["logs0"] = batch.out.read_text(), batch.logs()
    job["first"] = _training_records(metrics)
    job["requeued0"] = requeues.read_text().splitlines() if requeues.exists() else []
    job["latest0"] = find_latest(str(ckpt))
    if job["rc0"] != 0 or not job["first"]:
        pytest.fail(f"the first run failed\n{job['logs0']}")
    stopped_at = job["first"][-1]["iteration"]

    # The requeued job: same id, same command; it must resume, not restart. This time
    # the batch shell gets SIGTERM (`scancel --batch --signal=TERM`): the shell passes it
    # on as USR1 (srun would SIGKILL its tasks on SIGTERM; the shim does too), so the
    # trainers checkpoint, and the job ends cleanly without a requeue.
    env["SLURM_RESTART_COUNT"] = "1"
    batch = BatchJob(env, tmp_path / "run1.out")
    try:
        batch.wait_until(lambda: any(r["iteration"] >= stopped_at + 3 for r in _training_records(metrics)),
                         400, f"iteration {stopped_at + 3} after the resume")
        batch.proc.send_signal(signal.SIGTERM)
        job["rc1"] = batch.finish(300)
    finally:
        batch.kill()
    job["out1"], job["logs1"] = batch.out.read_text(), batch.logs()
    job["records"] = _training_records(metrics)
    job["latest1"] = find_latest(str(ckpt))
    return job


def test_train_lev_1b_on_two_nodes_checkpoints_on_usr1_requeues_resumes_and_stops_on_term(two_node_job):
    job = two_node_job
    job_id, ckpt, job_logs = job["job_id"], job["ckpt"], job["job_logs"]
    assert job["rc0"] == 0, job["logs0"]
    assert job["requeued0"] == [f"requeue {job_id}"], job["logs0"]
    first = job["first"]
    stopped_at = first[-1]["iteration"]
    assert 5 <= stopped_at < 2000
    assert job["latest0"] == f"iter_{stopped_at:07d}"  # the last step taken was saved
    assert f"requeueing job {job_id}" in job["out0"] and "USR1" in job["out0"]
    # Two srun tasks, one per node, each its own torchrun with its own node rank; one
    # data-parallel group across them (the batch arithmetic: 4 / DP 2 = micro-batch 2).
    assert "batch: DP=2 x MICRO_BATCH=2 x ACCUMULATION=1 = GLOBAL_BATCH=4" in job["out0"]
    node0, node1 = ((job_logs / f"restart0-node{n}.log").read_text() for n in (0, 1))
    assert f"exiting at iteration {stopped_at} (signal)" in node0
    assert f"exiting at iteration {stopped_at}" not in node1  # rank 0, which reports, is on node 0
    assert _run_config(ckpt)["training"]["data_parallel_size"] == 2
    # The index cache went under --save, where every node reads it.
    assert any((ckpt / "data_cache").glob("indices-*/*-shuffle_index.npy"))

    assert job["rc1"] == 0, job["logs1"]
    assert (job["tmp_path"] / "requeues").read_text().splitlines() == [f"requeue {job_id}"]  # no second requeue
    assert "not requeueing after SIGTERM" in job["out1"]
    records = job["records"]
    second_stop = records[-1]["iteration"]
    assert second_stop >= stopped_at + 3
    # One record per iteration 1..second_stop: the second run continued at stopped_at + 1.
    assert [r["iteration"] for r in records] == list(range(1, second_stop + 1))
    assert [r["consumed_samples"] for r in records] == [4 * i for i in range(1, second_stop + 1)]
    assert records[:stopped_at] == first
    assert job["latest1"] == f"iter_{second_stop:07d}"
    launch_log = (job_logs / "launch.log").read_text()
    assert f"restart 1 on localhost 127.0.0.1; resuming from checkpoint: iter_{stopped_at:07d}" in launch_log
    assert all((job_logs / f"restart1-node{n}.log").exists() for n in (0, 1))


def test_two_node_run_resumes_on_one_node(two_node_job):
    """The same CHECKPOINT_DIR submitted again on 1 node (DP=1): the trainer converts the
    DP=2 checkpoint (DeepSpeed's universal checkpoint, megatron_lev.checkpointing) and
    training continues at the next iteration and sample."""
    job = two_node_job
    assert job["rc1"] == 0, job["logs1"]
    second_stop = job["records"][-1]["iteration"]
    # The same run length (the schedule must not change); EXIT_INTERVAL stops it 2 steps on.
    env = {**job["env"], "SLURM_JOB_ID": str(job["job_id"] + 1), "SLURM_JOB_NUM_NODES": "1",
           "SLURM_JOB_NODELIST": "localhost", "SLURM_RESTART_COUNT": "0", "EXIT_INTERVAL": str(second_stop + 2)}
    batch = BatchJob(env, job["tmp_path"] / "run2.out")
    try:
        rc = batch.finish(400)
    finally:
        batch.kill()
    assert rc == 0, batch.logs()
    assert "batch: DP=1 x MICRO_BATCH=4 x ACCUMULATION=1 = GLOBAL_BATCH=4" in batch.out.read_text()
    records = _training_records(job["metrics"])
    assert [r["iteration"] for r in records] == list(range(1, second_stop + 3))
    assert [r["consumed_samples"] for r in records] == [4 * i for i in range(1, second_stop + 3)]
    assert records[:second_stop] == job["records"]


def _run_config(save_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((save_dir / "config.yaml").read_text())


def test_plain_srun_and_mpirun_each_train_two_ranks(tmp_path, tiny_dataset, spm_tokenizer):
    """The launchers without torchrun, run for real on 2 CPU processes: `srun --ntasks 2
    python -m megatron_lev.train` (one task per process: ranks from SLURM_PROCID, port from
    the job id) and `mpirun -np 2 python -m megatron_lev.train` (Open MPI; rank 0's host
    and a free port broadcast with mpi4py, as no MASTER_ADDR is set). Both train DP=2 with
    the same losses, bit for bit."""
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun is not installed: `bash tools/run_tests.sh` installs Open MPI "
                    "(apt-get install openmpi-bin libopenmpi-dev)")
    import mpi4py  # noqa: F401  (the test extra installs it)

    train = [sys.executable, "-m", "megatron_lev.train", "--config", "tiny-lev", "--data-path", tiny_dataset,
             "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", spm_tokenizer,
             "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--log-interval", "1",
             "--split", "90,8,2", "--eval-interval", "100000", "--eval-iters", "1", "--no-bf16"]
    port = _free_port_below(60000)
    env = script_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=1, SLURM_JOB_ID=port - 10000,
                     OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, OMPI_MCA_rmaps_base_oversubscribe=1)
    launchers = {
        "srun": ["srun", "--nodes", "1", "--ntasks", "2", "--kill-on-bad-exit=1"],
        "mpirun": ["mpirun", "-np", "2", "--bind-to", "none"],
    }
    losses = {}
    for name, launcher in launchers.items():
        save = tmp_path / name
        proc = subprocess.run([*launcher, *train, "--save", str(save)], env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=400)
        assert proc.returncode == 0, f"{name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert _run_config(save)["training"]["data_parallel_size"] == 2, name
        records = _training_records(save / "metrics.jsonl")
        assert [(r["iteration"], r["consumed_samples"]) for r in records] == [(1, 4), (2, 8), (3, 12)], name
        losses[name] = [r["loss"] for r in records]
        assert proc.stdout.count("training done") == 1, name  # rank 0 alone reports
    assert losses["srun"] == losses["mpirun"]


def test_preprocess_pile_task_runs_preprocess_data(tmp_path, python_corpus, spm_tokenizer):
    """One real array task: the script's command line is one tools/preprocess_data.py
    accepts; a finished task is skipped when the array is resubmitted; make_blend turns
    the outputs into the blend."""
    pile, out = tmp_path / "pile", tmp_path / "tok"
    (pile / "train").mkdir(parents=True)
    (pile / "train" / "00.jsonl.zst").symlink_to(python_corpus)
    env = {"PILE_DIR": pile, "OUTPUT_DIR": out, "TOKENIZER_MODEL": spm_tokenizer,
           "SLURM_ARRAY_TASK_ID": 0, "SLURM_CPUS_PER_TASK": 1}
    proc = run_script("preprocess_pile.sh", timeout=300, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prefix = out / "train" / "pile_00_text_document"
    assert prefix.with_suffix(".bin").stat().st_size > 0 and prefix.with_suffix(".idx").is_file()

    proc = run_script("preprocess_pile.sh", **env)
    assert proc.returncode == 0 and f"{prefix}.idx exists, skipping" in proc.stdout

    make_blend = _import_make_blend()
    assert make_blend.make_blend(make_blend.find_prefixes([str(out / "train")])) == f"1 {prefix}"
