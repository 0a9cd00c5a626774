"""The training job's launch, computed from the environment of slurm/train_*_1b.sh: every check the
scripts make at submit time (and under DRY_RUN), the batch arithmetic, and the torchrun and srun
command lines. `resolve_launch(env)` returns a `Launch`, or raises a LaunchError in one line.

One `srun` task per node; each runs `torchrun` with c10d rendezvous over that node's GPUs, and the
trainer is `python -m megatron_lev.train`. The batch shell keeps the signals, the background srun,
`wait` and `scontrol requeue` (slurm/common.sh); what it does after a step is steps.py's decision.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Mapping, MutableMapping, Optional

from megatron_lev.launcher.batch import BatchPlan, choose_micro_batch, micro_batch_fits
from megatron_lev.launcher.disk import KEEP_CHECKPOINTS_DEFAULT, CheckpointDisk, plan_checkpoint_disk
from megatron_lev.launcher.resume import Conversion, plan_conversion
from megatron_lev.launcher.shell import LaunchError, bash_quote, get, print_cmd, require_int, switch
from megatron_lev.launcher.steps import MAX_RESTARTS_DEFAULT, node_log_pattern
from megatron_lev.launcher.variables import check_blend, resolve_aliases, take_extra_args, tokenizer_flags

# What torchrun is told to pass on to the trainers (it must not die of USR1 itself: see common.sh).
HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# The variables the dry run shows, as the tasks will see them.
DRY_RUN_VARIABLES = ("CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTORCH_CUDA_ALLOC_CONF",
                     "NCCL_DEBUG", "PYTHONUNBUFFERED", "TOKENIZERS_PARALLELISM", "PYTHONPATH", "DS_ACCELERATOR")


@dataclass
class Launch:
    """Everything the batch shell runs, and what the log and the dry run say about it."""

    config: str
    nodes: int
    hosts: list[str]
    job_id: int
    restart: int  # SLURM_RESTART_COUNT: how many times Slurm requeued this job
    job_log_dir: str
    checkpoint_dir: str
    batch: BatchPlan
    compile_layers: bool
    max_requeues: int
    max_restarts: int  # restarts of a failed step inside the allocation, per job start
    torchrun_usr1: bool  # torchrun has --signals-to-handle (torch >= 2.9)
    torchrun_shutdown_timeout: bool  # torchrun has --shutdown-timeout (torch >= 2.11)
    exports: dict[str, str] = field(default_factory=dict)  # set in every task's environment
    train_args: list[str] = field(default_factory=list)
    torchrun_cmd: list[str] = field(default_factory=list)
    srun_cmd: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # lines for the log and the dry run (stderr: warnings)
    disk: Optional[CheckpointDisk] = None  # the checkpoints' size and the disk the run needs
    conversion: Optional[Conversion] = None  # a resume at another layout: converted before the trainers


def resolve_launch(env: MutableMapping[str, str], repo: str) -> Launch:
    """The launch of `env` (the batch shell's environment, updated with the resolved values), in the
    order the scripts always checked it."""
    resolve_aliases(env)
    extra_words = take_extra_args(env)
    if not env.get("CONFIG"):
        raise LaunchError("CONFIG is not set (the sbatch script sets it)")
    if not env.get("DATA_PATH"):
        raise LaunchError('DATA_PATH is not set: export DATA_PATH="PREFIX" or a blend "W1 PREFIX1 W2 PREFIX2" '
                          "(tools/make_blend.py prints one)")
    tokenizer = tokenizer_flags(env)
    data = check_blend("DATA_PATH", env["DATA_PATH"])
    valid = check_blend("VALID_DATA_PATH", env["VALID_DATA_PATH"]) if env.get("VALID_DATA_PATH") else []
    test = check_blend("TEST_DATA_PATH", env["TEST_DATA_PATH"]) if env.get("TEST_DATA_PATH") else []

    gpu_type = env["GPU_TYPE"] = get(env, "GPU_TYPE", "h100")
    seq_length, seq_from_config, global_batch = resolve_config(env)
    fits = micro_batch_fits(gpu_type, seq_length)
    env["TP"], env["PP"] = get(env, "TP", "1"), get(env, "PP", "1")
    env["NODES"] = get(env, "NODES", get(env, "SLURM_JOB_NUM_NODES", "1"))
    alloc_gpus, alloc_from = allocation_gpus(env)
    env["GPUS_PER_NODE"] = get(env, "GPUS_PER_NODE", str(alloc_gpus or 8))
    checkpoint_dir = get(env, "CHECKPOINT_DIR", f"{repo}/checkpoints/{env['CONFIG']}")
    tensorboard_dir = get(env, "TENSORBOARD_DIR", f"{checkpoint_dir}/tensorboard")
    # ZeRO-2 overlaps the (fp32) gradient reduction with backward; PP > 1 needs ZeRO-1 (docs/slurm.md).
    pipeline = env["PP"].isdigit() and int(env["PP"]) > 1
    deepspeed_config = get(env, "DEEPSPEED_CONFIG", f"{repo}/deepspeed_configs/zero{1 if pipeline else 2}.json")
    defaults = {"SAVE_INTERVAL": "1000", "LOG_INTERVAL": "10", "BF16": "1", "COMPILE_LAYERS": "1",
                "SHUTDOWN_TIMEOUT": "240", "MAX_REQUEUES": "50", "MAX_RESTARTS": str(MAX_RESTARTS_DEFAULT),
                "KEEP_CHECKPOINTS": str(KEEP_CHECKPOINTS_DEFAULT)}
    for name, default in defaults.items():
        env[name] = get(env, name, default)
    log_root = get(env, "LOG_ROOT", f"{repo}/logs")
    sizes = {name: require_int(name, env[name], 1) for name in ("NODES", "GPUS_PER_NODE", "TP", "PP", "SAVE_INTERVAL",
                                                                  "LOG_INTERVAL", "SHUTDOWN_TIMEOUT")}
    nodes, gpus_per_node, tp, pp = (sizes[k] for k in ("NODES", "GPUS_PER_NODE", "TP", "PP"))
    if alloc_gpus is not None and gpus_per_node != alloc_gpus:
        raise LaunchError(f"GPUS_PER_NODE={env['GPUS_PER_NODE']} but the allocation has {alloc_gpus} GPUs per node "
                          f"({alloc_from}): unset GPUS_PER_NODE (it follows the allocation), or submit with "
                          f"--gres=gpu:{env['GPUS_PER_NODE']}")
    micro_batch = require_int("MICRO_BATCH", env["MICRO_BATCH"], 1) if env.get("MICRO_BATCH") else None
    if env.get("EXIT_INTERVAL"):
        require_int("EXIT_INTERVAL", env["EXIT_INTERVAL"], 1)
    max_requeues = require_int("MAX_REQUEUES", env["MAX_REQUEUES"])
    max_restarts = require_int("MAX_RESTARTS", env["MAX_RESTARTS"])
    keep = require_int("KEEP_CHECKPOINTS", env["KEEP_CHECKPOINTS"])
    keep_every = require_int("KEEP_EVERY", env["KEEP_EVERY"], 1) if env.get("KEEP_EVERY") else None
    if keep_every and not keep:
        raise LaunchError(f"KEEP_EVERY={keep_every} keeps checkpoints besides the newest KEEP_CHECKPOINTS, but "
                          "KEEP_CHECKPOINTS=0 keeps every one already: set KEEP_CHECKPOINTS, or unset KEEP_EVERY")
    if env.get("TRAIN_TOKENS") and env.get("TRAIN_ITERS"):
        raise LaunchError("set TRAIN_TOKENS or TRAIN_ITERS, not both")
    bf16, compile_layers = switch("BF16", env["BF16"]), switch("COMPILE_LAYERS", env["COMPILE_LAYERS"])
    if not os.path.isfile(deepspeed_config):
        raise LaunchError(f"DEEPSPEED_CONFIG={deepspeed_config}: no such file")
    world = nodes * gpus_per_node
    if world % (tp * pp):
        raise LaunchError(f"TP={tp} x PP={pp} must divide the {world} GPUs (NODES={nodes} x "
                          f"GPUS_PER_NODE={gpus_per_node})")
    batch = choose_micro_batch(nodes=nodes, gpus_per_node=gpus_per_node, tp=tp, pp=pp, global_batch=global_batch,
                               micro_batch=micro_batch, fits=fits, seq_length=seq_length)

    if env.get("SLURM_JOB_NUM_NODES") and env["NODES"] != env["SLURM_JOB_NUM_NODES"]:
        raise LaunchError(f"NODES={env['NODES']} but the allocation has {env['SLURM_JOB_NUM_NODES']} nodes: submit "
                          f"with sbatch --nodes={env['NODES']}")
    dry_run = env.get("DRY_RUN") == "1"
    if not env.get("SLURM_JOB_ID") and not dry_run:
        raise LaunchError("not inside a Slurm job: submit with sbatch (or run with DRY_RUN=1 to print the commands)")
    job_id = int(get(env, "SLURM_JOB_ID", "0"))
    restart = int(get(env, "SLURM_RESTART_COUNT", "0"))
    # Paths are joined as the scripts always joined them (a CONFIG given as a path stays in them).
    job_log_dir = f"{log_root}/{get(env, 'SLURM_JOB_NAME', env['CONFIG'])}-{job_id}"
    hosts = job_hosts(env, nodes)
    if len(hosts) < nodes:
        raise LaunchError(f"the allocation lists {len(hosts)} hosts, fewer than NODES={nodes}")
    # The same job id gives the same port after a requeue; different jobs sharing a node get different
    # ports (the formula of megatron_lev.distributed.launch.detect_launch_env).
    master = f"{get(env, 'MASTER_ADDR', hosts[0])}:{get(env, 'MASTER_PORT', str(10000 + job_id % 50000))}"

    launch = Launch(config=env["CONFIG"], nodes=nodes, hosts=hosts, job_id=job_id, restart=restart,
                    job_log_dir=job_log_dir, checkpoint_dir=checkpoint_dir, batch=batch, compile_layers=compile_layers,
                    max_requeues=max_requeues, max_restarts=max_restarts, torchrun_usr1=False,
                    torchrun_shutdown_timeout=False)
    launch.exports = runtime_env(env, launch.notes)
    launch.torchrun_usr1, launch.torchrun_shutdown_timeout = torchrun_features()

    launch.train_args = ["--config", env["CONFIG"]]
    if valid or test:
        launch.train_args += ["--train-data-path", *data]
        launch.train_args += ["--valid-data-path", *valid] if valid else []
        launch.train_args += ["--test-data-path", *test] if test else []
    else:
        launch.train_args += ["--data-path", *data]  # train/valid/test split by --split
    launch.train_args += [*tokenizer, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                          str(pp), "--micro-batch-size", str(batch.micro_batch)]
    launch.train_args += [] if seq_from_config else ["--seq-length", str(seq_length)]
    launch.train_args += [] if global_batch is None else ["--global-batch-size", str(global_batch)]
    for name, flag in (("TRAIN_TOKENS", "--train-tokens"), ("TRAIN_ITERS", "--train-iters"),
                       ("EXIT_INTERVAL", "--exit-interval")):  # --exit-interval: checkpoint and stop there
        launch.train_args += [flag, env[name]] if env.get(name) else []
    launch.train_args += [
        "--save", checkpoint_dir,
        "--load", checkpoint_dir,  # empty on the first run: starts fresh; resumes after a requeue
        "--save-interval", env["SAVE_INTERVAL"],
        # The newest KEEP_CHECKPOINTS only (0: all): a week of checkpoints at 1.2B is terabytes.
        *(["--keep-last-checkpoints", str(keep)] if keep else []),
        *(["--keep-checkpoints-every", str(keep_every)] if keep_every else []),  # and every KEEP_EVERY-th
        "--log-interval", env["LOG_INTERVAL"],
        "--tensorboard-dir", tensorboard_dir, "--deepspeed-config", deepspeed_config, "--gpu-type", gpu_type,
        "--log-throughput",  # TFLOP/s per GPU and MFU (against --gpu-type's peak) in every iteration line
        # torch.compile each decoder layer: fused RoPE/SwiGLU/RMSNorm (docs/performance.md); the
        # compilation happens in the first step, and the log reports its time.
        "--compile-layers" if compile_layers else "--no-compile-layers",
        "--bf16" if bf16 else "--no-bf16",
        *extra_words,  # EXTRA_ARGS less the flags taken above
    ]
    launch.torchrun_cmd = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(gpus_per_node),
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", master, "--rdzv-id", str(job_id),
                           "--max-restarts", "0"]  # a crash restarts the step (steps.py), not torchrun
    launch.torchrun_cmd += ["--signals-to-handle", HANDLED_SIGNALS] if launch.torchrun_usr1 else []
    launch.torchrun_cmd += ["--shutdown-timeout", env["SHUTDOWN_TIMEOUT"]] if launch.torchrun_shutdown_timeout else []
    launch.torchrun_cmd += ["-m", "megatron_lev.train", *launch.train_args]
    launch.srun_cmd = srun_command(launch, env, node_log_pattern(job_log_dir, restart, 0))
    args, ds_config = check_trainer_flags(launch.train_args, world, env.get("EXTRA_ARGS", ""))
    launch.disk = plan_checkpoint_disk(args, keep=keep, keep_every=keep_every, checkpoint_dir=checkpoint_dir, bf16=bf16)
    launch.conversion = plan_conversion(args, ds_config, checkpoint_dir)
    return launch


def srun_command(launch: Launch, env: Mapping[str, str], output: str) -> list[str]:
    cmd = ["srun", "--nodes", str(launch.nodes), "--ntasks", str(launch.nodes), "--ntasks-per-node", "1",
           "--kill-on-bad-exit=1", "--output", output]
    # Since Slurm 22.05 a step no longer inherits --cpus-per-task: give torchrun the node.
    cmd += ["--cpus-per-task", env["SLURM_CPUS_ON_NODE"]] if env.get("SLURM_CPUS_ON_NODE") else []
    return cmd + launch.torchrun_cmd


def resolve_config(env: MutableMapping[str, str]) -> tuple[int, bool, Optional[int]]:
    """The run's sequence length, whether it is the config's (then not passed as --seq-length), and
    its global batch (None: neither GLOBAL_BATCH nor the config has one: micro-batch x DP). Reading
    the config also fails early, and clearly, on a bad CONFIG."""
    from megatron_lev.configs import load_config

    if env.get("SEQ_LENGTH"):
        require_int("SEQ_LENGTH", env["SEQ_LENGTH"], 1)
    if env.get("GLOBAL_BATCH"):
        require_int("GLOBAL_BATCH", env["GLOBAL_BATCH"], 1)
    try:
        config = load_config(env["CONFIG"])
        training = config.get("training") or {}
        config_seq = training.get("seq_length") or config["model"]["seq_length"]
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise LaunchError(f"CONFIG={env['CONFIG']}: {exc}") from None
    from_config = not env.get("SEQ_LENGTH")
    if from_config:
        env["SEQ_LENGTH"] = str(config_seq)
    env["GLOBAL_BATCH"] = get(env, "GLOBAL_BATCH", str(training.get("global_batch_size") or ""))
    return int(env["SEQ_LENGTH"]), from_config, int(env["GLOBAL_BATCH"]) if env["GLOBAL_BATCH"] else None


def allocation_gpus(env: Mapping[str, str]) -> tuple[Optional[int], str]:
    """GPUs per node of the allocation, and where that number comes from: Slurm's SLURM_GPUS_ON_NODE,
    else SLURM_GPUS_PER_NODE ("8" or "h100:8"), else, inside a job, nvidia-smi's count. (None, "")
    when unknown (a dry run on a login node)."""
    if re.fullmatch(r"[0-9]+", env.get("SLURM_GPUS_ON_NODE", "")):
        return int(env["SLURM_GPUS_ON_NODE"]), "SLURM_GPUS_ON_NODE"
    match = re.search(r"([0-9]+)$", env.get("SLURM_GPUS_PER_NODE", ""))
    if match:
        return int(match.group(1)), "SLURM_GPUS_PER_NODE"
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if env.get("SLURM_JOB_ID") and smi:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout
        count = sum(line.startswith("GPU ") for line in listing.splitlines())
        if count:
            return count, "nvidia-smi -L"
    return None, ""


def job_hosts(env: Mapping[str, str], nodes: int) -> list[str]:
    """Hostnames of the allocation (placeholders node0.. outside Slurm, for DRY_RUN)."""
    if not env.get("SLURM_JOB_NODELIST"):
        return [f"node{i}" for i in range(nodes)]
    try:
        proc = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], capture_output=True,
                              text=True)
    except FileNotFoundError:
        return []
    sys.stderr.write(proc.stderr)
    return proc.stdout.splitlines()


def normalized_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST without architecture-specific suffixes ("9.0a" -> "9.0", "9.0a+PTX" ->
    "9.0+PTX"): DeepSpeed 0.19's op builder reads each entry as MAJOR.MINOR[+PTX] and fails on the
    suffix ("invalid literal for int() with base 10: '0a'"), and fused Adam then falls back to torch's
    Adam without a word. Adam uses no sm_90a-only instruction (benchmarks/gpu_check.sh does the same)."""
    return re.sub(r"([0-9]+\.[0-9]+)[a-z]", r"\1", value)


def runtime_env(env: MutableMapping[str, str], notes: list[str]) -> dict[str, str]:
    """NCCL / CUDA defaults that are right on any cluster, each only where the environment has none.
    Network settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, FI_PROVIDER, ...) are site-specific: SITE_ENV."""
    exports = {
        # Megatron's TP/SP communication overlap relies on kernels launching in issue order.
        "CUDA_DEVICE_MAX_CONNECTIONS": get(env, "CUDA_DEVICE_MAX_CONNECTIONS", "1"),
        # A failed or hung collective aborts the job instead of hanging until the time limit.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": get(env, "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        # Fewer cudaMalloc retries and less fragmentation with variable activation sizes.
        "PYTORCH_CUDA_ALLOC_CONF": get(env, "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        "NCCL_DEBUG": get(env, "NCCL_DEBUG", "WARN"),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    arch = env.get("TORCH_CUDA_ARCH_LIST")
    if arch and normalized_arch_list(arch) != arch:
        exports["TORCH_CUDA_ARCH_LIST"] = normalized_arch_list(arch)
        notes.append(f"TORCH_CUDA_ARCH_LIST={arch} -> {exports['TORCH_CUDA_ARCH_LIST']} (DeepSpeed's op builder "
                     "cannot parse an architecture suffix)")
    env.update(exports)
    return exports


def torchrun_features() -> tuple[bool, bool]:
    """Which of torchrun's newer flags this torch has, read from its source (importing torch takes
    seconds): --signals-to-handle (torch 2.9) lets torchrun pass USR1 on to the trainers,
    --shutdown-timeout (torch 2.11) sets how long it then waits for them (30 s before)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise LaunchError(f"torch is not installed for {shutil.which('python') or sys.executable}: set VENV, or load "
                          "it in SITE_ENV")
    run_py = os.path.join(spec.submodule_search_locations[0], "distributed", "run.py")
    try:
        with open(run_py, encoding="utf-8") as f:
            source = f.read()
    except OSError:
        source = ""
    return '"--signals-to-handle"' in source, '"--shutdown-timeout"' in source


def check_trainer_flags(train_args: list[str], world: int, extra_args: str):
    """The trainer's own parser and batch arithmetic over the full command line (EXTRA_ARGS included),
    at submit time and under DRY_RUN: a typo in a flag fails here, in one line, before the queue wait
    and the allocation (megatron_lev/training/arguments.py: `validate_flags`, which reads no data and
    imports no torch). Its warnings (ignored Megatron-LM flags) are passed on. Returns the trainer's
    arguments and DeepSpeed config."""
    from megatron_lev.training.arguments import validate_flags
    from megatron_lev.utils.errors import ConfigError

    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            result = validate_flags(train_args, world)
    except SystemExit:  # argparse's refusal, printed as "megatron_lev.train: error: ..."
        result = None
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        said.write(f"megatron_lev.train: error: {exc}\n")
        result = None
    out = said.getvalue().rstrip("\n")
    if result is None:
        line = next((l for l in out.splitlines() if "error: " in l), out.splitlines()[-1] if out else "")
        line = line.split("error: ", 1)[1] if "error: " in line else line
        given = f' (EXTRA_ARGS="{extra_args}")' if extra_args else ""
        raise LaunchError(f"the trainer refuses its flags{given}: {line}")
    if out:
        print(out, file=sys.stderr, flush=True)
    return result


def dry_run_text(launch: Launch, env: Mapping[str, str]) -> str:
    lines = ["# DRY_RUN=1: nothing was launched. Environment exported to every task:"]
    shown = DRY_RUN_VARIABLES + (("TORCH_CUDA_ARCH_LIST",) if "TORCH_CUDA_ARCH_LIST" in launch.exports else ())
    for name in shown:
        lines.append(f"export {name}={bash_quote(env[name])}" if name in env else f"unset {name}")
    lines += [f"# {note}" for note in launch.notes]
    lines += [f"# Batch: {launch.batch.summary()}",
              f"# Checkpoints (--save, and --load to resume): {launch.checkpoint_dir}",
              f"# Disk: {launch.disk.summary()}",
              *([f"# Resume: {launch.conversion.summary()}"] if launch.conversion else []),
              f"# Decoder layers compiled (COMPILE_LAYERS={int(launch.compile_layers)}): "
              f"{'yes' if launch.compile_layers else 'no'}",
              f"# Restarts: a failed step restarts in the allocation from the latest checkpoint, up to "
              f"MAX_RESTARTS={launch.max_restarts} times; then the job requeues if it made progress "
              f"(MAX_REQUEUES={launch.max_requeues})",
              f"# The batch shell runs (one task per node, logs in {launch.job_log_dir}):",
              print_cmd(launch.srun_cmd)]
    for i, host in enumerate(launch.hosts):
        lines += [f"# node {i} ({host}) runs:", print_cmd(launch.torchrun_cmd)]
    return "\n".join(lines) + "\n"

