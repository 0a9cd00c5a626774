#!/usr/bin/env bash
# One-GPU check for an A100/H100/H200 machine, offline, in under 8 minutes (benchmarks/gpu_check.py,
# whose docstring lists the stages): the CUDA kernel tests, fused LEV against the PyTorch path,
# the bf16 GEMM ceiling, GPTModel+LEV against our model, lev-1.2b / tied-1.2b trained side by side
# as the Slurm scripts run them (interleaved timing, constant learning rate, the loss must fall),
# bf16 against fp32, and a save and resume. The JSON says what passed and why not.
#
#   bash benchmarks/gpu_wheels.sh                      # on a CPU machine with the package index
#   bash benchmarks/gpu_check.sh runs/gpu_wheels        # on the GPU machine, beside the code
#
# Nothing is downloaded: the wheels of WHEELS (what the GPU image lacks: DeepSpeed, megatron-core,
# this project and their small dependencies) go into a fresh environment over the machine's own
# Python ($PYTHON, default python3: its torch, triton, pytest, ...; benchmarks/gpu_check_env.sh).
# The JSON goes to runs/gpu_check.json (OUTPUT=... to change: on a machine whose files do not
# come back, into the folder that does), written whatever happens: after every stage, and on
# any exit (a failure before the check's Python starts is recorded in it). Extra arguments go
# to gpu_check.py (e.g. --allow-optimizer-fallback).
#
# Time on one H200 (480 s in all): the install about 30 s; gpu_check.py gets what is left of
# 470 s (--time-limit) and skips a stage that no longer fits its estimate
# (gpu_check_rules.STAGE_ESTIMATE_S; docs/performance.md, "The first GPU call").
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
# The image's pytest plugins are not loaded into the kernel tests (they need not match).
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
# DeepSpeed's fused Adam is built for this GPU's architecture only (one nvcc pass, not a list).
# DeepSpeed 0.19's op builder reads each entry as MAJOR.MINOR[+PTX] and cannot parse an
# architecture-specific suffix: the H200 image sets TORCH_CUDA_ARCH_LIST=9.0a, and its fused Adam
# then failed with "invalid literal for int() with base 10: '0a'" (first GPU call, 4 December
# 2026). The suffix is dropped (9.0a -> 9.0): Adam uses no sm_90a-only instruction.
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 || true)
if [[ -z ${TORCH_CUDA_ARCH_LIST:-} && -n $arch ]]; then
    export TORCH_CUDA_ARCH_LIST=$arch
fi
if [[ -n ${TORCH_CUDA_ARCH_LIST:-} ]]; then
    TORCH_CUDA_ARCH_LIST=$(sed -E 's/([0-9]+\.[0-9]+)[a-z]/\1/g' <<< "$TORCH_CUDA_ARCH_LIST")
    export TORCH_CUDA_ARCH_LIST
fi
export GPU_CHECK_SITE=$site
unset DS_ACCELERATOR  # DeepSpeed finds the GPU itself (slurm/common.sh does the same)
left=$((470 - (SECONDS - start)))
status=0
timeout --signal=INT --kill-after=20 "$left" "$py" benchmarks/gpu_check.py --output "$output" --time-limit "$left" "$@" \
    || status=$?
echo "gpu_check.sh: done in $((SECONDS - start)) s (exit status $status); JSON in $output" >&2
exit "$status"
