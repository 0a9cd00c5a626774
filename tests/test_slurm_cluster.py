"""The users' own commands under a real Slurm: `sbatch slurm/train_lev_1b.sh` and
`slurm/preprocess_pile.sh` on the single-node cluster of the `slurm_cluster` fixture (munged,
slurmctld and slurmd on this machine; tests/slurm_cluster.py), as docs/slurm.md's CPU smoke test
runs them: `--gres=none`, DeepSpeed's CPU accelerator from SITE_ENV, `tiny-lev` on 2 CPU ranks.

A run trains and checkpoints; a trainer process killed mid-run is restarted inside the job and
ends with the uninterrupted run's losses; USR1 through `scancel --signal=USR1 --batch` checkpoints, requeues,
and the job resumes at the next iteration with the same learning rates and losses as the
uninterrupted run; `scancel` then stops it with `latest` intact; preprocessing runs as a job
array; a dry run prints what it prints through the shims, and a bad EXTRA_ARGS is refused in the
same line.

Every kill and signal lands at a known iteration: the test-only hook tests/process_hooks holds
the trainers after that iteration until the test has acted (a signal also releases them), so no
test races the run, however fast the machine trains."""
from __future__ import annotations

import json
import os
import re
import shlex
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml

from tests.distributed import free_port
from tests.test_slurm import REPO, flag, run_script, script_env
from tests.test_slurm_jobs import _run_config, _training_records

TRAIN_ITERS = 60  # the schedule of both runs; the interrupted one is stopped long before
SAVE_INTERVAL = 5
SBATCH = "slurm/train_lev_1b.sh"
HOLD_HOOK = Path(__file__).resolve().parent / "process_hooks"


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


class Job:
    """One submitted job: its id, its files and the texts to show when a test fails."""

    def __init__(self, cluster, env: dict, folder: Path, sbatch_args: list, script: str = SBATCH,
                 output: str = "%x-%j.out"):
        self.cluster, self.env, self.folder = cluster, env, folder
        self.ckpt, self.log_root = Path(env.get("CHECKPOINT_DIR", folder / "ckpt")), Path(env.get("LOG_ROOT", folder))
        self.id = cluster.sbatch([*sbatch_args, f"--output={folder}/{output}", script], env=env, cwd=REPO)

    def out(self) -> str:
        return "".join(_read(p) for p in sorted(self.folder.glob(f"*-{self.id}.out")))

    def node_log(self, restart: int) -> str:
        return "".join(_read(p) for p in sorted(self.log_root.glob(f"*-{self.id}/restart{restart}-node*.log")))

    def logs(self) -> str:
        """What a failing test shows: the job's record, its outputs and the daemons' logs (the
        cluster's folder is gone after the run)."""
        record = self.cluster.client(["scontrol", "-o", "show", "job", str(self.id)], check=False)
        text = f"--- scontrol show job {self.id}\n{record.stdout.strip() or record.stderr.strip()}"
        text += f"\n--- batch output of job {self.id}\n{self.out()[-4000:]}"
        for path in sorted(self.log_root.glob(f"*-{self.id}/*.log")):
            text += f"\n--- {path.name} (tail)\n" + "\n".join(_read(path).splitlines()[-30:])
        return text + "\n" + self.cluster.daemon_logs(lines=40)

    def records(self) -> list[dict]:
        return _training_records(self.ckpt / "metrics.jsonl")

    def latest(self) -> str:
        return _read(self.ckpt / "latest").strip()

    def wait_for(self, predicate, timeout: float, what: str) -> dict:
        return self.cluster.wait_for(self.id, predicate, timeout, what, self.logs)

    def wait_finished(self, timeout: float) -> dict:
        return self.cluster.wait_finished(self.id, timeout, self.logs)


@pytest.fixture(scope="module")
def cpu_smoke_env(slurm_cluster, tmp_path_factory, tiny_dataset, spm_tokenizer):
    """docs/slurm.md's CPU smoke test: the variables of a tiny-lev run on 2 CPU ranks."""
    folder = tmp_path_factory.mktemp("cpu_smoke")
    site_env = folder / "site_env.sh"
    site_env.write_text("export DS_ACCELERATOR=cpu  # DeepSpeed on the CPU: the nodes have no GPU\n")
    return dict(CONFIG="tiny-lev", GPUS_PER_NODE=2, SITE_ENV=str(site_env), BF16=0, COMPILE_LAYERS=0,
                TRAIN_ITERS=TRAIN_ITERS, SAVE_INTERVAL=SAVE_INTERVAL, LOG_INTERVAL=1, OMP_NUM_THREADS=1,
                DATA_PATH=tiny_dataset, TOKENIZER_MODEL=spm_tokenizer,
                EXTRA_ARGS="--split 90,8,2 --eval-interval 100000 --eval-iters 1")


