#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install the package into it.
# Used by tools/run_tests.sh and tools/quickstart.sh. Prints the venv's python path last.
#   VENV=path     where the environment lives (default: <repo>/.venv)
#   EXTRAS=a,b    package extras to install (default: test; EXTRAS= for none)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$repo/.venv}
extras=${EXTRAS-test}
if [[ ! -x $venv/bin/python ]]; then
    python3 -m venv "$venv"
fi
py=$venv/bin/python
stamp=$venv/.megatron_lev_installed
# The stamp holds setup.py's hash and the extras installed. Reinstall only when setup.py changed
# or an extra is missing (re-runs are fast), keeping the extras already there: the tests (test)
# and the demo (hf,plots) share one venv without reinstalling in turn.
installed=""
[[ ! -f $stamp ]] || read -r _ installed < "$stamp" || true
extras=$(echo "${installed//,/ } ${extras//,/ }" | tr ' ' '\n' | sed '/^$/d' | sort -u | paste -sd, -)
want="$(sha256sum "$repo/setup.py" | cut -c1-16) $extras"
if [[ ! -f $stamp || "$(cat "$stamp")" != "$want" ]]; then
    "$py" -m pip install -q --upgrade pip >&2 2>/dev/null || true
    # A machine without torch gets torch 2.13.0. Which build is pip's choice: where pip's
    # find-links folder (PIP_FIND_LINKS, pip.conf) holds the CPU wheel 2.13.0+cpu, pip takes that
    # local file (a local version label satisfies ==2.13.0), as on our CI and CPU machines; with
    # only PyPI, Linux gets PyPI's default build, which is the multi-GB CUDA one. A cluster venv
    # that already has its CUDA torch keeps it: setup.py's range accepts it.
    if ! "$py" -c "import torch" >/dev/null 2>&1; then
        "$py" -m pip install -q "torch==2.13.0" >&2
    fi
    "$py" -m pip install -q -e "${repo}${extras:+[$extras]}" >&2
    echo "$want" > "$stamp"
fi
echo "$py"
