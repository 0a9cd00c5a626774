#!/usr/bin/env python
"""One-GPU check of the 1.2B configs (run by benchmarks/gpu_check.sh on an H100/H200):

1. bf16 training step time, tokens/s, MFU and memory of `lev-1.2b` and `tied-1.2b`
   (benchmarks/bench_train.py: the trainer's own DeepSpeed engines, ZeRO-1, interleaved
   repetitions, medians) and the LEV/tied step-time ratio. Both engines are resident at
   once; when that does not fit, the micro-batch and then the depth are reduced, and the
   JSON says so (`attempts`, `reduced`).
2. Sequence parallelism of the LEV embedding vs no sequence parallelism. A real TP group
   needs one GPU per rank (NCCL refuses two ranks on one device), so on one GPU TP=2 and
   TP=4 are emulated: each rank's head slice (`LEVGenerator(head_start, head_end)`, the
   same TP-independent initialisation) computes its partial embedding, gathered to
   positions (`ParallelLEVEmbedding._to_positions`, as the SP path does); the reduce-scatter
   is their sum split along the sequence. The ranks' shards, put back together, must equal
   the TP=1 non-SP module's output; with a one-rank group, the module's own SP path must
   equal its non-SP path exactly.

    python benchmarks/gpu_check.py --output gpu_check.json
    python benchmarks/gpu_check.py --tiny          # CPU smoke run of the same logic (tiny-* configs)

Prints one JSON object (and writes it to --output).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # before DeepSpeed is imported: its CPU accelerator
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402  (benchmarks/ is not a package)

# (num_layers or None for the config's, micro-batch) tried in order until both engines fit.
ATTEMPTS = ((None, 16), (None, 8), (11, 8))
TINY_ATTEMPTS = ((None, 4),)


def gpu_type(device: torch.device) -> str | None:
    """a100 / h100 / h200 from the device name (megatron_lev.flops peaks), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((kind for kind in ("h200", "h100", "a100") if kind in name), None)


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def training_check(config: str, seq_length: int, attempts, bf16: bool, device, peak_flops, repeats: int,
                   steps: int) -> dict:
    """bench_train's lev-vs-tied measurement of `config`, retried smaller on out-of-memory."""
    tried = []
    for num_layers, micro_batch in attempts:
        size = bench_train.Size(config, micro_batch_size=micro_batch, seq_length=seq_length, repeats=repeats,
                                steps=steps).resolved()
        try:
            result = bench_train.bench_size(config, size, ("lev", "tied"), bf16=bf16, device=device, data_path=None,
                                            peak_flops=peak_flops, warmup=2, num_layers=num_layers)
        except RuntimeError as exc:
            if not is_out_of_memory(exc):
                raise
            tried.append({"num_layers": num_layers, "micro_batch_size": micro_batch, "result": "out of memory"})
            del exc
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        tried.append({"num_layers": num_layers, "micro_batch_size": micro_batch, "result": "ok"})
        result["attempts"] = tried
        result["reduced"] = (None if len(tried) == 1 else
                             f"the first setting did not fit both engines: ran at {result['num_layers']} layers, "
                             f"micro-batch {micro_batch}")
        result["lev_over_tied_step_time"] = result["ratios"]["lev_over_tied"]
        if device.type == "cuda":
            result["peak_memory_gb_process"] = torch.cuda.max_memory_allocated() / 2**30
        return result
    return {"config": config, "attempts": tried, "error": "every setting ran out of memory"}


