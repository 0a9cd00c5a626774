#!/usr/bin/env bash
#SBATCH --job-name=lev-1.2b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
# Site-specific: uncomment and fill in.
##SBATCH --partition=PARTITION
##SBATCH --account=ACCOUNT
#
# The ~1.2B Leviathan run (LEV input embeddings, untied output head).
#
#   export DATA_PATH="$(python tools/make_blend.py /data/pile_tok/train)"
#   export TOKENIZER_MODEL=/data/tokenizer.model
#   sbatch slurm/train_lev_1b.sh                                # 1 x 8 H100
#   GPU_TYPE=a100 sbatch --nodes=4 slurm/train_lev_1b.sh        # 4 x 8 A100
#   DRY_RUN=1 NODES=4 bash slurm/train_lev_1b.sh                # print what each node runs
#
# Environment variables: docs/slurm.md (its table). Launch logic,
# preemption and requeue: slurm/common.sh.
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

CONFIG=${CONFIG:-lev-1.2b}
launch_training
