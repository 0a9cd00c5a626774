# shellcheck shell=bash
# What the Slurm scripts in this folder must do in bash. Sourced, never run.
#
#   slurm/train_lev_1b.sh, slurm/train_tied_1b.sh: set CONFIG, source this, call
#       `launch_training`: one `srun` task per node, each running `torchrun` with c10d
#       rendezvous over that node's GPUs; the trainer is `python -m megatron_lev.train`.
#   slurm/preprocess_pile.sh: `setup_python_env`, then its array task.
#
# Every knob is an environment variable (sbatch exports the submitting shell's
# environment to the job), listed in docs/slurm.md (its table). What they mean is computed
# in Python, in megatron_lev/launcher/ (tested: tests/test_launcher.py): the checks at
# submit, the batch arithmetic, the torchrun and srun command lines, and the decisions
# after a step. This file keeps what only the batch shell can do: the environment set-up
# (sourcing SITE_ENV and the virtual environment), the signal traps, srun in the
# background, `wait`, and `scontrol requeue`.
#
# Preemption and the time limit. The training scripts are submitted with
# `#SBATCH --signal=B:USR1@300`: five minutes before the time limit Slurm sends USR1
# to the *batch shell* only ("B:"). That is deliberate:
#   - the batch shell is the one process that must know, because it decides whether to
#     `scontrol requeue` the job once training has stopped. Without "B:" the signal
#     goes to the job steps, and the shell would have to guess why the step ended;
#   - bash runs a trap only between commands, so srun runs in the background and the
#     shell sits in `wait`, which a trapped signal interrupts at once;
#   - the trap sends USR1 to srun, which forwards USR1 to its tasks as it is (Slurm
#     signals every process of the step: torchrun and, with proctrack/cgroup, the
#     trainer processes too). torchrun is told to handle USR1 (--signals-to-handle), so
#     it passes USR1 on to the trainers and waits up to SHUTDOWN_TIMEOUT seconds for
#     them; without that, USR1's default action would kill torchrun, and Slurm would
#     kill the trainers mid-checkpoint once their step's task was gone;
#   - the trainers agree on the stop at the next step boundary, checkpoint and exit 0
#     (torchrun itself then exits 1, because it "died" of a signal: expected);
#   - the shell runs `scontrol requeue "$SLURM_JOB_ID"`; the job goes back to the queue
#     with the same id and, when it starts again, `--load` resumes from `latest`.
# The shell never sends SIGTERM to srun: srun answers SIGTERM (and SIGHUP, SIGQUIT) by
# SIGKILLing its tasks ("srun: forcing job termination"), which would lose the
# checkpoint. So a SIGTERM to the batch shell (`scancel --batch --signal=TERM`, or an
# `scancel` that also signals the step) is passed on as USR1 (the trainer treats USR1
# and SIGTERM alike), and never leads to a requeue: a cancelled job stays cancelled.
# A preemption (PreemptMode=REQUEUE) sends SIGTERM to the step's processes directly:
# torchrun forwards it, the trainers checkpoint within the site's GraceTime, and Slurm
# requeues the job itself (--requeue).
# With torch < 2.9, torchrun cannot handle USR1 (no --signals-to-handle): stop requests
# then go to the step as SIGTERM through `scancel --signal=TERM` (torchrun_features).

die() {
    echo "slurm: error: $*" >&2
    exit 1
}

log() {
    echo "[slurm $(date '+%Y-%m-%d %H:%M:%S')] $*"
}

# Site set-up, then the Python environment. SITE_ENV is a file of site-specific
# settings (module loads, NCCL network variables: see slurm/site_env.example.sh); what it
# sets is exported (set -a), so the launcher and every task see it. VENV is the virtual
# environment to activate. Without it: the environment active when the job was submitted
# (sbatch exports it), else the repository's .venv made by tools/setup_env.sh, else
# whatever python is on PATH.
setup_python_env() {
    export MEGATRON_LEV_DIR
    if [[ -n ${SITE_ENV:-} ]]; then
        [[ -f $SITE_ENV ]] || die "SITE_ENV=$SITE_ENV: no such file"
        set -a
        # shellcheck source=/dev/null
        source "$SITE_ENV"
        set +a
    fi
    local venv=${VENV:-}
    if [[ -z $venv && -z ${VIRTUAL_ENV:-} && -z ${CONDA_PREFIX:-} && -x $MEGATRON_LEV_DIR/.venv/bin/python ]]; then
        venv=$MEGATRON_LEV_DIR/.venv
    fi
    if [[ -n $venv ]]; then
        [[ -f $venv/bin/activate ]] || die "VENV=$venv: not a virtual environment (no bin/activate)"
        # shellcheck source=/dev/null
        source "$venv/bin/activate"
    fi
    command -v python >/dev/null || die "no python on PATH: set VENV, or load your environment in SITE_ENV"
    # The code of this checkout is what runs, installed or not.
    export PYTHONPATH=$MEGATRON_LEV_DIR${PYTHONPATH:+:$PYTHONPATH}
}

