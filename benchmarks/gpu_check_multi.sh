#!/usr/bin/env bash
# Checks for one node with 2 or more GPUs, under torchrun/NCCL, in under 8 minutes
# (benchmarks/gpu_check_multi.py): TP=2 with LEV's sequence-parallel reduce-scatter against
# TP=1 (logits, loss, gradients), DP=N bf16 training with compiled layers and the Slurm scripts'
# ZeRO-2 + overlap_comm against one GPU (loss, gradient norm), and the LEV/tied step time and
# MFU of the 1.2B configs as the Slurm scripts run them (global batch 512, their micro-batch
# and gradient accumulation, all the node's GPUs). On a one-GPU machine it runs the last part
# on that GPU, reports the others as "needs >= 2 GPUs" and exits 0 when that part passes.
# Prints the JSON and writes it to runs/gpu_check_multi.json (OUTPUT=... to change) after
# every stage.
#
#   bash benchmarks/gpu_check_multi.sh WHEELS          # every GPU of the node
#   NPROC=2 bash benchmarks/gpu_check_multi.sh WHEELS  # the first two
#
# WHEELS and the offline environment step (PYTHON=, GPU_CHECK_VENV=) are gpu_check.sh's
# (benchmarks/gpu_check_env.sh). Time budget: install about 30 s, the one-GPU reference of the
# data-parallel check 100 s, torchrun's stages 340 s.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benchmarks/gpu_check_env.sh
source "$repo/benchmarks/gpu_check_env.sh"
output=${OUTPUT:-$repo/runs/gpu_check_multi.json}
gpu_check_start gpu_check_multi.sh "$output"

gpu_check_install gpu_check_multi.sh "${1:-}"
shift
gpu_check_gpus gpu_check_multi.sh 1
nproc=${NPROC:-$gpus}
((nproc == 1 || (nproc >= 2 && nproc % 2 == 0 && nproc <= gpus))) \
    || fail "gpu_check_multi.sh: NPROC=$nproc: expected 1, or an even number from 2 to the $gpus GPUs" 1

cd "$repo"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore} CUDA_DEVICE_MAX_CONNECTIONS=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export TRITON_INTERPRET=0
unset DS_ACCELERATOR  # DeepSpeed finds the GPUs itself (slurm/common.sh does the same)
checks=(benchmarks/gpu_check_multi.py --output "$output")
if ((nproc > 1)); then
    # The one-GPU side of the data-parallel check, in its own process, before torchrun.
    reference=$(dirname "$output")/gpu_check_multi_reference.json
    timeout 100 "$py" benchmarks/gpu_check_multi.py --stage reference --dp-size "$nproc" --reference "$reference" "$@" \
        || fail "gpu_check_multi.sh: the one-GPU reference of the data-parallel check failed (see above)" 1
    checks+=(--reference "$reference")
fi
status=0
timeout --signal=INT --kill-after=20 340 "$py" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    "${checks[@]}" "$@" || status=$?
echo "gpu_check_multi.sh: done in $((SECONDS - start)) s (exit status $status); JSON in $output" >&2
exit "$status"
