# shellcheck shell=bash
# Shared launch logic for the Slurm scripts in this folder. Sourced, never run.
#
#   slurm/train_lev_1b.sh, slurm/train_tied_1b.sh: set CONFIG, source this, call
#       `launch_training`: one `srun` task per node, each running `torchrun` with c10d
#       rendezvous over that node's GPUs; the trainer is `python -m megatron_lev.train`.
#   slurm/preprocess_pile.sh: uses the helpers (die, run_or_print, setup_python_env).
#
# Every knob is an environment variable (sbatch exports the submitting shell's
# environment to the job), listed in docs/slurm.md (its table).
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

# Print a command exactly: shell-quoted where needed, so it can be pasted into a shell.
print_cmd() {
    local arg line=""
    for arg in "$@"; do
        if [[ -n $arg && $arg =~ ^[][A-Za-z0-9_@%+=:,./-]+$ ]]; then line+="$arg "; else line+="${arg@Q} "; fi
    done
    echo "${line% }"
}

# Run a command, or print it when DRY_RUN=1.
run_or_print() {
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        print_cmd "$@"
    else
        "$@"
    fi
}

require_int() {  # require_int NAME VALUE [MIN]
    [[ $2 =~ ^[0-9]+$ ]] || die "$1=$2 is not a non-negative integer"
    (($2 >= ${3:-0})) || die "$1=$2 must be >= ${3:-0}"
}

