"""TEST-ONLY: slows DeepSpeed's universal conversion down, in every Python process started with this
folder on PYTHONPATH (tests/test_slurm_resize.py), to make it outlast --distributed-timeout-minutes 1
or to interrupt it half-way. Nothing in the package knows of it.

    MEGATRON_LEV_TEST_SLOW_CONVERSION=SECONDS   sleep that long ...
    MEGATRON_LEV_TEST_SLOW_PHASE=start|merge    ... before ds_to_universal.main starts (default), or
                                                after its extraction, before the merge (half-way)

    MEGATRON_LEV_TEST_PROCESS_LOG=PATH          append "<time> <pid> start <command line>" for every
                                                Python process, and "<time> <pid> conversion done"
                                                when a conversion returns, so a test can tell the
                                                trainers started after the conversion ended

It prints one line when it starts sleeping, so a test knows the conversion has got that far.
"""
import importlib.abc
import importlib.util
import os
import sys
import time

_MODULE = "deepspeed.checkpoint.ds_to_universal"


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


class _SlowConversion(importlib.abc.MetaPathFinder):
    """Patches ds_to_universal right after it is imported."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            seconds = float(os.environ["MEGATRON_LEV_TEST_SLOW_CONVERSION"])
            phase = os.environ.get("MEGATRON_LEV_TEST_SLOW_PHASE", "start")
            attribute = "main" if phase == "start" else "_merge_tp_slice_files"
            setattr(module, attribute, _slowed(getattr(module, attribute), phase, seconds))

        spec.loader.exec_module = exec_module
        return spec


if _PROCESS_LOG:
    with open("/proc/self/cmdline", "rb") as cmdline:  # sys.argv is not set yet when site runs
        _record("start " + " ".join(part.decode(errors="replace") for part in cmdline.read().split(b"\0") if part))
if os.environ.get("MEGATRON_LEV_TEST_SLOW_CONVERSION"):
    sys.meta_path.insert(0, _SlowConversion())
