"""What a training run's log holds besides the trainer's own lines.

A healthy run's log is Megatron-style lines and what the user needs to act on. Third-party
chatter goes to the debug level (`--logging-level 10`, Megatron-LM's flag, shows it):
  - megatron-core's UserWarnings that do not apply to this stack (NOISY_MEGATRON_CORE_WARNINGS),
    filtered for megatron.core's modules only, never globally;
  - what DeepSpeed prints (not logs) while it builds the engine (`quiet_deepspeed`): the bf16
    optimizer's memory dumps (`see_memory_usage(..., force=True)`, six per engine, each after a
    full `gc.collect()`: 1.3 s of rank 0's start-up in the tiny bf16 run, docs/performance.md),
    the CPU build's "op built successfully".
DeepSpeed's logger stays at its default, WARNING, unless --logging-level asks for more.

`StartupTimer` splits the start-up into phases, from the process start (not from the first
import of this module), for the ` > start-up` line and the first iteration line's "time to
first step".
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import time
import warnings
from typing import Iterator, Optional

LOGGER = logging.getLogger("megatron_lev")

# megatron-core warnings (message starts) that say nothing a user of this stack can act on:
# CUDA_DEVICE_MAX_CONNECTIONS is set by the Slurm scripts on GPUs, and means nothing on the
# CPU path; its deprecated default cuda_graph_scope="full" (no CUDA graphs are used here).
NOISY_MEGATRON_CORE_WARNINGS = (
    "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    "When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    "full scope is deprecated",
)


def is_debug(logging_level: Optional[int]) -> bool:
    return logging_level is not None and logging_level <= logging.DEBUG


def configure_logging(logging_level: Optional[int]) -> None:
    """Megatron-LM's --logging-level (a Python level: 10 debug, 20 info, ...) for the root,
    DeepSpeed's and this package's loggers; below it, the third-party noise above is hidden."""
    if logging_level is not None:
        logging.basicConfig(level=logging_level, format="%(name)s: %(levelname)s: %(message)s")
        for name in ("", "DeepSpeed", "megatron_lev"):
            logging.getLogger(name).setLevel(logging_level)
    if is_debug(logging_level):
        return
    for message in NOISY_MEGATRON_CORE_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning, module=r"megatron\.core")


@contextlib.contextmanager
def quiet_prints(logging_level: Optional[int], what: str) -> Iterator[None]:
    """Route what third-party code print()s (to sys.stdout) inside the block to this package's
    logger at debug level; shown as it is with --logging-level 10, and on stderr if the block
    raises (it may explain the failure). Loggers keep their own streams."""
    if is_debug(logging_level):
        yield
        return
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    except BaseException:
        sys.stderr.write(captured.getvalue())
        raise
    for line in captured.getvalue().splitlines():
        LOGGER.debug("%s: %s", what, line)


@contextlib.contextmanager
def quiet_deepspeed(logging_level: Optional[int]) -> Iterator[None]:
    """`quiet_prints` for building a DeepSpeed engine, and its memory reports skipped: inside the
    block DeepSpeed's modules call a stand-in for `see_memory_usage` that logs the message at
    debug level instead of collecting garbage, querying memory and printing three lines."""
    if is_debug(logging_level):
        yield
        return
    from deepspeed.runtime import utils as ds_utils

    original = ds_utils.see_memory_usage

    def memory_usage_to_debug(message, force=False):
        if force:
            LOGGER.debug("deepspeed memory report skipped: %s", message)

    # A copy: other threads (Inductor's compile workers) may import while this runs.
    patched = [module for name, module in sys.modules.copy().items()
               if name.startswith("deepspeed") and getattr(module, "see_memory_usage", None) is original]
    for module in patched:
        module.see_memory_usage = memory_usage_to_debug
    try:
        with quiet_prints(logging_level, "deepspeed.initialize"):
            yield
    finally:
        for module in patched:
            module.see_memory_usage = original


def process_start_time() -> float:
    """When this process started (epoch seconds): /proc's start time, else now."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


class StartupTimer:
    """Wall-clock phases from the process start: `mark(name)` ends the phase running since
    the previous mark (the first one: since the process started, i.e. the imports)."""

    def __init__(self, start: Optional[float] = None):
        self.start = process_start_time() if start is None else start
        self.last = self.start
        self.phases: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        now = time.time()
        self.phases.append((name, now - self.last))
        self.last = now

    def since_start(self) -> float:
        return time.time() - self.start

    def line(self) -> str:
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.phases)
        return f" > start-up (seconds): {parts}; {self.last - self.start:.1f} in all before the first step"
