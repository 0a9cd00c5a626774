#!/usr/bin/env bash
# Set up the environment (tools/setup_env.sh) and run the whole test suite on CPU.
# Extra arguments go to pytest, e.g. `bash tools/run_tests.sh -k lev -x`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(env EXTRAS=test bash "$repo/tools/setup_env.sh" | tail -n 1)
# tests/test_slurm.py lints every shell script with shellcheck (a Debian/Ubuntu package).
if ! command -v shellcheck >/dev/null 2>&1; then
    sudo=""
    [[ $(id -u) == 0 ]] || sudo="sudo"
    if ! command -v apt-get >/dev/null 2>&1 \
        || ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq shellcheck; } >&2; then
        echo "run_tests.sh: shellcheck is missing and could not be installed with apt-get;" \
            "install it (https://github.com/koalaman/shellcheck#installing) and rerun" >&2
        exit 1
    fi
fi
cd "$repo"
export DS_ACCELERATOR=cpu
exec "$py" -m pytest -q -p no:cacheprovider tests "$@"
