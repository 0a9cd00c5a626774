"""Per-rank step timers: the straggler report of every log line and Megatron-LM's
`--timing-log-level` / `--timing-log-option` timer block (docs/training.md, "Stragglers").

Every rank times its own step and the part of it spent in DeepSpeed's gradient synchronisation
(`all-grads-sync`: the engine's `allreduce_gradients`, ZeRO-2's bucket reductions, the pipeline's
ReduceGrads / ReduceTiedGrads). A rank's *own time* is the difference: what it took to be ready
to synchronise. The step's wall time cannot name a slow rank, since every rank waits for the
slowest in the gradient reduction and they all end the step together; the waiting is inside
`all-grads-sync`, so the slow rank is the one with the largest own time. Each log line then
gathers every rank's own time per iteration (one all-gather of a few numbers) and reports the
minimum, the maximum and the rank and host of the slowest: Megatron-LM's straggler log
(megatron/core/utils.py StragglerDetector, `--log-straggler`: MnRtt/MxRtt and their ranks).

What the own time still contains: tensor-parallel collectives (a TP group is as slow as its
slowest member: the slowest host is still named), pipeline send/receive waits (a stage waits
for its neighbours), ZeRO-3's parameter gathers in forward.

Times are host clocks on CPU; on CUDA each section is timed by CUDA events (no synchronisation
inside the step) and by the host clock, and the larger counts (Megatron's rule), read once per
log line after the synchronisation the log line does anyway.

`--timing-log-level` (Megatron's meaning): 0 reports the iteration time only; 1 adds, after each
log line, the per-iteration time of `forward-backward`, `all-grads-sync` and `optimizer`; 2 also
`batch-generator`, `forward-compute` and `backward-compute`; `--timing-log-option` prints the
`max` over ranks, their `minmax` (default) or `all` ranks' times, in Megatron's format.
"""
from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

# Megatron-LM's timer names and levels (megatron/training/training.py train_step,
# megatron/core/distributed/finalize_model_grads.py).
TIMER_LEVELS = {"forward-backward": 1, "all-grads-sync": 1, "optimizer": 1,
                "batch-generator": 2, "forward-compute": 2, "backward-compute": 2}
STEP, SYNC = "step", "all-grads-sync"  # always timed: the straggler report needs them
TIMING_LOG_OPTIONS = ("max", "minmax", "all")


