#!/usr/bin/env bash
# Evaluate finished runs of experiments/queue.sh and keep what the analyses read in a folder
# small enough to commit (issue 32: results land in main as each experiment finishes).
#
#   bash experiments/collect.sh runs  --out OUT --results DIR [--vocab 8000] [--eval-tokens 65536] [GLOB...]
#   bash experiments/collect.sh group --out OUT --results DIR --vocab 32000 --name s1 NAME=RUN [NAME=RUN...]
#
# runs:  every finished run OUT/vVOCAB/runs/RUN (matching a GLOB, default all) gets
#        `python -m megatron_lev.evaluate` alone on the first --eval-tokens validation tokens (the
#        experiment's evaluator: split 95,5,0, seed 1234) -> DIR/vVOCAB/runs/RUN/evaluation.json,
#        beside copies of its metrics.jsonl and train.log. Evaluated runs are skipped.
# group: the runs, scored together on the whole validation split, by training-count bins of the
#        train split and with every position's NLL (--save-token-nll) -> DIR/vVOCAB/eval/NAME/
#        (megatron_lev.evaluation.bins reads it). token_nll.npz is not committed (.gitignore: the
#        working tree travels to the GPU machine in 64 MiB); the bins' outputs are.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}
# shellcheck source=experiments/lib.sh
source "$repo/experiments/lib.sh"

mode=${1:-}
[[ $mode == runs || $mode == group ]] || { echo "experiments/collect.sh: first argument 'runs' or 'group' (see --help)" >&2
                                           [[ $mode == -h || $mode == --help ]] && sed -n '2,15p' "${BASH_SOURCE[0]}"; exit 2; }
shift
out="" results="" vocab=8000 eval_tokens=65536 name=""
args=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --results) results=$2; shift 2 ;;
        --vocab) vocab=$2; shift 2 ;;
        --eval-tokens) eval_tokens=$2; shift 2 ;;
        --name) name=$2; shift 2 ;;
        -*) echo "experiments/collect.sh: unknown argument '$1'" >&2; exit 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
[[ -n $out && -n $results ]] || { echo "experiments/collect.sh: --out and --results are required" >&2; exit 2; }
data=$out/v$vocab
[[ -f $data/data/stdlib_text_document.idx ]] || { echo "experiments/collect.sh: no dataset in $data (--out, --vocab)" >&2; exit 2; }
common=(--data-path "$data/data/stdlib_text_document" --split "95,5,0" --eval-split valid --seed 1234 --device cpu
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "$data/tokenizer/spm.model"
        --data-cache-path "$data/cache")

if [[ $mode == runs ]]; then
    (( ${#args[@]} )) || args=("*")
    for run in "$data"/runs/*; do
        run_name=${run##*/}
        matched=0
        for pattern in "${args[@]}"; do
            # shellcheck disable=SC2053  # a glob on purpose
            [[ $run_name == $pattern ]] && matched=1
        done
        (( matched )) || continue
        steps=$(awk '/--train-iters/ { for (i = 1; i < NF; i++) if ($i == "--train-iters") print $(i + 1) }' \
            "$run/train.log" | tail -n 1)
        finished "$run" "${steps:-999999999}" || continue
        dest=$results/v$vocab/runs/$run_name
        if [[ ! -f $dest/evaluation.json ]]; then
            banner "evaluate $run_name -> $dest"
            "$py" -m megatron_lev.evaluate --model "$run_name=$run" "${common[@]}" --eval-tokens "$eval_tokens" \
                --output-dir "$dest" > /dev/null
        fi
        cp "$run/metrics.jsonl" "$run/train.log" "$dest/"
    done
else
    [[ -n $name ]] || { echo "experiments/collect.sh group: --name is required" >&2; exit 2; }
    (( ${#args[@]} )) || { echo "experiments/collect.sh group: give NAME=RUN for each model" >&2; exit 2; }
    model_args=()
    for spec in "${args[@]}"; do
        [[ $spec == *=* && -d $data/runs/${spec#*=} ]] \
            || { echo "experiments/collect.sh group: '$spec': want NAME=RUN with a run in $data/runs" >&2; exit 2; }
        model_args+=(--model "${spec%%=*}=$data/runs/${spec#*=}")
    done
    banner "evaluate ${args[*]} together -> $results/v$vocab/eval/$name"
    "$py" -m megatron_lev.evaluate "${model_args[@]}" "${common[@]}" --freq-dataset "$data/data/stdlib_text_document" \
        --buckets log:10 --save-token-nll --output-dir "$results/v$vocab/eval/$name" > /dev/null
fi
