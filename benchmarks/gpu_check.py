#!/usr/bin/env python
"""One-GPU check (run by benchmarks/gpu_check.sh on an A100/H100/H200, offline, under 8 minutes).
Stages, in order (gpu_check_rules.STAGE_ORDER; each is skipped, and the check fails, when what
is left of --time-limit is under its estimate):

1. kernel_tests      pytest tests/test_lev_kernels.py with CUDA tensors (compiled Triton kernels):
                     both LEV paths within the float32 error bound at the 1.2B generator's shapes,
                     the overflow cap, the fallback, the kernel count. Meanwhile DeepSpeed's fused
                     Adam is JIT-built in a child process (the training stages load it).
2. fused_vs_pytorch  lev-1.2b's LEV embedding on one training micro-batch: fused kernels against
                     the PyTorch path, output and every generator gradient, and the time of each.
3. gemm_ceiling      bf16 TFLOP/s of an 8192^3 matrix product: the ceiling MFU is also scored against.
4. megatron_gpt      GPTModel+LEV (local spec; TransformerEngine's where it imports) against
                     LeviathanModel on the same weights, fp32 forward and backward; one bf16 step.
5. training          lev-1.2b and tied-1.2b as the Slurm scripts run them (bf16, compiled layers,
                     ZeRO-2 + overlap_comm) at one GPU's share of an 8-GPU node's batch (the
                     scripts' micro-batch and accumulation, both halved/doubled only after an
                     out-of-memory error), at a constant learning rate: every step's loss and rate,
                     the loss must fall; 3 untimed steps then 20 timed ones per kind, interleaved,
                     the kind that starts a round alternating: step time median and spread,
                     LEV/tied (<= 1.02) with the pairwise spread, LEV's generator forward and
                     backward timed inside the steps (CUDA events) and its share of a step,
                     tokens/s, MFU (datasheet and measured ceiling), the optimizer that ran,
                     compile fallbacks, memory per engine and what deleting them freed.
6. bf16_vs_fp32      the same weights and batches trained in fp32 and bf16 at a small size: the two
                     loss curves within gpu_check_rules.bf16_loss_bounds.
7. save_resume       bf16 ZeRO-2 training saved and resumed on the device against an uninterrupted
                     run: bit-exact, or within gpu_check_rules.RESUME_TOLERANCE.

It fails (exit 1, `"ok": false`, `failures` says why: gpu_check_rules.failures) on any of those
rules. The JSON is written to --output after every stage and at the end, whatever happens.

    python benchmarks/gpu_check.py --output gpu_check.json
    python benchmarks/gpu_check.py --device cpu --tiny     # the same logic on CPU (tiny configs)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402  (benchmarks/ is not a package)
from gpu_check_rules import (KERNEL_TESTS_LIMIT_S, MAX_LEV_OVER_TIED, MIN_TIMED_STEPS,  # noqa: E402
                             STAGE_ESTIMATE_S, STAGE_ORDER, WARMUP_STEPS, failures, stage_fits)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Fused vs PyTorch LEV embedding, max |difference| / max |value| per tensor: twice the float32
# error bound of the modes at the 1.2B generator's shapes (tests/lev_error_bound.py gives about
# 3e-4 to 5e-4 of the largest mode and gradient there; docs/lev.md).
FUSED_VS_PYTORCH_TOLERANCE = 1e-3
GEMM_SIZE = {"cuda": 8192, "cpu": 256}
# DeepSpeed's fused Adam builds in about a minute (two files, one architecture); a build still
# running after this is stopped and the engines take torch's AdamW (recorded: a fallback).
FUSED_ADAM_BUILD_LIMIT_S = 240
# Kept back from --time-limit: writing the JSON, and the imports before main() started its clock.
TIME_MARGIN_S = 10

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


def save_partial(report: dict, output) -> None:
    """The report so far, atomically in `output` (a later time-out keeps it)."""
    if output:
        from megatron_lev.utils.files import atomic_path

        with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


def log(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


def version_of(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- kernel tests


def kernel_tests(device, tiny: bool) -> dict:
    """The real test file under pytest, in a child process; on a GPU TRITON_INTERPRET=0 makes it
    compile the kernels for CUDA tensors (tests/test_lev_kernels.py picks the device)."""
    # The image's own pytest plugins (xdist, cov, benchmark, ...) stay out: they need not match
    # the pytest that runs here.
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if device.type == "cuda":
        env["TRITON_INTERPRET"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_lev_kernels.py",
                   f"--junitxml={xml}"]
        if tiny:  # the CPU rehearsal of this stage: the toy shapes only (the suite runs the rest)
            command += ["-k", "toy_shapes"]
        started = time.time()
        try:
            proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=KERNEL_TESTS_LIMIT_S)
        except subprocess.TimeoutExpired as exc:  # recorded; the other stages still run
            out = "".join(b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
                          for b in (exc.stdout, exc.stderr))
            proc = subprocess.CompletedProcess(command, f"timed out after {KERNEL_TESTS_LIMIT_S} s", out, "")
        suite = ElementTree.parse(xml).getroot() if os.path.exists(xml) else None
    counts = {}
    if suite is not None:
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    result = {"command": " ".join(command[1:]), "returncode": proc.returncode, **counts,
              "pytest": version_of("pytest"), "plugin_autoload_disabled": True,
              "seconds": time.time() - started, "output_tail": (proc.stdout + proc.stderr)[-2000:]}
    result["ok"] = (proc.returncode == 0 and counts.get("tests", 0) > 0
                    and counts.get("failures", 1) == counts.get("errors", 1) == counts.get("skipped", 1) == 0)
    log(f"kernel tests: {counts} in {result['seconds']:.0f} s")
    return result


# --------------------------------------------------------------------------- fused vs PyTorch


def fused_vs_pytorch(config: str, micro_batch: int, seq: int, device) -> dict:
    """lev-1.2b's LEV embedding (float32 parameters) on one Zipf micro-batch: fused kernels
    against the PyTorch path (output, every generator gradient), and each path's time; then the
    fused path with `matmul_dtype: bfloat16` (W_seed and W_out on the tensor cores), its time and
    its distance from float32, recorded for choosing that option's default (not a rule)."""
    from megatron_lev.configs import load_config
    from megatron_lev.lev import generator as lev
    from megatron_lev.lev import dispatch as lev_dispatch
    from megatron_lev.lev.parallel import ParallelLEVEmbedding

    section = load_config(config)["model"]
    cfg = lev.LEVConfig.from_dict({**section.get("lev", {}), "vocab_size": section["vocab_size"],
                                   "hidden_size": section["hidden_size"]})
    (window,) = bench_train.zipf_batches(cfg.vocab_size, micro_batch, seq, 1, seed=5)
    batch = bench_train.as_inputs(window, device, cfg.vocab_size)
    upstream = torch.randn(seq, micro_batch, cfg.hidden_size, generator=torch.Generator().manual_seed(6)).to(device)
    results, devices = {}, lev_dispatch.FUSED_MODES_DEVICES
    for path, fused_devices, matmul_dtype in (("fused", ("cuda", "cpu"), "float32"), ("pytorch", (), "float32"),
                                              ("fused_bf16_matmul", ("cuda", "cpu"), "bfloat16")):
        lev_dispatch.FUSED_MODES_DEVICES = fused_devices
        try:
            module = ParallelLEVEmbedding(dataclasses.replace(cfg, matmul_dtype=matmul_dtype), init_seed=1234,
                                          device=device)
            if path == "fused" and not lev_dispatch.uses_fused_modes(device):
                lev_dispatch.FUSED_MODES_DEVICES = devices
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
            lev_dispatch.FUSED_MODES_DEVICES = devices
        results[path] = {"out": out.detach(), "grads": {n: p.grad for n, p in module.generator.named_parameters()},
                         "ms": 1000 * min(times[1:])}
    fused, pytorch = results["fused"], results["pytorch"]

    def relative(a, b):
        return float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-30)

    diffs = {"output": relative(fused["out"], pytorch["out"]),
             **{name: relative(fused["grads"][name], pytorch["grads"][name]) for name in pytorch["grads"]}}
    result = {"distinct_ids": int(batch["lev_ids"].numel()), "tokens": micro_batch * seq,
              "relative_max_diffs": diffs, "tolerance": FUSED_VS_PYTORCH_TOLERANCE,
              "fused_ms": fused["ms"], "pytorch_ms": pytorch["ms"], "fused_failure": lev_dispatch.fused_modes_failure}
    bf16 = results["fused_bf16_matmul"]
    result.update(bf16_matmul_ms=bf16["ms"], bf16_matmul_relative_max_diffs={
        "output": relative(bf16["out"], pytorch["out"]),
        **{name: relative(bf16["grads"][name], pytorch["grads"][name]) for name in pytorch["grads"]}})
    result["ok"] = lev_dispatch.fused_modes_failure is None and max(diffs.values()) <= FUSED_VS_PYTORCH_TOLERANCE
    log(f"fused vs PyTorch LEV ({result['distinct_ids']} distinct ids): worst {max(diffs.values()):.1e}, "
        f"{fused['ms']:.1f} vs {pytorch['ms']:.1f} ms forward + backward; bf16 W_seed/W_out {bf16['ms']:.1f} ms, "
        f"output {result['bf16_matmul_relative_max_diffs']['output']:.1e} from float32")
    return result


