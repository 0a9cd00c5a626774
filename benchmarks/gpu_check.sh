#!/usr/bin/env bash
# One-GPU check for an A100/H100/H200 machine, in under 8 minutes: bf16 step time, tokens/s, MFU
# and peak memory (after the first optimizer step) of lev-1.2b and tied-1.2b, and their LEV/tied
# step-time ratio (benchmarks/gpu_check.py). Prints the JSON and writes it to runs/gpu_check.json
# (OUTPUT=... to change) after every stage, so a cut-short run keeps what it measured.
# Tensor/sequence/data parallelism on 2+ GPUs: benchmarks/gpu_check_multi.sh.
#
#   bash benchmarks/gpu_check.sh
#
# Environment, in order of preference:
#   PYTHON=/path/to/python   use that interpreter as it is (it must import torch with CUDA and megatron_lev)
#   VENV (default <repo>/.venv, the cluster environment of the README) when its torch sees a GPU
#   otherwise, when VENV does not exist yet and the system python3's torch sees a GPU (an NGC/PyTorch
#                            container): VENV is created inheriting it (--system-site-packages)
#   otherwise                tools/setup_env.sh creates VENV and installs torch 2.13 from the package
#                            index (on Linux x86_64 the CUDA build) and the package
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benchmarks/gpu_check_env.sh
source "$repo/benchmarks/gpu_check_env.sh"
output=${OUTPUT:-$repo/runs/gpu_check.json}
gpu_check_python gpu_check.sh 1

cd "$repo"
mkdir -p "$(dirname "$output")"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
# The time limit leaves the environment step its share of the 8 minutes.
timeout --signal=INT 420 "$py" benchmarks/gpu_check.py --output "$output" "$@"
echo "gpu_check.sh: done in $((SECONDS - start)) s; JSON in $output" >&2
