#!/usr/bin/env bash
# One-GPU check for an H100/H200 machine, in under 8 minutes: bf16 step time, tokens/s, MFU and
# peak memory of lev-1.2b and tied-1.2b (their LEV/tied step-time ratio), and sequence-parallel vs
# non-SP LEV output. Prints the JSON and writes it to runs/gpu_check.json (OUTPUT=... to change).
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
venv=${VENV:-$repo/.venv}
output=${OUTPUT:-$repo/runs/gpu_check.json}
start=$SECONDS

cuda_torch() {  # PYTHON: does its torch see a GPU?
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

if [[ -n ${PYTHON:-} ]]; then
    py=$PYTHON
else
    if [[ ! -x $venv/bin/python ]] && command -v python3 >/dev/null && cuda_torch python3; then
        echo "gpu_check.sh: reusing the CUDA torch of $(command -v python3) in $venv" >&2
        python3 -m venv --system-site-packages "$venv"
    fi
    py=$(VENV=$venv EXTRAS="" bash "$repo/tools/setup_env.sh" | tail -n 1)  # no extras needed
fi
if ! cuda_torch "$py"; then
    echo "gpu_check.sh: $py: torch $("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '(none)')" \
        "sees no GPU. Install a CUDA build into it, e.g." \
        "$py -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" >&2
    exit 1
fi
echo "gpu_check.sh: environment ready in $((SECONDS - start)) s: $("$py" -c 'import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")')" >&2

cd "$repo"
mkdir -p "$(dirname "$output")"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
# The time limit leaves the environment step its share of the 8 minutes.
timeout --signal=INT 420 "$py" benchmarks/gpu_check.py --output "$output" "$@"
echo "gpu_check.sh: done in $((SECONDS - start)) s; JSON in $output" >&2
