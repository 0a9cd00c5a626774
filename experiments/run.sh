#!/usr/bin/env bash
# The papers' two comparisons on one 2-core CPU machine, over several seeds (issue 17):
#   v2 (iso-body):        LEV vs tied      (experiments/configs/exp-lev.yaml, exp-tied.yaml)
#   v1 (isoparametric):   LEV-deeper vs untied (exp-lev-deeper.yaml: the planner's depth for exp-untied)
# on Python's standard library (source, docstrings, pydoc topics) as Pile-format text, no download.
#
#   bash experiments/run.sh                          # everything into experiments/out (see README.md)
#   bash experiments/run.sh --seeds "1 2 3" --steps 400 --lanes 2 --out /tmp/exp
#   bash experiments/run.sh --train-only             # stop after training (the analysis re-runs later)
#
# Stages: corpus -> SentencePiece tokenizer -> indexed dataset -> 4 models x N seeds (one process
# each, --lanes at a time) -> per seed: megatron_lev.evaluate (both frequency stratifications) and
# training curves -> megatron_lev.evaluation.seeds (mean +- std over seeds, plots with error bars).
# Re-runnable: finished runs and stages whose output exists are reused; an interrupted run resumes.
# PYTHON (default <repo>/.venv/bin/python) is the interpreter.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}

out=$repo/experiments/out
seeds="1 2 3"
steps=200
lanes=2
eval_tokens=65536
train_only=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --seeds) seeds=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --lanes) lanes=$2; shift 2 ;;
        --eval-tokens) eval_tokens=$2; shift 2 ;;
        --train-only) train_only=1; shift ;;
        -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "experiments/run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
[[ $steps =~ ^[1-9][0-9]*$ ]] || { echo "experiments/run.sh: --steps needs a positive integer, got '$steps'" >&2; exit 2; }
[[ $lanes =~ ^[1-9][0-9]*$ ]] || { echo "experiments/run.sh: --lanes needs a positive integer, got '$lanes'" >&2; exit 2; }
for s in $seeds; do
    [[ $s =~ ^[0-9]+$ ]] || { echo "experiments/run.sh: --seeds needs integers, got '$s'" >&2; exit 2; }
done

configs=$repo/experiments/configs
corpus=$out/data/stdlib.jsonl.zst
tokenizer=$out/tokenizer/spm.model
dataset=$out/data/stdlib_text_document
cache=$out/cache
split=95,5,0
models=(tied lev untied lev-deeper)
export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
mkdir -p "$out/data" "$out/tokenizer" "$out/runs" "$out/eval"
banner() { printf '\n=== %s  (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

# --- corpus (hashed document order: the contiguous valid split mixes code and prose), tokenizer, dataset
if [[ ! -f $corpus ]]; then
    banner "corpus: Python's standard library (source, docstrings, pydoc topics) -> $corpus"
    "$py" -m megatron_lev.data.corpus "$corpus" --sources pydoc_topics stdlib_docstrings stdlib_source --order hashed
fi
vocab=$("$py" -c 'import sys; from megatron_lev.configs import load_config
print(load_config(sys.argv[1])["model"]["vocab_size"])' "$configs/exp-lev.yaml")
if [[ ! -f $tokenizer ]]; then
    banner "tokenizer: SentencePiece BPE, $vocab tokens -> $tokenizer"
    "$py" "$repo/tools/train_tokenizer.py" --input "$corpus" --output "$tokenizer" --vocab-size "$vocab" \
        --sample-documents 50000 --num-threads 2
fi
if [[ ! -f $dataset.idx ]]; then
    banner "preprocess -> $dataset.{bin,idx}"
    "$py" "$repo/tools/preprocess_data.py" --input "$corpus" --output-prefix "${dataset%_text_document}" \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "$tokenizer" --append-eod --workers 2
fi

# --- training: every model x seed, one process each, $lanes at a time (seed by seed, so an
# interrupted experiment leaves whole seeds)
finished() {
    local latest
    latest=$(cat "$1/latest" 2>/dev/null) || return 1
    [[ $latest =~ ^iter_0*([0-9]+)$ ]] && (( BASH_REMATCH[1] >= steps ))
}
train_one() {  # MODEL SEED
    local model=$1 seed=$2 run=$out/runs/$1-s$2
    finished "$run" && return 0
    mkdir -p "$run"
    # Another instance of this script (another --seeds, more lanes) may be training this run:
    # its trainer's pid is in .train.pid; skip the run while that process lives.
    local owner
    owner=$(cat "$run/.train.pid" 2>/dev/null || true)
    if [[ -n $owner ]] && kill -0 "$owner" 2>/dev/null; then
        banner "skip $model seed $seed: being trained by process $owner"
        return 0
    fi
    local cmd=("$py" -m megatron_lev.train --config "$configs/exp-$model.yaml" --seed "$seed"
        --data-path "$dataset" --split "$split" --data-cache-path "$cache"
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "$tokenizer"
        --train-iters "$steps" --save "$run" --load "$run" --save-interval 100 --keep-last-checkpoints 1
        --eval-interval 20 --eval-iters 4 --log-interval 20)
    echo "${cmd[*]}" >> "$run/train.log"
    banner "train $model seed $seed -> $run"
    "${cmd[@]}" >> "$run/train.log" 2>&1 &
    local trainer=$!
    echo "$trainer" > "$run/.train.pid"
    if ! wait "$trainer"; then
        echo "experiments/run.sh: training $model seed $seed failed; the end of $run/train.log:" >&2
        tail -n 20 "$run/train.log" >&2
        return 1
    fi
    banner "done $model seed $seed: $(grep -h 'training done' "$run/train.log" | tail -n 1)"
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
        "$py" -m megatron_lev.evaluate "${model_args[@]}" --baseline tied \
            --data-path "$dataset" --split "$split" --eval-split valid --seed 1234 --eval-tokens "$eval_tokens" \
            --freq-dataset "$dataset" --buckets quantile:5 --buckets types:5 --buckets log:10 --output-dir "$eval_dir/ppl" --device cpu
    fi
    for pair in tied:lev untied:lev-deeper; do
        base=${pair%%:*} other=${pair##*:}
        if [[ ! -f $eval_dir/curves-$other/curves.json ]]; then
            "$py" -m megatron_lev.evaluation.curves --run "$base=$out/runs/$base-s$seed" \
                --run "$other=$out/runs/$other-s$seed" --baseline "$base" --output-dir "$eval_dir/curves-$other"
        fi
    done
done

# --- over seeds: mean +- std of every change, plots with error bars
banner "seeds summary -> $out/eval/seeds"
seed_args=()
for seed in $seeds; do seed_args+=(--seed-dir "$seed=$out/eval/s$seed"); done
"$py" -m megatron_lev.evaluation.seeds "${seed_args[@]}" --pair lev:tied --pair lev-deeper:untied --pair untied:tied \
    --output-dir "$out/eval/seeds"
