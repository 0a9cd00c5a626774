"""Launch N gloo ranks on CPU for multi-process tests.

    results = run_distributed(check_fn, world_size=2, args=(...))

`check_fn(rank, world_size, *args)` must be a module-level function (ranks are
started by multiprocessing's forkserver, so they import it). Each rank has
torch.distributed initialised (gloo) before `check_fn` runs and torn down after.
Whatever it returns (tensors included) comes back as a list indexed by rank. An
exception in any rank fails the caller with that rank's traceback.

Why a forkserver: a spawned rank imports torch and megatron-core afresh, 4-5 s of every
launch on these 2 cores (35 call sites in 26 test files, some in loops); the forkserver imports them
once, single-threaded, and forks each rank from there. Each rank then takes the caller's
environment as it is at the launch (the server's is the one it started with), so a
test's environment reaches its ranks as under spawn.
"""
from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@contextlib.contextmanager
def one_in_process_rank():
    """torch.distributed and megatron-core groups for one in-process rank (TP = PP = 1). The
    launcher variables init_distributed sets are removed again afterwards: later tests'
    subprocesses inherit os.environ (a leaked WORLD_SIZE=1 made every srun task a rank 0)."""
    import torch.distributed as dist

    from megatron_lev.distributed.launch import init_distributed
    from megatron_lev.distributed.state import destroy_parallel, initialize_model_parallel

    saved = {k: os.environ.pop(k, None) for k in LAUNCH_VARIABLES}
    assert not dist.is_initialized()
    try:
        init_distributed(backend="gloo")
        initialize_model_parallel(1, 1)
        yield
    finally:
        destroy_parallel()
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the forkserver (the expensive imports that read no test's environment).
FORKSERVER_PRELOAD = ["torch", "megatron.core"]


def _rank_main(rank, world_size, port, fn, args, out_dir, caller_env, extra_env):
    os.environ.clear()
    os.environ.update(caller_env)
    os.environ.update(extra_env)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
        "DS_ACCELERATOR": "cpu",
    })
    # 2 ranks on 2 cores: one thread each, or they fight over the cores.
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        from megatron_lev.distributed.launch import init_distributed

        init_distributed(backend="gloo", timeout_minutes=5)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # report every failure, SystemExit included
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
    finally:
        from megatron_lev.distributed.state import destroy_parallel

        destroy_parallel()


def run_distributed(fn, world_size: int = 2, args: tuple = (), timeout: float = 600, env: dict | None = None):
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return per-rank results."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts (the first launch)
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_rank_main,
                             args=(r, world_size, port, fn, args, out_dir, dict(os.environ), env or {}))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r}: exited with code {procs[r].exitcode} and no result"
                              + (" (timed out)" if r in hung else ""))
                results.append(None)
                continue
            payload = torch.load(path, weights_only=False)
            if not payload["ok"]:
                errors.append(f"rank {r} failed:\n{payload['error']}")
            results.append(payload.get("result"))
        if errors:
            raise AssertionError("\n".join(errors))
        return results


def torchrun(module_args: list[str], nproc: int = 2, timeout: float = 600, cwd: str | None = None):
    """Run `python -m torch.distributed.run --nproc-per-node N <module_args>` on CPU (gloo,
    one thread per rank) and return the CompletedProcess; fails with its output tail."""
    import subprocess
    import sys

    repo = cwd or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *map(str, module_args)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc
