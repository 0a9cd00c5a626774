"""The Slurm scripts in slurm/: lint, dry runs and batch arithmetic, clear failures, and the
blend helper. tests/test_slurm_jobs.py runs the scripts for real through the shims."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "slurm"
SHIMS = Path(__file__).resolve().parent / "slurm_shims"

# Knobs the scripts read; a developer's or CI's own values must not leak into the tests.
SCRIPT_VARS = (
    "NODES GPUS_PER_NODE GPU_TYPE TP PP MICRO_BATCH GLOBAL_BATCH TRAIN_TOKENS TRAIN_ITERS CONFIG "
    "DATA_PATH VALID_DATA_PATH TEST_DATA_PATH TOKENIZER_TYPE TOKENIZER_MODEL VOCAB_FILE MERGE_FILE CHECKPOINT_DIR "
    "SEQ_LENGTH TENSORBOARD_DIR DEEPSPEED_CONFIG SAVE_INTERVAL LOG_INTERVAL EXIT_INTERVAL BF16 EXTRA_ARGS DRY_RUN "
    "LOG_ROOT COMPILE_LAYERS CHECKPOINT_PATH GLOBAL_BATCH_SIZE MICRO_BATCH_SIZE TENSORBOARD_LOGS_PATH "
    "SITE_ENV VENV MAX_REQUEUES MAX_RESTARTS KEEP_CHECKPOINTS KEEP_EVERY SHUTDOWN_TIMEOUT MASTER_ADDR MASTER_PORT MEGATRON_LEV_DIR "
    "PILE_DIR OUTPUT_DIR WORKERS FORCE CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_ASYNC_ERROR_HANDLING "
    "PYTORCH_CUDA_ALLOC_CONF NCCL_DEBUG TORCH_CUDA_ARCH_LIST "
    "RUNS SEEDS BASELINE STAGES EVAL_DATA_PATH EVAL_TOKENS FREQ_DATASET BUCKETS CURVES_METRIC TASK_DATA_DIR TASKS "
    "NUM_FEWSHOT LIMIT EVAL_BATCH_SIZE EXPORT_DTYPE LICENSE HF_DATASET"
).split()


def script_env(shims: bool = True, **overrides) -> dict:
    """The environment a batch script sees: no Slurm job unless the test says so, the shims
    first on PATH (not for a real Slurm: shims=False), this interpreter's environment active."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in SCRIPT_VARS}
    env["PATH"] = os.pathsep.join([*([str(SHIMS)] if shims else []), str(Path(sys.executable).parent),
                                   env.get("PATH", "")])
    env["VIRTUAL_ENV"] = sys.prefix
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def run_script(script: str, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SLURM / script)], env=script_env(**env), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def flag(tokens: list[str], name: str) -> list[str]:
    """The values after `name` in a command line, up to the next --flag."""
    i = tokens.index(name)
    values = []
    for tok in tokens[i + 1:]:
        if tok.startswith("--"):
            break
        values.append(tok)
    return values


@pytest.fixture()
def fake_inputs(tmp_path):
    """Files that satisfy the scripts' existence checks (dry runs never read them)."""
    for name in ("pile_00_text_document", "pile_01_text_document"):
        for suffix in (".bin", ".idx"):
            (tmp_path / (name + suffix)).touch()
    (tmp_path / "tokenizer.model").touch()
    a, b = tmp_path / "pile_00_text_document", tmp_path / "pile_01_text_document"
    return {"DATA_PATH": f"0.25 {a} 0.75 {b}", "TOKENIZER_MODEL": str(tmp_path / "tokenizer.model"),
            "CHECKPOINT_DIR": str(tmp_path / "check points"), "LOG_ROOT": str(tmp_path / "logs"),
            "prefixes": [str(a), str(b)]}


