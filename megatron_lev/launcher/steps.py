"""What the batch shell does once a job step has ended: restart the trainers in the allocation,
requeue the job, or end it with a status. The shell passes what it knows (the step's exit status,
whether USR1 or SIGTERM reached it, which attempt this was); the rest is read from the run's files:
`latest` in the checkpoint folder and the trainers' node logs.

    USR1 (the time limit is near)   the trainers checkpointed: `scontrol requeue` (up to
                                    MAX_REQUEUES), unless training had already finished
    SIGTERM (scancel)               no requeue: a cancelled job stays cancelled; a clean stop
                                    (a new checkpoint) ends it successfully
    neither, status 0               the job is done (training finished, or --exit-interval)
    neither, a failure              a crash (a trainer killed, a lost node, a hung collective):
                                    a new step in the same allocation resumes from `latest`, up
                                    to MAX_RESTARTS times per job start; then, if the job made
                                    progress (a checkpoint newer than the one it started from),
                                    `scontrol requeue` (other nodes, maybe), else the job fails.
                                    An error the trainer reports itself (`megatron_lev.train:
                                    error: ...`: a bad flag, a checkpoint that cannot fit on the
                                    disk, non-finite steps) would recur: no restart.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from megatron_lev.launcher.shell import stamp
from megatron_lev.utils.files import write_text_atomic

PLAN_FILE = "launch-plan.json"  # in the job's log folder: what after-step needs from the plan
TRAINING_DONE = "training done"  # the trainer's last line (megatron_lev/training/trainer.py)
TRAINER_ERROR = "megatron_lev.train: error: "  # the line of an error the trainer stops on (train.py)
MAX_RESTARTS_DEFAULT = 3  # restarts inside the allocation per job start (MAX_RESTARTS)


@dataclass
class StepPlan:
    """The part of the launch the decisions after a step read (written by `plan`, JSON)."""

    job_id: int
    restart: int
    job_log_dir: str
    checkpoint_dir: str
    max_requeues: int
    max_restarts: int = MAX_RESTARTS_DEFAULT
    srun_cmd: list[str] = field(default_factory=list)  # the first attempt's
    started_from: str = "none"  # the checkpoint the job start resumed from

    def save(self) -> str:
        path = os.path.join(self.job_log_dir, PLAN_FILE)
        write_text_atomic(path, json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, path: str) -> "StepPlan":
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))


@dataclass(frozen=True)
class Decision:
    action: str  # "restart", "requeue" or "exit"
    exit_code: int = 0
    srun_cmd: tuple[str, ...] = ()  # the restart's step


def node_log_pattern(job_log_dir: str, restart: int, attempt: int) -> str:
    """srun's --output for the trainers of one step: restart<N>-node<n>.log for a job start's first
    step, restart<N>-attempt<K>-node<n>.log for its K-th restart inside the allocation."""
    return f"{job_log_dir}/restart{restart}{f'-attempt{attempt}' if attempt else ''}-node%n.log"


def attempt_command(plan: StepPlan, attempt: int) -> list[str]:
    """The srun command of attempt `attempt`: the first one's, with that attempt's node logs."""
    cmd = list(plan.srun_cmd)
    cmd[cmd.index("--output") + 1] = node_log_pattern(plan.job_log_dir, plan.restart, attempt)
    return cmd


class LaunchLog:
    """Lines for the batch output and the job's launch.log, the way `log ... | tee -a` wrote them."""

    def __init__(self, job_log_dir: str):
        self.path = os.path.join(job_log_dir, "launch.log")

    def write(self, line: str, stamped: bool = True) -> None:
        text = f"{stamp()} {line}" if stamped else line
        print(text, flush=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text + "\n")


def latest_checkpoint(checkpoint_dir: str) -> str:
    """The tag `latest` names (`none` before the first checkpoint)."""
    try:
        with open(os.path.join(checkpoint_dir, "latest"), encoding="utf-8") as f:
            return f.read().rstrip("\n")
    except FileNotFoundError:
        return "none"