# Site set-up, then the Python environment. SITE_ENV is a file of site-specific
# settings (module loads, NCCL network variables: see slurm/site_env.example.sh).
# VENV is the virtual environment to activate. Without it: the environment active
# when the job was submitted (sbatch exports it), else the repository's .venv made by
# tools/setup_env.sh, else whatever python is on PATH.
setup_python_env() {
    if [[ -n ${SITE_ENV:-} ]]; then
        [[ -f $SITE_ENV ]] || die "SITE_ENV=$SITE_ENV: no such file"
        # shellcheck source=/dev/null
        source "$SITE_ENV"
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

# DATA_PATH is a Megatron blend: "PREFIX", "W1 PREFIX1 W2 PREFIX2 ..." or
# "PREFIX1 PREFIX2 ...". Every prefix needs PREFIX.bin and PREFIX.idx.
check_blend() {
    local name=$1 blend=$2 word
    local -a words
    read -r -a words <<<"$blend"
    ((${#words[@]} > 0)) || die "$name is empty"
    for word in "${words[@]}"; do
        [[ $word =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]] && continue  # a weight
        [[ -f $word.bin && -f $word.idx ]] \
            || die "$name: dataset prefix '$word' has no $word.bin / $word.idx (build it with tools/preprocess_data.py)"
    done
}

# Megatron-LM's example scripts name some knobs differently: CHECKPOINT_PATH, GLOBAL_BATCH_SIZE,
# MICRO_BATCH_SIZE, TENSORBOARD_LOGS_PATH work as this folder's names. Both names with different
# values is refused (which one was meant cannot be known).
MEGATRON_ALIASES=(CHECKPOINT_PATH:CHECKPOINT_DIR GLOBAL_BATCH_SIZE:GLOBAL_BATCH MICRO_BATCH_SIZE:MICRO_BATCH
    TENSORBOARD_LOGS_PATH:TENSORBOARD_DIR)
# Megatron's tokenizer flags into TOKENIZER_FLAGS: GPT2BPETokenizer reads VOCAB_FILE and
# MERGE_FILE (Megatron-LM's example scripts' names), every other type TOKENIZER_MODEL.
tokenizer_flags() {
    : "${TOKENIZER_TYPE:=SentencePieceTokenizer}"
    if [[ $TOKENIZER_TYPE == GPT2BPETokenizer ]]; then
        local var
        for var in VOCAB_FILE MERGE_FILE; do
            [[ -n ${!var:-} ]] || die "$var is not set: TOKENIZER_TYPE=GPT2BPETokenizer reads VOCAB_FILE=/path/gpt2-vocab.json and MERGE_FILE=/path/gpt2-merges.txt"
            [[ -e ${!var} ]] || die "$var=${!var}: no such file or directory"
        done
        TOKENIZER_FLAGS=(--tokenizer-type "$TOKENIZER_TYPE" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
    else
        [[ -n ${TOKENIZER_MODEL:-} ]] || die "TOKENIZER_MODEL is not set: export TOKENIZER_MODEL=/path/to/tokenizer.model (or a Hugging Face tokenizer directory; GPT-2 BPE files: TOKENIZER_TYPE=GPT2BPETokenizer VOCAB_FILE=... MERGE_FILE=...)"
        [[ -e $TOKENIZER_MODEL ]] || die "TOKENIZER_MODEL=$TOKENIZER_MODEL: no such file or directory"
        TOKENIZER_FLAGS=(--tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL")
    fi
}

resolve_aliases() {
    local pair alias canonical
    for pair in "${MEGATRON_ALIASES[@]}"; do
        alias=${pair%%:*} canonical=${pair#*:}
        [[ -n ${!alias:-} ]] || continue
        if [[ -n ${!canonical:-} && ${!canonical} != "${!alias}" ]]; then
            die "$alias=${!alias} and $canonical=${!canonical} disagree ($alias is Megatron-LM's name for $canonical): set one of them"
        fi
        printf -v "$canonical" '%s' "${!alias}"
    done
}

# Trainer flags that the scripts pass from a variable. Typed in EXTRA_ARGS as well, the trainer
# would take EXTRA_ARGS's value (argparse keeps the last one) while the batch arithmetic, the
# log, `--load` and the requeue went by the variable's. So such a flag is taken as the
# variable's value and passed once; when the variable says otherwise, the job is refused.
# "--flag:VAR" takes a value; "--flag:VAR=V" is a switch that means VAR=V.
EXTRA_ARGS_VARIABLES=(--micro-batch-size:MICRO_BATCH --global-batch-size:GLOBAL_BATCH --seq-length:SEQ_LENGTH
    --tensor-model-parallel-size:TP --pipeline-model-parallel-size:PP --train-tokens:TRAIN_TOKENS
    --train-iters:TRAIN_ITERS --exit-interval:EXIT_INTERVAL --save-interval:SAVE_INTERVAL
    --log-interval:LOG_INTERVAL --tensorboard-dir:TENSORBOARD_DIR --deepspeed-config:DEEPSPEED_CONFIG
    --deepspeed_config:DEEPSPEED_CONFIG --gpu-type:GPU_TYPE --config:CONFIG --save:CHECKPOINT_DIR
    --load:CHECKPOINT_DIR --tokenizer-type:TOKENIZER_TYPE --tokenizer-model:TOKENIZER_MODEL
    --vocab-file:VOCAB_FILE --merge-file:MERGE_FILE --bf16:BF16=1 --no-bf16:BF16=0
    --compile-layers:COMPILE_LAYERS=1 --no-compile-layers:COMPILE_LAYERS=0)
# Blends (several values each) are only taken from their variables, which check every prefix.
EXTRA_ARGS_REFUSED=(--data-path:DATA_PATH --train-data-path:DATA_PATH --valid-data-path:VALID_DATA_PATH
    --test-data-path:TEST_DATA_PATH)

# Sets the variables of the flags above from EXTRA_ARGS, and EXTRA_WORDS to the rest of it.
take_extra_args() {
    local -a words=()
    read -r -a words <<<"${EXTRA_ARGS:-}"
    EXTRA_WORDS=()
    local i=0 word name entry var value switch_value
    while ((i < ${#words[@]})); do
        word=${words[i]} i=$((i + 1))
        name=${word%%=*} var=""
        for entry in "${EXTRA_ARGS_REFUSED[@]}"; do
            [[ ${entry%%:*} != "$name" ]] \
                || die "EXTRA_ARGS passes $name: set ${entry#*:} instead (the script passes $name from it)"
        done
        for entry in "${EXTRA_ARGS_VARIABLES[@]}"; do
            if [[ ${entry%%:*} == "$name" ]]; then var=${entry#*:} && break; fi
        done
        if [[ -z $var ]]; then EXTRA_WORDS+=("$word") && continue; fi
        switch_value=""
        if [[ $var == *=* ]]; then switch_value=${var#*=} var=${var%%=*}; fi
        if [[ -n $switch_value ]]; then
            [[ $word == "$name" ]] || die "EXTRA_ARGS: $name takes no value ($word)"
            value=$switch_value
        elif [[ $word == *=* ]]; then
            value=${word#*=}
        elif ((i < ${#words[@]})) && [[ ${words[i]} != --* ]]; then
            value=${words[i]} i=$((i + 1))
        else
            die "EXTRA_ARGS: $name needs a value"
        fi
        if [[ -n ${!var:-} && ${!var} != "$value" ]]; then
            [[ -n $switch_value ]] || name+=" $value"
            die "EXTRA_ARGS passes $name, but $var=${!var}: set one of them (the script passes this flag from $var)"
        fi
        printf -v "$var" '%s' "$value"
    done
}

# GPUs per node of the allocation, and where that number comes from: Slurm's
# SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE ("8" or "h100:8"), else, inside a job,
# nvidia-smi's count. Both empty when unknown (a dry run on a login node).
allocation_gpus() {
    ALLOC_GPUS="" ALLOC_GPUS_FROM=""
    if [[ ${SLURM_GPUS_ON_NODE:-} =~ ^[0-9]+$ ]]; then
        ALLOC_GPUS=$SLURM_GPUS_ON_NODE ALLOC_GPUS_FROM=SLURM_GPUS_ON_NODE
    elif [[ ${SLURM_GPUS_PER_NODE:-} =~ ([0-9]+)$ ]]; then
        ALLOC_GPUS=${BASH_REMATCH[1]} ALLOC_GPUS_FROM=SLURM_GPUS_PER_NODE
    elif [[ -n ${SLURM_JOB_ID:-} ]] && command -v nvidia-smi >/dev/null; then
        local count
        count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
        if ((count > 0)); then ALLOC_GPUS=$count ALLOC_GPUS_FROM="nvidia-smi -L"; fi
    fi
}

# The trainer's own parser and batch arithmetic over the full command line (EXTRA_ARGS
# included), at submit time and under DRY_RUN: a typo in a flag fails here, in one line,
# before the queue wait and the allocation (megatron_lev/training/arguments.py; it reads no
# data and imports no torch). Its warnings (ignored Megatron-LM flags) are passed on.
check_trainer_flags() {
    local out
    if ! out=$(python -m megatron_lev.training.arguments --world-size "$((NODES * GPUS_PER_NODE))" \
        "${train_args[@]}" 2>&1); then
        out=$(grep -m1 'error: ' <<<"$out" || echo "$out" | tail -n1)
        die "the trainer refuses its flags${EXTRA_ARGS:+ (EXTRA_ARGS=\"$EXTRA_ARGS\")}: ${out#*error: }"
    fi
    [[ -z $out ]] || echo "$out" >&2
}

# Hostnames of the allocation, one per line (placeholders outside Slurm, for DRY_RUN).
job_hosts() {
    if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
        scontrol show hostnames "$SLURM_JOB_NODELIST"
    else
        local i
        for ((i = 0; i < NODES; i++)); do echo "node$i"; done
    fi
}

# The run's sequence length and global batch: SEQ_LENGTH and GLOBAL_BATCH (then passed
# as --seq-length / --global-batch-size), else the config's. Reading the config also
# fails early, and clearly, on a bad CONFIG.
resolve_config() {
    [[ -z ${SEQ_LENGTH:-} ]] || require_int SEQ_LENGTH "$SEQ_LENGTH" 1
    [[ -z ${GLOBAL_BATCH:-} ]] || require_int GLOBAL_BATCH "$GLOBAL_BATCH" 1
    local values
    values=$(python - "$CONFIG" <<'PY'
import sys
from megatron_lev.configs import load_config
try:
    config = load_config(sys.argv[1])
except (FileNotFoundError, ValueError) as exc:
    sys.exit(f"slurm: error: CONFIG={sys.argv[1]}: {exc}")
training = config.get("training") or {}
print(training.get("seq_length") or config["model"]["seq_length"], training.get("global_batch_size") or "")
PY
    ) || exit 1
    local config_seq config_batch
    read -r config_seq config_batch <<<"$values"
    if [[ -z ${SEQ_LENGTH:-} ]]; then SEQ_LENGTH=$config_seq CONFIG_SEQ_LENGTH=1; fi
    : "${GLOBAL_BATCH:=$config_batch}"  # empty when the config has none: micro-batch x DP
}

# Per-GPU defaults, sized for the 1.2B configs (docs/slurm.md "Sizing"): under ZeRO-1 the
# weights, gradients and Adam states of 1.2B parameters take 10-12 GB per GPU at TP=1, so
# tensor parallelism would only add communication; the micro-batch is what the
# activations allow, about 5.6 GB per 2048-token sequence (tokens per GPU per
# micro-batch below, divided by the sequence length): MICRO_BATCH_FITS.
gpu_defaults() {
    local tokens
    case $GPU_TYPE in
        a100) tokens=8192 ;;   # 80 GB (fits 40 GB cards, with little headroom)
        h100) tokens=16384 ;;  # 80 GB
        h200) tokens=32768 ;;  # 141 GB
        *) die "GPU_TYPE=$GPU_TYPE: expected a100, h100 or h200" ;;
    esac
    : "${TP:=1}" "${PP:=1}"
    MICRO_BATCH_FITS=$((tokens / SEQ_LENGTH > 0 ? tokens / SEQ_LENGTH : 1))
}

# The nearest values around $1 (down to 1, up to 4 x $1) for which `$2 VALUE` succeeds,
# as "A or B" (one side when the other has none).
nearest_valid() {
    local value=$1 test=$2 below="" above="" v
    for ((v = value - 1; v >= 1; v--)); do if "$test" "$v"; then below=$v; break; fi; done
    for ((v = value + 1; v <= 4 * value; v++)); do if "$test" "$v"; then above=$v; break; fi; done
    echo "${below}${below:+${above:+ or }}${above}"
}
_nodes_split_batch() {  # NODES=$1 gives a data-parallel size that divides GLOBAL_BATCH
    local gpus=$(($1 * GPUS_PER_NODE))
    ((gpus % (TP * PP) == 0 && GLOBAL_BATCH % (gpus / (TP * PP)) == 0))
}
_batch_splits() { (($1 % DP == 0)); }  # GLOBAL_BATCH=$1 splits over DP
_divides_per_rank() { ((PER_RANK % $1 == 0)); }

# Batch arithmetic, decided here so that a layout that cannot work is refused at submit
# time (also under DRY_RUN) instead of by the trainer after the allocation started:
# DP = GPUs / (TP x PP); every DP rank takes GLOBAL_BATCH / DP sequences per step, as
# MICRO_BATCH sequences at a time, accumulated ACCUMULATION times. Without MICRO_BATCH
# it is the largest size that fits the GPU (MICRO_BATCH_FITS) and divides the share.
choose_micro_batch() {
    DP=$((NODES * GPUS_PER_NODE / (TP * PP)))
    if [[ -z $GLOBAL_BATCH ]]; then  # no global batch anywhere: one micro-batch per rank
        : "${MICRO_BATCH:=$MICRO_BATCH_FITS}"
        ACCUMULATION=1
        return 0
    fi
    if ! _batch_splits "$GLOBAL_BATCH"; then
        local nodes
        nodes=$(nearest_valid "$NODES" _nodes_split_batch)
        die "GLOBAL_BATCH=$GLOBAL_BATCH sequences cannot be split over data-parallel size $DP" \
            "(NODES=$NODES x GPUS_PER_NODE=$GPUS_PER_NODE / TP=$TP x PP=$PP): use" \
            "${nodes:+NODES=$nodes, or }GLOBAL_BATCH=$(nearest_valid "$GLOBAL_BATCH" _batch_splits)"
    fi
    PER_RANK=$((GLOBAL_BATCH / DP))
    if [[ -z ${MICRO_BATCH:-} ]]; then
        MICRO_BATCH=$MICRO_BATCH_FITS
        ((MICRO_BATCH <= PER_RANK)) || MICRO_BATCH=$PER_RANK
        while ((PER_RANK % MICRO_BATCH)); do MICRO_BATCH=$((MICRO_BATCH - 1)); done
    else
        _divides_per_rank "$MICRO_BATCH" \
            || die "MICRO_BATCH=$MICRO_BATCH does not divide the $PER_RANK sequences per data-parallel rank" \
                "(GLOBAL_BATCH=$GLOBAL_BATCH / DP=$DP): use MICRO_BATCH=$(nearest_valid "$MICRO_BATCH" _divides_per_rank)"
    fi
    ACCUMULATION=$((PER_RANK / MICRO_BATCH))
}

# Which of torchrun's newer flags this torch has, read from its source (importing torch
# takes seconds): --signals-to-handle (torch 2.9) lets torchrun pass USR1 on to the
# trainers, --shutdown-timeout (torch 2.11) sets how long it then waits for them
# (30 s before). Sets TORCHRUN_USR1 and TORCHRUN_SHUTDOWN_TIMEOUT to 1 or 0.
torchrun_features() {
    local run_py
    run_py=$(python -c 'import importlib.util, os
spec = importlib.util.find_spec("torch")
print(os.path.join(spec.submodule_search_locations[0], "distributed", "run.py"))' 2>/dev/null) \
        || die "torch is not installed for $(command -v python): set VENV, or load it in SITE_ENV"
    TORCHRUN_USR1=0 TORCHRUN_SHUTDOWN_TIMEOUT=0
    if grep -q -- '"--signals-to-handle"' "$run_py"; then TORCHRUN_USR1=1; fi
    if grep -q -- '"--shutdown-timeout"' "$run_py"; then TORCHRUN_SHUTDOWN_TIMEOUT=1; fi
}

# NCCL / CUDA defaults that are right on any cluster. Each can be overridden from the
# environment. Network settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, FI_PROVIDER, ...)
# are SITE-SPECIFIC and belong in SITE_ENV, never here.
export_runtime_env() {
    # Megatron's TP/SP communication overlap relies on kernels launching in issue order.
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    # A failed or hung collective aborts the job instead of hanging until the time limit.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    # Fewer cudaMalloc retries and less fragmentation with variable activation sizes.
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export PYTHONUNBUFFERED=1
    export TOKENIZERS_PARALLELISM=false
}

# Build the arrays `train_args`, `torchrun_cmd`, `srun_cmd` from the environment.
build_commands() {
    local -a data=() valid=() test=()
    read -r -a data <<<"$DATA_PATH"
    read -r -a valid <<<"${VALID_DATA_PATH:-}"
    read -r -a test <<<"${TEST_DATA_PATH:-}"
    train_args=(--config "$CONFIG")
    if ((${#valid[@]} + ${#test[@]} == 0)); then
        train_args+=(--data-path "${data[@]}")  # train/valid/test split by --split
    else
        train_args+=(--train-data-path "${data[@]}")
        ((${#valid[@]} == 0)) || train_args+=(--valid-data-path "${valid[@]}")
        ((${#test[@]} == 0)) || train_args+=(--test-data-path "${test[@]}")
    fi
    train_args+=(
        "${TOKENIZER_FLAGS[@]}"
        --tensor-model-parallel-size "$TP"
        --pipeline-model-parallel-size "$PP"
        --micro-batch-size "$MICRO_BATCH"
    )
    [[ -n ${CONFIG_SEQ_LENGTH:-} ]] || train_args+=(--seq-length "$SEQ_LENGTH")
    [[ -z $GLOBAL_BATCH ]] || train_args+=(--global-batch-size "$GLOBAL_BATCH")
    [[ -n ${TRAIN_TOKENS:-} ]] && train_args+=(--train-tokens "$TRAIN_TOKENS")
    [[ -n ${TRAIN_ITERS:-} ]] && train_args+=(--train-iters "$TRAIN_ITERS")
    [[ -n ${EXIT_INTERVAL:-} ]] && train_args+=(--exit-interval "$EXIT_INTERVAL")  # checkpoint and stop there
    train_args+=(
        --save "$CHECKPOINT_DIR"
        --load "$CHECKPOINT_DIR"  # empty on the first run: starts fresh; resumes after a requeue
        --save-interval "$SAVE_INTERVAL"
        --log-interval "$LOG_INTERVAL"
        --tensorboard-dir "$TENSORBOARD_DIR"
        --deepspeed-config "$DEEPSPEED_CONFIG"
        --gpu-type "$GPU_TYPE"
        --log-throughput  # TFLOP/s per GPU and MFU (against --gpu-type's peak) in every iteration line
    )
    # torch.compile each decoder layer: fused RoPE/SwiGLU/RMSNorm (docs/performance.md); the
    # compilation happens in the first step, and the log reports its time.
    if [[ $COMPILE_LAYERS == 1 ]]; then train_args+=(--compile-layers); else train_args+=(--no-compile-layers); fi
    if [[ $BF16 == 1 ]]; then train_args+=(--bf16); else train_args+=(--no-bf16); fi
    train_args+=("${EXTRA_WORDS[@]}")  # EXTRA_ARGS less the flags taken above (take_extra_args)

    torchrun_cmd=(
        torchrun
        --nnodes "$NODES"
        --nproc-per-node "$GPUS_PER_NODE"
        --rdzv-backend c10d
        --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
        --rdzv-id "$JOB_ID"
        --max-restarts 0  # restarts are Slurm's job (requeue), not torchrun's
    )
    ((TORCHRUN_USR1 == 0)) || torchrun_cmd+=(--signals-to-handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    ((TORCHRUN_SHUTDOWN_TIMEOUT == 0)) || torchrun_cmd+=(--shutdown-timeout "$SHUTDOWN_TIMEOUT")
    torchrun_cmd+=(-m megatron_lev.train "${train_args[@]}")
    srun_cmd=(
        srun
        --nodes "$NODES"
        --ntasks "$NODES"
        --ntasks-per-node 1
        --kill-on-bad-exit=1
        --output "$JOB_LOG_DIR/restart${RESTART}-node%n.log"
    )
    # Since Slurm 22.05 a step no longer inherits --cpus-per-task: give torchrun the node.
    [[ -n ${SLURM_CPUS_ON_NODE:-} ]] && srun_cmd+=(--cpus-per-task "$SLURM_CPUS_ON_NODE")
    srun_cmd+=("${torchrun_cmd[@]}")
}

batch_summary() {
    echo "DP=$DP x MICRO_BATCH=$MICRO_BATCH x ACCUMULATION=$ACCUMULATION" \
        "= GLOBAL_BATCH=${GLOBAL_BATCH:-$((DP * MICRO_BATCH))} sequences of $SEQ_LENGTH tokens per step"
}

print_dry_run() {
    local i=0 host
    echo "# DRY_RUN=1: nothing was launched. Environment exported to every task:"
    local var
    for var in CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_ASYNC_ERROR_HANDLING PYTORCH_CUDA_ALLOC_CONF \
        NCCL_DEBUG PYTHONUNBUFFERED TOKENIZERS_PARALLELISM PYTHONPATH DS_ACCELERATOR; do
        if [[ -v $var ]]; then echo "export $var=${!var@Q}"; else echo "unset $var"; fi
    done
    echo "# Batch: $(batch_summary)"
    echo "# Checkpoints (--save, and --load to resume): $CHECKPOINT_DIR"
    echo "# Decoder layers compiled (COMPILE_LAYERS=$COMPILE_LAYERS): $( ((COMPILE_LAYERS)) && echo yes || echo no)"
    echo "# The batch shell runs (one task per node, logs in $JOB_LOG_DIR):"
    print_cmd "${srun_cmd[@]}"
    for host in "${HOSTS[@]}"; do
        echo "# node $i ($host) runs:"
        print_cmd "${torchrun_cmd[@]}"
        i=$((i + 1))
    done
}

# Signal handling (see the top of this file).
# Ask the trainers to checkpoint at the next step and exit.
stop_step() {
    [[ -n ${STEP_PID:-} ]] || return 0
    if ((${TORCHRUN_USR1:-1})); then
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

latest_iteration() {
    if [[ -f $CHECKPOINT_DIR/latest ]]; then cat "$CHECKPOINT_DIR/latest"; else echo "none"; fi
}

launch_training() {
    # Traps first: a signal during the set-up is then remembered, not fatal.
    REQUEUE=0 TERMINATED=0 STEP_PID=
    trap _on_usr1 USR1
    trap _on_term TERM
    # The submitting shell's DS_ACCELERATOR (the CPU instructions export
    # DS_ACCELERATOR=cpu) must not put DeepSpeed on the CPU on GPU nodes: DeepSpeed detects
    # the accelerator itself; a site that needs to force one sets it in SITE_ENV.
    unset DS_ACCELERATOR
    setup_python_env
    resolve_aliases
    take_extra_args
    [[ -n ${CONFIG:-} ]] || die "CONFIG is not set (the sbatch script sets it)"
    [[ -n ${DATA_PATH:-} ]] || die "DATA_PATH is not set: export DATA_PATH=\"PREFIX\" or a blend \"W1 PREFIX1 W2 PREFIX2\" (tools/make_blend.py prints one)"
    tokenizer_flags
    check_blend DATA_PATH "$DATA_PATH"
    [[ -z ${VALID_DATA_PATH:-} ]] || check_blend VALID_DATA_PATH "$VALID_DATA_PATH"
    [[ -z ${TEST_DATA_PATH:-} ]] || check_blend TEST_DATA_PATH "$TEST_DATA_PATH"

    : "${GPU_TYPE:=h100}"
    resolve_config
    gpu_defaults
    : "${NODES:=${SLURM_JOB_NUM_NODES:-1}}"
    allocation_gpus
    : "${GPUS_PER_NODE:=${ALLOC_GPUS:-8}}"
    : "${CHECKPOINT_DIR:=$MEGATRON_LEV_DIR/checkpoints/$CONFIG}"
    : "${TENSORBOARD_DIR:=$CHECKPOINT_DIR/tensorboard}"
    # ZeRO-2 overlaps the (fp32) gradient reduction with backward; PP > 1 needs ZeRO-1 (docs/slurm.md).
    : "${DEEPSPEED_CONFIG:=$MEGATRON_LEV_DIR/deepspeed_configs/zero$((PP > 1 ? 1 : 2)).json}"
    : "${SAVE_INTERVAL:=1000}" "${LOG_INTERVAL:=10}" "${BF16:=1}" "${COMPILE_LAYERS:=1}"
    : "${SHUTDOWN_TIMEOUT:=240}" "${MAX_REQUEUES:=50}"
    : "${LOG_ROOT:=$MEGATRON_LEV_DIR/logs}"
    for var in NODES GPUS_PER_NODE TP PP SAVE_INTERVAL LOG_INTERVAL SHUTDOWN_TIMEOUT; do
        require_int "$var" "${!var}" 1
    done
    if [[ -n $ALLOC_GPUS && $GPUS_PER_NODE != "$ALLOC_GPUS" ]]; then
        die "GPUS_PER_NODE=$GPUS_PER_NODE but the allocation has $ALLOC_GPUS GPUs per node ($ALLOC_GPUS_FROM):" \
            "unset GPUS_PER_NODE (it follows the allocation), or submit with --gres=gpu:$GPUS_PER_NODE"
    fi
    [[ -z ${MICRO_BATCH:-} ]] || require_int MICRO_BATCH "$MICRO_BATCH" 1
    [[ -z ${EXIT_INTERVAL:-} ]] || require_int EXIT_INTERVAL "$EXIT_INTERVAL" 1
    require_int MAX_REQUEUES "$MAX_REQUEUES"
    [[ -z ${TRAIN_TOKENS:-} || -z ${TRAIN_ITERS:-} ]] || die "set TRAIN_TOKENS or TRAIN_ITERS, not both"
    [[ $BF16 == 0 || $BF16 == 1 ]] || die "BF16=$BF16: expected 0 or 1"
    [[ $COMPILE_LAYERS == 0 || $COMPILE_LAYERS == 1 ]] || die "COMPILE_LAYERS=$COMPILE_LAYERS: expected 0 or 1"
    [[ -f $DEEPSPEED_CONFIG ]] || die "DEEPSPEED_CONFIG=$DEEPSPEED_CONFIG: no such file"
    local world=$((NODES * GPUS_PER_NODE))
    ((world % (TP * PP) == 0)) \
        || die "TP=$TP x PP=$PP must divide the $world GPUs (NODES=$NODES x GPUS_PER_NODE=$GPUS_PER_NODE)"
    choose_micro_batch

    if [[ -n ${SLURM_JOB_NUM_NODES:-} && $NODES != "$SLURM_JOB_NUM_NODES" ]]; then
        die "NODES=$NODES but the allocation has $SLURM_JOB_NUM_NODES nodes: submit with sbatch --nodes=$NODES"
    fi
    if [[ -z ${SLURM_JOB_ID:-} && ${DRY_RUN:-0} != 1 ]]; then
        die "not inside a Slurm job: submit with sbatch (or run with DRY_RUN=1 to print the commands)"
    fi

    JOB_ID=${SLURM_JOB_ID:-0}
    RESTART=${SLURM_RESTART_COUNT:-0}
    JOB_LOG_DIR=$LOG_ROOT/${SLURM_JOB_NAME:-$CONFIG}-$JOB_ID
    mapfile -t HOSTS < <(job_hosts)
    ((${#HOSTS[@]} >= NODES)) || die "the allocation lists ${#HOSTS[@]} hosts, fewer than NODES=$NODES"
    : "${MASTER_ADDR:=${HOSTS[0]}}"
    # The same job id gives the same port after a requeue; different jobs sharing a
    # node get different ports (same formula as megatron_lev.distributed.launch.detect_launch_env).
    : "${MASTER_PORT:=$((10000 + JOB_ID % 50000))}"
    export_runtime_env
    torchrun_features
    build_commands
    check_trainer_flags

    if [[ ${DRY_RUN:-0} == 1 ]]; then
        print_dry_run
        return 0
    fi

    mkdir -p "$JOB_LOG_DIR" "$CHECKPOINT_DIR"
    {
        log "job $JOB_ID restart $RESTART on ${HOSTS[*]:0:NODES}; resuming from checkpoint: $(latest_iteration)"
        log "batch: $(batch_summary)"
        echo "srun command: $(print_cmd "${srun_cmd[@]}")"
        ((TORCHRUN_USR1)) || log "warning: this torchrun has no --signals-to-handle (torch < 2.9):" \
            "stop requests reach the trainers as SIGTERM through scancel"
        ((TORCHRUN_SHUTDOWN_TIMEOUT)) || log "warning: this torchrun has no --shutdown-timeout (torch < 2.11):" \
            "after a signal it kills the trainers 30 s later, so a checkpoint must be written within 30 s"
    } | tee -a "$JOB_LOG_DIR/launch.log"

    local rc=0 resumed_from
    resumed_from=$(latest_iteration)
    if ((REQUEUE == 0 && TERMINATED == 0)); then  # a signal may arrive before the launch
        # In the background so that the traps run while the step is running; stdin
        # from /dev/null so srun does not hold the batch shell's.
        "${srun_cmd[@]}" </dev/null &
        STEP_PID=$!
        wait "$STEP_PID" || rc=$?
        # `wait` returns >128 when a trapped signal interrupts it: the step is still
        # running (now checkpointing), so wait again until it has really exited.
        while ((rc > 128)) && kill -0 "$STEP_PID" 2>/dev/null; do
            rc=0
            wait "$STEP_PID" || rc=$?
        done
    fi
    {
        log "job step exited with status $rc; latest checkpoint: $(latest_iteration)"
        if ((REQUEUE == 1 || TERMINATED == 1)); then
            # torchrun exits 1 (SignalException) after passing a signal on, even when every
            # trainer checkpointed and exited 0; the trainers' own lines are in the node logs.
            log "(a non-zero status is expected after a signal: torchrun reports the one it forwarded)"
            [[ $(latest_iteration) != "$resumed_from" ]] \
                || log "warning: no new checkpoint since $resumed_from; see $JOB_LOG_DIR/restart$RESTART-node*.log"
        fi
    } | tee -a "$JOB_LOG_DIR/launch.log"

    # "training done: ..." is the trainer's last line (megatron_lev/training/trainer.py).
    if ((TERMINATED == 1)); then
        # Stopped on request: a clean stop (a new checkpoint) ends the job successfully.
        log "not requeueing after SIGTERM" | tee -a "$JOB_LOG_DIR/launch.log"
        [[ $(latest_iteration) == "$resumed_from" ]] || exit 0
        exit "$rc"
    fi
    if ((REQUEUE == 1)) && grep -qs "^training done" "$JOB_LOG_DIR/restart$RESTART-node"*.log; then
        log "not requeueing: training finished before the signal took effect" | tee -a "$JOB_LOG_DIR/launch.log"
        exit 0
    fi
    if ((REQUEUE == 1)); then
        if ((RESTART >= MAX_REQUEUES)); then
            log "not requeueing: restart $RESTART reached MAX_REQUEUES=$MAX_REQUEUES" | tee -a "$JOB_LOG_DIR/launch.log"
            exit 1
        fi
        log "requeueing job $JOB_ID" | tee -a "$JOB_LOG_DIR/launch.log"
        scontrol requeue "$JOB_ID"
        exit 0
    fi
    exit "$rc"
}