@torch.no_grad()
def sequence_parallel_check(config: str, device, dtype: torch.dtype, tensor_parallel_sizes=(2, 4), batch: int = 4,
                            seq_length: int = 512) -> dict:
    """Emulated TP>1 sequence-parallel LEV output vs the TP=1 non-SP module (see the docstring)."""
    from megatron_lev.configs import load_config
    from megatron_lev.lev import LEVConfig, LEVGenerator, ids_to_evaluate
    from megatron_lev.lev_parallel import ParallelLEVEmbedding

    model = load_config(config)["model"]
    lev = LEVConfig.from_dict({**model.get("lev", {}), "vocab_size": model["vocab_size"],
                               "hidden_size": model["hidden_size"]})
    seed = 1234
    ids = bench_train.zipf_batches(lev.vocab_size, batch, seq_length - 1, 1)[0].to(device)  # [b, s]
    b, s = ids.shape
    kwargs = {"init_seed": seed, "params_dtype": dtype, "device": device}
    reference = ParallelLEVEmbedding(lev, sequence_parallel=False, **kwargs)(ids)  # [s, b, D]
    one_rank_sp = ParallelLEVEmbedding(lev, sequence_parallel=True, **kwargs)(ids)
    # Each rank's partial is cast to the parameter dtype before the reduction, as in the module.
    tolerance = 1e-5 if dtype == torch.float32 else 2.0 ** -6
    scale = float(reference.float().abs().max())
    out = {"config": config, "dtype": str(dtype).replace("torch.", ""), "batch": b, "seq_length": s,
           "one_rank_group_sp_equals_non_sp": bool(torch.equal(one_rank_sp, reference)),
           "relative_tolerance": tolerance, "emulated": {}}
    distinct, inverse = ids_to_evaluate(ids, lev.vocab_size, lev.unique_ids)
    for tp in tensor_parallel_sizes:
        if lev.num_heads % tp or s % tp:
            out["emulated"][f"tp{tp}"] = {"skipped": f"{lev.num_heads} LEV heads / sequence {s} not divisible by {tp}"}
            continue
        per_rank = lev.num_heads // tp
        partials = [ParallelLEVEmbedding._to_positions(
            LEVGenerator(lev, r * per_rank, (r + 1) * per_rank, init_seed=seed, dtype=dtype, device=device)(distinct)
            .to(dtype), inverse, b, s) for r in range(tp)]
        summed = partials[0].clone()
        for p in partials[1:]:
            summed += p
        shards = summed.chunk(tp, dim=0)  # reduce-scatter: rank r keeps positions [r s/tp, (r+1) s/tp)
        assert all(shard.shape == (s // tp, b, lev.hidden_size) for shard in shards)
        diff = float((torch.cat(shards).float() - reference.float()).abs().max())
        out["emulated"][f"tp{tp}"] = {"max_abs_diff": diff, "relative": diff / scale,
                                      "ok": diff / scale <= tolerance}
    out["ok"] = out["one_rank_group_sp_equals_non_sp"] and all(
        r.get("ok", True) for r in out["emulated"].values())
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny-lev/tiny-tied, fp32, few steps: a CPU smoke run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per kind per repetition")
    p.add_argument("--seq-length", type=int, default=512, help="tokens per sequence (the configs' 512)")
    p.add_argument("--output", help="also write the JSON here")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    started = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        raise SystemExit("gpu_check.py: error: torch sees no GPU (torch.cuda.is_available() is False; is the "
                         "installed torch a CUDA build?). Use --tiny for a CPU smoke run.")
    from megatron_lev.flops import peak_flops_per_device

    kind = gpu_type(device)
    peak = peak_flops_per_device(kind, None)
    config, bf16 = ("tiny-lev", False) if args.tiny else ("lev-1.2b", True)
    report = {"check": "gpu_check", "environment": bench_train.environment(device), "gpu_type": kind,
              "peak_tflops": peak / 1e12 if peak else None, "bf16": bf16}
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON only (DeepSpeed prints)
        bench_train.start_process_group(device)
        report["training"] = training_check(config, 64 if args.tiny else args.seq_length,
                                            TINY_ATTEMPTS if args.tiny else ATTEMPTS, bf16, device, peak,
                                            args.repeats, args.steps)
        dtypes = (torch.float32,) if args.tiny else (torch.float32, torch.bfloat16)
        report["sequence_parallel"] = [sequence_parallel_check(config, device, dtype,
                                                               seq_length=64 if args.tiny else 512)
                                       for dtype in dtypes]
    report["ok"] = "error" not in report["training"] and all(c["ok"] for c in report["sequence_parallel"])
    report["wall_s"] = time.time() - started
    bench_train.print_json(report, args.output)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