def _submit_training(cluster, tmp_path_factory, name: str, holds: tuple[int, ...] = (), **variables) -> Job:
    """Submit a training job. `holds`: iterations after whose log line its trainers wait (the
    test-only hook tests/process_hooks) until the test releases them or a signal reaches them:
    the test acts at a known iteration however fast the machine trains."""
    folder = tmp_path_factory.mktemp(name)
    hold_dir = folder / "holds"
    hold_dir.mkdir()
    for iteration in holds:
        (hold_dir / f"iter_{iteration}.hold").touch()
    env = cluster.env(script_env(shims=False, CHECKPOINT_DIR=folder / "ckpt", LOG_ROOT=folder / "logs",
                                 MASTER_PORT=free_port(), MEGATRON_LEV_TEST_HOLD_DIR=hold_dir,
                                 PYTHONPATH=HOLD_HOOK, **variables))
    job = Job(cluster, env, folder, ["--gres=none"])
    job.hold_dir = hold_dir
    return job


def _release(job: Job, iteration: int) -> None:
    (job.hold_dir / f"iter_{iteration}.hold").unlink()


def _held_at(log: str, iteration: int) -> bool:
    """A trainer said in `log` that it waits after iteration `iteration` (its record written)."""
    return re.search(rf"test hook: rank \d+ held after iteration {iteration}$", log, re.M) is not None


@pytest.fixture(scope="module")
def preempted_job(slurm_cluster, cpu_smoke_env, tmp_path_factory):
    """The batch flags in EXTRA_ARGS, as Megatron-LM users write them. After the first
    checkpoint: USR1 to the batch shell (`scancel --signal=USR1 --batch`, what Slurm does before
    the time limit); the requeued job is released and resumes; 3 iterations later a plain
    `scancel` stops it. Returns what the tests check."""
    env = {**cpu_smoke_env, "EXTRA_ARGS": "--micro-batch-size 2 --global-batch-size 4 " + cpu_smoke_env["EXTRA_ARGS"]}
    # Held the iteration after the first checkpoint until USR1 reaches it, and after the resume at
    # 2 * SAVE_INTERVAL + 1 until the SIGTERM of `scancel`: neither signal can come too late.
    first_hold, second_hold = SAVE_INTERVAL + 1, 2 * SAVE_INTERVAL + 1
    job = _submit_training(slurm_cluster, tmp_path_factory, "preempted", holds=(first_hold, second_hold), **env)
    result = {"job": job}
    job.wait_for(lambda j: _held_at(job.node_log(0), first_hold) or j["JobState"] not in ("PENDING", "RUNNING"),
                 600, f"the hold after iteration {first_hold}")
    assert job.latest() == f"iter_{SAVE_INTERVAL:07d}", f"no hold after the first checkpoint\n{job.logs()}"
    slurm_cluster.client(["scancel", "--signal=USR1", "--batch", str(job.id)])
    # Slurm holds a requeued job until its credential expires (AuthInfo cred_expire, 120 s).
    result["requeued"] = job.wait_for(
        lambda j: (j["JobState"], j["Restarts"], j["Reason"]) == ("PENDING", "1", "BeginTime"), 300, "the requeue")
    result["out0"], result["node0"], result["first"] = job.out(), job.node_log(0), job.records()
    result["latest0"] = job.latest()
    stopped_at = result["first"][-1]["iteration"] if result["first"] else 0
    # Released by hand, but not within the second of the requeue: Slurm revokes the old start's
    # credential at that second, and a start in the same second is killed ("Job credential
    # revoked", JobState FAILED). The 120 s hold exists to prevent exactly that.
    requeued_at = datetime.fromisoformat(result["requeued"]["SubmitTime"])
    while datetime.now() < requeued_at + timedelta(seconds=2):
        time.sleep(0.2)
    slurm_cluster.client(["scontrol", "update", f"JobId={job.id}", "StartTime=now"])
    assert stopped_at + 3 <= second_hold, f"USR1 stopped the run at iteration {stopped_at}\n{job.logs()}"
    job.wait_for(lambda j: _held_at(job.node_log(1), second_hold) or j["JobState"] not in ("PENDING", "RUNNING"),
                 600, f"the hold after iteration {second_hold}, after the resume")
    slurm_cluster.client(["scancel", str(job.id)])
    result["final"] = job.wait_finished(300)
    result["records"], result["latest1"], result["out1"], result["node1"] = (
        job.records(), job.latest(), job.out(), job.node_log(1))
    return result


