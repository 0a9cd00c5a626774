#!/usr/bin/env python
"""What the trainer's per-interval diagnostics cost against a training step (issue 43).

    python benchmarks/bench_watch.py                       # the CPU demo config, lev / tied / untied
    python benchmarks/bench_watch.py --kinds lev --repeats 20

One process, one rank, the demo's model and batch (demo-*.yaml: micro-batch 8, global batch 16,
so a step is 2 micro-batches), each kind's engine built as `python -m megatron_lev.train`
builds it (ZeRO-1). Timed, with the medians over `--repeats`:

    step                  one optimizer step (forward, backward, optimizer) without diagnostics
    family_grad_norms     the two families' gradient norms (training/diagnostics.py), read where the
                          optimizer holds the reduced gradients, and their all-reduce
    embedding_statistics  the input embedding's RMS, cosine and effective rank over its 512 fixed ids
    straggler_report      the gather of every rank's timers for the straggler report (training/timers.py;
                          the timers themselves run in every timed step, as in the trainer)

The diagnostics run once per log interval: `ratio_per_logged_step` is their sum over one step's
time (the cost at --log-interval 1), `ratio_at_log_interval_10` the same spread over 10 steps.
On a shared machine wall time is noisy: the load average at start and end is reported.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():  # before DeepSpeed is imported: its CPU accelerator
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import (SIZES, as_inputs, environment, finish_report, start_process_group,  # noqa: E402
                         trainer_argv, zipf_batches)

KINDS = ("lev", "tied", "untied")
GLOBAL_BATCH = 16  # the demo's: two micro-batches of 8 per step on one rank


def build_engine_for(kind: str):
    from megatron_lev.training.arguments import parse_args, validate_args
    from megatron_lev.training.ds_config import build_deepspeed_config
    from megatron_lev.training.engine import build_engine
    from megatron_lev.training.validation import build_model_config

    size = SIZES["demo"].resolved()
    argv = trainer_argv(size, kind, bf16=False)
    argv[argv.index("--global-batch-size") + 1] = str(GLOBAL_BATCH)
    args = validate_args(parse_args(argv), world_size=1)
    config = build_model_config(args)
    return args, config, build_engine(args, config, build_deepspeed_config(args))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_kind(kind: str, repeats: int, device) -> dict:
    from megatron_lev.training.batches import model_inputs
    from megatron_lev.training.diagnostics import EmbeddingWatch
    from megatron_lev.training.timers import STEP, StepTimers

    args, config, engine = build_engine_for(kind)
    try:
        watch = EmbeddingWatch(engine, config.vocab_size, args.clip_grad, device)
        size = SIZES["demo"].resolved()
        accumulation = args.gradient_accumulation_steps
        batches = [as_inputs(w, device, config.vocab_size)
                   for w in zipf_batches(config.vocab_size, size.micro_batch_size, size.seq_length, accumulation * 4)]
        family_times = []
        reduce_family_norms = watch._reduce_family_norms

        def timed_family_norms():  # the armed step's extra work, timed where it runs
            start = time.perf_counter()
            norms = reduce_family_norms()
            family_times.append(time.perf_counter() - start)
            return norms

        watch._reduce_family_norms = timed_family_norms
        timers = StepTimers(device)  # --timing-log-level 0, the default
        timers.install(engine)

        def step(i: int) -> None:
            engine.train()
            with timers(STEP).timing():
                micro_batches(i)

        def micro_batches(i: int) -> None:
            for j in range(accumulation):
                b = batches[(i * accumulation + j) % len(batches)]
                loss = engine(b["tokens"], **model_inputs(b))
                engine.backward(loss)
                engine.step()

        step(0)  # warm-up: the first step allocates Adam's moments
        steps, embedding, stragglers = [], [], []
        for i in range(1, repeats + 1):
            steps.append(timed(lambda: step(i)))
            watch.arm()
            step(i)  # an armed step: its family-norm work is timed inside
            embedding.append(timed(watch.embedding_record))
            stragglers.append(timed(lambda: timers.report(2)))
        step_s = statistics.median(steps)
        parts = {"family_grad_norms": statistics.median(family_times),
                 "embedding_statistics": statistics.median(embedding),
                 "straggler_report": statistics.median(stragglers)}
        per_log = sum(parts.values())
        return {"step_s_median": step_s, "step_s_min": min(steps), "diagnostics_s_median": parts,
                "diagnostics_s_per_log": per_log, "ratio_per_logged_step": per_log / step_s,
                "ratio_at_log_interval_10": per_log / (10 * step_s), "repeats": repeats}
    finally:
        getattr(engine, "destroy", lambda: None)()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--output", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"benchmark": "bench_watch", "environment": environment(device), "config": "demo", "kinds": {}}
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON only (DeepSpeed prints)
        start_process_group(device)
        for kind in args.kinds:
            report["kinds"][kind] = bench_kind(kind, args.repeats, device)
            print(f"[{kind}] step {1000 * report['kinds'][kind]['step_s_median']:.1f} ms, diagnostics "
                  f"{1000 * report['kinds'][kind]['diagnostics_s_per_log']:.2f} ms per log line", file=sys.stderr)
    report["max_ratio_per_logged_step"] = max(k["ratio_per_logged_step"] for k in report["kinds"].values())
    return finish_report(report, device, args.output)


if __name__ == "__main__":
    main()
