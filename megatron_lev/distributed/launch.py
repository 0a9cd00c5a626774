"""Start torch.distributed from whatever launched this process.

torchrun, the deepspeed launcher, Slurm's srun and Open MPI's mpirun each describe the job in
their own environment variables; `detect_launch_env` reads any of them into one `LaunchEnv`, and
`init_distributed` starts the process group from it (nccl on GPUs, gloo on CPU).
"""
from __future__ import annotations

import ctypes
import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


# The same settings as glibc tunables, plus the per-thread cache off: read only at process
# start, so CPU launchers put them in their children's environment (`cpu_malloc_environ`).
CPU_MALLOC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.tcache_count=0"


def cpu_malloc_environ(environ=None) -> dict:
    """The environment variables a CPU training process should start with so that it reuses
    freed memory every time (see `retain_freed_cpu_memory`): {"GLIBC_TUNABLES": ...}, or
    nothing when the user set any MALLOC_* or GLIBC_TUNABLES (theirs win)."""
    environ = os.environ if environ is None else environ
    return {} if any(name in environ for name in _MALLOC_ENV) else {"GLIBC_TUNABLES": CPU_MALLOC_TUNABLES}


def retain_freed_cpu_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of handing it back to the kernel.

    By default glibc serves every allocation over 32 MB (logits, flattened gradients) with
    a fresh mmap and unmaps it when freed, and trims the heap after each large free, so a
    CPU training step faults in the same pages again every step (measured on the demo tied
    model: 486 ms a step with the defaults, 463 ms without the faults). With mmap
    off and a 2 GB trim threshold the process keeps its peak working set (what a GPU's
    caching allocator does). glibc only, CPU runs only, and not when MALLOC_* or
    GLIBC_TUNABLES is set. Returns whether it applied.

    Set here, in a running process, it is not enough every time: torch allocates with
    posix_memalign, whose small alignment remainders sit in glibc's per-thread cache and can
    keep a freed 64 MB block from serving the next 64 MB request (whether that happens
    depends on the heap's layout, even on the size of the environment). Started with
    `cpu_malloc_environ()`'s tunables, which also turn that cache off, a process reuses the
    block every time; tools/quickstart.sh starts its CPU runs so.
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