@pytest.fixture(scope="module")
def uninterrupted_job(slurm_cluster, cpu_smoke_env, tmp_path_factory):
    """The same run, from start to end, with the batch from MICRO_BATCH and GLOBAL_BATCH."""
    job = _submit_training(slurm_cluster, tmp_path_factory, "uninterrupted", MICRO_BATCH=2, GLOBAL_BATCH=4,
                           **cpu_smoke_env)
    return {"job": job, "final": job.wait_finished(900)}


def _trainer_pid(job_id: int, local_rank: int) -> int | None:
    """The pid of the trainer process of `local_rank` in job `job_id` (torchrun's worker: it has
    LOCAL_RANK in its environment, torchrun itself has not)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = dict(item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0") if b"=" in item)
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (environ.get(b"SLURM_JOB_ID") == str(job_id).encode() and environ.get(b"LOCAL_RANK") == str(local_rank).encode()
                and b"megatron_lev.train" in cmdline):
            return int(entry.name)
    return None


@pytest.fixture(scope="module")
def crashed_job(slurm_cluster, cpu_smoke_env, tmp_path_factory, slurm_report):
    """The uninterrupted run's job, with one trainer process (local rank 1) killed by SIGKILL two
    iterations after the first checkpoint, while the hook holds the trainers there: the batch shell restarts the step in the same
    allocation (MAX_RESTARTS), which resumes from `latest` and trains to the end. The timeline
    (kill, restart, resume) goes to the run's summary."""
    import signal

    kill_at = SAVE_INTERVAL + 2
    job = _submit_training(slurm_cluster, tmp_path_factory, "crashed", holds=(kill_at,), MICRO_BATCH=2, GLOBAL_BATCH=4,
                           **cpu_smoke_env)
    start = time.time()
    job.wait_for(lambda j: _held_at(job.node_log(0), kill_at) or j["JobState"] not in ("PENDING", "RUNNING"),
                 600, f"the hold after iteration {kill_at}, two past the first checkpoint")
    pid = _trainer_pid(job.id, 1)
    assert pid is not None, f"no trainer process of local rank 1 in job {job.id}\n{job.logs()}"
    latest_at_kill, iteration_at_kill = job.latest(), job.records()[-1]["iteration"]
    assert (latest_at_kill, iteration_at_kill) == (f"iter_{SAVE_INTERVAL:07d}", kill_at), job.logs()
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    _release(job, kill_at)  # the restarted trainers pass it
    final = job.wait_finished(900)
    result = {"job": job, "final": final, "pid": pid, "latest_at_kill": latest_at_kill,
              "iteration_at_kill": iteration_at_kill, "records": job.records(),
              "launch": _read(next(job.log_root.glob(f"*-{job.id}/launch.log"), Path("none")))}
    restart_line = next((l for l in result["launch"].splitlines() if "restarting the trainers" in l), "")
    resumed = re.search(r"resumed from \S+ at iteration (\d+)", _read(next(
        job.log_root.glob(f"*-{job.id}/restart0-attempt1-node0.log"), Path("none"))))
    stamp = re.match(r"\[slurm ([0-9-]+ [0-9:]+)\]", restart_line)
    restarted = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S").timestamp() if stamp else float("nan")
    slurm_report.append(
        f"restart inside the job {job.id}: trainer pid {pid} (local rank 1) SIGKILLed {killed - start:.0f} s after "
        f"submit, at iteration {iteration_at_kill} (latest {latest_at_kill}); the step restarted "
        f"{restarted - killed:.0f} s later (launch.log, 1 s resolution), resumed at iteration "
        f"{resumed.group(1) if resumed else '?'}; job {final['JobState']} {time.time() - killed:.0f} s after the kill")
    return result


