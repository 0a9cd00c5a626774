#!/usr/bin/env python
"""One-GPU check (run by benchmarks/gpu_check.sh on an A100/H100/H200, offline, under 8 minutes):

1. kernel_tests      pytest tests/test_lev_kernels.py with CUDA tensors (compiled Triton kernels, no
                     interpreter): both LEV paths within the float32 error bound at the 1.2B
                     generator's shapes, the overflow cap, the fallback, the kernel count.
2. fused_vs_pytorch  lev-1.2b's LEV embedding on one training micro-batch (the Slurm scripts'
                     per-GPU micro-batch): fused kernels against the PyTorch path, output and every
                     generator gradient, and the time of each.
3. training          lev-1.2b and tied-1.2b trained as the Slurm scripts run them on a node of 8
                     GPUs of this type (their DRY_RUN command: bf16, --compile-layers, ZeRO-2 with
                     overlap_comm, their per-GPU micro-batch and gradient accumulation; the global
                     batch is this one GPU's share): step time, tokens/s, MFU, peak memory, and the
                     LEV/tied step-time ratio. One kind after the other, each engine alone on the GPU.

It fails (exit 1, `"ok": false`, `failures` says why) on a failed kernel test, fused and PyTorch
paths further apart than the bound allows, a non-finite loss, LEV/tied above --max-lev-over-tied
(1.05), or a LEV run in which the fused kernels did not run. The JSON is written to --output after
every stage and at the end, whatever happens (an exception is recorded in it).

    python benchmarks/gpu_check.py --output gpu_check.json
    python benchmarks/gpu_check.py --device cpu --tiny     # the same logic on CPU (tiny configs)
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402  (benchmarks/ is not a package)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Seconds each stage may take on one H200 (gpu_check.sh gives the whole check 470 s, the install
# about 30 s of it): the kernel tests compile 2 Triton kernels per shape; each training kind
# compiles its decoder layer (inductor) and, once, DeepSpeed's fused Adam.
BUDGET_S = {"kernel_tests": 150, "fused_vs_pytorch": 30, "training": 240}
# Fused vs PyTorch LEV embedding, max |difference| / max |value| per tensor: twice the float32
# error bound of the modes at the 1.2B generator's shapes (tests/lev_error_bound.py gives about
# 3e-4 to 5e-4 of the largest mode and gradient there; docs/lev.md).
FUSED_VS_PYTORCH_TOLERANCE = 1e-3
# (micro-batch divisor, accumulation multiplier) tried in order when a kind runs out of memory:
# the same tokens per optimizer step, in smaller micro-batches.
MEMORY_LADDER = (1, 2, 4)

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


def save_partial(report: dict, output) -> None:
    """The report so far, atomically in `output` (a later time-out keeps it)."""
    if output:
        import json

        from megatron_lev.utils.files import atomic_path

        with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


def log(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- trainer engines


def slurm_train_argv(script: str, gpus: int, gpu_type: str, config: str | None = None) -> list[str]:
    """The trainer flags `slurm/<script>` passes on one node of `gpus` GPUs (its DRY_RUN
    command, data files stubbed: the checks feed their own batches)."""
    import shlex

    with tempfile.TemporaryDirectory() as tmp:
        for suffix in (".bin", ".idx", ".model"):
            open(os.path.join(tmp, "stub" + suffix), "w").close()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(DRY_RUN="1", NODES="1", GPUS_PER_NODE=str(gpus), GPU_TYPE=gpu_type, DATA_PATH=f"{tmp}/stub",
                   TOKENIZER_MODEL=f"{tmp}/stub.model", CHECKPOINT_DIR=f"{tmp}/ckpt", VIRTUAL_ENV=sys.prefix,
                   PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
        for name in ("MICRO_BATCH", "GLOBAL_BATCH", "TP", "PP", "SEQ_LENGTH", "BF16", "EXTRA_ARGS", "CONFIG",
                     "EXIT_INTERVAL"):
            env.pop(name, None)
        if config:
            env["CONFIG"] = config
        proc = subprocess.run(["bash", os.path.join(REPO, "slurm", script)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"slurm/{script} DRY_RUN failed: {proc.stderr.strip()}")
    (line,) = {l for l in proc.stdout.splitlines() if l.startswith("torchrun ")}
    argv = shlex.split(line)
    argv = argv[argv.index("megatron_lev.train") + 1:]
    # No checkpoints, no logs: the checks measure steps only.
    for flag in ("--save", "--load", "--tensorboard-dir"):
        i = argv.index(flag)
        del argv[i:i + 2]
    return argv


def build_trainer_engine(argv: list[str], world_size: int, overrides: dict | None = None):
    """(args, model_config, engine) exactly as megatron_lev.train builds them (its start-up
    checks included)."""
    from megatron_lev.training.arguments import parse_args, validate_args
    from megatron_lev.training.ds_config import build_deepspeed_config
    from megatron_lev.training.engine import build_engine
    from megatron_lev.training.validation import build_model_config, check_deepspeed_version

    for flag, value in (overrides or {}).items():
        argv = [*argv, flag] + ([str(value)] if value != "" else [])
    args = validate_args(parse_args(argv), world_size=world_size)
    model_config = build_model_config(args)
    ds_config = build_deepspeed_config(args)
    check_deepspeed_version(ds_config, args.deepspeed_config_path)
    return args, model_config, build_engine(args, model_config, ds_config)


def optimizer_step(engine, batches: list[dict]) -> torch.Tensor:
    """One optimizer step over `batches` (its micro-batches, accumulated), as the trainer's
    train_step runs it; returns the mean micro-batch loss."""
    from megatron_lev.training.batches import model_inputs

    losses = []
    for b in batches:
        loss = engine(b["tokens"], **model_inputs(b))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    return torch.stack(losses).mean()


def train_kind(kind: str, argv: list[str], world: int, rank: int, device, peak, steps: int,
               overrides: dict | None = None) -> dict:
    """Optimizer steps of one kind's engine (one warm-up, then `steps` timed): step time,
    tokens/s, TFLOP/s and MFU per GPU, every step's loss, peak memory."""
    import torch.distributed as dist

    from megatron_lev.training.flops import flops_model, training_flops

    args, model_config, engine = build_trainer_engine(argv, world, overrides)
    acc, micro, seq = args.gradient_accumulation_steps, args.micro_batch_size, args.seq_length
    windows = bench_train.zipf_batches(model_config.vocab_size, micro, seq, (steps + 1) * acc, seed=100 + rank)
    batches = [bench_train.as_inputs(w, device, model_config.vocab_size) for w in windows]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses = [float(optimizer_step(engine, batches[:acc]))]  # warm-up: compiles, allocates Adam's moments
    times = []
    for s in range(1, steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        loss = optimizer_step(engine, batches[s * acc:(s + 1) * acc])
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    step_time = statistics.median(times)
    fm = flops_model(model_config, seq)
    distinct = [int(b["lev_ids"].numel()) if kind == "lev" else 0 for b in batches[acc:]]
    flops = sum(training_flops(fm, micro * seq, d) for d in distinct) / steps  # this GPU, per step
    result = {"global_batch_size": args.global_batch_size, "micro_batch_size": micro,
              "gradient_accumulation_steps": acc, "seq_length": seq, "data_parallel_size": world,
              "bf16": bool(args.bf16), "compile_layers": bool(args.compile_layers),
              "deepspeed_config": args.deepspeed_config, "step_time_s_median": step_time, "step_times_s": times,
              "tokens_per_s": args.global_batch_size * seq / step_time,
              "model_tflops_per_s_per_gpu": flops / step_time / 1e12,
              "mfu": flops / step_time / peak if peak else None, "losses": losses, "final_loss": losses[-1]}
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    del engine, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# --------------------------------------------------------------------------- 1. kernel tests


def kernel_tests(device, tiny: bool) -> dict:
    """The real test file under pytest, in a child process; on a GPU TRITON_INTERPRET=0 makes it
    compile the kernels for CUDA tensors (tests/test_lev_kernels.py picks the device)."""
    env = dict(os.environ)
    if device.type == "cuda":
        env["TRITON_INTERPRET"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_lev_kernels.py",
                   f"--junitxml={xml}"]
        if tiny:  # the CPU rehearsal of this stage: the toy shapes only (the suite runs the rest)
            command += ["-k", "toy_shapes"]
        started = time.time()
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=BUDGET_S["kernel_tests"])
        suite = ElementTree.parse(xml).getroot() if os.path.exists(xml) else None
    counts = {}
    if suite is not None:
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    result = {"command": " ".join(command[1:]), "returncode": proc.returncode, **counts,
              "seconds": time.time() - started, "output_tail": (proc.stdout + proc.stderr)[-2000:]}
    result["ok"] = (proc.returncode == 0 and counts.get("tests", 0) > 0
                    and counts.get("failures", 1) == counts.get("errors", 1) == counts.get("skipped", 1) == 0)
    log(f"kernel tests: {counts} in {result['seconds']:.0f} s")
    return result


