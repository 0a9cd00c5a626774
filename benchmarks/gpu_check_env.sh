# shellcheck shell=bash
# The environment step shared by benchmarks/gpu_check.sh and gpu_check_multi.sh. Sourced.
# Offline: nothing is downloaded, only the wheel folder of benchmarks/gpu_wheels.sh is installed.
#
# gpu_check_install NAME WHEELS: a fresh virtual environment ($GPU_CHECK_VENV, default
#   <repo>/runs/gpu_check_env) over the packages of the machine's own Python ($PYTHON, default
#   python3: its torch, triton, pytest, ...), with the wheels of WHEELS it lacks (or has at a
#   version the wheels' requirements refuse: benchmarks/gpu_install.py) installed by pip
#   --no-index; checks that every requirement of those wheels is met. Exports
#   GPU_CHECK_INSTALL_RECORD (what was installed, what was kept). Sets `py` (the environment's
#   python) and `site` (its site-packages), and exports PYTHONPATH=<repo> (the checkout's code
#   runs; the project's wheel brings its requirements). What is installed comes ahead of the
#   machine's packages.
# gpu_check_gpus NAME MIN_GPUS: sets `gpus` (what nvidia-smi lists), or stops when there are fewer
#   than MIN_GPUS (none: "no CUDA GPU on HOST").
# gpu_check_start NAME OUTPUT: sets `start`; from then on the JSON report OUTPUT is written on any
#   exit: the check's Python writes it (`"finished": true`); if it did not finish, or never
#   started, what is there (or a new report) gets `"ok": false` and the reason. Every failure
#   calls `fail LINE... STATUS`: the one line on stderr, in the JSON's `error`, and exit STATUS.

gpu_check_start() {
    _check_name=$1 _check_output=$2 failure=""
    # shellcheck disable=SC2034  # used by the scripts that source this file
    start=$SECONDS
    mkdir -p "$(dirname "$_check_output")"
    rm -f "$_check_output"
    trap _gpu_check_finish EXIT
}

fail() {
    local status=${*: -1}
    failure="${*:1:$#-1}"
    echo "$failure" >&2
    exit "$status"
}

_gpu_check_finish() {
    local status=$?
    "${PYTHON:-python3}" - "$_check_output" "$failure" "$status" "${_check_name%.sh}" <<'PY' || true
import json, os, sys
path, failure, status, check = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
try:
    with open(path) as f:
        report = json.load(f)
except (OSError, ValueError):
    report = {"check": check, "stages_done": []}
if not report.get("finished"):
    error = failure or f"stopped with exit status {status} before the check finished"
    report.update(ok=False, finished=True, exit_status=status, error=error,
                  failures=[error, *report.get("failures", [])])
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=2)
    os.replace(path + ".tmp", path)
PY
}

gpu_check_install() {
    local name=$1 wheels=$2 base=${PYTHON:-python3} venv=${GPU_CHECK_VENV:-$repo/runs/gpu_check_env}
    [[ -n $wheels ]] || fail "$name: usage: bash benchmarks/$name WHEELS (the folder benchmarks/gpu_wheels.sh builds)" 2
    compgen -G "$wheels/*.whl" >/dev/null \
        || fail "$name: $wheels: no wheels there (build the folder with benchmarks/gpu_wheels.sh and copy it here)" 2
    command -v "$base" >/dev/null || fail "$name: no $base here: set PYTHON=/path/to/the machine's python" 2
    rm -rf "$venv"
    # No pip inside (ensurepip may be missing); the base interpreter's pip installs into it.
    "$base" -m venv --without-pip "$venv" || fail "$name: $base -m venv $venv failed" 2
    py=$venv/bin/python
    site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # The machine's packages after the environment's own: `import` lines in a .pth file run at
    # start-up, and addsitedir also reads the .pth files there (editable installs, ...).
    "$base" - "$site/_machine_packages.pth" <<'PY'
import site, sys, sysconfig
paths = sysconfig.get_paths()
dirs = [*site.getsitepackages(), site.getusersitepackages(), paths["purelib"], paths["platlib"]]
with open(sys.argv[1], "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dict.fromkeys(dirs)) + "\n")
PY
    # The machine's own packages win where they meet the wheels' requirements (its pytest and
    # the plugins built for it, say): benchmarks/gpu_install.py picks what to install.
    export GPU_CHECK_INSTALL_RECORD=$venv/install_record.json
    local picked
    picked=$("$base" "$repo/benchmarks/gpu_install.py" "$wheels" "$GPU_CHECK_INSTALL_RECORD") \
        || fail "$name: choosing what to install from $wheels failed (see above)" 2
    mapfile -t picked < <(printf '%s' "$picked" | sed '/^$/d')
    if ((${#picked[@]})); then
        "$base" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target "$site" \
            "${picked[@]}" >&2 || fail "$name: pip install --no-index of $wheels into $venv failed (see above)" 2
    fi
    export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
    local missing
    missing=$("$py" - "$site" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, distributions, version
from packaging.requirements import Requirement
for dist in distributions(path=[sys.argv[1]]):
    for text in dist.requires or ():
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement, or another platform's
        try:
            found = version(req.name)
        except PackageNotFoundError:
            found = None
        if found is None or not req.specifier.contains(found, prereleases=True):
            print(f"{req} (needed by {dist.metadata['Name']} {dist.version}; found {found or 'none'})")
            sys.exit(0)
PY
    ) || fail "$name: checking the installed wheels' requirements failed (see above)" 2
    [[ -z $missing ]] \
        || fail "$name: $missing: neither $wheels nor $base provides it" \
            "(rebuild the folder with benchmarks/gpu_wheels.sh)" 2
    local count kept
    count=$(find "$wheels" -maxdepth 1 -name '*.whl' | wc -l)
    kept=$("$base" "$repo/benchmarks/gpu_install.py" --kept "$GPU_CHECK_INSTALL_RECORD")
    echo "$name: installed ${#picked[@]} of $count wheels offline into $venv in $((SECONDS - start)) s;" \
        "kept the machine's own: $kept" >&2
}

gpu_check_gpus() {
    local name=$1 min_gpus=$2
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    ((gpus > 0)) || fail "$name: no CUDA GPU on $(hostname) (nvidia-smi lists none): run it on a GPU node," \
        "e.g. srun --gres=gpu:$min_gpus --pty bash benchmarks/$name WHEELS" 1
    ((gpus >= min_gpus)) || fail "$name: needs $min_gpus GPUs, $(hostname) has $gpus (nvidia-smi -L)" 1
}
