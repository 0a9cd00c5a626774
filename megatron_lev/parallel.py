"""Parallel wiring: start torch.distributed, set up megatron-core's parallel groups,
seed the RNGs (with a CPU path for what megatron-core only does on CUDA), and give
DeepSpeed the `mpu` it expects.

Rank order is megatron-core's: tensor-parallel ranks are adjacent, then data
parallel, then pipeline stages ("tp-dp-pp" with tp fastest). DeepSpeed's
`PipeModelDataParallelTopology` uses axes (pipe, data, model) with model fastest,
which is the same order; `pipe_topology()` builds it.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import random
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mcore_random

MODEL_PARALLEL_RNG = "model-parallel-rng"
# megatron-core's offset between the data-parallel seed and the tensor-parallel one.
_TP_SEED_OFFSET = 2718


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "mpi" | "single"
    local_world_size: int = 1  # processes on this node


def _local_world_size(env, *names: str) -> int:
    """Processes on this node, from the first of `names` set (Slurm's per-node counts read
    like "2(x3)" or "4,2": this node's entry is the one at SLURM_NODEID)."""
    for name in names:
        value = env.get(name)
        if not value:
            continue
        if name.startswith("SLURM_"):
            counts = []
            for part in value.split(","):
                count, _, times = part.partition("(x")
                counts += [int(count)] * (int(times.rstrip(")")) if times else 1)
            node = int(env.get("SLURM_NODEID", 0))
            return counts[node] if node < len(counts) else counts[-1]
        return int(value)
    return 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_launch_env(environ=None) -> LaunchEnv:
    """Read rank/world size from torchrun, Slurm (srun one task per process) or MPI.

    torchrun's variables win when present (a Slurm job that runs torchrun per node
    sets both). Under plain srun, MASTER_ADDR must be set by the batch script (our
    slurm/ scripts derive it from `scontrol show hostnames`); the port defaults to one
    derived from the job id so concurrent jobs on a node don't collide.
    """
    env = os.environ if environ is None else environ
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         addr, int(env.get("MASTER_PORT", 29500)), "torchrun",
                         _local_world_size(env, "LOCAL_WORLD_SIZE"))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        port = int(env.get("MASTER_PORT", 10000 + int(env.get("SLURM_JOB_ID", 0)) % 50000))
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         int(env.get("SLURM_LOCALID", 0)), addr, port, "slurm",
                         _local_world_size(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    for rank_var, size_var, local_var, local_size_var in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    ):
        if rank_var in env and size_var in env:
            return _mpi_launch_env(env, int(env[rank_var]), int(env[size_var]), int(env.get(local_var, 0)),
                                   _local_world_size(env, local_size_var))
    return LaunchEnv(0, 1, 0, addr, int(env.get("MASTER_PORT", 0)) or _free_port(), "single")


def _mpi_launch_env(env, rank: int, world_size: int, local_rank: int, local_world_size: int) -> LaunchEnv:
    """Under mpirun, rank 0's host becomes the rendezvous address (broadcast with mpi4py)."""
    if "MASTER_ADDR" in env:
        return LaunchEnv(rank, world_size, local_rank, env["MASTER_ADDR"], int(env.get("MASTER_PORT", 29500)), "mpi",
                         local_world_size)
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the cluster
        raise RuntimeError("launched by MPI without MASTER_ADDR: install the 'mpi' extra (mpi4py) "
                           "or export MASTER_ADDR/MASTER_PORT") from exc
    comm = MPI.COMM_WORLD
    addr, port = comm.bcast((socket.gethostname(), _free_port()) if comm.Get_rank() == 0 else None, root=0)
    return LaunchEnv(rank, world_size, local_rank, addr, int(env.get("MASTER_PORT", port)), "mpi", local_world_size)


def cuda_device_index(launch: LaunchEnv, device_count: int) -> int:
    """This process's GPU: its local rank. Refuses a node that exposes fewer GPUs than it
    runs processes, where `local_rank % count` would silently share a GPU between ranks."""
    if launch.local_world_size > device_count or launch.local_rank >= device_count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError(
            f"this node runs {max(launch.local_world_size, launch.local_rank + 1)} processes ({launch.launcher}) but "
            f"exposes {device_count} GPU(s)"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            + ": start one process per GPU (torchrun --nproc-per-node, srun --ntasks-per-node, "
            "GPUS_PER_NODE in slurm/) or request more GPUs (--gres=gpu:N)")
    return launch.local_rank


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# glibc's environment variables for its allocator: a user who sets any of them decides.
_MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
               "GLIBC_TUNABLES")


