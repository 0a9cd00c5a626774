#!/usr/bin/env bash
#SBATCH --job-name=preprocess-pile
#SBATCH --array=0-31
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=32
#SBATCH --time=12:00:00
#SBATCH --open-mode=append
#SBATCH --output=%x-%A_%a.out
# Site-specific: uncomment and fill in.
##SBATCH --partition=PARTITION
##SBATCH --account=ACCOUNT
#
# Tokenize The Pile into Megatron indexed datasets: one array task per file.
#   tasks 0-29: $PILE_DIR/train/00.jsonl.zst .. 29.jsonl.zst -> $OUTPUT_DIR/train/pile_NN_text_document
#   task 30:    $PILE_DIR/val.jsonl.zst                      -> $OUTPUT_DIR/val/pile_val_text_document
#   task 31:    $PILE_DIR/test.jsonl.zst                     -> $OUTPUT_DIR/test/pile_test_text_document
# Each task runs tools/preprocess_data.py with one worker per core Slurm gave it
# (--cpus-per-task; use --exclusive for whole nodes). A task whose output exists is
# skipped (FORCE=1 redoes it), so resubmitting the array only redoes failed shards.
#
#   PILE_DIR=/data/pile OUTPUT_DIR=/data/pile_tok TOKENIZER_MODEL=/data/tokenizer.model \
#       sbatch slurm/preprocess_pile.sh
#   DRY_RUN=1 ... bash slurm/preprocess_pile.sh        # print all 32 commands
# then the training blend (weights = each shard's share of the tokens):
#   export DATA_PATH="$(python tools/make_blend.py "$OUTPUT_DIR/train")"
#   export VALID_DATA_PATH="$OUTPUT_DIR/val/pile_val_text_document"
#
# Variables: PILE_DIR, OUTPUT_DIR, TOKENIZER_MODEL (required; or VOCAB_FILE and MERGE_FILE with
# TOKENIZER_TYPE=GPT2BPETokenizer, Megatron's GPT-2 BPE files); TOKENIZER_TYPE
# (SentencePieceTokenizer), WORKERS (the task's cores), EXTRA_ARGS (more flags for
# preprocess_data.py, e.g. "--split-by-key meta.pile_set_name"), FORCE, DRY_RUN,
# VENV, SITE_ENV (as for the training scripts).
set -euo pipefail
# sbatch runs a copy of this file from its spool folder, so find the repository from
# MEGATRON_LEV_DIR, else this file's folder (bash slurm/...), else the submit folder.
if [[ -z ${MEGATRON_LEV_DIR:-} ]]; then
    MEGATRON_LEV_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    [[ -f $MEGATRON_LEV_DIR/slurm/common.sh ]] || MEGATRON_LEV_DIR=${SLURM_SUBMIT_DIR:-$PWD}
fi
[[ -f $MEGATRON_LEV_DIR/slurm/common.sh ]] \
    || { echo "slurm: error: no slurm/common.sh in $MEGATRON_LEV_DIR: submit from the repository root or set MEGATRON_LEV_DIR" >&2; exit 1; }
# shellcheck source=slurm/common.sh
source "$MEGATRON_LEV_DIR/slurm/common.sh"

NUM_TASKS=32  # keep equal to the --array range above

# Input file and output prefix of array task $1.
pile_task() {
    local task=$1
    if ((task < 30)); then
        printf -v shard '%02d' "$task"
        input=$PILE_DIR/train/$shard.jsonl.zst
        prefix=$OUTPUT_DIR/train/pile_$shard
    elif ((task == 30)); then
        input=$PILE_DIR/val.jsonl.zst
        prefix=$OUTPUT_DIR/val/pile_val
    else
        input=$PILE_DIR/test.jsonl.zst
        prefix=$OUTPUT_DIR/test/pile_test
    fi
}

preprocess_one() {
    local task=$1 input prefix shard
    pile_task "$task"
    [[ -f $input ]] || die "task $task: input $input does not exist (PILE_DIR=$PILE_DIR)"
    # preprocess_data.py renames its outputs into place only on success, so any final
    # .idx under this prefix means the task is done.
    local -a done_idx=()
    mapfile -t done_idx < <(compgen -G "${prefix}_*.idx" || true)
    if ((${#done_idx[@]} > 0)) && [[ ${FORCE:-0} != 1 ]]; then
        log "task $task: ${done_idx[0]} exists, skipping (FORCE=1 redoes it)"
        return 0
    fi
    local -a extra=()
    read -r -a extra <<<"${EXTRA_ARGS:-}"
    [[ ${DRY_RUN:-0} == 1 ]] || mkdir -p "$(dirname "$prefix")"
    run_or_print python "$MEGATRON_LEV_DIR/tools/preprocess_data.py" \
        --input "$input" \
        --output-prefix "$prefix" \
        --json-keys text \
        "${TOKENIZER_FLAGS[@]}" \
        --append-eod \
        --workers "$WORKERS" \
        --log-interval 100000 \
        "${extra[@]}"
}

setup_python_env
[[ -n ${PILE_DIR:-} ]] || die "PILE_DIR is not set: the folder holding train/00.jsonl.zst .. train/29.jsonl.zst, val.jsonl.zst, test.jsonl.zst"
[[ -n ${OUTPUT_DIR:-} ]] || die "OUTPUT_DIR is not set: where the indexed datasets go"
tokenizer_flags
: "${WORKERS:=${SLURM_CPUS_PER_TASK:-$(nproc)}}"
require_int WORKERS "$WORKERS" 1

if [[ -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
    require_int SLURM_ARRAY_TASK_ID "$SLURM_ARRAY_TASK_ID"
    ((SLURM_ARRAY_TASK_ID < NUM_TASKS)) || die "array task $SLURM_ARRAY_TASK_ID: expected 0-$((NUM_TASKS - 1))"
    preprocess_one "$SLURM_ARRAY_TASK_ID"
elif [[ ${DRY_RUN:-0} == 1 ]]; then
    for ((task = 0; task < NUM_TASKS; task++)); do preprocess_one "$task"; done
else
    die "not an array task: submit with sbatch (the header sets --array=0-$((NUM_TASKS - 1))), or set SLURM_ARRAY_TASK_ID"
fi
