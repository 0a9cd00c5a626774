"""TEST-ONLY: holds a training run at given iterations, in every Python process started with this
folder on PYTHONPATH (tests/test_slurm_cluster.py), so that a test kills, signals or cancels the
run at a known iteration instead of racing its speed. Nothing in the package knows of it.

    MEGATRON_LEV_TEST_HOLD_DIR=FOLDER   after the log line of iteration N (its metrics record
                                        written), each trainer process waits while
                                        FOLDER/iter_N.hold exists, or until SIGTERM/SIGUSR1 reaches
                                        it (the trainer's own handler): the signal is then acted
                                        on at the next step, as without the hold

It prints one line when a process starts waiting, so a test knows the run has got that far.
"""
import importlib.abc
import importlib.util
import os
import sys
import time

_MODULE = "megatron_lev.training.trainer"


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


class _HoldTraining(importlib.abc.MetaPathFinder):
    """Patches Trainer.log right after the trainer module is imported."""

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
            module.Trainer.log = _held(module.Trainer.log, os.environ["MEGATRON_LEV_TEST_HOLD_DIR"])

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("MEGATRON_LEV_TEST_HOLD_DIR"):
    sys.meta_path.insert(0, _HoldTraining())