# `launcher COMMAND ARGS`: python -m megatron_lev.launcher, whose lines for the job's output
# go to stdout as they come, and whose shell assignments (the commands to run, the decision
# after a step) come back on its file descriptor 3 and are evaluated here. A refusal has
# been printed (one line, "slurm: error: ..."): the job ends with its status.
launcher() {
    local assignments
    { assignments=$(python -m megatron_lev.launcher "$@" 3>&1 1>&4) || exit $?; } 4>&1
    eval "$assignments"
}

# Signal handling (see the top of this file).
# Ask the trainers to checkpoint at the next step and exit (a conversion: stop it; the next job
# start converts again, from a clean folder).
stop_step() {
    [[ -n ${STEP_PID:-} ]] || return 0
    if ((${CONVERTING:-0})); then
        kill -TERM "$STEP_PID" 2>/dev/null || true
    elif ((${TORCHRUN_USR1:-1})); then
        kill -USR1 "$STEP_PID" 2>/dev/null || true  # srun forwards USR1 to its tasks as it is
    else
        # This torchrun would die of USR1: SIGTERM every process of the step through
        # Slurm instead (not through srun, which would SIGKILL them). The batch step is
        # left out, as scancel does without --batch/--full.
        scancel --signal=TERM "$JOB_ID" || true
    fi
}

_on_usr1() {
    log "USR1: the time limit is near; asking the trainer to checkpoint and exit, then requeueing"
    REQUEUE=1
    stop_step
}

_on_term() {
    log "TERM: asking the trainer to checkpoint and exit (no requeue)"
    TERMINATED=1
    stop_step
}

# Run "$@" in the background so that the traps run while it is running (bash runs a trap
# only between commands, and a trapped signal interrupts `wait` at once); stdin from
# /dev/null so it does not hold the batch shell's. Sets rc to its exit status.
run_step() {
    rc=0
    "$@" </dev/null &
    STEP_PID=$!
    wait "$STEP_PID" || rc=$?
    # `wait` returns >128 when a trapped signal interrupts it: the step is still
    # running (now checkpointing), so wait again until it has really exited.
    while ((rc > 128)) && kill -0 "$STEP_PID" 2>/dev/null; do
        rc=0
        wait "$STEP_PID" || rc=$?
    done
}

launch_training() {
    # Traps first: a signal during the set-up is then remembered, not fatal.
    REQUEUE=0 TERMINATED=0 STEP_PID='' CONVERTING=0
    trap _on_usr1 USR1
    trap _on_term TERM
    # The submitting shell's DS_ACCELERATOR (the CPU instructions export
    # DS_ACCELERATOR=cpu) must not put DeepSpeed on the CPU on GPU nodes: DeepSpeed detects
    # the accelerator itself; a site that needs to force one sets it in SITE_ENV.
    unset DS_ACCELERATOR
    setup_python_env
    export CONFIG
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        exec python -m megatron_lev.launcher plan  # prints the commands, launches nothing
    fi
    # Checks, batch arithmetic and commands (megatron_lev/launcher/training.py): sets the
    # variables below; exports the tasks' variables.
    srun_cmd=() convert_cmd=() JOB_ID=0 JOB_LOG_DIR="" TORCHRUN_USR1=1 launch_plan="" launch_resumed_from=""
    launcher plan
    # A resume at another layout: the checkpoint is converted here, on this node's cores, before the
    # trainers start (megatron_lev/launcher/resume.py), where no collective waits on it.
    if ((${#convert_cmd[@]})) && ((REQUEUE == 0 && TERMINATED == 0)); then
        CONVERTING=1
        run_step "${convert_cmd[@]}"
        CONVERTING=0
        if ((rc != 0 && REQUEUE == 0 && TERMINATED == 0)); then
            log "the conversion failed (status $rc): not starting the trainers" | tee -a "$JOB_LOG_DIR/launch.log"
            exit "$rc"
        fi
    fi
    local attempt=0
    while :; do
        rc=0
        if ((REQUEUE == 0 && TERMINATED == 0)); then  # a signal may arrive before the launch
            run_step "${srun_cmd[@]}"
        fi
        # Restart the step in this allocation (a crash: a new srun_cmd and launch_resumed_from
        # are handed back), requeue, or the job's exit status (megatron_lev/launcher/steps.py).
        launch_action="" launch_exit=1
        launcher after-step --plan "$launch_plan" --attempt "$attempt" --rc "$rc" --requeue "$REQUEUE" \
            --terminated "$TERMINATED" --resumed-from "$launch_resumed_from"
        case $launch_action in
            restart) attempt=$((attempt + 1)) ;;  # a signal meanwhile: the next round decides on it
            requeue)
                scontrol requeue "$JOB_ID"
                exit 0
                ;;
            *) exit "$launch_exit" ;;
        esac
    done
}