# --------------------------------------------------------------------------- 2. fused vs PyTorch


def fused_vs_pytorch(config: str, micro_batch: int, seq: int, device) -> dict:
    """lev-1.2b's LEV embedding (float32 parameters) on one Zipf micro-batch: fused kernels
    against the PyTorch path (output, every generator gradient), and each path's time."""
    from megatron_lev.configs import load_config
    from megatron_lev.lev import generator as lev
    from megatron_lev.lev.parallel import ParallelLEVEmbedding

    section = load_config(config)["model"]
    cfg = lev.LEVConfig.from_dict({**section.get("lev", {}), "vocab_size": section["vocab_size"],
                                   "hidden_size": section["hidden_size"]})
    (window,) = bench_train.zipf_batches(cfg.vocab_size, micro_batch, seq, 1, seed=5)
    batch = bench_train.as_inputs(window, device, cfg.vocab_size)
    upstream = torch.randn(seq, micro_batch, cfg.hidden_size, generator=torch.Generator().manual_seed(6)).to(device)
    results, devices = {}, lev.FUSED_MODES_DEVICES
    for path, fused_devices in (("fused", ("cuda", "cpu")), ("pytorch", ())):
        lev.FUSED_MODES_DEVICES = fused_devices
        try:
            module = ParallelLEVEmbedding(cfg, init_seed=1234, device=device)
            if path == "fused" and not lev.uses_fused_modes(device):
                lev.FUSED_MODES_DEVICES = devices
                return {"skipped": f"no fused path on {device.type} (Triton's interpreter is off)", "ok": True}
            times = []
            for _ in range(3):  # the first one compiles
                module.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = module(batch["tokens"], batch["lev_ids"], batch["lev_inverse"])
                out.backward(upstream)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        finally:
            lev.FUSED_MODES_DEVICES = devices
        results[path] = {"out": out.detach(), "grads": {n: p.grad for n, p in module.generator.named_parameters()},
                         "ms": 1000 * min(times[1:])}
    fused, pytorch = results["fused"], results["pytorch"]

    def relative(a, b):
        return float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-30)

    diffs = {"output": relative(fused["out"], pytorch["out"]),
             **{name: relative(fused["grads"][name], pytorch["grads"][name]) for name in pytorch["grads"]}}
    result = {"distinct_ids": int(batch["lev_ids"].numel()), "tokens": micro_batch * seq,
              "relative_max_diffs": diffs, "tolerance": FUSED_VS_PYTORCH_TOLERANCE,
              "fused_ms": fused["ms"], "pytorch_ms": pytorch["ms"], "fused_failure": lev.fused_modes_failure}
    result["ok"] = lev.fused_modes_failure is None and max(diffs.values()) <= FUSED_VS_PYTORCH_TOLERANCE
    log(f"fused vs PyTorch LEV ({result['distinct_ids']} distinct ids): worst {max(diffs.values()):.1e}, "
        f"{fused['ms']:.1f} vs {pytorch['ms']:.1f} ms forward + backward")
    return result


