#!/usr/bin/env bash
# The whole system on one CPU machine, in one command (about 10-15 minutes on 2 cores):
#   corpus (Python's own documentation, Pile format) -> SentencePiece tokenizer -> indexed dataset
#   -> a LEV model (TP=2) and its tied baseline (DP=2), 2 processes each under torchrun
#   -> step-0 vs final validation loss, perplexity by token frequency, training curves, plots
#   -> Hugging Face export of the LEV model -> text generated with plain transformers.
#
#   bash tools/quickstart.sh                         # everything into demo/
#   bash tools/quickstart.sh --input 'my/*.jsonl.zst' --out demo-mine
#
# Re-runnable: a stage whose output is already there (and newer than its inputs) is reused,
# a finished training run is kept, an interrupted one resumes from its last checkpoint.
# Environment: VENV (default <repo>/.venv, created by tools/setup_env.sh with the hf and
# plots extras); PYTHON=/path/to/python uses that interpreter as it is and installs nothing.
# The paths are assigned by an eval of `python -m megatron_lev.demo layout`, which shellcheck cannot see:
# shellcheck disable=SC2154
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
    cat <<EOF
usage: bash tools/quickstart.sh [--input PATH_OR_GLOB]... [--out DIR] [--steps N] [--quick] [--publish]

  --input P   your own Pile-format JSON lines ({"text": ...}; .jsonl/.json[.zst|.gz], files, globs or
              folders; repeatable). Default: a corpus of Python's own documentation (no download).
  --out DIR   where everything goes (default: $repo/demo). A folder built from other --input is refused.
  --steps N   training iterations of each model (default: the config's, demo-lev.yaml).
  --quick     a reduced run (500 documents, tiny-lev/tiny-tied, 30 steps): the test suite's mode.
  --publish   a maintainer's step: after the default run (no --input, --steps or --quick), train both
              models at 2 more seeds (5.6 more minutes in the last run), then copy the numbers, lev vs tied over the
              3 seeds and the plots into docs/ (demo_results.{json,md}, the README's figures) and list
              the figures README.md must then quote. Without it the demo writes only under --out.
EOF
}

out=$repo/demo
inputs=()
steps=""
quick=0
publish=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --input) [[ $# -ge 2 ]] || { echo "quickstart.sh: --input needs a value" >&2; exit 2; }
                 inputs+=("$2"); shift 2 ;;
        --out) [[ $# -ge 2 ]] || { echo "quickstart.sh: --out needs a value" >&2; exit 2; }
               out=$2; shift 2 ;;
        --steps) [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*$ ]] || { echo "quickstart.sh: --steps needs a positive integer" >&2; exit 2; }
                 steps=$2; shift 2 ;;
        --quick) quick=1; shift ;;
        --publish) publish=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "quickstart.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done

