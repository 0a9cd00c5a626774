#!/usr/bin/env bash
# A learning-rate sweep: every kind at every peak learning rate (min lr = peak / 10, the
# configs' ratio), one process per run, --lanes at a time, then the table ranked by final
# validation loss (python -m megatron_lev.evaluation.lr_sweep) -> OUT/sweep.{md,json}.
#
#   bash experiments/lr_sweep.sh --config-pattern 'experiments/configs/exp-{}.yaml' --kinds "tied untied lev" \
#       --lrs "1e-3 2e-3 4e-3" --steps 1200 --out experiments/out/sweep -- TRAIN_ARGS...
#
# {} in --config-pattern is the kind. TRAIN_ARGS (after --) go to every run: the data
# (--data-path, --split, --tokenizer-*). Runs are OUT/KIND-lrLR-sSEED; finished ones are reused.
# experiments/run.sh --sweep runs the experiment's sweep; docs/experiments.md has the demo's.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}
# shellcheck source=experiments/lib.sh
source "$repo/experiments/lib.sh"

pattern="" kinds="" lrs="" seeds=1 steps="" lanes=2 out=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --config-pattern) pattern=$2; shift 2 ;;
        --kinds) kinds=$2; shift 2 ;;
        --lrs) lrs=$2; shift 2 ;;
        --seeds) seeds=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --lanes) lanes=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "experiments/lr_sweep.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
for flag in pattern kinds lrs steps out; do
    [[ -n ${!flag} ]] || { echo "experiments/lr_sweep.sh: --${flag/pattern/config-pattern} is required" >&2; exit 2; }
done
[[ $pattern == *"{}"* ]] || { echo "experiments/lr_sweep.sh: --config-pattern needs {} (the kind), got '$pattern'" >&2; exit 2; }
[[ $steps =~ ^[1-9][0-9]*$ ]] || { echo "experiments/lr_sweep.sh: --steps needs a positive integer, got '$steps'" >&2; exit 2; }
[[ $lanes =~ ^[1-9][0-9]*$ ]] || { echo "experiments/lr_sweep.sh: --lanes needs a positive integer, got '$lanes'" >&2; exit 2; }
for lr in $lrs; do
    [[ $lr =~ ^[0-9.]+(e-?[0-9]+)?$ ]] || { echo "experiments/lr_sweep.sh: --lrs needs numbers like 2e-3, got '$lr'" >&2; exit 2; }
done
for kind in $kinds; do
    [[ -f ${pattern//\{\}/$kind} ]] || { echo "experiments/lr_sweep.sh: --kinds $kind: no config ${pattern//\{\}/$kind}" >&2; exit 2; }
done

failed=0
for seed in $seeds; do
    for lr in $lrs; do
        min_lr=$(awk -v lr="$lr" 'BEGIN { printf "%g", lr / 10 }')
        for kind in $kinds; do
            train_run "$kind lr $lr seed $seed" "$out/$kind-lr$lr-s$seed" "$steps" --config "${pattern//\{\}/$kind}" \
                --seed "$seed" --lr "$lr" --min-lr "$min_lr" "$@" &
            while (( $(jobs -rp | wc -l) >= lanes )); do wait -n || failed=1; done
        done
    done
done
while (( $(jobs -rp | wc -l) > 0 )); do wait -n || failed=1; done
(( failed == 0 )) || { echo "experiments/lr_sweep.sh: some runs failed (see above)" >&2; exit 1; }
"$py" -m megatron_lev.evaluation.lr_sweep --sweep-dir "$out" --steps "$steps" --output-dir "$out"