# --------------------------------------------------------------------------- 3. training


def training(tiny: bool, gpu: dict, device, steps: int, gpus_per_node: int) -> dict:
    """lev-1.2b and tied-1.2b as the Slurm scripts run them (module docstring), one GPU's share."""
    from megatron_lev.lev import generator as lev
    from megatron_lev.lev import kernels
    from megatron_lev.models import transformer

    peak = gpu["peak_tflops"] * 1e12 if gpu["peak_tflops"] else None
    report = {"kinds": {}, "slurm_gpus_per_node": gpus_per_node}
    for kind, script in (("lev", "train_lev_1b.sh"), ("tied", "train_tied_1b.sh")):
        argv = slurm_train_argv(script, gpus_per_node, gpu["gpu_type"] or "h100", f"tiny-{kind}" if tiny else None)
        launches = dict(kernels.LAUNCHES)
        slurm, tried = _per_gpu_batch(argv, gpus_per_node), []
        for divisor in MEMORY_LADDER:
            micro, acc = slurm["micro"] // divisor, slurm["acc"] * divisor
            if micro < 1:
                break
            overrides = {"--micro-batch-size": micro, "--global-batch-size": micro * acc}
            if tiny:  # on CPU compiling the layers would take most of the run
                overrides["--no-compile-layers"] = ""
            try:
                result = train_kind(kind, argv, 1, 0, device, peak, steps, overrides)
            except RuntimeError as exc:
                if not is_out_of_memory(exc):
                    raise
                tried.append({"micro_batch_size": micro, "gradient_accumulation_steps": acc, "result": "out of memory"})
                del exc
                gc.collect()
                torch.cuda.empty_cache()
                continue
            tried.append({"micro_batch_size": micro, "gradient_accumulation_steps": acc, "result": "ok"})
            result["attempts"] = tried
            break
        else:
            result = {"attempts": tried, "error": "every micro-batch size ran out of memory"}
        if kind == "lev":
            result["fused_kernel_launches"] = {k: kernels.LAUNCHES[k] - launches.get(k, 0)
                                               for k in ("forward", "backward")}
            result["fused_failure"] = lev.fused_modes_failure
        result["compile_fallback_layers"] = list(transformer._compile_failures)
        report["kinds"][kind] = result
        log(f"{kind}: {result.get('step_time_s_median', float('nan')) * 1000:.0f} ms/step, MFU {result.get('mfu')}, "
            f"peak {result.get('peak_memory_gb')} GB")
    if all("step_time_s_median" in k for k in report["kinds"].values()):
        report["lev_over_tied_step_time"] = (report["kinds"]["lev"]["step_time_s_median"]
                                             / report["kinds"]["tied"]["step_time_s_median"])
    return report


