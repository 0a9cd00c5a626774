"""Parallel wiring: launcher detection, megatron-core groups, CPU RNG tracker, mpu adapter."""
import pytest
import torch
import torch.distributed as dist

from megatron_lev.distributed.launch import cuda_device_index, detect_launch_env
from megatron_lev.distributed.rng import CPURNGStatesTracker, get_rng_tracker, set_seed
from megatron_lev.distributed.state import DeepSpeedMPU, initialize_model_parallel
from tests.distributed import run_distributed


def test_detect_launch_env_torchrun_slurm_single():
    env = detect_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                             "MASTER_ADDR": "n0", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.launcher) == \
        (3, 8, 1, "n0", 1234, "torchrun")
    env = detect_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
                             "SLURM_JOB_ID": "123456", "MASTER_ADDR": "gpu01"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.launcher) == (5, 16, 5, "gpu01", "slurm")
    assert env.master_port == 10000 + 123456 % 50000
    env = detect_launch_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "5"})
    assert (env.rank, env.world_size, env.launcher) == (2, 4, "mpi")
    env = detect_launch_env({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single") and env.master_port > 0


def test_local_world_size_and_too_few_gpus_refused(monkeypatch):
    """Processes per node from each launcher; a node with fewer GPUs than processes is
    refused (local_rank % count would put two ranks on one GPU)."""
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "10", "SLURM_LOCALID": "1", "MASTER_ADDR": "n0"}
    assert detect_launch_env({**slurm, "SLURM_STEP_TASKS_PER_NODE": "4(x2),2",
                              "SLURM_NODEID": "2"}).local_world_size == 2
    assert detect_launch_env({**slurm, "SLURM_TASKS_PER_NODE": "4(x2),2",
                              "SLURM_NODEID": "1"}).local_world_size == 4
    assert detect_launch_env({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0",
                              "LOCAL_WORLD_SIZE": "8"}).local_world_size == 8
    mpi = detect_launch_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                             "MASTER_ADDR": "h"})
    assert (mpi.local_rank, mpi.local_world_size) == (1, 2)
    assert cuda_device_index(mpi, 2) == 1 and cuda_device_index(mpi, 8) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RuntimeError, match=r"^this node runs 2 processes \(mpi\) but exposes 1 GPU\(s\) "
                                           r"\(CUDA_VISIBLE_DEVICES=0\): start one process per GPU"):
        cuda_device_index(mpi, 1)


def test_cpu_rng_tracker_fork_is_isolated_and_restorable():
    tracker = CPURNGStatesTracker()
    tracker.add("a", 1234)
    torch.manual_seed(7)
    expected_default = torch.rand(3)
    torch.manual_seed(7)
    with tracker.fork("a"):
        first = torch.rand(3)
    # The default stream is untouched by the fork.
    assert torch.equal(torch.rand(3), expected_default)
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(1234)))
    saved = tracker.get_states()
    with tracker.fork("a"):
        second = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("a"):
        again = torch.rand(3)
    assert torch.equal(second, again) and not torch.equal(first, second)


def _groups_and_seeds(rank, world_size):
    from megatron.core import parallel_state

    initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    set_seed(1234)
    mpu = DeepSpeedMPU()
    with get_rng_tracker().fork():
        tp_draw = torch.rand(4)
    default_draw = torch.rand(4)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=mpu.get_model_parallel_group())
    return {
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "mp": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()),
        "dp": (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()),
        "pp_world": mpu.get_pipeline_model_parallel_world_size(),
        "tp_sum": t.item(), "tp_draw": tp_draw, "default_draw": default_draw,
        "gloo_groups": _gloo_groups_created(),
    }


def _gloo_groups_created() -> dict:
    """Whether megatron-core made its gloo duplicate groups, on CPU and where CUDA is used
    (is_available patched: the groups are created by the same call on the gloo world)."""
    from megatron.core import parallel_state

    created = {"cpu": parallel_state.get_data_parallel_group_gloo() is not None}
    parallel_state.destroy_model_parallel()
    is_available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
        created["cuda"] = parallel_state._DATA_PARALLEL_GROUP_GLOO is not None
    finally:
        torch.cuda.is_available = is_available
    return created


def test_two_ranks_tensor_parallel_groups_rng_and_mpu():
    r0, r1 = run_distributed(_groups_and_seeds, world_size=2)
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1)
    assert r0["mp"] == (0, 2) and r1["mp"] == (1, 2)
    assert r0["dp"] == (0, 1) and r1["dp"] == (0, 1) and r0["pp_world"] == 1
    assert r0["tp_sum"] == r1["tp_sum"] == 3.0
    # Same default stream on both TP ranks, distinct model-parallel streams.
    assert torch.equal(r0["default_draw"], r1["default_draw"])
    assert not torch.equal(r0["tp_draw"], r1["tp_draw"])
    assert r0["gloo_groups"] == r1["gloo_groups"] == {"cpu": True, "cuda": False}