def test_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck is not installed: `bash tools/run_tests.sh` installs it "
                    "(apt-get install shellcheck)")
    scripts = sorted(SLURM.glob("*.sh")) + sorted(SHIMS.iterdir()) + sorted((REPO / "tools").glob("*.sh"))
    scripts += sorted((REPO / "benchmarks").glob("*.sh"))
    scripts += [REPO / ".ci" / "run"]
    assert len(scripts) >= 8
    proc = subprocess.run([shellcheck, "--external-sources", *map(str, scripts)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dry_run_prints_each_node_command(fake_inputs):
    """4 A100 nodes inside an allocation: MASTER_ADDR is the first host, the port comes
    from the job id, every node runs the same torchrun with the requested sizes."""
    proc = run_script(
        "train_lev_1b.sh", DRY_RUN=1, GPU_TYPE="a100", TP=2, PP=2, GLOBAL_BATCH=512, SEQ_LENGTH=2048,
        TRAIN_TOKENS="2.4e10", EXTRA_ARGS="--lr 3e-4 --eval-interval 500",
        SLURM_JOB_ID=123456, SLURM_JOB_NUM_NODES=4, SLURM_JOB_NODELIST="gpu[07-09,12]",
        SLURM_JOB_NAME="lev-1.2b", SLURM_CPUS_ON_NODE=96,
        **{k: v for k, v in fake_inputs.items() if k != "prefixes"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    srun = [shlex.split(l) for l in lines if l.startswith("srun ")]
    node_headers = [l for l in lines if l.startswith("# node ")]
    torchruns = [shlex.split(l) for l in lines if l.startswith("torchrun ")]
    assert len(srun) == 1 and len(torchruns) == 4
    assert node_headers == ["# node 0 (gpu07) runs:", "# node 1 (gpu08) runs:",
                            "# node 2 (gpu09) runs:", "# node 3 (gpu12) runs:"]
    srun, cmd = srun[0], torchruns[0]
    assert all(t == cmd for t in torchruns)
    assert srun[srun.index("torchrun"):] == cmd  # srun runs exactly the per-node command
    srun = srun[:srun.index("torchrun")]
    assert flag(srun, "--nodes") == ["4"] and flag(srun, "--ntasks-per-node") == ["1"]
    assert flag(srun, "--cpus-per-task") == ["96"]
    assert "--kill-on-bad-exit=1" in srun
    assert flag(srun, "--output") == [f"{fake_inputs['LOG_ROOT']}/lev-1.2b-123456/restart0-node%n.log"]
    port = 10000 + 123456 % 50000
    assert flag(cmd, "--nnodes") == ["4"] and flag(cmd, "--nproc-per-node") == ["8"]
    assert flag(cmd, "--rdzv-backend") == ["c10d"]
    assert flag(cmd, "--rdzv-endpoint") == [f"gpu07:{port}"]
    assert "SIGUSR1" in flag(cmd, "--signals-to-handle")[0].split(",")
    assert flag(cmd, "-m") == ["megatron_lev.train"]
    assert flag(cmd, "--config") == ["lev-1.2b"]
    assert flag(cmd, "--tensor-model-parallel-size") == ["2"]
    assert flag(cmd, "--pipeline-model-parallel-size") == ["2"]
    assert flag(cmd, "--micro-batch-size") == ["4"]  # the a100 default at 2048 tokens
    assert flag(cmd, "--seq-length") == ["2048"]
    assert flag(cmd, "--global-batch-size") == ["512"]
    assert flag(cmd, "--train-tokens") == ["2.4e10"]
    a, b = fake_inputs["prefixes"]
    assert flag(cmd, "--data-path") == ["0.25", a, "0.75", b]
    assert flag(cmd, "--tokenizer-model") == [fake_inputs["TOKENIZER_MODEL"]]
    # The checkpoint folder has a space: quoting must round-trip.
    assert flag(cmd, "--save") == flag(cmd, "--load") == [fake_inputs["CHECKPOINT_DIR"]]
    assert flag(cmd, "--deepspeed-config") == [str(REPO / "deepspeed_configs" / "zero1.json")]
    assert flag(cmd, "--gpu-type") == ["a100"] and "--bf16" in cmd and "--log-throughput" in cmd
    assert cmd[-4:] == ["--lr", "3e-4", "--eval-interval", "500"]
    assert "export CUDA_DEVICE_MAX_CONNECTIONS='1'" in lines
    assert not Path(fake_inputs["CHECKPOINT_DIR"]).exists()  # a dry run creates nothing


def test_dry_run_defaults_outside_slurm(fake_inputs):
    """On a login node: the tied script, H100 defaults, placeholder hosts, separate
    train/valid datasets."""
    a, b = fake_inputs["prefixes"]
    proc = run_script("train_tied_1b.sh", DRY_RUN=1, NODES=2, DATA_PATH=a, VALID_DATA_PATH=b,
                      TOKENIZER_MODEL=fake_inputs["TOKENIZER_MODEL"], BF16=0, EXIT_INTERVAL=50)
    assert proc.returncode == 0, proc.stderr
    torchruns = [shlex.split(l) for l in proc.stdout.splitlines() if l.startswith("torchrun ")]
    assert len(torchruns) == 2
    cmd = torchruns[0]
    assert flag(cmd, "--config") == ["tied-1.2b"]
    assert flag(cmd, "--nnodes") == ["2"] and flag(cmd, "--rdzv-endpoint") == ["node0:10000"]
    # The config's sequence length (512) is kept, and sets the h100 micro batch.
    assert flag(cmd, "--tensor-model-parallel-size") == ["1"] and flag(cmd, "--micro-batch-size") == ["32"]
    assert "--seq-length" not in cmd
    assert flag(cmd, "--train-data-path") == [a] and flag(cmd, "--valid-data-path") == [b]
    assert "--data-path" not in cmd and "--no-bf16" in cmd and flag(cmd, "--gpu-type") == ["h100"]
    assert flag(cmd, "--exit-interval") == ["50"]  # the smoke run of docs/cluster.md
    assert flag(cmd, "--save") == [str(REPO / "checkpoints" / "tied-1.2b")]


def test_batch_arithmetic_for_every_node_count(tmp_path, fake_inputs):
    """1, 2, 4, 8 nodes of A100/H100/H200 (the configs' 512 x 512-token global batch): the
    micro-batch is the largest that fits the GPU (tokens per GPU / 512) and divides the
    512 / DP sequences of each rank, and the trainer's own validation accepts the command
    with the same accumulation. 3 nodes (DP=24) cannot split 512: refused before launch,
    in one line. The submitting shell's DS_ACCELERATOR=cpu never reaches the job."""
    from megatron_lev.training.arguments import parse_args, validate_args

    inputs = {k: v for k, v in fake_inputs.items() if k != "prefixes"}
    fits = {"a100": 8192 // 512, "h100": 16384 // 512, "h200": 32768 // 512}
    for gpu, nodes in [(g, n) for g in fits for n in (1, 2, 4, 8)]:
        proc = run_script("train_lev_1b.sh", DRY_RUN=1, GPU_TYPE=gpu, NODES=nodes, DS_ACCELERATOR="cpu", **inputs)
        assert proc.returncode == 0, (gpu, nodes, proc.stderr)
        (cmd,) = {l for l in proc.stdout.splitlines() if l.startswith("torchrun ")}
        cmd = shlex.split(cmd)
        dp, per_rank = nodes * 8, 512 // (nodes * 8)
        micro = max(m for m in range(1, fits[gpu] + 1) if per_rank % m == 0)
        assert flag(cmd, "--micro-batch-size") == [str(micro)], (gpu, nodes)
        args = validate_args(parse_args(cmd[cmd.index("-m") + 2:]), world_size=dp)
        assert (args.micro_batch_size, args.global_batch_size) == (micro, 512)
        assert args.gradient_accumulation_steps == per_rank // micro
        assert (f"# Batch: DP={dp} x MICRO_BATCH={micro} x ACCUMULATION={per_rank // micro} = GLOBAL_BATCH=512 "
                "sequences of 512 tokens per step") in proc.stdout
        assert "unset DS_ACCELERATOR" in proc.stdout.splitlines()
    # H100 at 4 nodes: 16 sequences per rank, below the 32 that fit.
    for env, message in [
        ({"NODES": 3}, "slurm: error: GLOBAL_BATCH=512 sequences cannot be split over data-parallel size 24 "
                       "(NODES=3 x GPUS_PER_NODE=8 / TP=1 x PP=1): use NODES=2 or 4, or GLOBAL_BATCH=504 or 528\n"),
        ({"NODES": 3, "TP": 2}, "slurm: error: GLOBAL_BATCH=512 sequences cannot be split over data-parallel size 12 "
                                "(NODES=3 x GPUS_PER_NODE=8 / TP=2 x PP=1): use NODES=2 or 4, or GLOBAL_BATCH=504 or 516\n"),
        ({"NODES": 4, "MICRO_BATCH": 3}, "slurm: error: MICRO_BATCH=3 does not divide the 16 sequences per "
                                         "data-parallel rank (GLOBAL_BATCH=512 / DP=32): use MICRO_BATCH=2 or 4\n"),
    ]:
        proc = run_script("train_lev_1b.sh", DRY_RUN=1, **env, **inputs)
        assert (proc.returncode, proc.stderr, proc.stdout) == (1, message, ""), env
    # A site that needs DeepSpeed's CPU accelerator forces it in SITE_ENV.
    site = tmp_path / "site_env.sh"
    site.write_text("export DS_ACCELERATOR=cpu\n")
    proc = run_script("train_lev_1b.sh", DRY_RUN=1, SITE_ENV=site, **inputs)
    assert "export DS_ACCELERATOR='cpu'" in proc.stdout.splitlines(), proc.stderr


@pytest.mark.parametrize("env, message", [
    ({"DATA_PATH": None}, "DATA_PATH is not set"),
    ({"TOKENIZER_MODEL": None}, "TOKENIZER_MODEL is not set"),
    ({"TOKENIZER_MODEL": "/nonexistent/tok.model"}, "TOKENIZER_MODEL=/nonexistent/tok.model: no such file"),
    ({"DATA_PATH": "0.5 {a} 0.5 /nonexistent/pile_07"}, "dataset prefix '/nonexistent/pile_07' has no"),
    ({"TOKENIZER_TYPE": "GPT2BPETokenizer"}, "slurm: error: VOCAB_FILE is not set: TOKENIZER_TYPE=GPT2BPETokenizer "
     "reads VOCAB_FILE=/path/gpt2-vocab.json and MERGE_FILE=/path/gpt2-merges.txt\n"),
    ({"TOKENIZER_TYPE": "GPT2BPETokenizer", "VOCAB_FILE": "/nonexistent/v.json", "MERGE_FILE": "/nonexistent/m.txt"},
     "VOCAB_FILE=/nonexistent/v.json: no such file or directory"),
    ({"TP": 3}, "TP=3 x PP=1 must divide the 8 GPUs"),
    ({"GPU_TYPE": "v100"}, "GPU_TYPE=v100: expected a100, h100 or h200"),
    ({"CONFIG": "lev-9b"}, "CONFIG=lev-9b: --config lev-9b: no such file, and not a packaged config"),
    ({"MICRO_BATCH": "four"}, "MICRO_BATCH=four is not a non-negative integer"),
    ({"TRAIN_ITERS": 10, "TRAIN_TOKENS": 1000}, "set TRAIN_TOKENS or TRAIN_ITERS, not both"),
    ({"NODES": 2, "SLURM_JOB_NUM_NODES": 4, "SLURM_JOB_ID": 7, "SLURM_JOB_NODELIST": "n[1-4]"},
     "NODES=2 but the allocation has 4 nodes"),
    ({"DRY_RUN": None}, "not inside a Slurm job"),
    ({"CHECKPOINT_PATH": "/scratch/a", "CHECKPOINT_DIR": "/scratch/b"},
     "slurm: error: CHECKPOINT_PATH=/scratch/a and CHECKPOINT_DIR=/scratch/b disagree (CHECKPOINT_PATH is "
     "Megatron-LM's name for CHECKPOINT_DIR): set one of them\n"),
    ({"COMPILE_LAYERS": "yes"}, "COMPILE_LAYERS=yes: expected 0 or 1"),
    # The allocation's GPU count, from either of Slurm's variables.
    ({"GPUS_PER_NODE": 8, "SLURM_GPUS_ON_NODE": 4, "SLURM_JOB_ID": 7},
     "slurm: error: GPUS_PER_NODE=8 but the allocation has 4 GPUs per node (SLURM_GPUS_ON_NODE): unset "
     "GPUS_PER_NODE (it follows the allocation), or submit with --gres=gpu:8\n"),
    ({"GPUS_PER_NODE": 4, "SLURM_GPUS_PER_NODE": "h100:8"},
     "GPUS_PER_NODE=4 but the allocation has 8 GPUs per node (SLURM_GPUS_PER_NODE)"),
    # EXTRA_ARGS through the trainer's parser and batch arithmetic, at submit time.
    ({"EXTRA_ARGS": "--lr 3e-4 --lr-warmup-iter 100"},
     'slurm: error: the trainer refuses its flags (EXTRA_ARGS="--lr 3e-4 --lr-warmup-iter 100"): unrecognized '
     "argument --lr-warmup-iter (did you mean --lr-warmup-iters?)\n"),
    # EXTRA_ARGS's batch flags are the batch (test_extra_args_batch_flags_are_the_batch): checked as such.
    ({"EXTRA_ARGS": "--micro-batch-size 3"}, "slurm: error: MICRO_BATCH=3 does not divide the 64 sequences per "
     "data-parallel rank (GLOBAL_BATCH=512 / DP=8): use MICRO_BATCH=2 or 4\n"),
    # A flag the script passes from a variable, in EXTRA_ARGS too with another value.
    ({"MICRO_BATCH_SIZE": 4, "EXTRA_ARGS": "--lr 3e-4 --micro-batch-size 2"},
     "slurm: error: EXTRA_ARGS passes --micro-batch-size 2, but MICRO_BATCH=4: set one of them (the script passes "
     "this flag from MICRO_BATCH)\n"),
    ({"GLOBAL_BATCH": 64, "EXTRA_ARGS": "--global-batch-size=32"}, "EXTRA_ARGS passes --global-batch-size 32, but "
     "GLOBAL_BATCH=64"),
    ({"EXTRA_ARGS": "--config tiny-lev"}, "EXTRA_ARGS passes --config tiny-lev, but CONFIG=lev-1.2b"),
    ({"BF16": 0, "EXTRA_ARGS": "--bf16"}, "EXTRA_ARGS passes --bf16, but BF16=0"),
    ({"CHECKPOINT_DIR": None, "EXTRA_ARGS": "--save /scratch/a --load /scratch/b"}, "EXTRA_ARGS passes --load /scratch/b, but "
     "CHECKPOINT_DIR=/scratch/a"),
    ({"EXTRA_ARGS": "--global-batch-size --lr 3e-4"}, "slurm: error: EXTRA_ARGS: --global-batch-size needs a value\n"),
    ({"EXTRA_ARGS": "--valid-data-path {a}"}, "slurm: error: EXTRA_ARGS passes --valid-data-path: set VALID_DATA_PATH "
     "instead (the script passes --valid-data-path from it)\n"),
    ({"EXTRA_ARGS": "--zero-stage 5"}, "--zero-stage"),
])
def test_clear_errors(fake_inputs, env, message):
    base = {k: v for k, v in fake_inputs.items() if k != "prefixes"}
    base["DRY_RUN"] = 1
    for key, value in env.items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = str(value).format(a=fake_inputs["prefixes"][0])
    proc = run_script("train_lev_1b.sh", **base)
    assert proc.returncode == 1
    assert message in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1  # one line
    assert proc.stdout == ""  # refused before anything is printed


def test_extra_args_batch_flags_are_the_batch(fake_inputs):
    """Megatron-LM users put the batch flags in EXTRA_ARGS: they are the batch the log states
    and the command passes, once (before, the command carried the script's pair and EXTRA_ARGS's,
    argparse trained with the last, and the log printed the script's). The parallel sizes and the
    checkpoint folder likewise."""
    from megatron_lev.training.arguments import parse_args, validate_args

    inputs = {k: v for k, v in fake_inputs.items() if k not in ("prefixes", "CHECKPOINT_DIR")}
    proc = run_script("train_lev_1b.sh", DRY_RUN=1, GPUS_PER_NODE=4, BF16=0, **inputs, EXTRA_ARGS=(
        "--micro-batch-size 2 --lr 3e-4 --global-batch-size=16 --tensor-model-parallel-size 2 --no-bf16 "
        "--save /scratch/run"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert ("# Batch: DP=2 x MICRO_BATCH=2 x ACCUMULATION=4 = GLOBAL_BATCH=16 sequences of 512 tokens per step"
            in lines)
    assert "# Checkpoints (--save, and --load to resume): /scratch/run" in lines
    (cmd,) = [shlex.split(l) for l in lines if l.startswith("torchrun ")]
    for name, value in [("--micro-batch-size", "2"), ("--global-batch-size", "16"),
                        ("--tensor-model-parallel-size", "2"), ("--save", "/scratch/run"), ("--load", "/scratch/run")]:
        assert (cmd.count(name), flag(cmd, name)) == (1, [value]), name
    assert cmd.count("--no-bf16") == 1 and "--bf16" not in cmd and "--global-batch-size=16" not in cmd
    assert cmd[-2:] == ["--lr", "3e-4"]  # the rest of EXTRA_ARGS, as given
    args = validate_args(parse_args(cmd[cmd.index("-m") + 2:]), world_size=4)
    assert (args.micro_batch_size, args.global_batch_size, args.gradient_accumulation_steps) == (2, 16, 4)
    assert (args.data_parallel_size, args.tensor_model_parallel_size) == (2, 2)

    # The same value in a variable and in EXTRA_ARGS is no conflict.
    proc = run_script("train_lev_1b.sh", DRY_RUN=1, GPUS_PER_NODE=2, MICRO_BATCH=2, GLOBAL_BATCH=4, **inputs,
                      EXTRA_ARGS="--micro-batch-size 2 --global-batch-size 4")
    assert proc.returncode == 0, proc.stderr
    assert "# Batch: DP=2 x MICRO_BATCH=2 x ACCUMULATION=1 = GLOBAL_BATCH=4 sequences of 512 tokens per step" in (
        proc.stdout.splitlines())


def test_megatron_names_and_switches(fake_inputs):
    """Megatron-LM's variable names set the same things (checkpoint folder, batch sizes,
    TensorBoard folder); COMPILE_LAYERS=0 turns --compile-layers off (on by default); the
    allocation's GPU count is the default GPUS_PER_NODE."""
    inputs = {k: v for k, v in fake_inputs.items() if k not in ("prefixes", "CHECKPOINT_DIR")}
    proc = run_script("train_lev_1b.sh", DRY_RUN=1, CHECKPOINT_PATH="/scratch/run 1", GLOBAL_BATCH_SIZE=64,
                      MICRO_BATCH_SIZE=2, TENSORBOARD_LOGS_PATH="/scratch/tb", COMPILE_LAYERS=0,
                      SLURM_GPUS_PER_NODE="a100:4", **inputs)
    assert proc.returncode == 0, proc.stderr
    (cmd,) = [shlex.split(l) for l in proc.stdout.splitlines() if l.startswith("torchrun ")]
    assert flag(cmd, "--save") == flag(cmd, "--load") == ["/scratch/run 1"]
    assert flag(cmd, "--global-batch-size") == ["64"] and flag(cmd, "--micro-batch-size") == ["2"]
    assert flag(cmd, "--tensorboard-dir") == ["/scratch/tb"] and flag(cmd, "--nproc-per-node") == ["4"]
    assert "--no-compile-layers" in cmd and "--compile-layers" not in cmd
    lines = proc.stdout.splitlines()
    assert "# Checkpoints (--save, and --load to resume): /scratch/run 1" in lines
    assert "# Decoder layers compiled (COMPILE_LAYERS=0): no" in lines
    assert "# Batch: DP=4 x MICRO_BATCH=2 x ACCUMULATION=8 = GLOBAL_BATCH=64 sequences of 512 tokens per step" in lines

    proc = run_script("train_lev_1b.sh", DRY_RUN=1, **inputs)
    (cmd,) = [shlex.split(l) for l in proc.stdout.splitlines() if l.startswith("torchrun ")]
    assert "--compile-layers" in cmd and "--no-compile-layers" not in cmd
    assert "# Decoder layers compiled (COMPILE_LAYERS=1): yes" in proc.stdout.splitlines()
    assert flag(cmd, "--save") == [str(REPO / "checkpoints" / "lev-1.2b")]


def _fake_torch(root: Path, *flags: str) -> Path:
    """A `torch` package whose torchrun source mentions only `flags` (older releases)."""
    run_py = root / "torch" / "distributed" / "run.py"
    run_py.parent.mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text("")
    run_py.write_text("".join(f'parser.add_argument("{f}")\n' for f in flags))
    return root


@pytest.mark.parametrize("flags", [(), ("--signals-to-handle",)])
def test_dry_run_on_older_torch(tmp_path, fake_inputs, flags):
    """torch < 2.9 lacks --signals-to-handle, < 2.11 --shutdown-timeout: torchrun would
    refuse them, so they are left out."""
    env = {k: v for k, v in fake_inputs.items() if k != "prefixes"}
    proc = run_script("train_lev_1b.sh", DRY_RUN=1, PYTHONPATH=_fake_torch(tmp_path / "old", *flags), **env)
    assert proc.returncode == 0, proc.stderr
    (cmd, *_) = [shlex.split(l) for l in proc.stdout.splitlines() if l.startswith("torchrun ")]
    assert ("--signals-to-handle" in cmd) == bool(flags)
    assert "--shutdown-timeout" not in cmd
    assert cmd[cmd.index("--max-restarts") + 2:][:2] == (["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
                                                          if flags else ["-m", "megatron_lev.train"])


def test_stop_requests_reach_the_step(tmp_path):
    """The batch shell's traps: with a torchrun that handles USR1 they send USR1 to srun
    (which forwards it as it is); with an older one, SIGTERM to the step through scancel.
    Never SIGTERM to srun (it would SIGKILL the trainers)."""
    got = tmp_path / "step_got"
    scancels = tmp_path / "scancels"
    script = f"""
set -euo pipefail
MEGATRON_LEV_DIR={shlex.quote(str(REPO))}
source "$MEGATRON_LEV_DIR/slurm/common.sh"
JOB_ID=4242
# A stand-in for srun: records the signals it receives.
bash -c 'trap "echo USR1 >>{got}" USR1; trap "echo TERM >>{got}" TERM; while :; do sleep 0.05; done' &
STEP_PID=$!
sleep 0.5
TORCHRUN_USR1=1
_on_usr1; sleep 0.3  # apart: the stand-in would see two quick USR1s as one
_on_term; sleep 0.3
TORCHRUN_USR1=0
_on_usr1; _on_term; sleep 0.3
kill -KILL "$STEP_PID"
echo "REQUEUE=$REQUEUE TERMINATED=$TERMINATED"
"""
    proc = subprocess.run(["bash", "-c", script], env=script_env(SCANCEL_SHIM_LOG=scancels),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "REQUEUE=1 TERMINATED=1"
    assert got.read_text().split() == ["USR1", "USR1"]
    assert scancels.read_text().splitlines() == ["scancel --signal=TERM 4242"] * 2


def test_megatron_gpt2_bpe_files(tmp_path, fake_inputs):
    """TOKENIZER_TYPE=GPT2BPETokenizer passes VOCAB_FILE and MERGE_FILE (Megatron-LM's names) to
    the trainer and to preprocess_pile.sh, instead of --tokenizer-model."""
    vocab, merges = tmp_path / "gpt2-vocab.json", tmp_path / "gpt2-merges.txt"
    vocab.touch()
    merges.touch()
    gpt2 = {"TOKENIZER_TYPE": "GPT2BPETokenizer", "VOCAB_FILE": vocab, "MERGE_FILE": merges}
    inputs = {k: v for k, v in fake_inputs.items() if k not in ("prefixes", "TOKENIZER_MODEL")}
    proc = run_script("train_lev_1b.sh", DRY_RUN=1, **gpt2, **inputs)
    assert proc.returncode == 0, proc.stderr
    (cmd,) = [shlex.split(l) for l in proc.stdout.splitlines() if l.startswith("torchrun ")]
    assert flag(cmd, "--tokenizer-type") == ["GPT2BPETokenizer"] and "--tokenizer-model" not in cmd
    assert flag(cmd, "--vocab-file") == [str(vocab)] and flag(cmd, "--merge-file") == [str(merges)]
    pile = tmp_path / "pile"
    (pile / "train").mkdir(parents=True)
    (pile / "train" / "00.jsonl.zst").touch()
    proc = run_script("preprocess_pile.sh", PILE_DIR=pile, OUTPUT_DIR=tmp_path / "tok", DRY_RUN=1,
                      SLURM_ARRAY_TASK_ID=0, **gpt2)
    assert proc.returncode == 0, proc.stderr
    (cmd,) = [shlex.split(l) for l in proc.stdout.splitlines()]
    assert flag(cmd, "--vocab-file") == [str(vocab)] and flag(cmd, "--merge-file") == [str(merges)]
    assert "--tokenizer-model" not in cmd


def test_preprocess_pile_dry_run(tmp_path, fake_inputs):
    pile = tmp_path / "pile"
    (pile / "train").mkdir(parents=True)
    for i in range(30):
        (pile / "train" / f"{i:02d}.jsonl.zst").touch()
    (pile / "val.jsonl.zst").touch()
    (pile / "test.jsonl.zst").touch()
    out = tmp_path / "tok"
    env = {"PILE_DIR": pile, "OUTPUT_DIR": out, "TOKENIZER_MODEL": fake_inputs["TOKENIZER_MODEL"], "DRY_RUN": 1}

    proc = run_script("preprocess_pile.sh", **env)  # no array task: all 32 commands
    assert proc.returncode == 0, proc.stderr
    cmds = [shlex.split(l) for l in proc.stdout.splitlines()]
    assert len(cmds) == 32
    assert [flag(c, "--input")[0] for c in cmds] == (
        [f"{pile}/train/{i:02d}.jsonl.zst" for i in range(30)] + [f"{pile}/val.jsonl.zst", f"{pile}/test.jsonl.zst"])
    assert [flag(c, "--output-prefix")[0] for c in cmds[28:]] == [
        f"{out}/train/pile_28", f"{out}/train/pile_29", f"{out}/val/pile_val", f"{out}/test/pile_test"]

    proc = run_script("preprocess_pile.sh", SLURM_ARRAY_TASK_ID=7, SLURM_CPUS_PER_TASK=48,
                      EXTRA_ARGS="--split-by-key meta.pile_set_name", **env)
    assert proc.returncode == 0, proc.stderr
    (cmd,) = [shlex.split(l) for l in proc.stdout.splitlines()]
    assert cmd[:2] == ["python", str(REPO / "tools" / "preprocess_data.py")]
    assert flag(cmd, "--input") == [f"{pile}/train/07.jsonl.zst"]
    assert flag(cmd, "--output-prefix") == [f"{out}/train/pile_07"]
    assert flag(cmd, "--workers") == ["48"] and flag(cmd, "--json-keys") == ["text"]
    assert flag(cmd, "--tokenizer-type") == ["SentencePieceTokenizer"] and "--append-eod" in cmd
    assert flag(cmd, "--split-by-key") == ["meta.pile_set_name"]

    (pile / "train" / "07.jsonl.zst").unlink()
    proc = run_script("preprocess_pile.sh", SLURM_ARRAY_TASK_ID=7, **env)
    assert proc.returncode == 1 and f"{pile}/train/07.jsonl.zst does not exist" in proc.stderr


def _write_dataset(prefix: Path, docs: list[list[int]]) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(np.array(doc, dtype=np.int64), [len(doc)])
    builder.finalize(f"{prefix}.idx")


def _import_make_blend():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import make_blend
    finally:
        sys.path.pop(0)
    return make_blend


def test_make_blend(tmp_path, capsys):
    make_blend = _import_make_blend()
    train = tmp_path / "train"
    train.mkdir()
    _write_dataset(train / "pile_00_text_document", [[1, 2, 3], [4, 5]])        # 5 tokens
    _write_dataset(train / "pile_01_text_document", [[7] * 10, [8] * 5])        # 15 tokens
    _write_dataset(train / "pile_02_text_document", [[9] * 20])                 # 20 tokens
    p0, p1, p2 = (str(train / f"pile_0{i}_text_document") for i in range(3))

    blend = make_blend.make_blend(make_blend.find_prefixes([str(train)]))
    assert blend.split() == ["0.125", p0, "0.375", p1, "0.5", p2]
    assert make_blend.make_blend(make_blend.find_prefixes([str(train)], exclude="pile_0[12]")) == f"1 {p0}"
    assert make_blend.make_blend(make_blend.find_prefixes([p2 + ".idx", p1]), "equal") == f"0.5 {p2} 0.5 {p1}"
    make_blend.main([str(train), "--exclude", "pile_00"])
    assert capsys.readouterr().out == f"0.42857143 {p1} 0.57142857 {p2}\n"  # 15 and 20 of 35 tokens
    with pytest.raises(SystemExit, match="pile_09.bin: no such file"):
        make_blend.find_prefixes([str(train / "pile_09")])
    with pytest.raises(SystemExit, match="no \\*.idx files"):
        make_blend.find_prefixes([str(tmp_path)])
