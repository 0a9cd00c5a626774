#!/usr/bin/env python
"""Time of the conversion of a training checkpoint to DeepSpeed's universal form (the step a resume at
another layout runs before the trainers: megatron_lev/launcher/resume.py), on CPU.

    python benchmarks/bench_universal.py                       # lev-125m, saved by 2 ranks, ZeRO-2, bf16
    python benchmarks/bench_universal.py --workers 1,2,4 --work-dir /scratch/bench

One process drives it: a 1-iteration run of the config (its vocabulary kept at the config's 50,304
rows, so the checkpoint has the model's real size) saves a checkpoint with torchrun on --dp CPU
ranks; then `python -m megatron_lev.checkpointing.universal` converts it once per worker count
(the universal folder removed in between), each a subprocess timed from start to exit, and by the
converter's own line (without the interpreter's start and imports).

Output: one JSON object: the checkpoint's parameters and bytes, per worker count the seconds and
bytes per second, the speed-up over 1 worker, the load average at start and end; and an estimate
for `--estimate-for` (lev-1.2b): the same bytes per second per worker (the conversion reads every
fp32 state of every rank's files, splits and rewrites it per parameter: its time grows with the
bytes), so seconds = bytes(1.2B) / (bytes per second measured here).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_lev.checkpointing.space import estimated_checkpoint_bytes, folder_bytes  # noqa: E402


def _data(work: str) -> tuple[str, str]:
    """A small corpus, its SentencePiece tokenizer and indexed dataset (the tests' recipe)."""
    from megatron_lev.data.corpus import build_python_corpus, read_documents
    from megatron_lev.data.tokenizer import train_sentencepiece, training_sentences

    corpus, model = os.path.join(work, "python.jsonl.zst"), os.path.join(work, "spm.model")
    build_python_corpus(corpus, max_documents=500)
    train_sentencepiece(training_sentences(r.texts[0] for r in read_documents(corpus)), model, 1000, num_threads=1)
    prefix = os.path.join(work, "python")
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", corpus,
                    "--output-prefix", prefix, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                    model, "--append-eod", "--workers", "1"], check=True, capture_output=True)
    return prefix + "_text_document", model


def _checkpoint(work: str, config: str, dp: int, data: str, tokenizer: str) -> str:
    """One iteration of `config` on `dp` CPU ranks (ZeRO-2, bf16, the Slurm scripts' defaults), saved."""
    from megatron_lev.configs import load_config

    yaml_path = os.path.join(work, "bench.yaml")
    vocab = load_config(config)["model"]["vocab_size"]
    with open(yaml_path, "w") as f:  # a vocab_size of the user's own YAML is kept (the tokenizer has 1000)
        f.write(f"base: {config}\nmodel:\n  vocab_size: {vocab}\n")
    save = os.path.join(work, "ckpt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(dp), "--master-port", "29533",
           "-m", "megatron_lev.train", "--config", yaml_path, "--data-path", data, "--tokenizer-type",
           "SentencePieceTokenizer", "--tokenizer-model", tokenizer, "--split", "98,1,1", "--seq-length", "128",
           "--micro-batch-size", "1", "--global-batch-size", str(dp), "--train-iters", "1", "--lr-warmup-iters", "0",
           "--eval-interval", "100000", "--eval-iters", "1", "--zero-stage", "2", "--bf16", "--save", save, "--data-cache-path",
           os.path.join(work, "cache")]
    proc = subprocess.run(cmd, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"training failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return save


def _convert(save: str, workers: int) -> dict:
    folder = os.path.join(save, "iter_0000001")
    shutil.rmtree(os.path.join(folder, "universal"), ignore_errors=True)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megatron_lev.checkpointing.universal", "--load", save, "--workers",
                           str(workers)], env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"conversion failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    own = float(re.search(r"converted \S+ in ([0-9.]+) s", proc.stdout).group(1))
    return {"workers": workers, "wall_s": round(wall, 1), "conversion_s": own,
            "universal_bytes": folder_bytes(os.path.join(folder, "universal"))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="lev-125m")
    parser.add_argument("--dp", type=int, default=2, help="ranks that save the checkpoint")
    parser.add_argument("--workers", default=f"1,{len(os.sched_getaffinity(0))}", help="worker counts, comma-separated")
    parser.add_argument("--estimate-for", default="lev-1.2b")
    parser.add_argument("--work-dir", help="default: a temporary folder, removed at the end")
    args = parser.parse_args(argv)
    from megatron_lev.configs import load_config
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.param_count import count_parameters

    load_start = os.getloadavg()[0]
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_universal_")
    os.makedirs(work, exist_ok=True)
    try:
        data, tokenizer = _data(work)
        t0 = time.perf_counter()
        save = _checkpoint(work, args.config, args.dp, data, tokenizer)
        train_s = time.perf_counter() - t0
        size = folder_bytes(os.path.join(save, "iter_0000001"))
        with open(os.path.join(save, "iter_0000001", "config.json")) as f:
            parameters = count_parameters(model_config_from_dict(json.load(f)["model"]))["total"]
        runs = [_convert(save, w) for w in dict.fromkeys(int(w) for w in args.workers.split(","))]
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    for run in runs:
        run["MB_per_s"] = round(size / run["conversion_s"] / 1e6, 1)
        run["speedup_over_1_worker"] = round(runs[0]["conversion_s"] / run["conversion_s"], 2)
    target_parameters = count_parameters(model_config_from_dict(load_config(args.estimate_for)["model"]))["total"]
    target_bytes = estimated_checkpoint_bytes(target_parameters, bf16=True)
    report = {
        "benchmark": "universal_conversion", "cpus": len(os.sched_getaffinity(0)), "config": args.config,
        "dp": args.dp, "parameters": parameters, "checkpoint_bytes": size, "train_and_save_s": round(train_s, 1),
        "runs": runs, "load_average_start": load_start, "load_average_end": os.getloadavg()[0],
        "estimate": {"config": args.estimate_for, "parameters": target_parameters, "checkpoint_bytes": target_bytes,
                     "assumption": "time grows with the checkpoint's bytes at the bytes per second measured here",
                     **{f"seconds_at_{r['workers']}_workers": round(target_bytes / (r["MB_per_s"] * 1e6))
                        for r in runs}},
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
