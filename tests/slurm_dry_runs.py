"""The Slurm scripts' dry runs (and refusals) over many combinations of variables, recorded once
from the bash launcher (slurm/common.sh at main ec52b9f, before the launch logic moved to
megatron_lev/launcher/) in tests/data/slurm_dry_runs.json. tests/test_launcher.py runs every case
again and requires the very same stdout, stderr and exit status: what a user sees did not change.

Paths that differ between machines are written as {REPO} (the repository) and {TMP} (the case's
temporary folder), and the launcher's `[slurm YYYY-MM-DD HH:MM:SS]` stamps as `[slurm TIME]`.

    python -m tests.slurm_dry_runs --record   # re-record (only where a change of output is meant)
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.test_slurm import REPO, SLURM, script_env

GOLDEN = Path(__file__).resolve().parent / "data" / "slurm_dry_runs.json"

# Every case: the script, then its variables over the fake inputs' (None: unset). "{TMP}" in a value
# is the case's folder. The fake inputs: a 2-prefix blend, a tokenizer, a checkpoint folder with a space.
TRAIN = "train_lev_1b.sh"
IN_JOB = dict(SLURM_JOB_ID=123456, SLURM_JOB_NUM_NODES=4, SLURM_JOB_NODELIST="gpu[07-09,12]",
              SLURM_JOB_NAME="lev-1.2b", SLURM_CPUS_ON_NODE=96)
CASES: dict[str, tuple[str, dict]] = {
    "defaults": (TRAIN, {}),
    "a100_4_nodes": (TRAIN, {"NODES": 4, "GPU_TYPE": "a100"}),
    "h200_2_nodes_tp2": (TRAIN, {"NODES": 2, "GPU_TYPE": "h200", "TP": 2}),
    "pp2_zero1": (TRAIN, {"NODES": 3, "TP": 2, "PP": 2, "GLOBAL_BATCH": 48, "MICRO_BATCH": 2}),
    "h100_8_nodes_seq2048": (TRAIN, {"NODES": 8, "SEQ_LENGTH": 2048, "TRAIN_ITERS": 20000}),
    "in_allocation": (TRAIN, {**IN_JOB, "GPU_TYPE": "a100", "TP": 2, "PP": 2, "GLOBAL_BATCH": 512,
                              "SEQ_LENGTH": 2048, "TRAIN_TOKENS": "2.4e10",
                              "EXTRA_ARGS": "--lr 3e-4 --eval-interval 500"}),
    "requeued_in_allocation": (TRAIN, {**IN_JOB, "SLURM_RESTART_COUNT": 3, "SLURM_GPUS_ON_NODE": 8}),
    "tied_valid_test": ("train_tied_1b.sh", {"NODES": 2, "VALID_DATA_PATH": "{TMP}/pile_01_text_document",
                                             "TEST_DATA_PATH": "{TMP}/pile_00_text_document", "BF16": 0,
                                             "EXIT_INTERVAL": 50, "TRAIN_ITERS": 1000}),
    "megatron_names": (TRAIN, {"CHECKPOINT_DIR": None, "CHECKPOINT_PATH": "/scratch/run 1", "GLOBAL_BATCH_SIZE": 64,
                               "MICRO_BATCH_SIZE": 2, "TENSORBOARD_LOGS_PATH": "/scratch/tb", "COMPILE_LAYERS": 0,
                               "SLURM_GPUS_PER_NODE": "a100:4"}),
    "extra_args_batch_flags": (TRAIN, {"CHECKPOINT_DIR": None, "GPUS_PER_NODE": 4, "BF16": 0, "EXTRA_ARGS": (
        "--micro-batch-size 2 --lr 3e-4 --global-batch-size=16 --tensor-model-parallel-size 2 --no-bf16 "
        "--save /scratch/run")}),
    "extra_args_warning": (TRAIN, {"EXTRA_ARGS": "--use-flash-attn --lr 1e-4 --weight-decay 0.05"}),
    "gpt2_bpe": (TRAIN, {"TOKENIZER_MODEL": None, "TOKENIZER_TYPE": "GPT2BPETokenizer",
                         "VOCAB_FILE": "{TMP}/gpt2-vocab.json", "MERGE_FILE": "{TMP}/gpt2-merges.txt"}),
    "older_torch": (TRAIN, {"PYTHONPATH": "{TMP}/torch_2_8"}),
    "torch_2_9": (TRAIN, {"PYTHONPATH": "{TMP}/torch_2_9", "NODES": 2}),
    "site_env_and_overrides": (TRAIN, {"SITE_ENV": "{TMP}/site_env.sh", "NCCL_DEBUG": "INFO",
                                       "CUDA_DEVICE_MAX_CONNECTIONS": 8, "MASTER_ADDR": "10.0.0.1",
                                       "MASTER_PORT": 29500, "SHUTDOWN_TIMEOUT": 100, "SAVE_INTERVAL": 250,
                                       "LOG_INTERVAL": 1, "TENSORBOARD_DIR": "/scratch/tb run",
                                       "DEEPSPEED_CONFIG": "{REPO}/deepspeed_configs/zero1.json",
                                       "LOG_ROOT": "/scratch/logs", "MAX_REQUEUES": 5}),
    "cpu_smoke": (TRAIN, {"CONFIG": "tiny-lev", "GPUS_PER_NODE": 2, "BF16": 0, "COMPILE_LAYERS": 0,
                          "MICRO_BATCH": 2, "GLOBAL_BATCH": 4, "TRAIN_ITERS": 60, "SAVE_INTERVAL": 5,
                          "LOG_INTERVAL": 1, "EXTRA_ARGS": "--split 90,8,2 --eval-interval 100000 --eval-iters 1"}),
    "config_path_no_global_batch": (TRAIN, {"CONFIG": "{TMP}/nobatch.yaml", "NODES": 2, "GPU_TYPE": "a100"}),
    "config_no_global_batch_seq": (TRAIN, {"CONFIG": "{TMP}/nobatch.yaml", "NODES": 2, "SEQ_LENGTH": 128}),
    # Refusals: one line on stderr, exit 1.
    "refused_nodes_3": (TRAIN, {"NODES": 3}),
    "refused_nodes_3_tp2": (TRAIN, {"NODES": 3, "TP": 2}),
    "refused_micro_batch": (TRAIN, {"NODES": 4, "MICRO_BATCH": 3}),
    "refused_tp3": (TRAIN, {"TP": 3}),
    "refused_gpu_type": (TRAIN, {"GPU_TYPE": "v100"}),
    "refused_config": (TRAIN, {"CONFIG": "lev-9b"}),
    "refused_typo": (TRAIN, {"EXTRA_ARGS": "--lr 3e-4 --lr-warmup-iter 100"}),
    "refused_conflict": (TRAIN, {"MICRO_BATCH_SIZE": 4, "EXTRA_ARGS": "--lr 3e-4 --micro-batch-size 2"}),
    "refused_switch": (TRAIN, {"BF16": 0, "EXTRA_ARGS": "--bf16"}),
    "refused_data_flag": (TRAIN, {"EXTRA_ARGS": "--valid-data-path {TMP}/pile_00_text_document"}),
    "refused_missing_prefix": (TRAIN, {"DATA_PATH": "0.5 {TMP}/pile_00_text_document 0.5 /nonexistent/pile_07"}),
    "refused_gpus_per_node": (TRAIN, {"GPUS_PER_NODE": 8, "SLURM_GPUS_ON_NODE": 4, "SLURM_JOB_ID": 7}),
    "refused_nodes_vs_allocation": (TRAIN, {"NODES": 2, "SLURM_JOB_NUM_NODES": 4, "SLURM_JOB_ID": 7,
                                            "SLURM_JOB_NODELIST": "n[1-4]"}),
    "refused_not_in_job": (TRAIN, {"DRY_RUN": None}),
    "refused_both_lengths": (TRAIN, {"TRAIN_ITERS": 10, "TRAIN_TOKENS": 1000}),
    "refused_bf16_value": (TRAIN, {"BF16": "yes"}),
    "refused_save_interval": (TRAIN, {"SAVE_INTERVAL": 0}),
    "refused_no_tokenizer": (TRAIN, {"TOKENIZER_MODEL": None}),
    "refused_deepspeed_config": (TRAIN, {"DEEPSPEED_CONFIG": "/nonexistent/zero9.json"}),
    # The preprocessing array.
    "pile_all_tasks": ("preprocess_pile.sh", {"PILE": 1}),
    "pile_task_7": ("preprocess_pile.sh", {"PILE": 1, "SLURM_ARRAY_TASK_ID": 7, "SLURM_CPUS_PER_TASK": 48,
                                           "EXTRA_ARGS": "--split-by-key meta.pile_set_name"}),
    "pile_task_30_gpt2": ("preprocess_pile.sh", {"PILE": 1, "SLURM_ARRAY_TASK_ID": 30, "WORKERS": 4,
                                                 "TOKENIZER_MODEL": None, "TOKENIZER_TYPE": "GPT2BPETokenizer",
                                                 "VOCAB_FILE": "{TMP}/gpt2-vocab.json",
                                                 "MERGE_FILE": "{TMP}/gpt2-merges.txt"}),
    "pile_task_done": ("preprocess_pile.sh", {"PILE": 1, "SLURM_ARRAY_TASK_ID": 3, "DONE": 3}),
    "pile_task_done_forced": ("preprocess_pile.sh", {"PILE": 1, "SLURM_ARRAY_TASK_ID": 3, "DONE": 3, "FORCE": 1}),
    "pile_refused_missing_input": ("preprocess_pile.sh", {"PILE": 1, "SLURM_ARRAY_TASK_ID": 31, "MISSING": 31}),
    "pile_refused_task": ("preprocess_pile.sh", {"PILE": 1, "SLURM_ARRAY_TASK_ID": 40}),
    "pile_refused_no_task": ("preprocess_pile.sh", {"PILE": 1, "DRY_RUN": None}),
    "pile_refused_workers": ("preprocess_pile.sh", {"PILE": 1, "SLURM_ARRAY_TASK_ID": 0, "WORKERS": 0}),
    "pile_refused_no_output": ("preprocess_pile.sh", {"PILE": 1, "OUTPUT_DIR": None}),
}

_STAMP = re.compile(r"\[slurm \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]")


def _fake_torch(root: Path, *flags: str) -> None:
    """A `torch` package whose torchrun source mentions only `flags` (an older release)."""
    run_py = root / "torch" / "distributed" / "run.py"
    run_py.parent.mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text("")
    run_py.write_text("".join(f'parser.add_argument("{f}")\n' for f in flags))


def _inputs(tmp: Path) -> dict:
    """The files the cases name, and the variables every training case starts from."""
    for name in ("pile_00_text_document", "pile_01_text_document"):
        for suffix in (".bin", ".idx"):
            (tmp / (name + suffix)).touch()
    for name in ("tokenizer.model", "gpt2-vocab.json", "gpt2-merges.txt"):
        (tmp / name).touch()
    _fake_torch(tmp / "torch_2_8")
    _fake_torch(tmp / "torch_2_9", "--signals-to-handle")
    (tmp / "site_env.sh").write_text("export DS_ACCELERATOR=cpu\nexport NCCL_SOCKET_IFNAME=ib0\n")
    # tiny-tied without a global batch (nor a sequence length): micro-batch x DP, --seq-length required.
    (tmp / "nobatch.yaml").write_text("base: tiny-tied\ntraining:\n  global_batch_size: null\n  seq_length: null\n")
    return {"DATA_PATH": f"0.25 {tmp}/pile_00_text_document 0.75 {tmp}/pile_01_text_document",
            "TOKENIZER_MODEL": f"{tmp}/tokenizer.model", "CHECKPOINT_DIR": f"{tmp}/check points",
            "LOG_ROOT": f"{tmp}/logs", "DRY_RUN": "1"}


def _pile(tmp: Path, variables: dict) -> dict:
    pile, out = tmp / "pile", tmp / "tok"
    (pile / "train").mkdir(parents=True)
    missing = variables.pop("MISSING", None)
    for task in range(32):
        path = pile / "train" / f"{task:02d}.jsonl.zst" if task < 30 else pile / ("val.jsonl.zst" if task == 30
                                                                                   else "test.jsonl.zst")
        if task != missing:
            path.touch()
    done = variables.pop("DONE", None)
    if done is not None:
        (out / "train").mkdir(parents=True)
        (out / "train" / f"pile_{done:02d}_text_document.idx").touch()
    return {"PILE_DIR": str(pile), "OUTPUT_DIR": str(out), "TOKENIZER_MODEL": f"{tmp}/tokenizer.model",
            "DRY_RUN": "1"}


def run_case(name: str) -> dict:
    """Run one case in a fresh folder: {"rc", "stdout", "stderr"}, paths and stamps normalised."""
    script, variables = CASES[name]
    variables = dict(variables)
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        base = _inputs(tmp)
        if variables.pop("PILE", None):
            base = _pile(tmp, variables)
        for key, value in variables.items():
            if value is None:
                base.pop(key, None)
            else:
                base[key] = str(value).replace("{TMP}", str(tmp)).replace("{REPO}", str(REPO))
        env = script_env(**base)
        if "PYTHONPATH" not in variables:  # the dry run shows it: only the repository, as recorded
            env.pop("PYTHONPATH", None)
        proc = subprocess.run(["bash", str(SLURM / script)], env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=300)

        def normal(text: str) -> str:
            return _STAMP.sub("[slurm TIME]", text.replace(str(tmp), "{TMP}").replace(str(REPO), "{REPO}"))

        return {"rc": proc.returncode, "stdout": normal(proc.stdout), "stderr": normal(proc.stderr)}


def load_golden() -> dict:
    return json.loads(GOLDEN.read_text())


def expected(name: str, golden: dict) -> dict:
    """The recorded output with what issue 43 changes in it on purpose: the trainers keep the newest
    3 checkpoints (KEEP_CHECKPOINTS, item 2: `--keep-last-checkpoints 3` after `--save-interval`), and
    the dry run has a line on restarts inside the allocation (item 3). (Its `# Disk:` line, which
    says how much is free on this machine, is checked on its own: `without_disk_line`.)"""
    result = dict(golden[name])
    script, variables = CASES[name]
    if not script.startswith("train_") or result["rc"] != 0:
        return result
    interval = variables.get("SAVE_INTERVAL", 1000)
    result["stdout"] = result["stdout"].replace(f" --save-interval {interval} ",
                                                f" --save-interval {interval} --keep-last-checkpoints 3 ")
    lines = result["stdout"].splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("# Decoder layers compiled")) + 1
    lines.insert(at, "# Restarts: a failed step restarts in the allocation from the latest checkpoint, up to "
                     f"MAX_RESTARTS=3 times; then the job requeues if it made progress "
                     f"(MAX_REQUEUES={variables.get('MAX_REQUEUES', 50)})\n")
    result["stdout"] = "".join(lines)
    return result


def record(names=None) -> None:
    golden = load_golden() if GOLDEN.exists() else {}
    for name in names or CASES:
        golden[name] = run_case(name)
        print(f"{name}: rc {golden[name]['rc']}", file=sys.stderr)
    GOLDEN.write_text(json.dumps({k: golden[k] for k in CASES if k in golden}, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--record"]:
        sys.exit(__doc__)
    record(sys.argv[2:])


def without_disk_line(result: dict) -> dict:
    """A dry run's result less its `# Disk:` line (checkpoint size, disk needed, free space now)."""
    lines = result["stdout"].splitlines(keepends=True)
    return {**result, "stdout": "".join(line for line in lines if not line.startswith("# Disk: "))}
