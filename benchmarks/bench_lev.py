"""LEV embedding speed and memory vs a dense embedding table, printed as JSON.

    python benchmarks/bench_lev.py                 # 4 x 2048 tokens, V = 50,304 and 200,064, D = 2048
    python benchmarks/bench_lev.py --quick         # small and fast (smoke test)

For each vocabulary size and id distribution (Zipf-like, as in text, and uniform),
times one forward+backward of, in this process:

  embedding      torch.nn.Embedding(V, D), output transposed to [s, b, D] as megatron does
                 (the baseline)
  lev_unique     ParallelLEVEmbedding, each distinct id of the micro-batch evaluated once
  lev_position   ParallelLEVEmbedding with unique_ids=False: the generator on every position

Reported per run: median wall seconds of forward and of forward+backward over --reps,
median CPU seconds of forward+backward (less sensitive to other load on a shared
machine), peak memory of the step above what was allocated before it (parameter
gradients included: they are allocated in the step), and ratios to the embedding's
times. CUDA: torch.cuda.max_memory_allocated. CPU: peak resident set size (VmHWM,
reset through /proc/self/clear_refs), after returning freed heap memory to the OS.
The LEV outputs of both evaluation modes are checked to be bit-identical.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lev.lev.generator import LEVConfig  # noqa: E402
from megatron_lev.lev.parallel import ParallelLEVEmbedding  # noqa: E402

METHODS = ("embedding", "lev_unique", "lev_position")
DISTRIBUTIONS = ("zipf", "uniform")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sample_ids(distribution: str, vocab_size: int, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Zipf: P(rank k) ~ 1/k over the vocabulary (natural-language unigram statistics),
    ranks scattered over ids by a fixed permutation. Uniform: every id equally likely."""
    rng = np.random.default_rng(seed)
    n = shape[0] * shape[1]
    if distribution == "uniform":
        ids = rng.integers(0, vocab_size, size=n)
    else:
        p = 1.0 / np.arange(1, vocab_size + 1)
        ids = rng.permutation(vocab_size)[rng.choice(vocab_size, size=n, p=p / p.sum())]
    return torch.from_numpy(ids.astype(np.int64)).view(shape)


class DenseEmbedding(torch.nn.Module):
    """The baseline: a V x D table, [b, s] -> [s, b, D] like megatron's embedding."""

    def __init__(self, vocab_size, hidden_size, dtype, device):
        super().__init__()
        self.table = torch.nn.Embedding(vocab_size, hidden_size, dtype=dtype, device=device)

    def forward(self, ids):
        return self.table(ids).transpose(0, 1).contiguous()


def build(method: str, vocab_size: int, args, device) -> torch.nn.Module:
    if method == "embedding":
        return DenseEmbedding(vocab_size, args.hidden_size, DTYPES[args.dtype], device)
    cfg = LEVConfig(vocab_size=vocab_size, hidden_size=args.hidden_size, unique_ids=method == "lev_unique")
    return ParallelLEVEmbedding(cfg, params_dtype=DTYPES[args.dtype], device=device)


class PeakMemory:
    """Peak bytes allocated during a block, above the level at its start."""

    def __init__(self, device: torch.device):
        self.device = device
        self.libc = None
        if device.type == "cpu":
            try:
                self.libc = ctypes.CDLL("libc.so.6")
            except OSError:
                pass

    @staticmethod
    def _status_bytes(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise KeyError(key)

    def __enter__(self):
        self.peak = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        if self.libc is not None:
            self.libc.malloc_trim(0)  # freed heap memory back to the OS, so RSS starts low
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.base = self._status_bytes("VmRSS")
        except OSError:
            self.base = None
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        elif self.base is not None:
            self.peak = self._status_bytes("VmHWM") - self.base


def measure(module, ids, grad, reps: int, warmup: int, device) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fwd, step, cpu, peaks, out = [], [], [], [], None
    for rep in range(warmup + reps):
        module.zero_grad(set_to_none=True)
        out = None
        with PeakMemory(device) as mem:
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            out = module(ids)
            sync()
            t1 = time.perf_counter()
            out.backward(grad)
            sync()
            t2, c2 = time.perf_counter(), time.process_time()
        if rep >= warmup:
            fwd.append(t1 - t0)
            step.append(t2 - t0)
            cpu.append(c2 - c0)
            peaks.append(mem.peak)
    return {
        "fwd_s": statistics.median(fwd),
        "fwd_bwd_s": statistics.median(step),
        "fwd_bwd_cpu_s": statistics.median(cpu),
        "peak_mem_mib": None if peaks[0] is None else round(max(peaks) / 2**20, 1),
        "output": out.detach(),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-sizes", default="50304,200064", help="comma-separated")
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--distributions", default=",".join(DISTRIBUTIONS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter dtype")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 1 x 256 tokens, D = 256, one rep, no warm-up")
    args = parser.parse_args(argv)
    if args.quick:
        args.micro_batch_size, args.seq_length, args.hidden_size, args.reps, args.warmup = 1, 256, 256, 1, 0
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    methods = [m for m in args.methods.split(",") if m]
    distributions = [d for d in args.distributions.split(",") if d]
    for name, given, allowed in (("--methods", methods, METHODS), ("--distributions", distributions, DISTRIBUTIONS)):
        if not given or set(given) - set(allowed):
            parser.error(f"{name} {','.join(given)}: choose from {','.join(allowed)}")

    shape = (args.micro_batch_size, args.seq_length)
    results = []
    for vocab_size in (int(v) for v in args.vocab_sizes.split(",")):
        for distribution in distributions:
            ids = sample_ids(distribution, vocab_size, shape, args.seed).to(device)
            distinct = int(ids.unique().numel())
            grad = torch.randn(shape[1], shape[0], args.hidden_size,
                               generator=torch.Generator().manual_seed(args.seed)).to(device, DTYPES[args.dtype])
            runs, outputs = {}, {}
            for method in methods:
                module = build(method, vocab_size, args, device)
                run = measure(module, ids, grad, args.reps, args.warmup, device)
                outputs[method] = run.pop("output")
                run["params"] = sum(p.numel() for p in module.parameters())
                runs[method] = run
                del module
            if "lev_unique" in outputs and "lev_position" in outputs \
                    and not torch.equal(outputs["lev_unique"], outputs["lev_position"]):
                raise SystemExit(f"V={vocab_size} {distribution}: unique-id and per-position LEV outputs differ")
            base = runs.get("embedding")
            for method, run in runs.items():
                if base is not None:
                    run["fwd_bwd_ratio_vs_embedding"] = round(run["fwd_bwd_s"] / base["fwd_bwd_s"], 2)
                    run["cpu_ratio_vs_embedding"] = round(run["fwd_bwd_cpu_s"] / base["fwd_bwd_cpu_s"], 2)
                results.append({"vocab_size": vocab_size, "distribution": distribution, "tokens": ids.numel(),
                                "distinct_ids": distinct, "method": method,
                                **{k: round(v, 4) if isinstance(v, float) else v for k, v in run.items()}})
            print(json.dumps(results[-len(runs):]), file=sys.stderr, flush=True)  # progress
    report = {
        "benchmark": "lev_embedding",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "dtype": args.dtype, "hidden_size": args.hidden_size,
        "micro_batch": list(shape), "reps": args.reps, "warmup": args.warmup,
        "lev": {k: v for k, v in LEVConfig(vocab_size=2, hidden_size=args.hidden_size).to_dict().items()
                if k not in ("vocab_size", "hidden_size", "unique_ids", "digit_base")},
        "results": results,
    }
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
