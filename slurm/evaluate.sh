#!/usr/bin/env bash
#SBATCH --job-name=evaluate
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=16
#SBATCH --time=12:00:00
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
# Site-specific: uncomment and fill in.
##SBATCH --partition=PARTITION
##SBATCH --account=ACCOUNT
#
# A comparison's evaluation and release on one GPU, per seed: perplexity overall and by token
# frequency, training curves, the Hugging Face exports, lm-eval's downstream tasks with standard
# errors, the exports again with the scores in their cards, then the summary over seeds.
#
#   RUNS="lev=checkpoints/exp/lev-1.2b-200k-s{seed} tied=checkpoints/exp/tied-1.2b-200k-s{seed}" \
#   SEEDS="1 2 3" BASELINE=tied OUTPUT_DIR=eval/exp-1.2b TASK_DATA_DIR=eval_data \
#   EVAL_TOKENS=10000000 LICENSE=apache-2.0 HF_DATASET=monology/pile-uncopyrighted \
#       sbatch slurm/evaluate.sh
#   DRY_RUN=1 ... bash slurm/evaluate.sh             # print every stage's command
#
# Each run is pinned to its newest complete checkpoint at start. A finished stage is skipped when
# the job is resubmitted (FORCE=1 redoes it); a stage writes into <folder>.partial and renames it
# when done (megatron_lev/launcher/evaluation.py). Variables: docs/slurm.md, "Evaluation and
# release".
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

# As for training: DeepSpeed finds the accelerator itself on a GPU node (SITE_ENV may force one).
unset DS_ACCELERATOR
setup_python_env
# The stages run one after the other as this process's children (megatron_lev/launcher/evaluation.py).
exec python -m megatron_lev.launcher evaluate
