#!/usr/bin/env bash
# The papers' two comparisons on one 2-core CPU machine, over several seeds (issues 17, 23):
#   v2 (iso-body):        LEV vs tied      (experiments/configs/exp-lev.yaml, exp-tied.yaml)
#   v1 (isoparametric):   LEV-deeper vs untied (exp-lev-deeper.yaml: the planner's depth for exp-untied)
#   the generator alone:  LEV vs untied (the same head), and exp-lev-init (both init options) beside LEV
# each kind at its own learning rate (the configs', tuned with --sweep), on Python's standard
# library (source, docstrings, pydoc topics) as Pile-format text, no download.
#
#   bash experiments/run.sh                          # everything into experiments/out (see README.md)
#   bash experiments/run.sh --seeds "1 2 3" --steps 400 --lanes 2 --out /tmp/exp
#   bash experiments/run.sh --train-only             # stop after training (the analysis re-runs later)
#   bash experiments/run.sh --models "tied lev"      # only these models, and the pairs among them
#   bash experiments/run.sh --sweep                  # the learning-rate sweep (seed 1; --sweep-lrs "1e-3 2e-3 4e-3")
#   bash experiments/run.sh --sweep --sweep-lrs 8e-3 --models "tied untied"   # one more point for two kinds
#
# Stages: corpus -> SentencePiece tokenizer -> indexed dataset -> 5 models x N seeds (one process
# each, --lanes at a time) -> per seed: megatron_lev.evaluate (both frequency stratifications) and
# training curves -> megatron_lev.evaluation.seeds (mean +- std over seeds, plots with error bars).
# Re-runnable: finished runs and stages whose output exists are reused; an interrupted run resumes.
# PYTHON (default <repo>/.venv/bin/python) is the interpreter.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}

out=$repo/experiments/out
seeds="1 2 3"
steps=1200
lanes=2
eval_tokens=65536
train_only=0
sweep=0
sweep_lrs="1e-3 2e-3 4e-3"
only_models=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --seeds) seeds=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --lanes) lanes=$2; shift 2 ;;
        --eval-tokens) eval_tokens=$2; shift 2 ;;
        --train-only) train_only=1; shift ;;
        --models) only_models=$2; shift 2 ;;
        --sweep) sweep=1; shift ;;
        --sweep-lrs) sweep_lrs=$2; shift 2 ;;
        -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "experiments/run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
[[ $steps =~ ^[1-9][0-9]*$ ]] || { echo "experiments/run.sh: --steps needs a positive integer, got '$steps'" >&2; exit 2; }
[[ $lanes =~ ^[1-9][0-9]*$ ]] || { echo "experiments/run.sh: --lanes needs a positive integer, got '$lanes'" >&2; exit 2; }
for s in $seeds; do
    [[ $s =~ ^[0-9]+$ ]] || { echo "experiments/run.sh: --seeds needs integers, got '$s'" >&2; exit 2; }
done

configs=$repo/experiments/configs
tokenizer=$out/tokenizer/spm.model
dataset=$out/data/stdlib_text_document
cache=$out/cache
split=95,5,0
models=(tied untied lev lev-init lev-deeper)
if [[ -n $only_models ]]; then
    for model in $only_models; do
        [[ " ${models[*]} " == *" $model "* ]] \
            || { echo "experiments/run.sh: --models: no model '$model' (one of: ${models[*]})" >&2; exit 2; }
    done
    read -r -a models <<< "$only_models"
fi
has_model() { [[ " ${models[*]} " == *" $1 "* ]]; }
# shellcheck source=experiments/lib.sh
source "$repo/experiments/lib.sh"
mkdir -p "$out/runs" "$out/eval"

