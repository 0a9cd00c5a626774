#!/usr/bin/env bash
# Train the runs of a plan file, --lanes at a time, in the file's order (issue 32's experiments).
#
#   bash experiments/queue.sh --plan experiments/plans/issue32.plan --out experiments/out/issue32
#   bash experiments/queue.sh --plan ... --out ... --status      # each run: done / at iteration N / pending
#
# A plan line is   NAME STEPS CONFIG SEED [TRAIN FLAGS...]   ('#' starts a comment), e.g.
#   untied-w32-s1  1200  exp-untied-w32  1  --lr 2e-3 --min-lr 2e-4
# CONFIG is experiments/configs/CONFIG.yaml; its vocabulary picks the data: OUT/vVOCAB (corpus,
# SentencePiece BPE of that size, indexed dataset; prepare_data in lib.sh makes it when missing).
# A run is OUT/vVOCAB/runs/NAME: `python -m megatron_lev.train` with the flags every experiment
# run gets (lib.sh train_run: validation every 50 steps on 8 batches, a checkpoint every 400),
# the data, --seed SEED and the plan's flags. Its train.log starts with the commit and the command;
# it runs the package as committed there (code_snapshot), whatever happens to the checkout meanwhile.
# The plan is read again each time a lane frees, so lines appended meanwhile are picked up;
# finished runs are skipped and an interrupted one resumes from its checkpoint. A queue started
# again adopts the runs a stopped one left training (lib.sh train_run waits for them in a lane).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}
# shellcheck source=experiments/lib.sh
source "$repo/experiments/lib.sh"

plan="" out="" lanes=2 status=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --plan) plan=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --lanes) lanes=$2; shift 2 ;;
        --status) status=1; shift ;;
        -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "experiments/queue.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
[[ -n $plan && -n $out ]] || { echo "experiments/queue.sh: --plan and --out are required" >&2; exit 2; }
[[ -f $plan ]] || { echo "experiments/queue.sh: --plan $plan: no such file" >&2; exit 2; }
[[ $lanes =~ ^[1-9][0-9]*$ ]] || { echo "experiments/queue.sh: --lanes needs a positive integer, got '$lanes'" >&2; exit 2; }
plan=$(cd "$(dirname "$plan")" && pwd)/$(basename "$plan")
mkdir -p "$out"
out=$(cd "$out" && pwd)

declare -A vocab_of  # config -> vocabulary size
config_vocab() {
    local config=$repo/experiments/configs/$1.yaml
    if [[ -z ${vocab_of[$1]:-} ]]; then
        vocab_of[$1]=$("$py" -c 'import sys; from megatron_lev.configs import load_config
print(load_config(sys.argv[1])["model"]["vocab_size"])' "$config")
    fi
    echo "${vocab_of[$1]}"
}

# plan_lines: the plan's jobs, checked, one per line (comments and blank lines dropped).
plan_lines() {
    local n=0 line name steps config seed
    while IFS= read -r line || [[ -n $line ]]; do
        n=$((n + 1))
        line=${line%%#*}
        [[ $line =~ [^[:space:]] ]] || continue
        read -r name steps config seed _ <<< "$line"
        if [[ ! $name =~ ^[A-Za-z0-9._-]+$ || ! $steps =~ ^[1-9][0-9]*$ || ! $seed =~ ^[0-9]+$ \
              || ! -f $repo/experiments/configs/$config.yaml ]]; then
            echo "experiments/queue.sh: $plan line $n: want 'NAME STEPS CONFIG SEED [FLAGS]' with an existing" \
                "experiments/configs/CONFIG.yaml, got '$line'" >&2
            return 2
        fi
        echo "$line"
    done < "$plan"
}

run_dir() { echo "$out/v$(config_vocab "$2")/runs/$1"; }  # NAME CONFIG

if [[ $status == 1 ]]; then
    plan_lines | while read -r name steps config seed _; do
        run=$(run_dir "$name" "$config")
        if finished "$run" "$steps"; then state="done"
        elif [[ -f $run/metrics.jsonl ]]; then
            state="at iteration $(tail -n 1 "$run/metrics.jsonl" | sed -E 's/.*"iteration": ([0-9]+).*/\1/') of $steps"
        else state="pending"; fi
        printf '%-28s %s\n' "$name" "$state"
    done
    exit 0
fi

# The commit the code is at now (the queue reads a job's code when the job starts).
current_commit() {
    local commit
    commit=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)
    [[ -z $(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null) ]] || commit="$commit (with uncommitted changes)"
    echo "$commit"
}

# code_snapshot: OUT/code/COMMIT, the package as committed at COMMIT (git archive), made once. A job
# runs it (PYTHONPATH), not the checkout: Python imports some modules only when first needed (at the
# first checkpoint, say), so a checkout updated while a job runs could hand it a mix of two commits
# (that broke two runs on 4 December). Uncommitted changes never reach a job.
code_snapshot() {
    local commit snap
    commit=$(git -C "$repo" rev-parse HEAD)
    snap=$out/code/$commit
    if [[ ! -d $snap ]]; then
        mkdir -p "$snap.tmp.$$"
        git -C "$repo" archive "$commit" megatron_lev | tar -x -C "$snap.tmp.$$"
        mv "$snap.tmp.$$" "$snap" 2>/dev/null || rm -rf "$snap.tmp.$$"  # another lane made it first
    fi
    echo "$snap"
}

one_job() {  # NAME STEPS CONFIG SEED FLAGS...
    local name=$1 steps=$2 config=$3 seed=$4 vocab data run snap
    shift 4
    vocab=$(config_vocab "$config")
    data=$out/v$vocab
    run=$data/runs/$name
    mkdir -p "$run"
    snap=$(code_snapshot)
    echo "# experiments/queue.sh --plan $plan, line '$name', at commit $(current_commit), running the package" \
        "as committed there ($snap)" >> "$run/train.log"
    cd "$snap"  # python -m puts the working folder first on sys.path: the snapshot, not the checkout
    PYTHONPATH=$snap${PYTHONPATH:+:$PYTHONPATH} \
    train_run "$name" "$run" "$steps" --config "$repo/experiments/configs/$config.yaml" --seed "$seed" \
        --data-path "$data/data/stdlib_text_document" --split 95,5,0 --data-cache-path "$data/cache" \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "$data/tokenizer/spm.model" "$@"
}

declare -A started  # run folders this queue has started
failed=0
banner "queue: $plan -> $out, $lanes lanes, commit $(current_commit)"
while true; do
    while (( $(jobs -rp | wc -l) < lanes )); do
        next=""
        while read -r name steps config seed flags; do
            run=$(run_dir "$name" "$config")
            [[ -z ${started[$run]:-} ]] || continue
            finished "$run" "$steps" && continue
            next="$name $steps $config $seed $flags"
            break
        done < <(plan_lines)
        [[ -n $next ]] || break
        read -r name steps config seed flags <<< "$next"
        started[$(run_dir "$name" "$config")]=1
        prepare_data "$out/v$(config_vocab "$config")" "$(config_vocab "$config")"
        # shellcheck disable=SC2086  # the plan's flags are words
        one_job "$name" "$steps" "$config" "$seed" $flags &
    done
    (( $(jobs -rp | wc -l) > 0 )) || break
    wait -n || failed=1
done
banner "queue done"
(( failed == 0 )) || { echo "experiments/queue.sh: some runs failed (see above)" >&2; exit 1; }
