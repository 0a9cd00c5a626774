"""megatron_lev/launcher/: the Slurm launcher in Python. The scripts' dry runs and refusals are
those the bash launcher printed (tests/slurm_dry_runs.py recorded them before the move); the batch
arithmetic, bash's quoting, the architecture list and the decisions after a step, one by one."""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from megatron_lev.launcher.batch import choose_micro_batch, nearest_valid
from megatron_lev.launcher.shell import LaunchError, bash_quote, print_cmd
from megatron_lev.launcher.steps import LaunchLog, StepPlan, after_step
from megatron_lev.launcher.training import normalized_arch_list
from tests.slurm_dry_runs import CASES, expected, load_golden, run_case, without_disk_line
from tests.test_slurm import REPO, SLURM, script_env

GOLDEN = load_golden()


@pytest.mark.parametrize("name", list(CASES))
def test_dry_runs_and_refusals_are_the_bash_launchers(name):
    """Every recorded combination: the same stdout (environment, batch line, srun and torchrun
    commands, byte for byte), the same one-line refusal, the same exit status; only the lines issue
    43 adds on purpose are new (slurm_dry_runs.expected)."""
    result = run_case(name)
    assert without_disk_line(result) == expected(name, GOLDEN)
    disk = [line for line in result["stdout"].splitlines() if line.startswith("# Disk: ")]
    if not CASES[name][0].startswith("train") or result["rc"] != 0:
        assert disk == []
    else:  # also under a stand-in torch package (PYTHONPATH cases): the count needs no torch
        assert len(disk) == 1 and disk[0].startswith("# Disk: one checkpoint is about "), disk


@pytest.mark.parametrize("value", ["plain", "", "a b", "it's", "'", "tab\there", "new\nline", "bell\a\x01",
                                   "é ü", "$HOME `x` \\", "--flag=v", "x*?[a]"])
def test_quoting_is_bashs(value):
    """bash_quote is bash's ${value@Q}; print_cmd leaves a word bare only where bash's print_cmd did."""
    bash = subprocess.run(["bash", "-c", 'printf "%s" "${1@Q}"', "_", value], capture_output=True, text=True)
    assert bash_quote(value) == bash.stdout
    # The printed line, pasted into bash, gives back the words.
    back = subprocess.run(["bash", "-c", 'eval "set -- $1"; printf "%s|%s" "$#" "$2"', "_", print_cmd(["cmd", value])],
                          capture_output=True, text=True)
    assert back.stdout == f"2|{value}"


def test_batch_arithmetic():
    # 8 x H100 at 512 tokens: 512 sequences over DP 8 = 64 per rank, 32 fit -> 2 accumulation steps.
    plan = choose_micro_batch(nodes=1, gpus_per_node=8, tp=1, pp=1, global_batch=512, micro_batch=None, fits=32,
                              seq_length=512)
    assert (plan.data_parallel, plan.micro_batch, plan.accumulation) == (8, 32, 2)
    assert plan.summary() == ("DP=8 x MICRO_BATCH=32 x ACCUMULATION=2 = GLOBAL_BATCH=512 sequences of 512 tokens "
                              "per step")
    # 48 sequences over DP 6 (3 nodes x 8 / TP 2 x PP 2) = 8 per rank; 5 fit: the largest divisor is 4.
    plan = choose_micro_batch(nodes=3, gpus_per_node=8, tp=2, pp=2, global_batch=48, micro_batch=None, fits=5,
                              seq_length=2048)
    assert (plan.data_parallel, plan.micro_batch, plan.accumulation) == (6, 4, 2)
    # No global batch: one micro-batch per rank, the batch line says DP x micro.
    plan = choose_micro_batch(nodes=2, gpus_per_node=8, tp=1, pp=1, global_batch=None, micro_batch=None, fits=128,
                              seq_length=128)
    assert plan.summary().startswith("DP=16 x MICRO_BATCH=128 x ACCUMULATION=1 = GLOBAL_BATCH=2048 ")
    assert nearest_valid(24, lambda dp: 512 % dp == 0) == "16 or 32"
    assert nearest_valid(1, lambda v: v == 3) == "3" and nearest_valid(5, lambda v: False) == ""
    with pytest.raises(LaunchError, match=r"^GLOBAL_BATCH=500 sequences cannot be split over data-parallel size 8 "
                       r"\(NODES=1 x GPUS_PER_NODE=8 / TP=1 x PP=1\): use GLOBAL_BATCH=496 or 504$"):
        choose_micro_batch(nodes=1, gpus_per_node=8, tp=1, pp=1, global_batch=500, micro_batch=None, fits=32,
                           seq_length=512)


