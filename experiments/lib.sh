# shellcheck shell=bash
# Shared by experiments/run.sh, lr_sweep.sh and queue.sh (sourced): prepare the data, train one
# run in one process, resumably, and tell whether it finished. The caller sets py (the
# interpreter) and repo.

banner() { printf '\n=== %s  (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

# finished RUN STEPS: RUN's newest complete checkpoint is at iteration >= STEPS.
finished() {
    local latest
    latest=$(cat "$1/latest" 2>/dev/null) || return 1
    [[ $latest =~ ^iter_0*([0-9]+)$ ]] && (( BASH_REMATCH[1] >= $2 ))
}

# train_run NAME RUN STEPS TRAIN_ARGS...: `python -m megatron_lev.train TRAIN_ARGS --train-iters
# STEPS --save RUN --load RUN` into RUN/train.log, unless RUN finished (an interrupted run resumes).
# Validation every 50 steps on 8 batches, a checkpoint every 400 (the last one kept).
train_run() {
    local name=$1 run=$2 steps=$3
    shift 3
    finished "$run" "$steps" && return 0
    mkdir -p "$run"
    # Another instance of the script (or an earlier one, stopped and started again) may be
    # training this run: its trainer's pid is in .train.pid. Wait for that process, holding this
    # lane, then go on from its checkpoint unless it finished.
    local owner
    owner=$(cat "$run/.train.pid" 2>/dev/null || true)
    if [[ -n $owner ]] && kill -0 "$owner" 2>/dev/null; then
        banner "$name: being trained by process $owner; waiting for it"
        while kill -0 "$owner" 2>/dev/null; do sleep 20; done
        finished "$run" "$steps" && return 0
    fi
    local cmd=("$py" -m megatron_lev.train "$@"
        --train-iters "$steps" --save "$run" --load "$run" --save-interval 400 --keep-last-checkpoints 1
        --eval-interval 50 --eval-iters 8 --log-interval 50)
    echo "${cmd[*]}" >> "$run/train.log"
    banner "train $name -> $run"
    "${cmd[@]}" >> "$run/train.log" 2>&1 &
    local trainer=$!
    echo "$trainer" > "$run/.train.pid"
    if ! wait "$trainer"; then
        echo "${BASH_SOURCE[1]##*/}: training $name failed; the end of $run/train.log:" >&2
        tail -n 20 "$run/train.log" >&2
        return 1
    fi
    banner "done $name: $(grep -h 'training done' "$run/train.log" | tail -n 1)"
}

# prepare_data OUT VOCAB: the experiment's data in OUT, unless there: Python's standard library as
# Pile-format text (hashed document order, so the contiguous valid split mixes code and prose)
# -> OUT/data/stdlib.jsonl.zst, a SentencePiece BPE of VOCAB entries -> OUT/tokenizer/spm.model,
# the indexed dataset -> OUT/data/stdlib_text_document.{bin,idx}. Only the vocabulary differs
# between two OUTs: the corpus is the same documents in the same order.
prepare_data() {
    local out=$1 vocab=$2
    local corpus=$1/data/stdlib.jsonl.zst tokenizer=$1/tokenizer/spm.model dataset=$1/data/stdlib_text_document
    mkdir -p "$out/data" "$out/tokenizer"
    if [[ ! -f $corpus ]]; then
        banner "corpus: Python's standard library (source, docstrings, pydoc topics) -> $corpus"
        "$py" -m megatron_lev.data.corpus "$corpus" --sources pydoc_topics stdlib_docstrings stdlib_source --order hashed
    fi
    if [[ ! -f $tokenizer ]]; then
        banner "tokenizer: SentencePiece BPE, $vocab tokens -> $tokenizer"
        "$py" "${repo:?}/tools/train_tokenizer.py" --input "$corpus" --output "$tokenizer" --vocab-size "$vocab" \
            --sample-documents 50000 --num-threads 2
    fi
    if [[ ! -f $dataset.idx ]]; then
        banner "preprocess -> $dataset.{bin,idx}"
        "$py" "$repo/tools/preprocess_data.py" --input "$corpus" --output-prefix "${dataset%_text_document}" \
            --tokenizer-type SentencePieceTokenizer --tokenizer-model "$tokenizer" --append-eod --workers 2
    fi
}

# The runs are on CPU, one thread per process.
export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