def node_logs(plan: StepPlan, attempt: int) -> list[str]:
    """The node logs of one attempt's step (srun's %n expanded)."""
    return sorted(glob.glob(glob.escape(node_log_pattern(plan.job_log_dir, plan.restart, attempt)).replace("%n", "*")))


def logs_contain_line(paths: list[str], prefix: str) -> bool:
    """Whether a line of these logs starts with `prefix` (grep -qs "^prefix")."""
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                if any(line.startswith(prefix) for line in f):
                    return True
        except OSError:
            continue
    return False


def after_step(plan: StepPlan, rc: int, requeue: bool, terminated: bool, resumed_from: str, attempt: int = 0,
               log: Optional[LaunchLog] = None) -> Decision:
    """The decision once attempt `attempt` (0: the job start's first step) exited with `rc`;
    `requeue` / `terminated`: USR1 / SIGTERM reached the batch shell; `resumed_from`: the checkpoint
    the step started from. Writes the log lines the batch output and launch.log show."""
    log = log or LaunchLog(plan.job_log_dir)
    latest = latest_checkpoint(plan.checkpoint_dir)
    log.write(f"job step exited with status {rc}; latest checkpoint: {latest}")
    logs = node_log_pattern(plan.job_log_dir, plan.restart, attempt).replace("%n", "*")
    if requeue or terminated:
        # torchrun exits 1 (SignalException) after passing a signal on, even when every trainer
        # checkpointed and exited 0; the trainers' own lines are in the node logs.
        log.write("(a non-zero status is expected after a signal: torchrun reports the one it forwarded)")
        if latest == resumed_from:
            log.write(f"warning: no new checkpoint since {resumed_from}; see {logs}")
    if terminated:
        # Stopped on request: a clean stop (a new checkpoint) ends the job successfully.
        log.write("not requeueing after SIGTERM")
        return Decision("exit", 0 if latest != resumed_from else rc)
    if requeue and logs_contain_line(node_logs(plan, attempt), TRAINING_DONE):
        log.write("not requeueing: training finished before the signal took effect")
        return Decision("exit", 0)
    if requeue:
        return _requeue(plan, log, "")
    if rc == 0:
        return Decision("exit", 0)
    if logs_contain_line(node_logs(plan, attempt), TRAINER_ERROR):
        log.write(f"not restarting: the trainer stopped on an error it reports (the line starting "
                  f"'{TRAINER_ERROR.strip()}' in {logs}), which a restart would meet again")
        return Decision("exit", rc)
    if attempt < plan.max_restarts:
        log.write(f"the step failed: restarting the trainers in this allocation from checkpoint {latest} "
                  f"(restart {attempt + 1} of MAX_RESTARTS={plan.max_restarts}; node logs "
                  f"{node_log_pattern(plan.job_log_dir, plan.restart, attempt + 1).replace('%n', '*')})")
        return Decision("restart", srun_cmd=tuple(attempt_command(plan, attempt + 1)))
    if latest == plan.started_from:
        log.write(f"not restarting: MAX_RESTARTS={plan.max_restarts} restarts used, and no checkpoint since the job "
                  f"started from {plan.started_from}: the job fails (see {logs})")
        return Decision("exit", rc)
    return _requeue(plan, log, f"MAX_RESTARTS={plan.max_restarts} restarts used; the job got from "
                               f"{plan.started_from} to {latest}: ")


def _requeue(plan: StepPlan, log: LaunchLog, why: str) -> Decision:
    if plan.restart >= plan.max_requeues:
        log.write(f"{why}not requeueing: restart {plan.restart} reached MAX_REQUEUES={plan.max_requeues}")
        return Decision("exit", 1)
    log.write(f"{why}requeueing job {plan.job_id}")
    return Decision("requeue")