@pytest.mark.parametrize("given, expected", [
    ("9.0a", "9.0"), ("9.0a+PTX", "9.0+PTX"), ("8.0;9.0a", "8.0;9.0"), ("8.0 9.0a 10.0a", "8.0 9.0 10.0"),
    ("9.0", "9.0"), ("8.6+PTX", "8.6+PTX"), ("12.0f", "12.0"),
])
def test_cuda_arch_suffix_is_dropped(given, expected):
    assert normalized_arch_list(given) == expected


def _launch_in_shell(tmp_path, **variables) -> subprocess.CompletedProcess:
    """The batch shell's own use of the launcher, inside a (shimmed) job: `launcher plan`, then what
    it leaves in the shell's environment for srun to pass on to the tasks."""
    for suffix in (".bin", ".idx"):
        (tmp_path / f"data{suffix}").touch()
    (tmp_path / "tok.model").touch()
    script = f"""
set -euo pipefail
MEGATRON_LEV_DIR={shlex.quote(str(REPO))}
source "$MEGATRON_LEV_DIR/slurm/common.sh"
setup_python_env
export CONFIG=tiny-lev
launcher plan
env | grep -E '^(TORCH_CUDA_ARCH_LIST|CUDA_DEVICE_MAX_CONNECTIONS)=' | sort
printf 'srun_cmd:'; printf ' %q' "${{srun_cmd[@]}}"; echo
echo "JOB_ID=$JOB_ID TORCHRUN_USR1=$TORCHRUN_USR1 resumed_from=$launch_resumed_from plan=$launch_plan"
"""
    env = script_env(SLURM_JOB_ID=4242, SLURM_JOB_NUM_NODES=1, SLURM_JOB_NODELIST="localhost", SLURM_JOB_NAME="t",
                     DATA_PATH=tmp_path / "data", TOKENIZER_MODEL=tmp_path / "tok.model", GPUS_PER_NODE=2,
                     CHECKPOINT_DIR=tmp_path / "ckpt", LOG_ROOT=tmp_path / "logs", **variables)
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)


def test_plan_hands_the_commands_and_the_tasks_environment_to_the_shell(tmp_path):
    """Inside a job, `launcher plan` logs the job's first lines (batch output and launch.log) and
    hands back, on fd 3, the srun command and the tasks' variables, TORCH_CUDA_ARCH_LIST's `9.0a`
    as `9.0` (DeepSpeed 0.19's op builder cannot parse the suffix; fused Adam would silently fall
    back), +PTX kept."""
    proc = _launch_in_shell(tmp_path, TORCH_CUDA_ARCH_LIST="8.0;9.0a+PTX", CUDA_DEVICE_MAX_CONNECTIONS=4)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert "TORCH_CUDA_ARCH_LIST=8.0;9.0+PTX" in out and "CUDA_DEVICE_MAX_CONNECTIONS=4" in out
    assert out[0].endswith("job 4242 restart 0 on localhost; resuming from checkpoint: none")
    assert out[1].endswith("batch: DP=2 x MICRO_BATCH=4 x ACCUMULATION=1 = GLOBAL_BATCH=8 sequences of 64 tokens "
                           "per step")
    assert " checkpoints: one checkpoint is about 2.5 MB (178,080 parameters x 14 bytes: " in out[2]
    assert out[3].startswith("srun command: srun --nodes 1 --ntasks 1 ")
    assert out[4].endswith("TORCH_CUDA_ARCH_LIST=8.0;9.0a+PTX -> 8.0;9.0+PTX (DeepSpeed's op builder cannot parse "
                           "an architecture suffix)")
    (srun,) = [shlex.split(l.split(":", 1)[1]) for l in out if l.startswith("srun_cmd:")]
    assert srun == shlex.split(out[3].split(": ", 1)[1])
    assert srun[srun.index("--output") + 1] == f"{tmp_path}/logs/t-4242/restart0-node%n.log"
    plan = StepPlan.load(str(tmp_path / "logs" / "t-4242" / "launch-plan.json"))
    assert (plan.job_id, plan.restart, plan.srun_cmd, plan.started_from) == (4242, 0, srun, "none")
    assert out[-1] == f"JOB_ID=4242 TORCHRUN_USR1=1 resumed_from=none plan={tmp_path}/logs/t-4242/launch-plan.json"
    assert (tmp_path / "logs" / "t-4242" / "launch.log").read_text().splitlines() == out[:5]
    # Without a suffix nothing is changed, and nothing said.
    proc = _launch_in_shell(tmp_path, TORCH_CUDA_ARCH_LIST="9.0")
    assert "TORCH_CUDA_ARCH_LIST=9.0" in proc.stdout.splitlines() and "->" not in proc.stdout


