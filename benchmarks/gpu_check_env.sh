# shellcheck shell=bash
# The environment step shared by benchmarks/gpu_check.sh and gpu_check_multi.sh. Sourced.
#
# gpu_check_python NAME MIN_GPUS: sets `py` (an interpreter whose torch sees the GPUs),
# `gpus` (how many it sees) and `start` (SECONDS at the beginning), or exits 1 with one
# clear first line:
#   - no CUDA GPU on this machine (nothing else is tried: this is the wrong node);
#   - fewer than MIN_GPUS GPUs;
#   - tools/setup_env.sh failed (typically no network to the package index): set PYTHON=;
#   - the interpreter's torch is not a CUDA build.
# Interpreter, in order of preference: PYTHON as it is; VENV (default <repo>/.venv) when its
# torch sees a GPU; when VENV does not exist and the system python3's torch sees a GPU (an
# NGC/PyTorch container), VENV is created inheriting it (--system-site-packages); otherwise
# tools/setup_env.sh creates VENV (torch 2.13, the CUDA build on Linux x86_64).

cuda_torch() {  # PYTHON: does its torch see a GPU?
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

gpu_check_python() {
    local name=$1 min_gpus=$2 venv=${VENV:-$repo/.venv} listed
    # shellcheck disable=SC2034  # used by the scripts that source this file
    start=$SECONDS
    listed=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if ((listed == 0)); then
        echo "$name: no CUDA GPU on $(hostname) (nvidia-smi lists none): run it on a GPU node," \
            "e.g. srun --gres=gpu:$min_gpus --pty bash benchmarks/$name" >&2
        exit 1
    fi
    if ((listed < min_gpus)); then
        echo "$name: needs $min_gpus GPUs, $(hostname) has $listed (nvidia-smi -L)" >&2
        exit 1
    fi
    if [[ -n ${PYTHON:-} ]]; then
        py=$PYTHON
    else
        if [[ ! -x $venv/bin/python ]] && command -v python3 >/dev/null && cuda_torch python3; then
            echo "$name: reusing the CUDA torch of $(command -v python3) in $venv" >&2
            python3 -m venv --system-site-packages "$venv"
        fi
        if ! py=$(VENV=$venv EXTRAS="" bash "$repo/tools/setup_env.sh" | tail -n 1); then  # no extras needed
            echo "$name: tools/setup_env.sh could not prepare $venv (no network to the package index?):" \
                "set PYTHON=/path/to/python of an environment with a CUDA torch and this package's" \
                "requirements (e.g. an NGC PyTorch container's python3), or VENV= to an existing one" >&2
            exit 1
        fi
    fi
    if ! cuda_torch "$py"; then
        echo "$name: $py: torch $("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '(none)')" \
            "sees no GPU. Install a CUDA build into it, e.g." \
            "$py -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" >&2
        exit 1
    fi
    # shellcheck disable=SC2034  # used by the scripts that source this file
    gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
    echo "$name: environment ready in $((SECONDS - start)) s: $("$py" -c 'import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name()}")')" >&2
}
