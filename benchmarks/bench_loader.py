#!/usr/bin/env python
"""The trainer's step with the data loader in the training process (--num-workers 0) against
DataLoader worker processes (--num-workers 2), on real data (issue 43).

    python benchmarks/bench_loader.py                      # demo-lev, 2 x 3 interleaved runs of 12 steps
    python benchmarks/bench_loader.py --workers 0 2 4 --repeats 2 --steps 20

One process: a one-rank process group, then `megatron_lev.train.main` (the trainer itself: the
indexed dataset, Megatron's sampler, the collate with LEV's distinct ids, the DeepSpeed engine)
run again and again, each worker count in turn, the order rotated from one repetition to the
next so load drift hits them alike. Data: a Python-documentation corpus tokenized with a small
SentencePiece model, built in a temporary folder (or --data-path / --tokenizer-model).

Per worker count: the median step time (metrics.jsonl `step_time_s`, the first step of each run
left out: it compiles), and the time the training process waited for a micro-batch per step
(`batch-generator`, `--timing-log-level 2`). `ratios`: each count's median step over workers
0's (<= 1: no slower). The CPU load average at start and end is reported.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import environment, finish_report  # noqa: E402

BATCH_GENERATOR = re.compile(r"    batch-generator \.+: \(([\d.]+), ([\d.]+)\)")


def build_data(work: str) -> tuple[str, str]:
    """(dataset prefix, SentencePiece model) of the test suite's Python corpus."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.fixtures import build_corpus, build_spm, build_tiny_dataset

    corpus = build_corpus(work)
    tokenizer = build_spm(corpus, work)
    return build_tiny_dataset(corpus, tokenizer, work), tokenizer


def one_run(args, workers: int, work: str, index: int) -> dict:
    from megatron_lev.train import main

    metrics = os.path.join(work, f"run{index}_w{workers}.jsonl")
    argv = ["--config", args.config, "--data-path", args.data_path, "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", args.tokenizer_model, "--split", "98,1,1",
            "--data-cache-path", os.path.join(work, "cache"), "--num-workers", str(workers),
            "--train-iters", str(args.steps), "--lr-warmup-iters", "1", "--log-interval", "1",
            "--eval-interval", str(10 * args.steps), "--eval-iters", "1", "--timing-log-level", "2",
            "--metrics-file", metrics, "--seed", "1234"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"bench_loader.py: the run with --num-workers {workers} exited {code}:\n{out.getvalue()[-3000:]}")
    with open(metrics, encoding="utf-8") as f:
        steps = [r["step_time_s"] for r in map(json.loads, f) if "loss" in r]
    waits = [float(m[2]) / 1000 for m in BATCH_GENERATOR.finditer(out.getvalue())]
    return {"step_times_s": steps[1:], "batch_generator_s": waits[1:]}  # the first step compiles


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="demo-lev")
    p.add_argument("--workers", nargs="+", type=int, default=[0, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--data-path", help="indexed dataset prefix (default: built here)")
    p.add_argument("--tokenizer-model", help="its SentencePiece model")
    p.add_argument("--output", help="also write the JSON here")
    args = p.parse_args(argv)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"benchmark": "bench_loader", "environment": environment(device), "config": args.config,
              "steps_per_run": args.steps, "repeats": args.repeats, "workers": {}}
    with tempfile.TemporaryDirectory() as work, contextlib.redirect_stdout(sys.stderr):
        if not args.data_path:
            args.data_path, args.tokenizer_model = build_data(work)
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": os.environ.get("MASTER_PORT", "29517")})
        from megatron_lev.distributed.launch import init_distributed

        init_distributed(backend="gloo")
        runs = {w: {"step_times_s": [], "batch_generator_s": []} for w in args.workers}
        for rep in range(args.repeats):
            order = args.workers[rep % len(args.workers):] + args.workers[:rep % len(args.workers)]
            for workers in order:
                for key, values in one_run(args, workers, work, rep).items():
                    runs[workers][key] += values
                print(f"[repetition {rep + 1}/{args.repeats}] --num-workers {workers}: step "
                      f"{1000 * statistics.median(runs[workers]['step_times_s']):.1f} ms", file=sys.stderr, flush=True)
    for workers, times in runs.items():
        report["workers"][str(workers)] = {
            "step_time_s_median": statistics.median(times["step_times_s"]),
            "step_time_s_min": min(times["step_times_s"]),
            "batch_generator_s_median": statistics.median(times["batch_generator_s"]),
            "steps": len(times["step_times_s"])}
    base = report["workers"][str(args.workers[0])]
    report["ratios"] = {f"workers_{w}_over_{args.workers[0]}": v["step_time_s_median"] / base["step_time_s_median"]
                        for w, v in report["workers"].items() if w != str(args.workers[0])}
    report["ratios_of_fastest_step"] = {f"workers_{w}_over_{args.workers[0]}": v["step_time_s_min"] / base["step_time_s_min"]
                                        for w, v in report["workers"].items() if w != str(args.workers[0])}
    return finish_report(report, device, args.output)


if __name__ == "__main__":
    main()