def _per_gpu_batch(argv: list[str], gpus_per_node: int) -> dict:
    """The Slurm command's micro-batch and, per GPU, its gradient accumulation."""
    micro = int(argv[argv.index("--micro-batch-size") + 1])
    global_batch = int(argv[argv.index("--global-batch-size") + 1])
    return {"micro": micro, "acc": global_batch // (micro * gpus_per_node)}


def failures(report: dict, device, max_ratio: float) -> list[str]:
    """Why the check fails (empty: it passes)."""
    found = []
    for stage in ("kernel_tests", "fused_vs_pytorch"):
        if stage in report and not report[stage]["ok"]:
            found.append(f"{stage} failed")
    kinds = report.get("training", {}).get("kinds", {})
    for kind, result in kinds.items():
        if "error" in result:
            found.append(f"{kind}: {result['error']}")
        elif not all(math.isfinite(loss) for loss in result["losses"]):
            found.append(f"{kind}: non-finite loss {result['losses']}")
    lev = kinds.get("lev", {})
    if device.type == "cuda" and lev and (lev.get("fused_failure") or not all(lev["fused_kernel_launches"].values())):
        found.append(f"lev: the fused LEV kernels did not run (launches {lev['fused_kernel_launches']}, "
                     f"failure {lev.get('fused_failure')})")
    ratio = report.get("training", {}).get("lev_over_tied_step_time")
    if ratio is not None and ratio > max_ratio:
        found.append(f"lev_over_tied_step_time {ratio:.3f} > {max_ratio}")
    return found


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: run the logic on the CPU (with --tiny), for tests")
    p.add_argument("--tiny", action="store_true", help="tiny-lev/tiny-tied, fp32, eager layers")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per kind")
    p.add_argument("--slurm-gpus-per-node", type=int, default=8, help="the Slurm job whose per-GPU work to run")
    p.add_argument("--max-lev-over-tied", type=float, default=1.05, help="fail above this LEV/tied step-time ratio")
    p.add_argument("--stages", nargs="+", default=["kernel_tests", "fused_vs_pytorch", "training"],
                   choices=("kernel_tests", "fused_vs_pytorch", "training"))
    p.add_argument("--output", help="write the JSON here, after every stage and at the end")
    return p


def wheel_matches_checkout() -> bool | None:
    """Whether the megatron_lev the wheel folder installed (gpu_check.sh, GPU_CHECK_SITE) holds the
    checkout's code (which is what runs); None outside gpu_check.sh."""
    site = os.environ.get("GPU_CHECK_SITE")
    if not site or not os.path.isdir(os.path.join(site, "megatron_lev")):
        return None

    def digest(root):
        h = hashlib.sha256()
        for folder, _, names in sorted(os.walk(os.path.join(root, "megatron_lev"))):
            for name in sorted(n for n in names if n.endswith(".py")):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
        return h.hexdigest()

    return digest(site) == digest(REPO)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    started = time.time()
    device = torch.device(args.device)
    report = {"check": "gpu_check", "stages_done": [], "finished": False, "ok": False}
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit(f"gpu_check.py: torch {torch.__version__} sees no GPU (is it a CUDA build?); "
                             "--device cpu --tiny runs the logic on the CPU")
        if args.device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported
            if not args.tiny:
                raise SystemExit("gpu_check.py: --device cpu needs --tiny (the 1.2B configs are for GPUs)")
        gpu = gpu_variant(torch.cuda.get_device_name(device)) if device.type == "cuda" else gpu_variant("")
        report.update(environment=bench_train.environment(device), **gpu, bf16=not args.tiny,
                      wheel_matches_checkout=wheel_matches_checkout())
        save_partial(report, args.output)
        config = "tiny-lev" if args.tiny else "lev-1.2b"
        slurm = _per_gpu_batch(slurm_train_argv("train_lev_1b.sh", args.slurm_gpus_per_node, gpu["gpu_type"] or "h100",
                                                config if args.tiny else None), args.slurm_gpus_per_node)
        stages = {"kernel_tests": lambda: kernel_tests(device, args.tiny),
                  "fused_vs_pytorch": lambda: fused_vs_pytorch(config, slurm["micro"], 64 if args.tiny else 512,
                                                               device),
                  "training": lambda: training(args.tiny, gpu, device, args.steps, args.slurm_gpus_per_node)}
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON only (DeepSpeed prints)
            if "training" in args.stages or "fused_vs_pytorch" in args.stages:
                bench_train.start_process_group(device)
            for name in args.stages:
                report[name] = stages[name]()
                report["stages_done"].append(name)
                save_partial(report, args.output)
    except KeyboardInterrupt:  # gpu_check.sh's time limit (timeout --signal=INT): keep what was measured
        report["error"] = "time limit (interrupted)"
    except BaseException as exc:  # noqa: BLE001 - recorded in the JSON, which is written whatever happens
        report["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        report["traceback"] = traceback.format_exc()[-4000:]
    report["failures"] = failures(report, device, args.max_lev_over_tied)
    if "error" in report:
        report["failures"].insert(0, report["error"])
    report["ok"] = not report["failures"] and report["stages_done"] == args.stages
    report["finished"] = True
    for line in report["failures"]:
        log(f"FAILED: {line}")
    report["wall_s"] = time.time() - started
    bench_train.print_json(report, args.output)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
