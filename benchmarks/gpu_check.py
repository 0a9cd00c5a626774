#!/usr/bin/env python
"""One-GPU check of the 1.2B configs (run by benchmarks/gpu_check.sh on an A100/H100/H200):
bf16 training step time, tokens/s, MFU and memory of `lev-1.2b` and `tied-1.2b` and their
LEV/tied step-time ratio (benchmarks/bench_train.py: the trainer's own DeepSpeed engines,
ZeRO-1, interleaved repetitions, medians). Memory is read after the warm-up steps, so the
optimizer's Adam moments (allocated by the first step) are counted. Both engines are
resident at once; when that does not fit, the micro-batch and then the depth are reduced,
and the JSON says so (`attempts`, `reduced`). MFU is scored against the peak of the card's
variant, read from the device name (H100 SXM / PCIe / NVL, H200 / H200 NVL, A100).

Tensor and sequence parallelism need two GPUs: benchmarks/gpu_check_multi.sh.

    python benchmarks/gpu_check.py --output gpu_check.json
    python benchmarks/gpu_check.py --device cpu --tiny     # CPU run of the same logic (tiny configs)

The JSON is written to --output after every stage (`stages_done`), so a run cut short by a
time limit keeps what it measured; stdout gets the final object.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402  (benchmarks/ is not a package)

# (num_layers or None for the config's, micro-batch) tried in order until both engines fit.
ATTEMPTS = ((None, 16), (None, 8), (11, 8))
TINY_ATTEMPTS = ((None, 4),)

# Dense bf16 tensor-core peaks (NVIDIA data sheets, TFLOP/s without sparsity) by the variant
# in the device name; the trainer's --gpu-type peaks (megatron_lev.training.flops) are the SXM ones.
GPU_VARIANTS = (  # (substring of the lower-cased name, gpu type, variant, peak TFLOP/s)
    ("h200 nvl", "h200", "h200-nvl", 835.0),
    ("gh200", "h200", "gh200", 989.0),
    ("h200", "h200", "h200-sxm", 989.0),
    ("h100 nvl", "h100", "h100-nvl", 835.0),
    ("h100 pcie", "h100", "h100-pcie", 756.0),
    ("h100", "h100", "h100-sxm", 989.0),
    ("a100", "a100", "a100", 312.0),
)


def gpu_variant(device_name: str) -> dict:
    """{"gpu_type", "variant", "peak_tflops"} for a CUDA device name (torch.cuda.get_device_name),
    all None for an unknown card (MFU then not reported)."""
    name = device_name.lower().replace("-", " ")
    for key, kind, variant, peak in GPU_VARIANTS:
        if key in name:
            return {"gpu_type": kind, "variant": variant, "peak_tflops": peak}
    return {"gpu_type": None, "variant": None, "peak_tflops": None}


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: run the logic on the CPU (with --tiny), for tests")
    p.add_argument("--tiny", action="store_true", help="tiny-lev/tiny-tied, fp32, few steps")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per kind per repetition")
    p.add_argument("--seq-length", type=int, default=512, help="tokens per sequence (the configs' 512)")
    p.add_argument("--output", help="write the JSON here, after every stage")
    return p


def save_partial(report: dict, output) -> None:
    """The report so far, atomically in `output` (a later time-out keeps it)."""
    if output:
        from megatron_lev.utils.files import atomic_path

        with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    started = time.time()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py: error: torch sees no GPU (torch.cuda.is_available() is False; is the "
                         "installed torch a CUDA build?). --device cpu --tiny runs the logic on the CPU.")
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported
        if not args.tiny:
            raise SystemExit("gpu_check.py: error: --device cpu needs --tiny (the 1.2B configs are for GPUs)")
    device = torch.device(args.device)
    gpu = gpu_variant(torch.cuda.get_device_name(device)) if device.type == "cuda" else gpu_variant("")
    peak = gpu["peak_tflops"] * 1e12 if gpu["peak_tflops"] else None
    config, bf16 = ("tiny-lev", False) if args.tiny else ("lev-1.2b", True)
    report = {"check": "gpu_check", "environment": bench_train.environment(device), **gpu, "bf16": bf16,
              "stages_done": []}
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON only (DeepSpeed prints)
            bench_train.start_process_group(device)
            report["training"] = training_check(config, 64 if args.tiny else args.seq_length,
                                                TINY_ATTEMPTS if args.tiny else ATTEMPTS, bf16, device, peak,
                                                args.repeats, args.steps)
            report["stages_done"].append("training")
            save_partial(report, args.output)
    except KeyboardInterrupt:  # gpu_check.sh's time limit (timeout --signal=INT): keep what was measured
        report["interrupted"] = "time limit"
    report["ok"] = "training" in report and "error" not in report["training"]
    report["wall_s"] = time.time() - started
    bench_train.print_json(report, args.output)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