# --------------------------------------------------------------------------- DeepSpeed's fused Adam


FUSED_ADAM_BUILD = [sys.executable, "-c", "from deepspeed.accelerator import get_accelerator; "
                    "get_accelerator().create_op_builder('FusedAdamBuilder').load()"]


class FusedAdamBuild:
    """DeepSpeed's fused Adam JIT-built (nvcc, ninja) by `command` in a child process while the
    first stages run; its build is cached, so the engines built later load it. `wait()` -> what
    happened. `command` None (not on CUDA): nothing to build."""

    def __init__(self, command: list[str] | None):
        self.proc = None
        if command is None:
            return
        self.log = tempfile.NamedTemporaryFile("w+", prefix="fused_adam_build_", suffix=".log")
        self.started = time.time()
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)

    def wait(self, timeout: float) -> dict:
        if self.proc is None:
            return {"skipped": "not on CUDA: the optimizer there is torch's fused AdamW"}
        try:
            returncode = self.proc.wait(timeout=min(max(timeout, 1), FUSED_ADAM_BUILD_LIMIT_S))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            # torch's build lock would make every later load wait for the killed build forever.
            with contextlib.suppress(OSError, ImportError):
                from torch.utils.cpp_extension import _get_build_directory

                os.remove(os.path.join(_get_build_directory("fused_adam", verbose=False), "lock"))
            returncode = f"killed after {time.time() - self.started:.0f} s"
        self.log.seek(0)
        return {"returncode": returncode, "seconds": time.time() - self.started, "log_tail": self.log.read()[-1500:]}


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: run the logic on the CPU (with --tiny), for tests")
    p.add_argument("--tiny", action="store_true", help="tiny-lev/tiny-tied, fp32, eager layers")
    p.add_argument("--steps", type=int, default=MIN_TIMED_STEPS,
                   help=f"timed training steps per kind, after {WARMUP_STEPS} untimed ones (at least {MIN_TIMED_STEPS})")
    p.add_argument("--slurm-gpus-per-node", type=int, default=8, help="the Slurm job whose per-GPU work to run")
    p.add_argument("--max-lev-over-tied", type=float, default=MAX_LEV_OVER_TIED,
                   help="fail above this LEV/tied step-time ratio (medians)")
    p.add_argument("--allow-optimizer-fallback", action="store_true",
                   help="pass although DeepSpeed's fused Adam did not run (recorded either way)")
    p.add_argument("--stages", nargs="+", default=list(STAGE_ORDER), choices=STAGE_ORDER)
    p.add_argument("--time-limit", type=float, help="seconds this process may take; a stage that no longer "
                                                    "fits (gpu_check_rules.STAGE_ESTIMATE_S) is skipped")
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