class SectionTimer:
    """One section's time summed over start/stop pairs (nested pairs count once) since the last read."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.depth = 0
        self.host_total = 0.0
        self.host_start = 0.0
        self.pairs: list = []  # CUDA events (start, stop), read at the log line
        self.host_pairs: list = []

    def start(self) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        self.host_start = time.perf_counter()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.pairs.append([event, None])

    def stop(self) -> None:
        self.depth -= 1
        if self.depth:
            return
        host = time.perf_counter() - self.host_start
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.pairs[-1][1] = event
            self.host_pairs.append(host)
        else:
            self.host_total += host

    @contextlib.contextmanager
    def timing(self):
        self.start()
        try:
            yield
        finally:
            self.stop()

    def read(self) -> float:
        """Seconds since the last read (CUDA: the device must be synchronised), then reset."""
        total = self.host_total
        if self.cuda:  # each pair: the larger of the device's and the host's measure
            total += sum(max(start.elapsed_time(stop) / 1000.0, host)
                         for (start, stop), host in zip(self.pairs, self.host_pairs))
            self.pairs, self.host_pairs = [], []
        self.host_total = 0.0
        return total


class _NoTimer:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    @contextlib.contextmanager
    def timing(self):
        yield


NO_TIMER = _NoTimer()


@dataclass(frozen=True)
class StragglerReport:
    """Own time per iteration over ranks (module docstring)."""

    min_s: float
    max_s: float
    fastest_rank: int
    slowest_rank: int
    slowest_host: str

    def record(self) -> dict:
        return {"rank_time_min_s": self.min_s, "rank_time_max_s": self.max_s, "fastest_rank": self.fastest_rank,
                "slowest_rank": self.slowest_rank, "slowest_host": self.slowest_host}


class StepTimers:
    """This rank's timers; `report()` gathers every rank's (collective) once per log line."""

    def __init__(self, device: torch.device, level: int = 0, option: str = "minmax"):
        self.device, self.level, self.option = device, level, option
        cuda = device.type == "cuda"
        self.timers = {name: SectionTimer(cuda) for name in (STEP, *TIMER_LEVELS)
                       if name in (STEP, SYNC) or TIMER_LEVELS[name] <= level}
        world = dist.get_world_size()
        self.hosts = [None] * world
        dist.all_gather_object(self.hosts, socket.gethostname())

    def __call__(self, name: str):
        return self.timers.get(name, NO_TIMER)

    def install(self, engine) -> None:
        """Time DeepSpeed's gradient synchronisation (`all-grads-sync`) and, in a pipeline, the
        schedule's instructions, on this engine instance."""
        sync = self(SYNC)
        for owner, method in ((engine, "allreduce_gradients"), (engine.optimizer, "reduce_ipg_grads")):
            if hasattr(owner, method):
                setattr(owner, method, _timed(getattr(owner, method), sync))
        table = getattr(engine, "_INSTRUCTION_MAP", None)
        if table is not None:  # DeepSpeed's PipelineEngine: per instance, the class's table
            from deepspeed.runtime.pipe import schedule

            sections = {schedule.ReduceGrads: SYNC, schedule.ReduceTiedGrads: SYNC,
                        schedule.OptimizerStep: "optimizer", schedule.LoadMicroBatch: "batch-generator",
                        schedule.ForwardPass: "forward-compute", schedule.BackwardPass: "backward-compute"}
            engine._INSTRUCTION_MAP = {kind: _timed(fn, self(sections[kind])) if kind in sections else fn
                                       for kind, fn in table.items()}

    def report(self, iterations: int) -> tuple[StragglerReport, Optional[str]]:
        """Every rank's times per iteration since the last report (one all-gather): the straggler
        report, and on rank 0 the `--timing-log-level` block (None at level 0). Collective."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        names = [n for n in TIMER_LEVELS if n in self.timers]
        seconds = {name: timer.read() / max(iterations, 1) for name, timer in self.timers.items()}
        mine = torch.tensor([seconds[STEP] - seconds[SYNC]] + [seconds[n] for n in names], dtype=torch.float64,
                            device=self.device)
        gathered = [torch.empty_like(mine) for _ in self.hosts]
        dist.all_gather(gathered, mine)
        table = torch.stack(gathered).cpu()  # [world, 1 + timers]
        own = table[:, 0]
        slowest, fastest = int(own.argmax()), int(own.argmin())
        report = StragglerReport(float(own[fastest]), float(own[slowest]), fastest, slowest, self.hosts[slowest])
        block = timers_block({n: table[:, 1 + i].tolist() for i, n in enumerate(names)}, self.option) \
            if self.level > 0 else None
        return report, block


def _timed(fn, timer):
    def timed(*args, **kwargs):
        with timer.timing():
            return fn(*args, **kwargs)

    return timed


def timers_block(times: dict[str, list[float]], option: str) -> Optional[str]:
    """Megatron's timer log (megatron/core/timers.py): per timer the max, (min, max) or every
    rank's time per iteration in ms, names padded with dots to 48 characters; ranks that did not
    run a section (0 s: a pipeline stage without it) are left out, as Megatron leaves them."""
    times = {name: {rank: v for rank, v in enumerate(values) if v > 0} for name, values in times.items()}
    times = {name: by_rank for name, by_rank in times.items() if by_rank}
    if not times:
        return None
    if option == "all":
        lines = ["times across ranks (ms):"]
        for name, by_rank in times.items():
            lines.append(f"  {name}:")
            lines += [f"     rank {rank:2d}: {1000 * value:.2f}" for rank, value in by_rank.items()]
        return "\n".join(lines)
    header = "max time across ranks (ms):" if option == "max" else "(min, max) time across ranks (ms):"
    lines = [header]
    for name, by_rank in times.items():
        values = list(by_rank.values())
        label = (name + " ").ljust(48, ".")
        lines.append(f"    {label}: {1000 * max(values):.2f}" if option == "max"
                     else f"    {label}: ({1000 * min(values):.2f}, {1000 * max(values):.2f})")
    return "\n".join(lines)


def straggler_line_fields(record: dict) -> str:
    """The report's fields of the Megatron-style iteration line."""
    if "rank_time_max_s" not in record:
        return ""
    return (f" rank time (ms) min/max: {1000 * record['rank_time_min_s']:.1f} (rank {record['fastest_rank']}) / "
            f"{1000 * record['rank_time_max_s']:.1f} (rank {record['slowest_rank']}, {record['slowest_host']}) |")
