"""TEST-ONLY hooks, in every Python process started with this folder on PYTHONPATH: each is off
unless its environment variable is set. Nothing in the package knows of them.

Holding a training run at given iterations (tests/test_slurm_cluster.py), so that a test kills,
signals or cancels the run at a known iteration instead of racing its speed:

    MEGATRON_LEV_TEST_HOLD_DIR=FOLDER   after the log line of iteration N (its metrics record
                                        written), each trainer process waits while
                                        FOLDER/iter_N.hold exists, or until SIGTERM/SIGUSR1 reaches
                                        it (the trainer's own handler): the signal is then acted
                                        on at the next step, as without the hold

Slowing DeepSpeed's universal conversion down (tests/test_slurm_resize.py), to make it outlast
--distributed-timeout-minutes 1 or to interrupt it half-way:

    MEGATRON_LEV_TEST_SLOW_CONVERSION=SECONDS   sleep that long ...
    MEGATRON_LEV_TEST_SLOW_PHASE=start|merge    ... before ds_to_universal.main starts (default), or
                                                after its extraction, before the merge (half-way)

    MEGATRON_LEV_TEST_PROCESS_LOG=PATH          append "<time> <pid> start <command line>" for every
                                                Python process, and "<time> <pid> conversion done"
                                                when a conversion returns, so a test can tell the
                                                trainers started after the conversion ended

Each prints one line when it starts waiting or sleeping, so a test knows the run has got that far.
"""
import importlib.abc
import importlib.util
import os
import sys
import time


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Calls `patch(module)` right after the module named `name` is imported (once, by whoever
    imports it first), so the hook changes nothing else of the process."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


# --------------------------------------------------------------------------- holding the trainer

def _held(log, folder: str):
    def log_then_hold(self, *args, **kwargs):
        log(self, *args, **kwargs)
        iteration = self.state.iteration
        hold = os.path.join(folder, f"iter_{iteration}.hold")
        signalled = lambda: self.exit_handler is not None and self.exit_handler.received is not None  # noqa: E731
        if os.path.exists(hold) and not signalled():
            print(f"test hook: rank {self.rank} held after iteration {iteration}", flush=True)
            while os.path.exists(hold) and not signalled():
                time.sleep(0.05)

    return log_then_hold


def _hold_training(module):
    module.Trainer.log = _held(module.Trainer.log, os.environ["MEGATRON_LEV_TEST_HOLD_DIR"])


# --------------------------------------------------------------------------- slowing the conversion

_PROCESS_LOG = os.environ.get("MEGATRON_LEV_TEST_PROCESS_LOG")


def _record(event: str) -> None:
    if _PROCESS_LOG:
        with open(_PROCESS_LOG, "a") as f:  # one short append per line: lines of processes do not mix
            f.write(f"{time.time():.6f} {os.getpid()} {event}\n")


def _slowed(function, phase: str, seconds: float):
    def slow(*args, **kwargs):
        print(f"test hook: the conversion sleeps {seconds:.0f} s ({phase})", flush=True)
        time.sleep(seconds)
        result = function(*args, **kwargs)
        _record("conversion done")
        return result

    return slow


def _slow_conversion(module):
    seconds = float(os.environ["MEGATRON_LEV_TEST_SLOW_CONVERSION"])
    phase = os.environ.get("MEGATRON_LEV_TEST_SLOW_PHASE", "start")
    attribute = "main" if phase == "start" else "_merge_tp_slice_files"
    setattr(module, attribute, _slowed(getattr(module, attribute), phase, seconds))


if os.environ.get("MEGATRON_LEV_TEST_HOLD_DIR"):
    sys.meta_path.insert(0, _PatchAfterImport("megatron_lev.training.trainer", _hold_training))
if _PROCESS_LOG:
    with open("/proc/self/cmdline", "rb") as cmdline:  # sys.argv is not set yet when site runs
        _record("start " + " ".join(part.decode(errors="replace") for part in cmdline.read().split(b"\0") if part))
if os.environ.get("MEGATRON_LEV_TEST_SLOW_CONVERSION"):
    sys.meta_path.insert(0, _PatchAfterImport("deepspeed.checkpoint.ds_to_universal", _slow_conversion))