def _plan(tmp_path, restart=0, max_requeues=50, max_restarts=3) -> StepPlan:
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    return StepPlan(job_id=77, restart=restart, job_log_dir=str(tmp_path / "logs"), checkpoint_dir=str(tmp_path / "ckpt"),
                    max_requeues=max_requeues, max_restarts=max_restarts, started_from="iter_0000010",
                    srun_cmd=["srun", "--nodes", "2", "--output", f"{tmp_path}/logs/restart{restart}-node%n.log", "torchrun"])


def _decide(tmp_path, plan, *, rc, requeue=False, terminated=False, latest="iter_0000010", node_log="", attempt=0,
            resumed_from="iter_0000010", srun=False):
    (tmp_path / "ckpt" / "latest").write_text(latest + "\n")
    for path in (tmp_path / "logs").glob("restart*.log"):
        path.unlink()
    name = f"restart{plan.restart}{f'-attempt{attempt}' if attempt else ''}-node1.log"
    (tmp_path / "logs" / name).write_text(node_log)
    decision = after_step(plan, rc, requeue, terminated, resumed_from, attempt, LaunchLog(plan.job_log_dir))
    lines = [l.split("] ", 1)[1] for l in (tmp_path / "logs" / "launch.log").read_text().splitlines()]
    (tmp_path / "logs" / "launch.log").unlink()
    return (decision.action, decision.exit_code, lines) + ((list(decision.srun_cmd),) if srun else ())


def test_decisions_after_a_step(tmp_path):
    plan = _plan(tmp_path)
    # USR1: checkpointed at iteration 12, requeued.
    action, code, lines = _decide(tmp_path, plan, rc=1, requeue=True, latest="iter_0000012")
    assert (action, code) == ("requeue", 0)
    assert lines == ["job step exited with status 1; latest checkpoint: iter_0000012",
                     "(a non-zero status is expected after a signal: torchrun reports the one it forwarded)",
                     "requeueing job 77"]
    # USR1 after training finished: nothing to requeue.
    action, code, lines = _decide(tmp_path, plan, rc=1, requeue=True, latest="iter_0000012",
                                  node_log="training done: 12 iterations, 100 tokens, 0 skipped steps\n")
    assert (action, code, lines[-1]) == ("exit", 0, "not requeueing: training finished before the signal took effect")
    # SIGTERM: a clean stop ends the job successfully, no requeue; without a new checkpoint it keeps the status.
    assert _decide(tmp_path, plan, rc=1, terminated=True, latest="iter_0000012")[:2] == ("exit", 0)
    action, code, lines = _decide(tmp_path, plan, rc=143, terminated=True)
    assert (action, code) == ("exit", 143)
    assert lines[2:] == [f"warning: no new checkpoint since iter_0000010; see {tmp_path}/logs/restart0-node*.log",
                         "not requeueing after SIGTERM"]
    # The requeue limit.
    action, code, lines = _decide(tmp_path, _plan(tmp_path, restart=5, max_requeues=5), rc=1, requeue=True,
                                  latest="iter_0000012")
    assert (action, code, lines[-1]) == ("exit", 1, "not requeueing: restart 5 reached MAX_REQUEUES=5")
    # No signal: the step's own status.
    assert _decide(tmp_path, plan, rc=0, latest="iter_0000100")[:2] == ("exit", 0)