def install_record() -> dict | None:
    """What gpu_check.sh installed from the wheel folder and what it kept of the image's own
    packages (benchmarks/gpu_install.py writes it); None outside gpu_check.sh."""
    path = os.environ.get("GPU_CHECK_INSTALL_RECORD")
    if not path or not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def run_stages(args, device, gpu: dict, report: dict, deadline: float | None) -> None:
    import gpu_check_correctness as correctness
    import gpu_check_training as training

    config = "tiny-lev" if args.tiny else "lev-1.2b"
    gpu_type = gpu["gpu_type"] or "h100"
    slurm = training.per_gpu_batch(training.slurm_train_argv("train_lev_1b.sh", args.slurm_gpus_per_node, gpu_type,
                                                             config if args.tiny else None), args.slurm_gpus_per_node)
    engine_stages = {"training", "bf16_vs_fp32", "save_resume"}
    adam = (FusedAdamBuild(FUSED_ADAM_BUILD if device.type == "cuda" else None)
            if engine_stages & set(args.stages) else None)

    def train():
        report["training"] = {}  # filled as it goes: an interruption keeps what was measured
        return training.training_stage(args.tiny, gpu, device, args.steps, args.slurm_gpus_per_node,
                                       report.get("gemm_ceiling"), report["training"])

    stages = {"kernel_tests": lambda: kernel_tests(device, args.tiny),
              "fused_vs_pytorch": lambda: fused_vs_pytorch(config, slurm["micro"], 64 if args.tiny else 512, device),
              "gemm_ceiling": lambda: training.gemm_ceiling(device, GEMM_SIZE[device.type]),
              "megatron_gpt": lambda: correctness.megatron_gpt(device),
              "training": train,
              "bf16_vs_fp32": lambda: correctness.bf16_vs_fp32(device, gpu_type),
              "save_resume": lambda: correctness.save_resume(device, gpu_type)}
    for name in [s for s in STAGE_ORDER if s in args.stages]:
        left = None if deadline is None else deadline - time.time()
        if not stage_fits(name, left):
            report.setdefault("skipped_stages", {})[name] = (f"{left:.0f} s left, the stage needs about "
                                                             f"{STAGE_ESTIMATE_S[name]} s")
            continue
        if name in engine_stages and "fused_adam_build" not in report:  # the engines load what it built
            report["fused_adam_build"] = adam.wait(left if left is not None else 600)
        started = time.time()
        try:
            report[name] = stages[name]()
            report["stages_done"].append(name)
        except Exception as exc:  # noqa: BLE001 - one stage's error is its result; the others still run
            error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
            report[name] = {**(report.get(name) or {}), "ok": False, "why": error, "error": error,
                            "traceback": traceback.format_exc()[-3000:]}
            log(f"{name}: {error}")
            del exc
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report["stage_seconds"][name] = time.time() - started
        save_partial(report, args.output)
    if adam is not None and "fused_adam_build" not in report:  # every engine stage skipped: stop it
        report["fused_adam_build"] = adam.wait(1)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    started = time.time()
    deadline = started + args.time_limit - TIME_MARGIN_S if args.time_limit else None
    device = torch.device(args.device)
    report = {"check": "gpu_check", "stages_done": [], "stage_seconds": {}, "stage_estimates_s": STAGE_ESTIMATE_S,
              "finished": False, "ok": False,
              "settings": {"time_limit_s": args.time_limit, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
                           "max_lev_over_tied": args.max_lev_over_tied,
                           "allow_optimizer_fallback": args.allow_optimizer_fallback,
                           **{name: os.environ.get(name) for name in ("PYTEST_DISABLE_PLUGIN_AUTOLOAD",
                                                                      "TORCH_CUDA_ARCH_LIST", "TRITON_INTERPRET")}}}
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit(f"gpu_check.py: torch {torch.__version__} sees no GPU (is it a CUDA build?); "
                             "--device cpu --tiny runs the logic on the CPU")
        if args.device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported
            if not args.tiny:
                raise SystemExit("gpu_check.py: --device cpu needs --tiny (the 1.2B configs are for GPUs)")
        if args.steps < MIN_TIMED_STEPS:
            raise SystemExit(f"gpu_check.py: --steps {args.steps}: the training stage needs at least "
                             f"{MIN_TIMED_STEPS} timed steps")
        gpu = gpu_variant(torch.cuda.get_device_name(device)) if device.type == "cuda" else gpu_variant("")
        report.update(environment={**bench_train.environment(device), "python": sys.version.split()[0],
                                   **{name: version_of(name) for name in ("triton", "deepspeed", "megatron-core",
                                                                          "pytest")}},
                      **gpu, wheel_matches_checkout=wheel_matches_checkout(), install=install_record())
        save_partial(report, args.output)
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON only (DeepSpeed prints)
            bench_train.start_process_group(device)
            run_stages(args, device, gpu, report, deadline)
    except KeyboardInterrupt:  # gpu_check.sh's time limit (timeout --signal=INT): keep what was measured
        report["error"] = "time limit (interrupted)"
    except BaseException as exc:  # noqa: BLE001 - recorded in the JSON, which is written whatever happens
        report["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        report["traceback"] = traceback.format_exc()[-4000:]
    report["failures"] = failures(report, device.type, args.max_lev_over_tied, args.allow_optimizer_fallback)
    if "error" in report:
        report["failures"].insert(0, report["error"])
    report["ok"] = not report["failures"] and report["stages_done"] == [s for s in STAGE_ORDER if s in args.stages]
    report["finished"] = True
    for line in report["failures"]:
        log(f"FAILED: {line}")
    report["wall_s"] = time.time() - started
    bench_train.print_json(report, args.output)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
