#!/usr/bin/env bash
# The wheels an offline GPU machine needs for benchmarks/gpu_check.sh, built on a CPU machine
# that reaches the package index. The GPU image this is made for (docs/cluster.md) has Python
# 3.12 with torch, triton, transformers, sentencepiece, tensorboard, tqdm, mpi4py, numpy, pyyaml,
# safetensors, ninja and nvcc; the folder holds exactly what it lacks:
#   - DeepSpeed as a pure-Python wheel (no ops built: it JIT-builds what it needs, with nvcc);
#   - megatron-core (cp312 manylinux: it has one compiled helper);
#   - this project, from the working tree (tracked files, as they are now);
#   - their dependencies the image lacks: hjson, pydantic (pydantic-core, annotated-types,
#     typing-inspection, typing-extensions), einops, msgpack, psutil, py-cpuinfo, packaging,
#     zstandard, orjson;
#   - pytest (iniconfig, pluggy, pygments), which runs the CUDA kernel tests on an image without
#     one: where the machine has its own, gpu_check.sh keeps it (benchmarks/gpu_install.py installs
#     a wheel only where the machine lacks the package or has a version the wheels refuse).
# It prints the folder's size, which must stay under 50 MiB (the device call carries it with the
# working tree: 64 MiB in all; docs/performance.md, "The first GPU call").
#
#   bash benchmarks/gpu_wheels.sh [FOLDER]              # default: runs/gpu_wheels
#   PYTHON_VERSION=3.11 bash benchmarks/gpu_wheels.sh   # for another Python (a CPU rehearsal)
#
# Environment: PYTHON (default python3) runs pip and builds the pure wheels (no torch needed);
# PYTHON_VERSION (3.12), DEEPSPEED_VERSION (0.19.8), MEGATRON_CORE_VERSION (0.16.1).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
folder=${1:-$repo/runs/gpu_wheels}
python=${PYTHON:-python3}
py_version=${PYTHON_VERSION:-3.12}
deepspeed_version=${DEEPSPEED_VERSION:-0.19.8}
megatron_core_version=${MEGATRON_CORE_VERSION:-0.16.1}
limit_mib=50
die() { echo "gpu_wheels.sh: $*" >&2; exit 1; }

[[ $py_version =~ ^3\.[0-9]+$ ]] || die "PYTHON_VERSION=$py_version: expected 3.N"
abi="cp${py_version/./}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$folder"
mkdir -p "$folder"

# A build environment without torch: DeepSpeed's setup.py then builds no ops (a pure wheel).
"$python" -m venv "$work/build" || die "$python -m venv failed (install the python3-venv package)"
build=$work/build/bin/python
"$build" -m pip install -q --upgrade pip setuptools wheel >&2 || die "pip could not reach the package index"

# Binary wheels for the GPU machine's Python and platform (glibc 2.28 or newer, as torch's own).
target=(--only-binary=:all: --python-version "$py_version" --implementation cp --abi "$abi" --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# Small, with their dependencies (none of them pulls torch).
"$build" -m pip download -q "${target[@]}" -d "$folder" hjson pydantic einops msgpack psutil py-cpuinfo \
    "packaging>=24.2" zstandard orjson pytest >&2 || die "pip download of the dependencies failed"
# megatron-core's own dependencies are torch, numpy (the image's) and packaging (above).
"$build" -m pip download -q "${target[@]}" --no-deps -d "$folder" "megatron-core==$megatron_core_version" >&2 \
    || die "pip download megatron-core==$megatron_core_version failed"

"$build" -m pip download -q --no-deps --no-binary=:all: -d "$work/sdist" "deepspeed==$deepspeed_version" >&2 \
    || die "pip download of the deepspeed==$deepspeed_version source failed"
DS_BUILD_OPS=0 "$build" -m pip wheel -q --no-deps --no-build-isolation -w "$folder" "$work"/sdist/deepspeed-*.tar.gz \
    >&2 2>"$work/deepspeed.log" || { tail -n 20 "$work/deepspeed.log" >&2; die "building the DeepSpeed wheel failed"; }

# This project: its tracked files as they are in the working tree (pip would write build/ and
# .egg-info into the repository).
mkdir -p "$work/src"
git -C "$repo" ls-files -z | (cd "$repo" && xargs -0 cp -P --parents -t "$work/src" 2>/dev/null) \
    || die "copying the repository's tracked files failed"
"$build" -m pip wheel -q --no-deps --no-build-isolation -w "$folder" "$work/src" >&2 \
    || die "building the megatron_lev wheel failed"

(cd "$folder" && sha256sum -- *.whl > SHA256SUMS)
count=$(find "$folder" -name '*.whl' | wc -l)
bytes=$(du -sb "$folder" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "gpu_wheels.sh: $count wheels for CPython $py_version, $mib MiB in $folder" >&2
ls -l "$folder" >&2
((bytes < limit_mib * 1048576)) || die "the folder is $mib MiB, over the $limit_mib MiB it must fit in"
echo "$folder"