if [[ $publish == 1 && ( ${#inputs[@]} -gt 0 || -n $steps || $quick == 1 ) ]]; then
    echo "quickstart.sh: --publish publishes the default demo only: drop --input, --steps and --quick" >&2
    exit 2
fi

# Sizes. The full demo uses the demo-* configs; --quick the tiny-* ones the tests use.
if [[ $quick == 1 ]]; then
    lev_config=tiny-lev; tied_config=tiny-tied; max_documents=500
    default_steps=30; eval_interval=10; eval_iters=2; save_interval=10; log_interval=5; new_tokens=16
else
    lev_config=demo-lev; tied_config=demo-tied; max_documents=""
    default_steps=""; eval_interval=25; eval_iters=4; save_interval=50; log_interval=10; new_tokens=48
fi

now() { echo "$EPOCHREALTIME"; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
banner() { printf '\n=== %s\n' "$*"; }

# --- 1. environment
t=$(now)
if [[ -n ${PYTHON:-} ]]; then
    py=$PYTHON
    status=given
else
    banner "environment (tools/setup_env.sh; the first time installs torch and the package)"
    py=$(EXTRAS=hf,plots bash "$repo/tools/setup_env.sh" | tail -n 1)
    status=ready
fi
"$py" -c "import megatron_lev" 2>/dev/null \
    || { echo "quickstart.sh: $py cannot import megatron_lev (install the package, or unset PYTHON)" >&2; exit 1; }
mkdir -p "$out"
# Every path comes from megatron_lev/demo.py (the summary reads the same layout).
eval "$("$py" -m megatron_lev.demo layout --out "$out")"
: > "$timings"
record() { printf '%s\t%s\t%s\n' "$1" "$(elapsed "$2")" "$3" >> "$timings"; }
record environment "$t" "$status"

# The demo runs on CPU: gloo, one thread per process, DeepSpeed's CPU accelerator.
export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
# CPU processes keep and reuse freed memory (megatron_lev.distributed.launch.CPU_MALLOC_TUNABLES),
# unless the user set glibc's allocator variables.
if [[ -z ${GLIBC_TUNABLES:-} ]] && ! env | grep -q '^MALLOC_'; then
    export GLIBC_TUNABLES="glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.tcache_count=0"
fi
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}

# newer OUT IN...: OUT exists and is newer than every IN.
newer() {
    local target=$1 dep
    shift
    [[ -e $target ]] || return 1
    for dep in "$@"; do [[ $target -nt $dep ]] || return 1; done
}

# stage NAME DESCRIPTION OUTPUT INPUT... -- COMMAND...: run COMMAND unless OUTPUT is newer than every INPUT.
stage() {
    local name=$1 what=$2 output=$3 t inputs=()
    shift 3
    while [[ $1 != -- ]]; do inputs+=("$1"); shift; done
    shift
    t=$(now)
    if newer "$output" "${inputs[@]}"; then
        record "$name" "$t" reused
        return
    fi
    banner "$what"
    "$@"
    record "$name" "$t" ran
}

# --- 2. corpus
if [[ ${#inputs[@]} -eq 0 ]]; then
    source_spec="python documentation (pydoc topics, standard-library docstrings)${max_documents:+, $max_documents documents}"
    data_inputs=("$corpus")
else
    source_spec="${inputs[*]}"
    data_inputs=("${inputs[@]}")
fi
if [[ -f $inputs_file && "$(cat "$inputs_file")" != "$source_spec" ]]; then
    echo "quickstart.sh: $out was built from '$(cat "$inputs_file")', not '$source_spec':" \
        "pass another --out, or delete $out" >&2
    exit 2
fi
if [[ ${#inputs[@]} -gt 0 ]]; then  # a mistyped --input fails here, before anything is written
    "$py" -c 'import sys; from megatron_lev.data.corpus import expand_inputs
try:
    expand_inputs(sys.argv[1:])
except (OSError, ValueError) as exc:
    sys.exit(f"quickstart.sh: {exc}")' "${inputs[@]}"
fi
if [[ ! -f $inputs_file ]]; then
    # Fresh data: whatever an earlier, failed attempt left of the data stages came from other input.
    rm -f "$corpus" "$tokenizer" "${tokenizer%.model}.vocab" "$dataset.bin" "$dataset.idx"
    echo "$source_spec" > "$inputs_file"
fi
# Until the dataset exists, a failure leaves the folder reusable with other --input.
forget_inputs_unless_built() { [[ -f $dataset.idx ]] || rm -f "$inputs_file"; }
trap forget_inputs_unless_built EXIT
if [[ ${#inputs[@]} -eq 0 ]]; then
    stage corpus "corpus: Python's own documentation in Pile format -> $corpus" "$corpus" "$inputs_file" -- \
        "$py" -m megatron_lev.data.corpus "$corpus" ${max_documents:+--max-documents "$max_documents"}
fi

# --- 3. tokenizer (as large as the model's vocabulary), 4. indexed dataset
vocab=$("$py" -c 'import sys; from megatron_lev.configs import load_config
print(load_config(sys.argv[1])["model"]["vocab_size"])' "$lev_config")
stage tokenizer "tokenizer: SentencePiece BPE, $vocab tokens -> $tokenizer" "$tokenizer" "${data_inputs[@]}" -- \
    "$py" "$repo/tools/train_tokenizer.py" --input "${data_inputs[@]}" --output "$tokenizer" \
    --vocab-size "$vocab" --sample-documents 50000 --num-threads 2
stage preprocess "preprocess: tools/preprocess_data.py (2 workers) -> $dataset.{bin,idx}" "$dataset.idx" "$tokenizer" -- \
    "$py" "$repo/tools/preprocess_data.py" --input "${data_inputs[@]}" --output-prefix "${dataset%_text_document}" \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$tokenizer" --append-eod --workers 2

# --- 5. training, 2 processes each
if [[ -z $steps ]]; then
    steps=${default_steps:-$("$py" -c 'import sys; from megatron_lev.configs import load_config
print(load_config(sys.argv[1])["training"]["train_iters"])' "$lev_config")}
fi

finished() {  # the run's newest complete checkpoint is at iteration >= $steps
    local latest
    latest=$(cat "$1/latest" 2>/dev/null) || return 1
    [[ $latest =~ ^iter_0*([0-9]+)$ ]] && (( BASH_REMATCH[1] >= steps ))
}

train() {  # NAME CONFIG SAVE_DIR PARALLEL_FLAGS...: train, or resume an interrupted run (--load)
    local name=$1 config=$2 run=$3 t
    shift 3
    t=$(now)
    if finished "$run"; then
        record "train $name" "$t" reused
        return
    fi
    mkdir -p "$run"
    banner "train $name: $config, $steps steps, 2 processes ($*) -> $run (full log: $run/train.log)"
    local cmd=("$py" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 2
        -m megatron_lev.train --config "$config" "$@"
        --data-path "$dataset" --split "90,8,2" --data-cache-path "$data_cache"
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "$tokenizer"
        --train-iters "$steps" --save "$run" --load "$run" --save-interval "$save_interval"
        --keep-last-checkpoints 2 --eval-interval "$eval_interval" --eval-iters "$eval_iters"
        --log-interval "$log_interval")
    echo "${cmd[*]}" >> "$run/train.log"
    # The full output goes to train.log; the terminal gets the progress lines.
    if ! "${cmd[@]}" 2>&1 | tee -a "$run/train.log" \
            | { grep --line-buffered -E '\] iteration | (validation|test) loss at |resumed from|saved checkpoint|training done|^megatron_lev.train: error' || true; }; then
        echo "quickstart.sh: training $name failed; the end of $run/train.log:" >&2
        tail -n 40 "$run/train.log" >&2
        exit 1
    fi
    record "train $name" "$t" ran
}

train lev "$lev_config" "$run_lev" --tensor-model-parallel-size 2
train tied "$tied_config" "$run_tied" --zero-stage 1

# --- 6. evaluation
perplexity_report() {
    "$py" -m megatron_lev.evaluate --model tied="$run_tied" --model lev="$run_lev" --baseline tied \
        --eval-tokens "$("$py" -m megatron_lev.demo report-tokens --valid-loss "$valid_loss")" \
        --freq-dataset "$dataset" --output-dir "$eval_ppl"
}
stage "valid loss" "validation loss at step 0 and after training -> $valid_loss" \
    "$valid_loss" "$run_lev/latest" "$run_tied/latest" -- \
    "$py" -m megatron_lev.demo valid-loss --run lev="$run_lev" --run tied="$run_tied" --output "$valid_loss"
stage evaluate "perplexity overall and by token frequency (megatron_lev.evaluate) -> $eval_ppl" \
    "$eval_ppl/evaluation.json" "$valid_loss" -- perplexity_report
stage curves "training curves and tokens to the baseline's final loss -> $eval_curves" \
    "$eval_curves/curves.json" "$run_lev/metrics.jsonl" "$run_tied/metrics.jsonl" -- \
    "$py" -m megatron_lev.evaluation.curves --run tied="$run_tied" --run lev="$run_lev" --baseline tied \
    --output-dir "$eval_curves"

# --- 7. Hugging Face export and generation
export_lev() {
    rm -rf "$hf_lev"  # convert_to_hf.py writes only into a new (or empty) folder
    "$py" "$repo/tools/convert_to_hf.py" --load "$run_lev" --output "$hf_lev"
}
stage export "export the LEV model to Hugging Face (tools/convert_to_hf.py) -> $hf_lev" \
    "$hf_lev/config.json" "$run_lev/latest" -- export_lev
stage generate "generate with transformers (AutoModelForCausalLM, trust_remote_code) -> $generation" \
    "$generation" "$hf_lev/config.json" -- \
    "$py" -m megatron_lev.demo generate --hf "$hf_lev" --load "$run_lev" --max-new-tokens "$new_tokens" \
    --output "$generation"

banner "summary ($summary_md)"
"$py" -m megatron_lev.demo summary --out "$out"
# Publishing the README's figures is a deliberate step (--publish): a plain run leaves the
# repository as it was (everything above is under $out). It first trains both models at two more
# seeds (the runs above have the config's, 1234), so the README quotes lev vs tied over 3 seeds.
if [[ $publish == 1 ]]; then
    timings=$seed_timings  # not part of the demo's own wall time
    : > "$timings"
    for seed in 1 2; do
        train "lev seed $seed" "$lev_config" "$seed_runs/lev-s$seed" --tensor-model-parallel-size 2 --seed "$seed"
        train "tied seed $seed" "$tied_config" "$seed_runs/tied-s$seed" --zero-stage 1 --seed "$seed"
    done
    banner "lev vs tied over 3 seeds -> $seeds"
    "$py" -m megatron_lev.demo seeds --out "$out"
    banner "publish: docs/demo_results.{json,md} and the README's plots from $out"
    "$py" -m megatron_lev.demo publish --out "$out" --docs "$repo/docs" --readme "$repo/README.md"
fi