def test_a_killed_trainer_restarts_inside_the_job_with_the_uninterrupted_losses(crashed_job, uninterrupted_job):
    """One trainer process SIGKILLed mid-run: no requeue (Restarts=0), the step restarts in the
    allocation from the checkpoint, and every iteration from there on has the uninterrupted run's
    learning rate and loss; the iterations before the kill had them too."""
    job, final = crashed_job["job"], crashed_job["final"]
    assert (final["JobState"], final["ExitCode"], final["Restarts"]) == ("COMPLETED", "0:0", "0"), job.logs()
    # The checkpoint the restart resumed from: the latest at the kill (a save finishing in the
    # microseconds between reading `latest` and the kill would make it the next one).
    launch = crashed_job["launch"]
    restart = re.search(r"the step failed: restarting the trainers in this allocation from checkpoint (iter_(\d+)) "
                        r"\(restart 1 of MAX_RESTARTS=3", launch)
    assert restart, job.logs()
    resumed_at = int(restart.group(2))
    assert int(crashed_job["latest_at_kill"].split("_")[1]) <= resumed_at < crashed_job["iteration_at_kill"] + 1
    node0 = _read(next(job.log_root.glob(f"*-{job.id}/restart0-attempt1-node0.log")))
    assert f"resumed from {job.ckpt}/{restart.group(1)} at iteration {resumed_at}" in node0
    assert f"training done: {TRAIN_ITERS} iterations" in node0
    records = crashed_job["records"]
    # metrics.jsonl holds the crashed attempt's records, then the restarted one's from resumed_at + 1.
    back = next(i for i in range(1, len(records)) if records[i]["iteration"] <= records[i - 1]["iteration"])
    before, after = records[:back], records[back:]
    assert [r["iteration"] for r in before] == list(range(1, len(before) + 1))
    assert len(before) >= crashed_job["iteration_at_kill"] > resumed_at
    assert [r["iteration"] for r in after] == list(range(resumed_at + 1, TRAIN_ITERS + 1))
    reference = {r["iteration"]: r for r in uninterrupted_job["job"].records()}
    for key in ("consumed_samples", "lr", "loss"):
        assert [r[key] for r in before + after] == [reference[r["iteration"]][key] for r in before + after], key
    assert job.latest() == f"iter_{TRAIN_ITERS:07d}"


def test_sbatch_trains_on_two_cpu_ranks_and_checkpoints(uninterrupted_job):
    job, final = uninterrupted_job["job"], uninterrupted_job["final"]
    assert (final["JobState"], final["ExitCode"]) == ("COMPLETED", "0:0"), job.logs()
    out = job.out()
    assert "batch: DP=2 x MICRO_BATCH=2 x ACCUMULATION=1 = GLOBAL_BATCH=4 sequences of 64 tokens per step" in out
    (srun,) = [shlex.split(l.split(": ", 1)[1]) for l in out.splitlines() if l.startswith("srun command: ")]
    assert srun[srun.index("--cpus-per-task") + 1] == final["NumCPUs"] == "2"  # the node's CPUs: --exclusive
    assert flag(srun, "--nproc-per-node") == ["2"] and flag(srun, "--rdzv-endpoint")[0].startswith(job.cluster.node)
    records = job.records()
    assert [(r["iteration"], r["consumed_samples"]) for r in records] == [(i, 4 * i) for i in range(1, TRAIN_ITERS + 1)]
    assert f"training done: {TRAIN_ITERS} iterations" in job.node_log(0)
    assert job.latest() == f"iter_{TRAIN_ITERS:07d}"
    from megatron_lev.checkpointing.catalog import complete_checkpoints

    # A checkpoint every SAVE_INTERVAL, the newest KEEP_CHECKPOINTS (3, the default) kept; the job's
    # first lines said one checkpoint's size and the disk the run needs.
    saved = [iteration for iteration, _ in complete_checkpoints(str(job.ckpt))]
    assert sorted(saved) == list(range(SAVE_INTERVAL, TRAIN_ITERS + 1, SAVE_INTERVAL))[-3:]
    assert sorted(p.name for p in job.ckpt.glob("iter_*")) == [f"iter_{i:07d}" for i in sorted(saved)]
    assert "checkpoints: one checkpoint is about " in out and "the newest 3 kept (KEEP_CHECKPOINTS=3)" in out
    assert "step and save times not measured yet" in out  # the first start
    # Each checkpoint records its save's time, which a later start weighs SAVE_INTERVAL with.
    assert all(json.loads((job.ckpt / f"iter_{i:07d}" / "complete.json").read_text())["save_seconds"] > 0 for i in saved)
    training = _run_config(job.ckpt)["training"]
    assert (training["data_parallel_size"], training["micro_batch_size"], training["global_batch_size"]) == (2, 2, 4)


