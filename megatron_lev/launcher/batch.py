"""Batch arithmetic, decided at submit time so that a layout that cannot work is refused before the
allocation starts (also under DRY_RUN): DP = GPUs / (TP x PP); every DP rank takes GLOBAL_BATCH / DP
sequences per step, MICRO_BATCH sequences at a time, accumulated ACCUMULATION times. Without
MICRO_BATCH it is the largest size that fits the GPU (`micro_batch_fits`) and divides the share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from megatron_lev.launcher.shell import LaunchError

# Tokens per GPU per micro-batch, sized for the 1.2B configs (docs/slurm.md "Sizing"): under ZeRO-1
# the weights, gradients and Adam states of 1.2B parameters take 10-12 GB per GPU at TP=1, so tensor
# parallelism would only add communication; the micro-batch is what the activations allow, about
# 5.6 GB per 2048-token sequence.
TOKENS_PER_GPU = {
    "a100": 8192,    # 80 GB (fits 40 GB cards, with little headroom)
    "h100": 16384,   # 80 GB
    "h200": 32768,   # 141 GB
}


def micro_batch_fits(gpu_type: str, seq_length: int) -> int:
    """The largest micro-batch (sequences) the GPU type's activation budget holds, at least 1."""
    if gpu_type not in TOKENS_PER_GPU:
        raise LaunchError(f"GPU_TYPE={gpu_type}: expected a100, h100 or h200")
    return max(TOKENS_PER_GPU[gpu_type] // seq_length, 1)


def nearest_valid(value: int, ok: Callable[[int], bool]) -> str:
    """The nearest values around `value` (down to 1, up to 4 x value) that `ok` accepts, as "A or B"
    (one side when the other has none; empty when neither)."""
    below = next((v for v in range(value - 1, 0, -1) if ok(v)), None)
    above = next((v for v in range(value + 1, 4 * value + 1) if ok(v)), None)
    return " or ".join(str(v) for v in (below, above) if v is not None)


@dataclass(frozen=True)
class BatchPlan:
    data_parallel: int
    micro_batch: int
    accumulation: int
    global_batch: Optional[int]  # None: the config has none (one micro-batch per rank)
    seq_length: int

    def summary(self) -> str:
        global_batch = self.global_batch if self.global_batch is not None else self.data_parallel * self.micro_batch
        return (f"DP={self.data_parallel} x MICRO_BATCH={self.micro_batch} x ACCUMULATION={self.accumulation} = "
                f"GLOBAL_BATCH={global_batch} sequences of {self.seq_length} tokens per step")


def choose_micro_batch(*, nodes: int, gpus_per_node: int, tp: int, pp: int, global_batch: Optional[int],
                       micro_batch: Optional[int], fits: int, seq_length: int) -> BatchPlan:
    """The batch of a layout, or a LaunchError naming the node counts, global batches or
    micro-batches that would work."""
    dp = nodes * gpus_per_node // (tp * pp)
    if global_batch is None:  # no global batch anywhere: one micro-batch per rank
        return BatchPlan(dp, micro_batch or fits, 1, None, seq_length)

    def nodes_split_batch(n: int) -> bool:
        gpus = n * gpus_per_node
        return gpus % (tp * pp) == 0 and global_batch % (gpus // (tp * pp)) == 0

    if global_batch % dp:
        node_counts = nearest_valid(nodes, nodes_split_batch)
        raise LaunchError(
            f"GLOBAL_BATCH={global_batch} sequences cannot be split over data-parallel size {dp} (NODES={nodes} x "
            f"GPUS_PER_NODE={gpus_per_node} / TP={tp} x PP={pp}): use "
            f"{f'NODES={node_counts}, or ' if node_counts else ''}"
            f"GLOBAL_BATCH={nearest_valid(global_batch, lambda b: b % dp == 0)}")
    per_rank = global_batch // dp
    if micro_batch is None:
        micro_batch = min(fits, per_rank)
        while per_rank % micro_batch:
            micro_batch -= 1
    elif per_rank % micro_batch:
        raise LaunchError(f"MICRO_BATCH={micro_batch} does not divide the {per_rank} sequences per data-parallel "
                          f"rank (GLOBAL_BATCH={global_batch} / DP={dp}): use MICRO_BATCH="
                          f"{nearest_valid(micro_batch, lambda m: per_rank % m == 0)}")
    return BatchPlan(dp, micro_batch, per_rank // micro_batch, global_batch, seq_length)
