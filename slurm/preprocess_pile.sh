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
# (--cpus-per-task; use --exclusive for whole nodes); the tasks are numbered in
# megatron_lev/launcher/pile.py (keep its NUM_TASKS equal to the --array range above). A task whose output exists is
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

setup_python_env
# The task's checks and command (megatron_lev/launcher/pile.py); the launcher's process becomes
# preprocess_data.py, so Slurm's signals reach it. Under DRY_RUN=1 the commands are printed.
exec python -m megatron_lev.launcher pile