def retain_freed_cpu_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of handing it back to the kernel.

    By default glibc serves every allocation over 32 MB (logits, flattened gradients) with
    a fresh mmap and unmaps it when freed, and trims the heap after each large free, so a
    CPU training step faults in the same pages again every step (measured on the demo tied
    model: 486 ms a step with the defaults, 463 ms without the faults). With mmap
    off and a 2 GB trim threshold the process keeps its peak working set (what a GPU's
    caching allocator does). glibc only, CPU runs only, and not when MALLOC_* or
    GLIBC_TUNABLES is set. Returns whether it applied.
    """
    if any(name in os.environ for name in _MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def init_distributed(backend: str | None = None, timeout_minutes: int = 30) -> LaunchEnv:
    """Start torch.distributed from the launcher's environment (idempotent).

    Backend: nccl on GPUs, gloo on CPU. Sets the CUDA device from the local rank; on CPU
    keeps freed memory in the process (`retain_freed_cpu_memory`).
    """
    launch = detect_launch_env()
    if dist.is_initialized():
        return launch
    if torch.cuda.is_available():
        torch.cuda.set_device(cuda_device_index(launch, torch.cuda.device_count()))
    else:
        retain_freed_cpu_memory()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ.setdefault("MASTER_ADDR", launch.master_addr)
    os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    # DeepSpeed reads these too.
    os.environ.setdefault("RANK", str(launch.rank))
    os.environ.setdefault("WORLD_SIZE", str(launch.world_size))
    os.environ.setdefault("LOCAL_RANK", str(launch.local_rank))
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )
    return launch


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> None:
    """Create megatron-core's TP/PP/DP groups; world size must be a multiple of TP x PP."""
    world = dist.get_world_size()
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp < 1 or pp < 1 or world % (tp * pp) != 0:
        raise ValueError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} must divide "
            f"the world size {world}")
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() == tp
                and parallel_state.get_pipeline_model_parallel_world_size() == pp):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        order="tp-cp-ep-dp-pp",
        # Gloo duplicates of the groups are only needed on CPU, where they are the groups
        # anyway; on GPUs they would open TCP connections by hostname, which fails
        # multi-node where the hostname resolves to loopback or a wrong interface.
        create_gloo_process_groups=not torch.cuda.is_available(),
    )


def destroy_parallel() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


class CPURNGStatesTracker:
    """megatron-core's CudaRNGStatesTracker, for the CPU generator.

    Keeps named RNG states; `fork(name)` swaps the named state in for the block and
    saves the advanced state on exit. Installed as megatron-core's tracker on CPU so
    code that calls `get_cuda_rng_tracker()` (activation recomputation, dropout in TP
    regions) works the same without CUDA.
    """

    def __init__(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states):
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int):
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        generator = torch.Generator().manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def get_rng_tracker():
    """megatron-core's RNG tracker: the CUDA one on GPU, our CPU one otherwise."""
    if not torch.cuda.is_available() and not isinstance(mcore_random._CUDA_RNG_STATE_TRACKER, CPURNGStatesTracker):
        mcore_random._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return mcore_random.get_cuda_rng_tracker()


def set_seed(seed: int) -> None:
    """Seed python/numpy/torch identically on every rank, and the model-parallel RNG
    per tensor-parallel rank (megatron-core's scheme: seed + 2718 + tp_rank).

    Pipeline stages get distinct default seeds (seed + 100 * pp_rank), as in Megatron.
    Weight initialisation never depends on these per-rank streams: models build full
    tensors from their own seeded generator and slice them (see lev/generator.py / model.py).
    """
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(stage_seed)
        return
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, stage_seed + _TP_SEED_OFFSET + tp_rank)


def rng_state_dict() -> dict:
    """Every RNG stream this process uses, for exact resume."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def load_rng_state_dict(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


class DeepSpeedMPU:
    """The `mpu` object DeepSpeed expects, over megatron-core's parallel_state.

    DeepSpeed calls get_model_parallel_{rank,world_size,group} (what old Megatron's
    mpu called the tensor-parallel group; DeepSpeed uses it to count replicated
    parameters once in the grad norm) and get_data_parallel_*; parallel_state lacks
    the first family. Everything
    else is forwarded to parallel_state. Pass it as `deepspeed.initialize(mpu=...)`
    for plain (non-pipeline) models; a PipelineModule carries its own topology, so
    use mpu=None there.
    """

    def get_model_parallel_rank(self):
        return parallel_state.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self):
        return parallel_state.get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return parallel_state.get_tensor_model_parallel_group()

    def get_data_parallel_rank(self):
        return parallel_state.get_data_parallel_rank()

    def get_data_parallel_world_size(self):
        return parallel_state.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return parallel_state.get_data_parallel_group()

    def __getattr__(self, name):
        return getattr(parallel_state, name)


def pipe_topology(tensor_model_parallel_size: int, pipeline_model_parallel_size: int, world_size: int | None = None):
    """DeepSpeed topology with megatron-core's rank order (tp fastest, then dp, then pp)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    world = world_size or dist.get_world_size()
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (tp * pp))


def is_rank_0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print_rank_0(*args, **kwargs) -> None:
    if is_rank_0():
        print(*args, **kwargs, flush=True)
