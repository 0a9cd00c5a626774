"""The trainer's engines in benchmarks/gpu_check.py and gpu_check_multi.py: flags as the Slurm
scripts pass them, lev and tied trained side by side with interleaved timing, what ran (the
optimizer, compile fallbacks), memory, and the bf16 GEMM ceiling MFU is also scored against.
"""
from __future__ import annotations

import gc
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import weakref

import torch

import bench_train
from gpu_check_rules import (DP1_LABEL, FP32_STATE_BYTES_PER_PARAMETER, KINDS, WARMUP_STEPS, halved, interleaved_order,
                             learning_rate_problems, lev_share, loss_falls, micro_batch_plan, spread,
                             step_time_ratio)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The training stage's schedule: a constant learning rate from the first step (the configs' own
# warm-up, 900 iterations for the 1.2B ones, would keep a short run at a rate of almost 0).
CONSTANT_LR = {"--lr-warmup-iters": 0, "--lr-decay-style": "constant"}


def log(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


def slurm_train_argv(script: str, gpus: int, gpu_type: str, config: str | None = None) -> list[str]:
    """The trainer flags `slurm/<script>` passes on one node of `gpus` GPUs (its DRY_RUN
    command, data files stubbed: the checks feed their own batches)."""
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


def per_gpu_batch(argv: list[str], gpus_per_node: int) -> dict:
    """The Slurm command's micro-batch and, per GPU, its gradient accumulation."""
    micro = int(argv[argv.index("--micro-batch-size") + 1])
    global_batch = int(argv[argv.index("--global-batch-size") + 1])
    return {"micro": micro, "acc": global_batch // (micro * gpus_per_node)}


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


def optimizer_record(engine, fallbacks_before: int) -> dict:
    """The optimizer class DeepSpeed steps (under its ZeRO wrapper) and the fallbacks
    build_optimizer took for this engine (training/optim.py records them)."""
    from megatron_lev.training import optim

    basic = engine.basic_optimizer
    return {"class": f"{type(basic).__module__}.{type(basic).__qualname__}",
            "fallbacks": list(optim.optimizer_fallbacks[fallbacks_before:])}


def compile_state() -> dict:
    """Counters the fallbacks are read against (compile_fallbacks)."""
    from megatron_lev.models import transformer

    return {"decoder_layers": len(transformer._compile_failures)}


def compile_fallbacks(before: dict, caught: list) -> dict:
    """Every compile fallback since `before`: decoder layers run eagerly after torch.compile failed,
    the fused LEV kernels replaced by the PyTorch path, LEV's CPU mode product or its prologue not
    compiled, and the warnings that said why."""
    from megatron_lev.lev import dispatch as lev_dispatch
    from megatron_lev.models import transformer

    return {"decoder_layers": list(transformer._compile_failures[before["decoder_layers"]:]),
            "lev_fused_kernels": lev_dispatch.fused_modes_failure,
            "lev_cpu_mode_product": getattr(lev_dispatch._cpu_mode_product, "compiled", None) is False,
            "lev_prologue": getattr(lev_dispatch._compiled_prologue, "compiled", None) is False,
            "warnings": [str(w.message)[:300] for w in caught if "fail" in str(w.message)]}


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def allocated(device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def release_engine(engine) -> None:
    """Take a DeepSpeed engine apart so that deleting it frees its memory: ZeRO's gradient hooks
    live in the parameters' autograd nodes (C++) and refer back to the optimizer, a cycle Python's
    collector cannot see, so without destroy() an engine is never freed before the process ends."""
    engine.destroy()


def free_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the GEMM ceiling


def gemm_ceiling(device, size: int, repeats: int = 10, warmup: int = 3) -> dict:
    """bf16 TFLOP/s of a size^3 matrix product on random data (median of `repeats` timed products
    after `warmup`): the ceiling the training stage's MFU is also scored against."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device, torch.bfloat16)
    b = torch.randn(size, size, generator=g).to(device, torch.bfloat16)
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    result = {"size": size, "dtype": "bfloat16", "data": "randn", "repeats": repeats, "warmup": warmup,
              "seconds_median": median, "tflops": 2 * size ** 3 / median / 1e12,
              "tflops_spread": spread([2 * size ** 3 / t / 1e12 for t in times])}
    result["ok"] = result["tflops"] > 0
    log(f"bf16 GEMM {size}^3: {result['tflops']:.1f} TFLOP/s (median of {repeats})")
    return result


# --------------------------------------------------------------------------- LEV inside the steps


class HostEvent:
    """torch.cuda.Event's timing interface on the host clock (time.perf_counter), for a CPU run:
    the rehearsal runs the same hooks as a GPU."""

    clock = staticmethod(time.perf_counter)  # seconds

    def __init__(self):
        self.time = None

    def record(self) -> None:
        self.time = self.clock()

    def elapsed_time(self, end: "HostEvent") -> float:
        return 1000 * (end.time - self.time)


class LevTimer:
    """LEV's generator timed inside the training steps: a forward pre-hook and a forward hook on the
    model's one ParallelLEVEmbedding record an event before and after its forward; a hook on its
    output's gradient one when its backward starts, and a multi-gradient hook on its parameters
    one when every generator gradient is computed (its backward's end). CUDA events on CUDA
    (recorded on the stream, no sync; read after the step's synchronize), HostEvent on CPU. The
    backward's interval also holds whatever else the stream ran meanwhile (DeepSpeed's copies of
    the generator's gradients into its buckets)."""

    def __init__(self, model: torch.nn.Module, device):
        from megatron_lev.lev.parallel import ParallelLEVEmbedding

        modules = [m for m in model.modules() if isinstance(m, ParallelLEVEmbedding)]
        if len(modules) != 1:
            raise RuntimeError(f"LevTimer: {len(modules)} LEV embeddings in the model, expected 1")
        (module,) = modules
        self.source = "cuda events" if device.type == "cuda" else "time.perf_counter"
        self.new_event = (lambda: torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else HostEvent
        self.marks: list[dict] = []  # one dict of events per micro-batch since the last take()
        params = [p for p in module.parameters() if p.requires_grad]
        self.handles = [module.register_forward_pre_hook(self._before_forward),
                        module.register_forward_hook(self._after_forward),
                        torch.autograd.graph.register_multi_grad_hook(params, self._after_backward, mode="all")]

    def _mark(self, marks: dict, name: str) -> None:
        marks[name] = self.new_event()
        marks[name].record()

    def _before_forward(self, module, args) -> None:
        self.marks.append({})
        self._mark(self.marks[-1], "forward_start")

    def _after_forward(self, module, args, output) -> None:
        marks = self.marks[-1]
        self._mark(marks, "forward_end")
        if output.requires_grad:
            output.register_hook(lambda grad: self._mark(marks, "backward_start"))

    def _after_backward(self, grads) -> None:
        if self.marks and "backward_start" in self.marks[-1]:
            self._mark(self.marks[-1], "backward_end")

    def take(self) -> tuple[float, float]:
        """(forward s, backward s) summed over the micro-batches since the last take(); call after
        the step's work has finished (torch.cuda.synchronize)."""
        marks, self.marks = self.marks, []
        missing = [i for i, m in enumerate(marks) if len(m) != 4]
        if not marks or missing:
            raise RuntimeError(f"LevTimer: {len(marks)} micro-batches timed, incomplete: {missing} "
                               f"({[sorted(m) for m in marks]})")
        return (sum(m["forward_start"].elapsed_time(m["forward_end"]) for m in marks) / 1000,
                sum(m["backward_start"].elapsed_time(m["backward_end"]) for m in marks) / 1000)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


# --------------------------------------------------------------------------- interleaved training


def train_interleaved(argvs: dict, world: int, rank: int, device, steps: int, overrides: dict,
                      peak_flops: float | None, ceiling_flops: float | None, into: dict, *, warmup: int = 1,
                      rotate: bool = False, time_lev: bool = False) -> dict:
    """lev and tied engines built side by side and trained on the same micro-batches, `steps`
    steps each, interleaved (gpu_check_rules.interleaved_order: with `rotate` the kind that starts
    a round alternates). The first `warmup` steps of each kind (the first compiles) are not timed;
    every step's loss and learning rate are recorded; with `time_lev` LEV's generator is timed
    inside lev's steps (LevTimer). Fills `into` as it goes (an interruption keeps what was
    measured); frees both engines at the end and records what that freed."""
    from megatron_lev.models.transformer import sdpa_backend_used
    from megatron_lev.training import optim
    from megatron_lev.training.flops import flops_model

    kinds, engines, refs, aux, batches = into.setdefault("kinds", {}), {}, {}, {}, None
    memory = into.setdefault("memory", {"allocated_before_bytes": allocated(device)})
    order = interleaved_order(KINDS, steps, rotate)
    into.update(order=[kind for _, kind in order], warmup_steps=warmup)
    caught, step_batches, timer = [], None, None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step, kind in order:
                if step == 0:
                    before, compiled = allocated(device), compile_state()
                    fallbacks = len(optim.optimizer_fallbacks)
                    args, model_config, engines[kind] = build_trainer_engine(argvs[kind], world, overrides)
                    refs[kind] = weakref.ref(engines[kind])
                    acc, micro, seq = args.gradient_accumulation_steps, args.micro_batch_size, args.seq_length
                    if batches is None:  # the same micro-batches for both kinds
                        windows = bench_train.zipf_batches(model_config.vocab_size, micro, seq, steps * acc,
                                                           seed=100 + rank)
                        batches = [bench_train.as_inputs(w, device, model_config.vocab_size) for w in windows]
                    kinds[kind] = {
                        "global_batch_size": args.global_batch_size, "micro_batch_size": micro,
                        "gradient_accumulation_steps": acc, "seq_length": seq, "data_parallel_size": world,
                        "bf16": bool(args.bf16), "compile_layers": bool(args.compile_layers),
                        "deepspeed_config": args.deepspeed_config, "parameters": sum(
                            p.numel() for p in engines[kind].module.parameters()),
                        "optimizer": optimizer_record(engines[kind], fallbacks),
                        "sdpa_backend": sdpa_backend_used(engines[kind].module, micro, seq,
                                                          torch.bfloat16 if args.bf16 else torch.float32, device),
                        "losses": [], "lrs": [], "step_times_s": [], "distinct_ids": []}
                    aux[kind] = {"compiled_before": compiled, "flops_model": flops_model(model_config, seq)}
                    if time_lev and kind == "lev":
                        timer = LevTimer(engines[kind].module, device)
                        kinds[kind].update(lev_timing=timer.source, lev_forward_s=[], lev_backward_s=[])
                result = kinds[kind]
                acc = result["gradient_accumulation_steps"]
                step_batches = batches[step * acc:(step + 1) * acc]
                result["lrs"].append(float(engines[kind].get_lr()[0]))  # the rate this step runs at
                base = allocated(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                if world > 1:
                    torch.distributed.barrier()
                t0 = time.perf_counter()
                loss = float(optimizer_step(engines[kind], step_batches))  # float(): waits for the step
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
                result["losses"].append(loss)
                lev_times = timer.take() if timer is not None and kind == "lev" else None
                if step == 0:  # compiles, allocates Adam's moments: states, not a timed step
                    result["first_step_s"] = elapsed
                    if base is not None:
                        result["engine_memory_bytes"] = allocated(device) - before
                if step < warmup:
                    result.setdefault("warmup_step_times_s", []).append(elapsed)
                else:
                    result["step_times_s"].append(elapsed)
                    if lev_times is not None:
                        result["lev_forward_s"].append(lev_times[0])
                        result["lev_backward_s"].append(lev_times[1])
                    result["distinct_ids"].append(sum(int(b["lev_ids"].numel()) for b in step_batches)
                                                  if kind == "lev" else 0)
                if base is not None:
                    peak = torch.cuda.max_memory_allocated() - base
                    result["step_peak_above_states_bytes"] = max(result.get("step_peak_above_states_bytes", 0), peak)
    finally:
        batches = step_batches = None  # only the engines' memory is left to free
        if timer is not None:
            timer.remove()
            timer = None
        for kind in list(engines):
            engine_bytes = allocated(device)
            release_engine(engines.pop(kind))
            free_memory(device)
            memory.setdefault("freed_bytes", {})[kind] = (None if engine_bytes is None
                                                          else engine_bytes - allocated(device))
        memory["engines_collected"] = {kind: ref() is None for kind, ref in refs.items()}
        if memory["allocated_before_bytes"] is not None:
            memory["left_allocated_bytes"] = allocated(device) - memory["allocated_before_bytes"]
    for kind, result in kinds.items():  # an interrupted run keeps its raw steps, unsummarised
        summarize_kind(result, aux[kind], peak_flops, ceiling_flops, caught)
    if all(kind in kinds and kinds[kind]["step_times_s"] for kind in KINDS):
        into["lev_over_tied_step_time"] = step_time_ratio(kinds["lev"], kinds["tied"])
    return into


def summarize_kind(result: dict, aux: dict, peak_flops: float | None, ceiling_flops: float | None,
                   caught: list) -> None:
    """Step time (median and spread), tokens/s, model TFLOP/s and MFU (against the datasheet peak
    and the measured GEMM ceiling), the loss and learning-rate rules, compile fallbacks."""
    from megatron_lev.training.flops import training_flops

    fm = aux["flops_model"]
    result["compile_fallbacks"] = compile_fallbacks(aux["compiled_before"], caught)
    result["loss_falls"] = loss_falls(result["losses"])
    result["learning_rate_problems"] = learning_rate_problems(result["lrs"])
    result["final_loss"] = result["losses"][-1] if result["losses"] else None
    times = result["step_times_s"]
    if not times:
        return
    if "lev_forward_s" in result:
        result["lev_generator"] = lev_share(times, result["lev_forward_s"], result["lev_backward_s"])
    tokens = result["micro_batch_size"] * result["seq_length"]
    flops = statistics.mean(training_flops(fm, tokens * result["gradient_accumulation_steps"], d)
                            for d in result["distinct_ids"])  # this GPU's model FLOPs per step
    median = statistics.median(times)
    result.update(step_time_s_median=median, step_time_spread=spread(times),
                  tokens_per_s=result["global_batch_size"] * result["seq_length"] / median,
                  model_tflops_per_s_per_gpu=flops / median / 1e12,
                  mfu=flops / median / peak_flops if peak_flops else None,
                  mfu_of_measured_gemm_ceiling=flops / median / ceiling_flops if ceiling_flops else None)


def training_stage(tiny: bool, gpu: dict, device, steps: int, gpus_per_node: int, ceiling: dict | None,
                   into: dict, warmup: int = WARMUP_STEPS) -> dict:
    """lev-1.2b and tied-1.2b as the Slurm scripts run them on a node of `gpus_per_node` GPUs (their
    DRY_RUN command: bf16, compiled layers, ZeRO-2 + overlap_comm), one GPU's share of the batch,
    both kinds at the Slurm scripts' micro-batch and accumulation (halved and doubled only after an
    out-of-memory error, both kinds again), constant learning rate: `warmup` untimed steps and
    `steps` timed ones per kind, rounds rotated, LEV's generator timed inside lev's steps."""
    from megatron_lev.lev import dispatch as lev_dispatch
    from megatron_lev.lev import kernels
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.param_count import count_parameters
    from megatron_lev.configs import load_config

    argvs = {kind: slurm_train_argv(f"train_{kind}_1b.sh", gpus_per_node, gpu["gpu_type"] or "h100",
                                    f"tiny-{kind}" if tiny else None) for kind in KINDS}
    slurm = per_gpu_batch(argvs["lev"], gpus_per_node)
    section = load_config("tiny-lev" if tiny else "lev-1.2b")["model"]
    parameters = count_parameters(model_config_from_dict(section))["total"]
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    plan = micro_batch_plan(slurm["micro"], slurm["acc"], parameters, capacity,
                            int(argvs["lev"][argvs["lev"].index("--seq-length") + 1])
                            if "--seq-length" in argvs["lev"] else section["seq_length"])
    into.update(slurm_gpus_per_node=gpus_per_node, slurm_micro_batch_size=slurm["micro"],
                slurm_gradient_accumulation_steps=slurm["acc"], micro_batch_plan=plan, label=DP1_LABEL)
    peak = gpu["peak_tflops"] * 1e12 if gpu["peak_tflops"] else None
    launches = dict(kernels.LAUNCHES)
    micro, acc = plan["micro_batch_size"], plan["gradient_accumulation_steps"]
    while True:
        overrides = {"--micro-batch-size": micro, "--global-batch-size": micro * acc, **CONSTANT_LR}
        if tiny:  # on CPU compiling the layers would take most of the run
            overrides["--no-compile-layers"] = ""
        try:
            train_interleaved(argvs, 1, 0, device, warmup + steps, overrides, peak,
                              ceiling["tflops"] * 1e12 if ceiling else None, into, warmup=warmup, rotate=True,
                              time_lev=True)
            break
        except RuntimeError as exc:
            # Out of memory at this micro-batch: both kinds again at half of it.
            if not is_out_of_memory(exc) or halved(micro, acc) is None:
                raise
        # Outside the except block: its traceback (and the frames holding tensors) is gone.
        into.setdefault("attempts", []).append({"micro_batch_size": micro, "gradient_accumulation_steps": acc,
                                                "result": "out of memory", "memory": into.pop("memory")})
        into.pop("kinds")
        free_memory(device)
        micro, acc = halved(micro, acc)
    for result in into["kinds"].values():
        if "engine_memory_bytes" in result and "step_peak_above_states_bytes" in result:
            # The Slurm job's GPU: 1/8 of the fp32 state, the Slurm micro-batch's activations.
            fp32_state = FP32_STATE_BYTES_PER_PARAMETER * result["parameters"]
            result["estimated_bytes_per_gpu_of_the_slurm_job"] = (
                result["engine_memory_bytes"] - fp32_state * (1 - 1 / gpus_per_node)
                + result["step_peak_above_states_bytes"] * slurm["micro"] / result["micro_batch_size"])
    lev_result = into["kinds"].get("lev", {})
    lev_result["fused_kernel_launches"] = {k: kernels.LAUNCHES[k] - launches.get(k, 0) for k in ("forward", "backward")}
    lev_result["fused_failure"] = lev_dispatch.fused_modes_failure
    for kind, result in into["kinds"].items():
        log(f"{kind}: {1000 * result.get('step_time_s_median', float('nan')):.0f} ms/step, MFU {result.get('mfu')} "
            f"(of the measured GEMM ceiling {result.get('mfu_of_measured_gemm_ceiling')}), losses "
            f"{[round(loss, 3) for loss in result['losses']]}")
    return into
