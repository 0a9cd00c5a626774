"""Seeding and the random streams of a run: megatron-core's model-parallel RNG tracker
(with a CPU version of what megatron-core only does on CUDA) and every stream's state, saved
with checkpoints for an exact resume."""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mcore_random

MODEL_PARALLEL_RNG = "model-parallel-rng"


# megatron-core's offset between the data-parallel seed and the tensor-parallel one.
_TP_SEED_OFFSET = 2718


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
    tensors from their own seeded generator and slice them (see lev/generator.py, models/layers.py).
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