def test_usr1_checkpoints_requeues_and_resumes_at_the_next_iteration(preempted_job, uninterrupted_job):
    job = preempted_job["job"]
    first = preempted_job["first"]
    assert first, job.logs()
    stopped_at = first[-1]["iteration"]
    assert SAVE_INTERVAL <= stopped_at < TRAIN_ITERS
    # The batch flags of EXTRA_ARGS are the batch the log states, and the command passes them once.
    out0 = preempted_job["out0"]
    assert "batch: DP=2 x MICRO_BATCH=2 x ACCUMULATION=1 = GLOBAL_BATCH=4 sequences of 64 tokens per step" in out0
    srun = shlex.split(next(l for l in out0.splitlines() if l.startswith("srun command: ")).split(": ", 1)[1])
    assert (srun.count("--micro-batch-size"), srun.count("--global-batch-size")) == (1, 1)
    assert (flag(srun, "--micro-batch-size"), flag(srun, "--global-batch-size")) == (["2"], ["4"])
    # USR1: a checkpoint at the step it stopped, then the requeue; Slurm holds the job a while.
    assert "USR1: the time limit is near" in out0 and f"requeueing job {job.id}" in out0
    assert f"exiting at iteration {stopped_at} (signal)" in preempted_job["node0"]
    assert preempted_job["latest0"] == f"iter_{stopped_at:07d}"
    requeued = preempted_job["requeued"]
    held = datetime.fromisoformat(requeued["EligibleTime"]) - datetime.fromisoformat(requeued["SubmitTime"])
    assert held.total_seconds() >= 100, requeued  # about 2 minutes (docs/slurm.md), then released by hand
    # The second start resumed from that checkpoint and went on at the next iteration.
    launch = _read(next(job.log_root.glob(f"*-{job.id}/launch.log")))
    assert f"restart 1 on {job.cluster.node}; resuming from checkpoint: iter_{stopped_at:07d}" in launch, job.logs()
    assert f"resumed from {job.ckpt}/iter_{stopped_at:07d} at iteration {stopped_at}" in preempted_job["node1"], \
        job.logs()
    # The second start's first lines weigh the save interval with the first start's measured times.
    assert re.search(r"a step took [0-9.e+-]+ s and a save [0-9.e+-]+ s \(measured in CHECKPOINT_DIR\): "
                     r"SAVE_INTERVAL=5 spends [0-9.e+-]+% of the time saving", preempted_job["out1"]), job.logs()
    records = preempted_job["records"]
    last = records[-1]["iteration"]
    assert last >= stopped_at + 3
    assert [r["iteration"] for r in records] == list(range(1, last + 1))
    assert records[:stopped_at] == first
    # The same learning rates and losses as the run nobody interrupted, before and after the resume.
    reference = {r["iteration"]: r for r in uninterrupted_job["job"].records()}
    for key in ("consumed_samples", "lr", "loss"):
        assert [r[key] for r in records] == [reference[r["iteration"]][key] for r in records], key


def test_scancel_stops_the_job_with_latest_intact(preempted_job):
    """A plain `scancel`: Slurm sends SIGTERM to every process of the job (SIGKILL KillWait
    seconds later); the trainers checkpoint at the next step, the batch shell does not requeue."""
    from megatron_lev.checkpointing.catalog import complete_checkpoints, is_complete

    job, final = preempted_job["job"], preempted_job["final"]
    assert (final["JobState"], final["Restarts"]) == ("CANCELLED", "1"), job.logs()
    assert "TERM: asking the trainer to checkpoint and exit (no requeue)" in preempted_job["out1"]
    assert "not requeueing after SIGTERM" in preempted_job["out1"]
    stopped_at = preempted_job["records"][-1]["iteration"]
    assert f"exiting at iteration {stopped_at} (signal)" in preempted_job["node1"]
    assert preempted_job["latest1"] == f"iter_{stopped_at:07d}" and is_complete(str(job.ckpt), preempted_job["latest1"])
    # Every checkpoint folder there is complete: none was cut short.
    folders = sorted(p.name for p in job.ckpt.glob("iter_*"))
    assert folders == sorted(tag for _, tag in complete_checkpoints(str(job.ckpt)))


