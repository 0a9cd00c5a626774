#!/usr/bin/env bash
# Set up the environment (tools/setup_env.sh) and run the whole test suite on CPU.
# Extra arguments go to pytest, e.g. `bash tools/run_tests.sh -k lev -x`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(EXTRAS=test bash "$repo/tools/setup_env.sh" | tail -n 1)
cd "$repo"
export DS_ACCELERATOR=cpu
exec "$py" -m pytest -q -p no:cacheprovider tests "$@"
