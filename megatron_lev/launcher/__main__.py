"""`python -m megatron_lev.launcher COMMAND`: what slurm/common.sh asks of the launcher.

    plan          the training launch from the environment: under DRY_RUN=1 the dry run is printed;
                  otherwise the job's first log lines, and the commands handed back to the shell
    after-step    the decision once a job step has ended: restart it in the allocation, requeue the
                  job, or the job's exit status (steps.py)
    pile          slurm/preprocess_pile.sh's array task: its command is run (printed under DRY_RUN)
    evaluate      slurm/evaluate.sh's job: the evaluation and release stages, one after the other
                  (printed under DRY_RUN; evaluation.py)

Lines for the job's output go to stdout; what the batch shell must evaluate (exports, the srun
command, the decision) comes back as shell assignments on file descriptor 3. A launch that cannot
work ends with one line, `slurm: error: ...`, and exit status 1.
"""
from __future__ import annotations

import argparse
import os
import sys

from megatron_lev.launcher.shell import LaunchError, assign, bash_quote, print_cmd


def _repo(env) -> str:
    return env.get("MEGATRON_LEV_DIR") or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def hand_back(assignments: list[str]) -> None:
    """Shell assignments for the batch shell, on file descriptor 3 (its stdout is the job's output)."""
    try:
        os.write(3, ("".join(line + "\n" for line in assignments)).encode())
    except OSError as exc:
        raise LaunchError(f"file descriptor 3 is not open ({exc.strerror}): slurm/common.sh runs this command, with "
                          "its fd 3 reading the result") from None


def plan(env: dict) -> int:
    from megatron_lev.launcher.steps import LaunchLog, StepPlan, latest_checkpoint
    from megatron_lev.launcher.training import dry_run_text, resolve_launch

    launch = resolve_launch(env, _repo(env))
    if env.get("DRY_RUN") == "1":
        sys.stdout.write(dry_run_text(launch, env))
        return 0
    os.makedirs(launch.job_log_dir, exist_ok=True)
    os.makedirs(launch.checkpoint_dir, exist_ok=True)
    log = LaunchLog(launch.job_log_dir)
    started_from = latest_checkpoint(launch.checkpoint_dir)
    log.write(f"job {launch.job_id} restart {launch.restart} on {' '.join(launch.hosts[:launch.nodes])}; "
              f"resuming from checkpoint: {started_from}")
    log.write(f"batch: {launch.batch.summary()}")
    log.write(f"checkpoints: {launch.disk.summary()}")
    if launch.disk.shortfall():
        log.write(launch.disk.shortfall())
    if launch.conversion:
        log.write(f"resume: {launch.conversion.summary()}")
    log.write(f"srun command: {print_cmd(launch.srun_cmd)}", stamped=False)
    for note in launch.notes:
        log.write(note)
    if not launch.torchrun_usr1:
        log.write("warning: this torchrun has no --signals-to-handle (torch < 2.9): stop requests reach the trainers "
                  "as SIGTERM through scancel")
    if not launch.torchrun_shutdown_timeout:
        log.write("warning: this torchrun has no --shutdown-timeout (torch < 2.11): after a signal it kills the "
                  "trainers 30 s later, so a checkpoint must be written within 30 s")
    plan_path = StepPlan(job_id=launch.job_id, restart=launch.restart, job_log_dir=launch.job_log_dir,
                         checkpoint_dir=launch.checkpoint_dir, max_requeues=launch.max_requeues,
                         max_restarts=launch.max_restarts, srun_cmd=launch.srun_cmd, started_from=started_from).save()
    hand_back([f"export {name}={bash_quote(value)}" for name, value in launch.exports.items()]
              + [assign("srun_cmd", launch.srun_cmd), assign("JOB_ID", launch.job_id),
                 assign("convert_cmd", launch.conversion.cmd if launch.conversion else []),
                 assign("JOB_LOG_DIR", launch.job_log_dir),
                 assign("TORCHRUN_USR1", int(launch.torchrun_usr1)), assign("launch_plan", plan_path),
                 assign("launch_resumed_from", started_from)])
    return 0


def after_step(argv: list[str]) -> int:
    from megatron_lev.launcher.steps import StepPlan, after_step as decide, latest_checkpoint

    parser = argparse.ArgumentParser(prog="python -m megatron_lev.launcher after-step")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--rc", type=int, required=True)
    parser.add_argument("--requeue", type=int, choices=(0, 1), default=0)
    parser.add_argument("--terminated", type=int, choices=(0, 1), default=0)
    parser.add_argument("--resumed-from", required=True)
    parser.add_argument("--attempt", type=int, default=0)
    args = parser.parse_args(argv)
    plan = StepPlan.load(args.plan)
    decision = decide(plan, args.rc, bool(args.requeue), bool(args.terminated), args.resumed_from, args.attempt)
    assignments = [assign("launch_action", decision.action), assign("launch_exit", decision.exit_code)]
    if decision.action == "restart":
        assignments += [assign("srun_cmd", decision.srun_cmd),
                        assign("launch_resumed_from", latest_checkpoint(plan.checkpoint_dir))]
    hand_back(assignments)
    return 0


def pile(env: dict) -> int:
    from megatron_lev.launcher.pile import run_pile

    cmd = run_pile(env, _repo(env))
    if cmd is not None:
        sys.stdout.flush()
        os.execvp(cmd[0], cmd)  # the task's process becomes preprocess_data.py: Slurm's signals reach it
    return 0


def evaluate(env: dict) -> int:
    from megatron_lev.launcher.evaluation import run_evaluation

    return run_evaluation(env, _repo(env))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"plan": lambda: plan(dict(os.environ)), "after-step": lambda: after_step(argv[1:]),
                "pile": lambda: pile(dict(os.environ)), "evaluate": lambda: evaluate(dict(os.environ))}
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        return commands[argv[0]]()
    except LaunchError as exc:
        sys.stdout.flush()
        print(f"slurm: error: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