def test_a_failed_step_restarts_in_the_allocation_then_requeues_or_fails(tmp_path):
    """A crash (no signal, a failure status) restarts the step from `latest` with its own node logs,
    up to MAX_RESTARTS times; then the job requeues if it got past the checkpoint it started from,
    else fails. An error the trainer reports itself is not retried."""
    plan, logs = _plan(tmp_path, restart=2), tmp_path / "logs"
    action, code, lines, srun = _decide(tmp_path, plan, rc=1, latest="iter_0000015", srun=True)
    assert (action, srun) == ("restart", ["srun", "--nodes", "2", "--output", f"{logs}/restart2-attempt1-node%n.log",
                                          "torchrun"])
    assert lines == ["job step exited with status 1; latest checkpoint: iter_0000015",
                     "the step failed: restarting the trainers in this allocation from checkpoint iter_0000015 (restart "
                     f"1 of MAX_RESTARTS=3; node logs {logs}/restart2-attempt1-node*.log)"]
    action, code, lines, srun = _decide(tmp_path, plan, rc=137, attempt=2, latest="iter_0000020", srun=True)
    assert (action, srun[4]) == ("restart", f"{logs}/restart2-attempt3-node%n.log")
    # The trainer's own error (here: a checkpoint that cannot fit) would come back: the job fails.
    action, code, lines = _decide(tmp_path, plan, rc=1, attempt=1, node_log=(
        "megatron_lev.train: error: checkpoint iter_0000020 needs 17.3 GB ...\n"))
    assert (action, code) == ("exit", 1)
    assert lines[-1] == ("not restarting: the trainer stopped on an error it reports (the line starting "
                         f"'megatron_lev.train: error:' in {logs}/restart2-attempt1-node*.log), which a restart would "
                         "meet again")
    # Restarts used up: progress since the job started (iter 10 -> 25) requeues, none fails it.
    action, code, lines = _decide(tmp_path, plan, rc=1, attempt=3, latest="iter_0000025")
    assert (action, lines[-1]) == ("requeue", "MAX_RESTARTS=3 restarts used; the job got from iter_0000010 to "
                                              "iter_0000025: requeueing job 77")
    action, code, lines = _decide(tmp_path, plan, rc=1, attempt=3)
    assert (action, code, lines[-1]) == ("exit", 1, "not restarting: MAX_RESTARTS=3 restarts used, and no checkpoint "
                                                    "since the job started from iter_0000010: the job fails (see "
                                                    f"{logs}/restart2-attempt3-node*.log)")
    action, code, lines = _decide(tmp_path, _plan(tmp_path, restart=2, max_requeues=2), rc=1, attempt=3,
                                  latest="iter_0000025")
    assert (action, code, lines[-1]) == ("exit", 1, "MAX_RESTARTS=3 restarts used; the job got from iter_0000010 to "
                                                    "iter_0000025: not requeueing: restart 2 reached MAX_REQUEUES=2")
    # MAX_RESTARTS=0: the first failure goes straight to that choice; a status 0 is never restarted.
    assert _decide(tmp_path, _plan(tmp_path, max_restarts=0), rc=1, latest="iter_0000012")[0] == "requeue"
    assert _decide(tmp_path, plan, rc=0, latest="iter_0000012")[:2] == ("exit", 0)
    # A signal during the restarted step: the requeue looks at that attempt's node logs.
    action, code, lines = _decide(tmp_path, plan, rc=1, requeue=True, attempt=1, latest="iter_0000030",
                                  resumed_from="iter_0000025", node_log="training done: 30 iterations\n")
    assert (action, code) == ("exit", 0)