def _save_folder_at(folder: Path, ckpt: Path, iteration: int) -> str:
    """A --save folder holding one checkpoint of the run in `ckpt` (linked) and its metrics up to
    it: that run as it stood at `iteration`."""
    folder.mkdir(parents=True)
    tag = f"iter_{iteration:07d}"
    (folder / tag).symlink_to(ckpt / tag)
    (folder / "latest").write_text(tag)
    lines = [l for l in (ckpt / "metrics.jsonl").read_text().splitlines() if json.loads(l)["iteration"] <= iteration]
    (folder / "metrics.jsonl").write_text("".join(l + "\n" for l in lines))
    return str(folder)


def test_evaluation_and_release_as_a_job(slurm_cluster, uninterrupted_job, tmp_path, tiny_dataset):
    """slurm/evaluate.sh on the trained tiny run, two "seeds" of a pair (`late` = its iteration 60,
    `early` = 50 and 55): perplexity, curves, exports, lm-eval on local PIQA / LAMBADA, the
    release with the scores in its card, the summary over seeds. Each stage's numbers are the
    tools' own on the same checkpoints; resubmitted, the job skips every finished stage."""
    ckpt = uninterrupted_job["job"].ckpt
    for seed, early in (("1", 50), ("2", 55)):
        _save_folder_at(tmp_path / "runs" / f"late-s{seed}", ckpt, TRAIN_ITERS)
        _save_folder_at(tmp_path / "runs" / f"early-s{seed}", ckpt, early)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    piqa = [{"goal": "def f", "sol1": "return x", "sol2": "import y", "label": 0},
            {"goal": "for i in", "sol1": "range(3):", "sol2": "the mat", "label": 0},
            {"goal": "class A", "sol1": "(object):", "sol2": "print", "label": 1}]
    (tasks / "piqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in piqa))
    lambada = [{"text": "import os"}, {"text": "return self"}, {"text": "def main"}]
    (tasks / "lambada_openai.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lambada))
    out = tmp_path / "eval"
    env = slurm_cluster.env(script_env(
        shims=False, RUNS=f"late={tmp_path}/runs/late-s{{seed}} early={tmp_path}/runs/early-s{{seed}}", SEEDS="1 2",
        BASELINE="early", OUTPUT_DIR=out, TASK_DATA_DIR=tasks, TASKS="piqa,lambada_openai", EVAL_BATCH_SIZE=2,
        EVAL_TOKENS=2048, CURVES_METRIC="loss", FREQ_DATASET=tiny_dataset, BUCKETS="quantile:2", BF16=0,
        EXPORT_DTYPE="fp32", LICENSE="apache-2.0", HF_DATASET="monology/pile-uncopyrighted", OMP_NUM_THREADS=1,
        SITE_ENV=uninterrupted_job["job"].env["SITE_ENV"]))
    job = Job(slurm_cluster, env, tmp_path, ["--gres=none", "--cpus-per-task=2"], "slurm/evaluate.sh")
    final = job.wait_finished(900)
    assert (final["JobState"], final["ExitCode"]) == ("COMPLETED", "0:0"), job.out()[-6000:]
    log = job.out()
    assert f"seed 2: late = {tmp_path}/runs/late-s2 at iter_{TRAIN_ITERS:07d}, early = {tmp_path}/runs/early-s2 at " \
           "iter_0000055" in log
    assert "[15/15] seeds -> seeds: " in log and not list(out.rglob("*.partial"))
    evaluation = {s: json.loads((out / f"s{s}" / "evaluation" / "evaluation.json").read_text()) for s in ("1", "2")}
    loss = {s: {m: r["loss"] for m, r in e["models"].items()} for s, e in evaluation.items()}
    assert loss["1"]["late"] == loss["2"]["late"] and loss["1"]["early"] != loss["2"]["early"]  # the same iter 60
    assert all(e["eval_tokens"] == 2048 and e["baseline"] == "early" for e in evaluation.values())
    curves = json.loads((out / "s1" / "curves" / "curves.json").read_text())
    assert curves["baseline"] == "early"
    downstream = {s: json.loads((out / f"s{s}" / "downstream" / "downstream.json").read_text()) for s in ("1", "2")}
    for s, report in downstream.items():
        for name in ("late", "early"):
            piqa_scores = report["models"][name]["tasks"]["piqa"]
            assert piqa_scores["num_examples"] == 3 and 0 <= piqa_scores["acc"] <= 1
            assert piqa_scores["acc_stderr"] >= 0 and report["models"][name]["tasks"]["lambada_openai"]["perplexity"] > 1
            assert report["models"][name]["path"] == str(out / f"s{s}" / "hf" / name)
    # The release: the checkpoint again, its card carrying that seed's scores with their errors.
    card = (out / "s2" / "release" / "late" / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["license"] == "apache-2.0" and meta["datasets"] == ["monology/pile-uncopyrighted"]
    late = downstream["2"]["models"]["late"]["tasks"]
    assert (f"| piqa | acc | {late['piqa']['acc']:.4f} | {late['piqa']['acc_stderr']:.4f} | 3 |") in card
    assert f"model `late` of `downstream.json`" in card
    assert Path(out / "s2" / "release" / "late" / "model.safetensors").read_bytes() == Path(
        out / "s2" / "hf" / "late" / "model.safetensors").read_bytes()
    seeds = json.loads((out / "seeds" / "seeds.json").read_text())
    (pair,) = seeds["pairs"]
    assert (pair["model"], pair["baseline"]) == ("late", "early")
    difference = [loss[s]["late"] - loss[s]["early"] for s in ("1", "2")]
    assert pair["loss_difference"]["mean"] == pytest.approx(sum(difference) / 2, rel=1e-9)
    rows = {(r["task"], r["metric"]): r for r in pair["downstream"]["rows"]}
    assert rows["piqa", "acc"]["late"]["n"] == 2

    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*.json")}
    (tmp_path / "again").mkdir()
    again = Job(slurm_cluster, env, tmp_path / "again", ["--gres=none", "--cpus-per-task=2"], "slurm/evaluate.sh")
    final = again.wait_finished(300)
    assert (final["JobState"], final["ExitCode"]) == ("COMPLETED", "0:0"), again.out()
    assert again.out().count(": done, skipping (FORCE=1 redoes it)") == 15
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.json")} == stamps


def test_preprocess_pile_as_a_job_array(slurm_cluster, tmp_path, python_corpus, spm_tokenizer, tiny_dataset):
    """Array tasks 0 (train shard 00), 1 (shard 01, absent) and 30 (val), one CPU each: the two
    present shards tokenize to the very bytes of tests' own preprocessing of the same corpus;
    the absent one fails alone, in one line."""
    pile, out = tmp_path / "pile", tmp_path / "tok"
    (pile / "train").mkdir(parents=True)
    (pile / "train" / "00.jsonl.zst").symlink_to(python_corpus)
    (pile / "val.jsonl.zst").symlink_to(python_corpus)
    env = slurm_cluster.env(script_env(shims=False, PILE_DIR=pile, OUTPUT_DIR=out, TOKENIZER_MODEL=spm_tokenizer))
    job = Job(slurm_cluster, env, tmp_path, ["--array=0,1,30", "--cpus-per-task=1"], "slurm/preprocess_pile.sh",
              output="%x-%A_%a.out")
    states = {task: slurm_cluster.wait_finished(f"{job.id}_{task}", 600) for task in (0, 1, 30)}
    outputs = {task: _read(tmp_path / f"preprocess-pile-{job.id}_{task}.out") for task in (0, 1, 30)}
    assert [(states[t]["JobState"], states[t]["ExitCode"]) for t in (0, 1, 30)] == [
        ("COMPLETED", "0:0"), ("FAILED", "1:0"), ("COMPLETED", "0:0")], outputs
    assert outputs[1] == f"slurm: error: task 1: input {pile}/train/01.jsonl.zst does not exist (PILE_DIR={pile})\n"
    expected = Path(tiny_dataset + ".bin").read_bytes()
    for prefix in (out / "train" / "pile_00_text_document", out / "val" / "pile_val_text_document"):
        assert Path(f"{prefix}.bin").read_bytes() == expected, prefix
        assert Path(f"{prefix}.idx").read_bytes() == Path(tiny_dataset + ".idx").read_bytes(), prefix


def test_dry_run_and_refusal_as_under_the_shims(slurm_cluster, tmp_path, tiny_dataset, spm_tokenizer):
    """On a real allocation (shared: --oversubscribe, one CPU) DRY_RUN=1 prints exactly what the
    shims print for the same job id, host and CPUs, and launches nothing; a typo in EXTRA_ARGS
    ends the job with the shims' one-line refusal. Without `--gres=none` sbatch itself refuses
    the header's `--gres=gpu:8` here (no GPUs)."""
    variables = dict(DATA_PATH=tiny_dataset, TOKENIZER_MODEL=spm_tokenizer, CHECKPOINT_DIR=tmp_path / "ckpt",
                     LOG_ROOT=tmp_path / "logs")
    env = slurm_cluster.env(script_env(shims=False, DRY_RUN=1, **variables))
    dry = Job(slurm_cluster, env, tmp_path, ["--gres=none", "--oversubscribe", "--cpus-per-task=1"])
    final = dry.wait_finished(300)
    assert (final["JobState"], final["ExitCode"], final["OverSubscribe"], final["NumCPUs"]) == (
        "COMPLETED", "0:0", "YES", "1"), dry.logs()
    node = slurm_cluster.node
    shim = run_script("train_lev_1b.sh", DRY_RUN=1, SLURM_JOB_ID=dry.id, SLURM_JOB_NUM_NODES=1,
                      SLURM_JOB_NODELIST=node, SLURM_JOB_NAME="lev-1.2b", SLURM_CPUS_ON_NODE=1, **variables)
    assert (shim.returncode, shim.stderr) == (0, "")
    assert dry.out() == shim.stdout
    (torchrun, *_) = [shlex.split(l) for l in shim.stdout.splitlines() if l.startswith("torchrun ")]
    assert flag(torchrun, "--rdzv-endpoint") == [f"{node}:{10000 + dry.id % 50000}"]
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ckpt").exists()

    typo = {**variables, "EXTRA_ARGS": "--lr 3e-4 --lr-warmup-iter 100"}
    (tmp_path / "refused").mkdir()
    refused = Job(slurm_cluster, slurm_cluster.env(script_env(shims=False, **typo)), tmp_path / "refused",
                  ["--gres=none"])
    final = refused.wait_finished(300)
    assert (final["JobState"], final["ExitCode"]) == ("FAILED", "1:0"), refused.logs()
    shim = run_script("train_lev_1b.sh", DRY_RUN=1, **typo)
    assert shim.returncode == 1 and shim.stderr.count("\n") == 1
    assert refused.out() == shim.stderr == ('slurm: error: the trainer refuses its flags (EXTRA_ARGS="--lr 3e-4 '
                                            '--lr-warmup-iter 100"): unrecognized argument --lr-warmup-iter (did you '
                                            "mean --lr-warmup-iters?)\n")
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ckpt").exists()

    proc = slurm_cluster.client(["sbatch", "--parsable", f"--output={tmp_path}/%j.out", SBATCH],
                                env=slurm_cluster.env(script_env(shims=False, **variables)), cwd=REPO, check=False)
    assert (proc.returncode, proc.stderr) == (1, "sbatch: error: Invalid generic resource (gres) specification\n")


def test_a_cluster_that_cannot_start_skips_in_one_line_or_fails_in_ci(monkeypatch):
    """No root, or Slurm missing with no apt-get: one line says why; the tests are skipped,
    or fail where MEGATRON_LEV_REQUIRE_SLURM=1 (.ci/run)."""
    from tests import slurm_cluster

    monkeypatch.delenv(slurm_cluster.REQUIRE_VARIABLE, raising=False)
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    report = []
    with pytest.raises(pytest.skip.Exception) as skipped:
        slurm_cluster.start_for_tests(report)
    line = "real Slurm cluster not started: not root (uid 1000): slurmctld and slurmd run as root here"
    assert (report, skipped.value.msg) == ([line], line)

    monkeypatch.setattr(slurm_cluster, "_which", lambda program: None)
    with pytest.raises(slurm_cluster.ClusterUnavailable, match="^munged, slurmctld, slurmd, sbatch, squeue, scontrol, "
                       "scancel, sinfo not installed, and installing slurm-wlm and munge needs root$"):
        slurm_cluster.install_packages()
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    with pytest.raises(slurm_cluster.ClusterUnavailable, match="and there is no apt-get to install slurm-wlm and munge$"):
        slurm_cluster.install_packages()

    monkeypatch.setenv(slurm_cluster.REQUIRE_VARIABLE, "1")
    report = []
    with pytest.raises(pytest.fail.Exception, match="^MEGATRON_LEV_REQUIRE_SLURM=1, and the real Slurm cluster not "
                       "started: munged, slurmctld.* no apt-get"):
        slurm_cluster.start_for_tests(report)
    assert len(report) == 1