# --- corpus (hashed document order: the contiguous valid split mixes code and prose), tokenizer, dataset
vocab=$("$py" -c 'import sys; from megatron_lev.configs import load_config
print(load_config(sys.argv[1])["model"]["vocab_size"])' "$configs/exp-lev.yaml")
prepare_data "$out" "$vocab"

# --- the learning-rate sweep (--sweep): tied, untied and lev (or --models) at each --sweep-lrs, seed 1,
# then the table of every run in $out/sweep, and stop.
# The configs carry each kind's best (lev-init and lev-deeper take lev's: the same generator).
common=(--data-path "$dataset" --split "$split" --data-cache-path "$cache"
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$tokenizer")
if [[ $sweep == 1 ]]; then
    kinds="tied untied lev"
    [[ -z $only_models ]] || kinds="${models[*]}"
    bash "$repo/experiments/lr_sweep.sh" --config-pattern "$configs/exp-{}.yaml" --kinds "$kinds" \
        --lrs "$sweep_lrs" --seeds 1 --steps "$steps" --lanes "$lanes" --out "$out/sweep" -- "${common[@]}"
    exit 0
fi

# --- training: every model x seed, one process each, $lanes at a time (seed by seed, so an
# interrupted experiment leaves whole seeds). A sweep run with the config's learning rate and
# the same seed and steps is the same command: it is linked, not trained again.
config_lr() {
    "$py" -c 'import sys; from megatron_lev.configs import load_config
print(load_config(sys.argv[1])["training"]["lr"])' "$configs/exp-$1.yaml"
}
train_one() {  # MODEL SEED
    local model=$1 seed=$2 run=$out/runs/$1-s$2 lr swept
    if [[ ! -e $run ]]; then
        lr=$(config_lr "$model")
        for swept in "$out/sweep/$model"-lr*-s"$seed"; do
            [[ $swept =~ -lr([0-9.e-]+)-s[0-9]+$ ]] || continue
            if awk -v a="${BASH_REMATCH[1]}" -v b="$lr" 'BEGIN { exit !(a == b) }' && finished "$swept" "$steps"; then
                ln -s "../sweep/${swept##*/}" "$run"
                banner "$model seed $seed: the sweep's run at lr $lr -> $run"
                break
            fi
        done
    fi
    train_run "$model seed $seed" "$run" "$steps" --config "$configs/exp-$model.yaml" --seed "$seed" "${common[@]}"
}
failed=0
for seed in $seeds; do
    for model in "${models[@]}"; do
        train_one "$model" "$seed" &
        while (( $(jobs -rp | wc -l) >= lanes )); do wait -n || failed=1; done
    done
done
while (( $(jobs -rp | wc -l) > 0 )); do wait -n || failed=1; done
wait || failed=1
(( failed == 0 )) || { echo "experiments/run.sh: some training runs failed (see above)" >&2; exit 1; }
if [[ $train_only == 1 ]]; then banner "training done (--train-only)"; exit 0; fi

# --- per seed: perplexity overall and by frequency (predicted and input token), training curves
for seed in $seeds; do
    eval_dir=$out/eval/s$seed
    if [[ ! -f $eval_dir/ppl/evaluation.json ]]; then
        banner "evaluate seed $seed -> $eval_dir/ppl"
        model_args=()
        for model in "${models[@]}"; do model_args+=(--model "$model=$out/runs/$model-s$seed"); done
        "$py" -m megatron_lev.evaluate "${model_args[@]}" --baseline "${models[0]}" \
            --data-path "$dataset" --split "$split" --eval-split valid --seed 1234 --eval-tokens "$eval_tokens" \
            --freq-dataset "$dataset" --buckets quantile:5 --buckets types:5 --buckets log:10 --output-dir "$eval_dir/ppl" --device cpu
    fi
    # Curves against each baseline: tokens to its final validation loss, and the loss difference's trend.
    for group in "tied:untied lev lev-init" "untied:lev lev-init lev-deeper"; do
        base=${group%%:*}
        has_model "$base" || continue
        if [[ ! -f $eval_dir/curves-vs-$base/curves.json ]]; then
            run_args=(--run "$base=$out/runs/$base-s$seed")
            for other in ${group#*:}; do
                has_model "$other" && run_args+=(--run "$other=$out/runs/$other-s$seed")
            done
            "$py" -m megatron_lev.evaluation.curves "${run_args[@]}" --baseline "$base" --output-dir "$eval_dir/curves-vs-$base"
        fi
    done
done

# --- over seeds: mean +- std of every change, plots with error bars
banner "seeds summary -> $out/eval/seeds"
seed_args=()
for seed in $seeds; do seed_args+=(--seed-dir "$seed=$out/eval/s$seed"); done
pair_args=()
for pair in lev:tied lev-init:tied lev:untied lev-init:untied lev-deeper:untied untied:tied lev-init:lev; do
    has_model "${pair%%:*}" && has_model "${pair##*:}" && pair_args+=(--pair "$pair")
done
"$py" -m megatron_lev.evaluation.seeds "${seed_args[@]}" "${pair_args[@]}" \
    --output-dir "$out/eval/seeds"
