#!/usr/bin/env bash
# Checks for one node with 2 or more GPUs, under torchrun/NCCL, in under 8 minutes
# (benchmarks/gpu_check_multi.py): TP=2 with LEV's sequence-parallel reduce-scatter against
# TP=1 (logits, loss, gradients), DP=N bf16 training against one GPU (loss, gradient norm),
# and the LEV/tied step time and MFU of the 1.2B configs as the Slurm scripts run them
# (global batch 512, their micro-batch and gradient accumulation, all the node's GPUs).
# Prints the JSON and writes it to runs/gpu_check_multi.json (OUTPUT=... to change) after
# every stage.
#
#   bash benchmarks/gpu_check_multi.sh                 # every GPU of the node
#   NPROC=2 bash benchmarks/gpu_check_multi.sh          # the first two
#
# The environment step (PYTHON=, VENV=) is gpu_check.sh's: benchmarks/gpu_check_env.sh.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benchmarks/gpu_check_env.sh
source "$repo/benchmarks/gpu_check_env.sh"
output=${OUTPUT:-$repo/runs/gpu_check_multi.json}
gpu_check_python gpu_check_multi.sh 2
nproc=${NPROC:-$gpus}
((nproc >= 2 && nproc % 2 == 0 && nproc <= gpus)) \
    || { echo "gpu_check_multi.sh: NPROC=$nproc: expected an even number from 2 to the $gpus GPUs" >&2; exit 1; }

cd "$repo"
mkdir -p "$(dirname "$output")"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore} CUDA_DEVICE_MAX_CONNECTIONS=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
unset DS_ACCELERATOR  # DeepSpeed finds the GPUs itself (slurm/common.sh does the same)
reference=$(mktemp --suffix .json)
trap 'rm -f "$reference"' EXIT
# The one-GPU side of the data-parallel check, in its own process, before torchrun.
timeout 100 "$py" benchmarks/gpu_check_multi.py --stage reference --dp-size "$nproc" --reference "$reference" "$@"
timeout --signal=INT 340 "$py" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    benchmarks/gpu_check_multi.py --reference "$reference" --output "$output" "$@"
echo "gpu_check_multi.sh: done in $((SECONDS - start)) s; JSON in $output" >&2
