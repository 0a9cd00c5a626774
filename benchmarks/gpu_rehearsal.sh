#!/usr/bin/env bash
# The first GPU call rehearsed on a CPU machine (docs/performance.md, "The first GPU call"), as
# far as a CPU allows:
#   1. wheels   benchmarks/gpu_wheels.sh builds the folder the call carries (the package index;
#               WHEELS=FOLDER reuses one built before);
#   2. image    a stand-in for the GPU image: a Python 3.12 virtual environment holding the
#               image's pytest (8.4.2, real, from the index) and stand-ins of its other packages
#               (benchmarks/gpu_rehearsal_image.py: torch 2.11.0+cu130 that refuses to import,
#               triton 3.6.0, numpy, ..., and a pytest plugin that breaks pytest if autoloaded);
#   3. install  benchmarks/gpu_check.sh with that Python as PYTHON, the folder as WHEELS and OUTPUT
#               where the device call puts it: the offline install (pip --no-index, the image's
#               pytest kept, every requirement met), then the one-GPU machine's path up to
#               gpu_check.py, which stops at the stand-in torch (the expected end here);
#   4. rules    the check's torch-free rules (tests/test_gpu_check_rules.py) under the image's
#               Python 3.12 and pytest, plugins not autoloaded; every installed package, this
#               project, its benchmarks and tests byte-compiled by Python 3.12;
#   5. logic    gpu_check.py --device cpu --tiny, every stage, with this machine's torch (CPU):
#               the torch side of the check cannot run on the stand-in.
# Prints and writes OUT/rehearsal.json (each step's seconds and result); exit 0 when all pass.
#
#   bash benchmarks/gpu_rehearsal.sh [OUT]          # default: runs/gpu_rehearsal
#
# Environment: PYTHON312 (default: python3.12 on PATH, then ~/.pyenv/versions/3.12*, then
# `uv python find 3.12`; without any, the rehearsal says so and uses python3), WHEELS (a built
# folder), LOGIC_PYTHON (step 5's interpreter, default python3: it needs this project's
# requirements, torch and triton included; default .venv/bin/python, else python3).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(mkdir -p "${1:-$repo/runs/gpu_rehearsal}" && cd "${1:-$repo/runs/gpu_rehearsal}" && pwd)
logic_python=${LOGIC_PYTHON:-$( [[ -x $repo/.venv/bin/python ]] && echo "$repo/.venv/bin/python" || echo python3)}
die() { echo "gpu_rehearsal.sh: $*" >&2; exit 1; }
steps=()  # "name seconds status" for rehearsal.json
step() {  # step NAME COMMAND...: run, time, record; the output in OUT/NAME.log
    local name=$1 t0=$SECONDS status=0
    shift
    "$@" >"$out/$name.log" 2>&1 || status=$?
    steps+=("$name $((SECONDS - t0)) $status")
    echo "gpu_rehearsal.sh: $name: exit $status in $((SECONDS - t0)) s (log: $out/$name.log)" >&2
    return 0
}

find_python312() {
    local candidate
    for candidate in ${PYTHON312:-} python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if [[ -n $candidate ]] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null
        then command -v "$candidate"; return; fi
    done
    if command -v uv >/dev/null && candidate=$(uv python find 3.12 2>/dev/null); then echo "$candidate"; return; fi
    command -v python3
}
py312=$(find_python312)
py_version=$("$py312" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ $py_version == 3.12 ]] || echo "gpu_rehearsal.sh: no Python 3.12 here: the image steps run under $py312" \
    "($py_version)" >&2

# 1. The wheel folder the device call carries.
wheels=${WHEELS:-$out/wheels}
if [[ -z ${WHEELS:-} ]]; then
    step wheels env PYTHON_VERSION="$py_version" bash "$repo/benchmarks/gpu_wheels.sh" "$wheels"
fi

