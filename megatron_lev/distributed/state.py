"""megatron-core's parallel groups, and what DeepSpeed needs to see them.

Rank order is megatron-core's: tensor-parallel ranks are adjacent, then data
parallel, then pipeline stages ("tp-dp-pp" with tp fastest). DeepSpeed's
`PipeModelDataParallelTopology` uses axes (pipe, data, model) with model fastest,
which is the same order; `pipe_topology()` builds it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state


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
