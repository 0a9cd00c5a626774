"""What the batch shell does once a job step has ended: requeue the job, or end it with a status.
The shell passes what it knows (the step's exit status, whether USR1 or SIGTERM reached it); the
rest is read from the run's files: `latest` in the checkpoint folder and the trainers' node logs.

    USR1 (the time limit is near)   the trainers checkpointed: `scontrol requeue` (up to
                                    MAX_REQUEUES), unless training had already finished
    SIGTERM (scancel)               no requeue: a cancelled job stays cancelled; a clean stop
                                    (a new checkpoint) ends it successfully
    neither                         the step's own status
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


@dataclass
class StepPlan:
    """The part of the launch the decisions after a step read (written by `plan`, JSON)."""

    job_id: int
    restart: int
    job_log_dir: str
    checkpoint_dir: str
    max_requeues: int
    srun_cmd: list[str] = field(default_factory=list)
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
    action: str  # "requeue" or "exit"
    exit_code: int = 0


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


def node_logs(job_log_dir: str, restart: int) -> list[str]:
    return sorted(glob.glob(os.path.join(job_log_dir, f"restart{restart}-node*.log")))


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


def after_step(plan: StepPlan, rc: int, requeue: bool, terminated: bool, resumed_from: str,
               log: Optional[LaunchLog] = None) -> Decision:
    """The decision once the step exited with `rc`; `requeue` / `terminated`: USR1 / SIGTERM reached
    the batch shell. Writes the log lines the batch output and launch.log show."""
    log = log or LaunchLog(plan.job_log_dir)
    latest = latest_checkpoint(plan.checkpoint_dir)
    log.write(f"job step exited with status {rc}; latest checkpoint: {latest}")
    logs = os.path.join(plan.job_log_dir, f"restart{plan.restart}-node*.log")
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
    if requeue and logs_contain_line(node_logs(plan.job_log_dir, plan.restart), TRAINING_DONE):
        log.write("not requeueing: training finished before the signal took effect")
        return Decision("exit", 0)
    if requeue:
        if plan.restart >= plan.max_requeues:
            log.write(f"not requeueing: restart {plan.restart} reached MAX_REQUEUES={plan.max_requeues}")
            return Decision("exit", 1)
        log.write(f"requeueing job {plan.job_id}")
        return Decision("requeue")
    return Decision("exit", rc)