# 2. The stand-in image.
image=$out/image
make_image() {
    rm -rf "$image" "$out/image_wheels"
    "$py312" -m venv "$image"
    "$image/bin/python" -m pip download -q --only-binary=:all: -d "$out/image_wheels" "pytest==8.4.2"
    "$image/bin/python" "$repo/benchmarks/gpu_rehearsal_image.py" "$out/image_wheels"
    "$image/bin/python" -m pip install -q --no-index --no-deps "$out/image_wheels"/*.whl
}
step image make_image

# 3. The device call's command, on this machine: an H200 that nvidia-smi lists, the stand-in image.
fake_bin=$out/bin
mkdir -p "$fake_bin"
cat >"$fake_bin/nvidia-smi" <<'SH'
#!/bin/sh
case "$*" in
    *compute_cap*) echo "9.0" ;;
    *) echo "GPU 0: NVIDIA H200 (UUID: GPU-rehearsal)" ;;
esac
SH
chmod +x "$fake_bin/nvidia-smi"
step install env PATH="$fake_bin:$PATH" PYTHON="$image/bin/python" GPU_CHECK_VENV="$out/check_env" \
    OUTPUT="$out/gpu_check.json" bash "$repo/benchmarks/gpu_check.sh" "$wheels"

# 4. The torch-free rules under the image's Python and pytest; byte-compiling under 3.12.
check_env=$out/check_env
step rules env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$check_env/bin/python" -m pytest -q -p no:cacheprovider \
    --noconftest --rootdir "$repo" "$repo/tests/test_gpu_check_rules.py"
step plugin_autoload env -u PYTEST_DISABLE_PLUGIN_AUTOLOAD "$check_env/bin/python" -m pytest --version
site=$("$check_env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
step compile env PYTHONPYCACHEPREFIX="$out/pycache" "$check_env/bin/python" -m compileall -q -j 0 -x '/(tests?|testing)/data/' "$site" \
    "$repo/megatron_lev" "$repo/benchmarks" "$repo/tests" "$repo/tools"

# 5. The check's logic with a real (CPU) torch.
step logic env OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 DS_ACCELERATOR=cpu PYTHONPATH="$repo" \
    "$logic_python" "$repo/benchmarks/gpu_check.py" --device cpu --tiny --max-lev-over-tied 100 \
    --output "$out/gpu_check_cpu.json"

"$py312" - "$out" "$py312" "$py_version" "$wheels" "${steps[@]}" <<'PY'
import json, os, sys
out, python, version, wheels, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
steps = {n: {"seconds": int(s), "exit_status": int(c)} for n, s, c in (line.split() for line in steps)}
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
install = load("gpu_check.json") or {}
record = load("check_env/install_record.json")
autoload_log = open(os.path.join(out, "plugin_autoload.log")).read()
expected_end = ("stopped with exit status 1 before the check finished",)
checks = {
    "wheels": steps.get("wheels", {"exit_status": 0})["exit_status"] == 0,
    "image": steps["image"]["exit_status"] == 0,
    # The install passed and the machine's path reached gpu_check.py, which stopped at the stand-in torch.
    "install": (steps["install"]["exit_status"] == 1 and install.get("error") in expected_end
                and record is not None and any(k["name"] == "pytest" for k in record["kept"])),
    "rules": steps["rules"]["exit_status"] == 0,
    "plugin_autoload": steps["plugin_autoload"]["exit_status"] != 0 and "autoloaded" in autoload_log,
    "compile": steps["compile"]["exit_status"] == 0,
    "logic": steps["logic"]["exit_status"] == 0 and (load("gpu_check_cpu.json") or {}).get("ok") is True,
    # LEV's generator timed inside the training steps (the hooks a GPU runs with CUDA events).
    "lev_timing": 0 < (((load("gpu_check_cpu.json") or {}).get("training", {}).get("kinds", {}).get("lev", {})
                        .get("lev_generator") or {}).get("share") or {}).get("median", 0) < 1,
}
wheel_files = sorted(f for f in os.listdir(wheels) if f.endswith(".whl"))
report = {"python": python, "python_version": version, "steps": steps, "checks": checks,
          "ok": all(checks.values()), "install_record": record,
          "wheels": {"count": len(wheel_files), "bytes": sum(os.path.getsize(os.path.join(wheels, f)) for f in wheel_files),
                     "files": wheel_files}}
with open(os.path.join(out, "rehearsal.json"), "w") as f:
    json.dump(report, f, indent=1)
print(json.dumps({k: report[k] for k in ("python_version", "steps", "checks", "ok")}, indent=1))
sys.exit(0 if report["ok"] else 1)
PY
