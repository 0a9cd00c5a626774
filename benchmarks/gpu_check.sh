#!/usr/bin/env bash
# One-GPU check for an A100/H100/H200 machine, offline, in under 8 minutes (benchmarks/gpu_check.py):
# the CUDA kernel tests (pytest tests/test_lev_kernels.py), fused LEV against the PyTorch path,
# and lev-1.2b / tied-1.2b training steps as the Slurm scripts run them (bf16, --compile-layers,
# ZeRO-2 + overlap_comm, their per-GPU micro-batch and accumulation): MFU, the LEV/tied step
# ratio, peak memory. It fails on a failed kernel test, a non-finite loss, LEV/tied above 1.05
# or fused kernels that did not run.
#
#   bash benchmarks/gpu_wheels.sh                      # on a CPU machine with the package index
#   bash benchmarks/gpu_check.sh runs/gpu_wheels        # on the GPU machine, beside the code
#
# Nothing is downloaded: the wheels of WHEELS (what the GPU image lacks: DeepSpeed, megatron-core,
# this project and their small dependencies) go into a fresh environment over the machine's own
# Python ($PYTHON, default python3: its torch, triton, ...; benchmarks/gpu_check_env.sh).
# The JSON goes to runs/gpu_check.json (OUTPUT=... to change), written whatever happens: after
# every stage, and on any exit (a failure before the check's Python starts is recorded in it).
#
# Time budget on one H200 (480 s in all): installing the wheels about 30 s; then gpu_check.py
# gets what is left of 470 s: kernel tests 150 s, fused vs PyTorch 30 s, training 240 s (the
# two kinds' layer compilations, DeepSpeed's fused-Adam build, 1 + 3 optimizer steps each).
# Tensor/sequence/data parallelism on 2+ GPUs: benchmarks/gpu_check_multi.sh.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benchmarks/gpu_check_env.sh
source "$repo/benchmarks/gpu_check_env.sh"
output=${OUTPUT:-$repo/runs/gpu_check.json}
gpu_check_start gpu_check.sh "$output"

gpu_check_install gpu_check.sh "${1:-}"
shift
gpu_check_gpus gpu_check.sh 1
cd "$repo"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore} CUDA_DEVICE_MAX_CONNECTIONS=1 TRITON_INTERPRET=0
export GPU_CHECK_SITE=$site
unset DS_ACCELERATOR  # DeepSpeed finds the GPU itself (slurm/common.sh does the same)
left=$((470 - (SECONDS - start)))
status=0
timeout --signal=INT --kill-after=20 "$left" "$py" benchmarks/gpu_check.py --output "$output" "$@" || status=$?
echo "gpu_check.sh: done in $((SECONDS - start)) s (exit status $status); JSON in $output" >&2
exit "$status"
