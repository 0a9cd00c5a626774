#!/usr/bin/env bash
# Set up the environment (tools/setup_env.sh) and run the whole test suite on CPU.
# Extra arguments go to pytest, e.g. `bash tools/run_tests.sh -k lev -x`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# System packages the tests use, from the Debian/Ubuntu archive, installed when missing:
# the shellcheck linter (tests/test_slurm.py lints every shell script) and Open MPI (a test trains
# under mpirun; its headers let pip build mpi4py where no wheel fits). Before the Python
# environment, which installs mpi4py. Debian's slurm-wlm and munge, for the real Slurm of
# tests/test_slurm_cluster.py, are installed by that test's fixture (tests/slurm_cluster.py).
missing=()
command -v shellcheck >/dev/null 2>&1 || missing+=(shellcheck)
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || missing+=(libopenmpi-dev)
if ((${#missing[@]})); then
    sudo=""
    [[ $(id -u) == 0 ]] || sudo="sudo"
    if ! command -v apt-get >/dev/null 2>&1 \
        || ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq "${missing[@]}"; } >&2; then
        echo "run_tests.sh: ${missing[*]} missing and could not be installed with apt-get; install them" \
            "(shellcheck: https://github.com/koalaman/shellcheck#installing; Open MPI: your package manager)" \
            "and rerun" >&2
        exit 1
    fi
fi
py=$(env EXTRAS=test bash "$repo/tools/setup_env.sh" | tail -n 1)
cd "$repo"
export DS_ACCELERATOR=cpu
# One intra-op thread per process: the tests are many small processes (2-rank groups, trainers,
# Slurm jobs) on a 2-core machine, where a second torch thread only waits on the other process's
# core. Measured: tests/test_capacity.py's fit took 586 s with 2 threads beside one busy core, 15 s
# with 1. Set OMP_NUM_THREADS to override.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$py" -m pytest -q -p no:cacheprovider tests "$@"
