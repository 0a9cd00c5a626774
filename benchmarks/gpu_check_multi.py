#!/usr/bin/env python
"""Checks for a node with 2 or more GPUs, under torchrun/NCCL (run by benchmarks/gpu_check_multi.sh);
with one process (one GPU) only the throughput stage runs, the others say "needs >= 2 GPUs":

1. tensor_parallel: the Leviathan decoder at TP=2 against TP=1 on the same weights and batch
   (lev-1.2b's width at 2 layers; float32 and bf16): logits, loss and every gradient (TP=2
   shards merged). And the LEV embedding's sequence-parallel branch, the only one the model
   has, at TP=2 (its reduce-scatter over the TP group) against TP=1 without it: output and
   generator gradients. The SP branch needs CUDA (gloo has no reduce-scatter): on CPU it is
   reported as skipped.
2. data_parallel: DP=N bf16 training with the trainer's engine (build_engine), compiled layers
   and the DeepSpeed config the Slurm scripts pass (ZeRO-2 with overlap_comm), against one GPU
   running the same global batch by gradient accumulation (`--stage reference`, run first in
   its own process): loss and global gradient norm of the first steps. Gradients reduced in
   fp32 keep the norms equal to about 1e-6 relative; reduced in bf16 they differ by about 1e-3.
3. throughput: lev-1.2b and tied-1.2b trained data-parallel over all the node's GPUs exactly as
   `slurm/train_lev_1b.sh` / `train_tied_1b.sh` run them (their DRY_RUN command: global batch,
   the micro-batch their batch arithmetic picks, gradient accumulation, DeepSpeed config, bf16):
   step time, tokens/s, MFU, peak memory, and the LEV/tied step-time ratio.

    python benchmarks/gpu_check_multi.py --stage reference --reference ref.json        # 1 GPU
    torchrun --standalone --nproc-per-node 8 benchmarks/gpu_check_multi.py --reference ref.json --output out.json
    # the same logic on CPU (gloo, tiny configs), as tests/test_gpu_check.py runs it:
    python benchmarks/gpu_check_multi.py --device cpu --tiny --stage reference --dp-size 2 --reference ref.json

Rank 0 writes the JSON to --output after every stage (`stages_done`) and prints it at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402  (benchmarks/ is not a package)
from gpu_check import gpu_variant, save_partial  # noqa: E402
from gpu_check_training import (CONSTANT_LR, build_trainer_engine, optimizer_step, release_engine,  # noqa: E402
                                slurm_train_argv, train_interleaved)


# Max |TP=2 - TP=1| / max |TP=1| allowed: float32 sums in another order; bf16 rounds the
# partial sums of each TP rank before they are added.
TP_TOLERANCE = {"float32": 1e-4, "bfloat16": 2.0 ** -5}
# Relative difference allowed between DP=N and one GPU with accumulation: fp32 reduction.
DP_GRAD_NORM_TOLERANCE = 1e-4
DP_LOSS_TOLERANCE = 1e-3


def log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"gpu_check_multi: {message}", file=sys.stderr, flush=True)


def relative_max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


# --------------------------------------------------------------------------- 1. tensor parallel


def tensor_parallel_check(config: str, layers: int, batch: int, seq: int, device) -> dict:
    """TP=2 vs TP=1 logits/loss/gradients of the decoder, and LEV's SP branch (see the docstring)."""
    from megatron_lev.configs import load_config
    from megatron_lev.distributed.rng import set_seed
    from megatron_lev.distributed.state import initialize_model_parallel
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.decoder import build_model, gather_logits, gather_tensor_parallel

    section = dict(load_config(config)["model"], num_layers=layers)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, section["vocab_size"], (batch, seq + 1), generator=g)
    ids, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    loss_mask = (torch.rand(batch, seq, generator=g) > 0.1).float().to(device)
    report = {"config": config, "num_layers": layers, "batch": batch, "seq_length": seq, "dtypes": {}}
    for bf16 in (False, True):
        dtype = "bfloat16" if bf16 else "float32"
        outputs = {}
        for tp in (1, 2):  # TP=1 first: every rank computes it, as data-parallel replicas
            initialize_model_parallel(tensor_model_parallel_size=tp)
            set_seed(1234)
            model = build_model(model_config_from_dict(section, tensor_model_parallel_size=tp, bf16=bf16)).to(device)
            logits = gather_logits(model(ids), section["vocab_size"]).detach()
            loss = model(ids, labels=labels, loss_mask=loss_mask)
            loss.backward()
            outputs[tp] = {"logits": logits, "loss": float(loss.detach()),
                           "grads": {n: gather_tensor_parallel(p.grad, p) for n, p in model.named_parameters()}}
            del model
        one, two = outputs[1], outputs[2]
        grads = {n: relative_max_diff(two["grads"][n], one["grads"][n]) for n in one["grads"]}
        worst = max(grads, key=grads.get)
        result = {
            "logits_relative_max_diff": relative_max_diff(two["logits"], one["logits"]),
            "loss_tp1": one["loss"], "loss_tp2": two["loss"],
            "loss_relative_diff": abs(two["loss"] - one["loss"]) / abs(one["loss"]),
            "grads_relative_max_diff": grads[worst], "grads_worst_parameter": worst,
            "tolerance": TP_TOLERANCE[dtype],
        }
        result["ok"] = all(result[k] <= TP_TOLERANCE[dtype] for k in
                           ("logits_relative_max_diff", "loss_relative_diff", "grads_relative_max_diff"))
        report["dtypes"][dtype] = result
        log(f"TP=2 vs TP=1 ({dtype}): logits {result['logits_relative_max_diff']:.2e}, "
            f"loss {result['loss_relative_diff']:.2e}, grads {result['grads_relative_max_diff']:.2e} ({worst})")
    report["lev_sequence_parallel"] = (lev_sequence_parallel_check(section, ids) if device.type == "cuda" else
                                       {"skipped": "the sequence-parallel reduce-scatter needs CUDA (gloo has "
                                                   "no reduce-scatter)"})
    report["ok"] = all(r["ok"] for r in report["dtypes"].values()) and report["lev_sequence_parallel"].get("ok", True)
    initialize_model_parallel(1, 1)
    return report


def lev_sequence_parallel_check(section: dict, ids: torch.Tensor) -> dict:
    """ParallelLEVEmbedding at TP=2 with sequence parallelism (reduce-scatter to [s/2, b, D])
    vs TP=1 without: the output gathered along the sequence, and the generator's gradients
    for the same upstream gradient."""
    from megatron.core import parallel_state

    from megatron_lev.distributed.state import initialize_model_parallel
    from megatron_lev.lev.generator import LEVConfig
    from megatron_lev.lev.parallel import ParallelLEVEmbedding
    from megatron_lev.models.decoder import gather_tensor_parallel

    lev = LEVConfig.from_dict({**section.get("lev", {}), "vocab_size": section["vocab_size"],
                               "hidden_size": section["hidden_size"]})
    seq = ids.shape[1]
    upstream = torch.randn(seq, ids.shape[0], lev.hidden_size, generator=torch.Generator().manual_seed(3)).to(ids.device)
    outputs = {}
    for tp, sp in ((1, False), (2, True)):
        initialize_model_parallel(tensor_model_parallel_size=tp)
        module = ParallelLEVEmbedding(lev, sequence_parallel=sp, init_seed=1234, device=ids.device)
        out = module(ids)  # [s / tp, b, D] with SP
        rank = parallel_state.get_tensor_model_parallel_rank()
        chunk = seq // tp
        (out * upstream[rank * chunk:(rank + 1) * chunk]).sum().backward()
        if sp:
            shards = [torch.empty_like(out) for _ in range(tp)]
            dist.all_gather(shards, out.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
            out = torch.cat(shards)
        outputs[tp] = {"out": out.detach(),
                       "grads": {n: gather_tensor_parallel(p.grad, p) for n, p in module.generator.named_parameters()}}
    one, two = outputs[1], outputs[2]
    grads = {n: relative_max_diff(two["grads"][n], one["grads"][n]) for n in one["grads"]}
    result = {"output_relative_max_diff": relative_max_diff(two["out"], one["out"]),
              "grads_relative_max_diff": max(grads.values()), "tolerance": TP_TOLERANCE["float32"]}
    result["ok"] = max(result["output_relative_max_diff"], result["grads_relative_max_diff"]) <= result["tolerance"]
    log(f"LEV SP TP=2 vs TP=1: output {result['output_relative_max_diff']:.2e}, grads "
        f"{result['grads_relative_max_diff']:.2e}")
    return result


# --------------------------------------------------------------------------- 2. data parallel

DP_STEPS = 3


def dp_setup(tiny: bool, dp_size: int) -> tuple[list[str], dict, int]:
    """Trainer flags, overrides and micro-batch size of the DP check: the Slurm scripts' run
    at a reduced depth, global batch = dp_size micro-batches."""
    micro = 2
    argv = slurm_train_argv("train_lev_1b.sh", dp_size, "h100", "tiny-lev" if tiny else None)
    overrides = {"--micro-batch-size": micro, "--global-batch-size": micro * dp_size, "--lr-warmup-iters": 0}
    if tiny:  # on CPU, compiling would take most of the run
        overrides["--no-compile-layers"] = ""
    else:
        # Compiled layers, as the Slurm scripts run them: ZeRO-2's overlap_comm with compiled
        # backward hooks on several streams is where DeepSpeed's bucket races were (#8061).
        overrides["--num-layers"] = 4
    return argv, overrides, micro


def dp_batches(vocab: int, micro: int, seq: int, dp_size: int, device) -> list[list[dict]]:
    """DP_STEPS global batches of dp_size micro-batches, the same on every rank."""
    windows = bench_train.zipf_batches(vocab, micro, seq, DP_STEPS * dp_size, seed=11)
    batches = [bench_train.as_inputs(w, device, vocab) for w in windows]
    return [batches[s * dp_size:(s + 1) * dp_size] for s in range(DP_STEPS)]


def run_dp_engine(tiny: bool, dp_size: int, world_size: int, rank: int, device) -> dict:
    """Losses and global grad norms of DP_STEPS steps; world_size 1 is the reference."""
    argv, overrides, micro = dp_setup(tiny, dp_size)
    argv = [a for a in argv if a != "--no-bf16"] + ["--bf16"]  # the tiny configs are fp32
    args, model_config, engine = build_trainer_engine(argv, world_size, overrides)
    steps = dp_batches(model_config.vocab_size, micro, args.seq_length, dp_size, device)
    losses, norms = [], []
    for global_batch in steps:
        mine = global_batch if world_size == 1 else [global_batch[rank]]
        loss = optimizer_step(engine, mine)
        if world_size > 1:
            dist.all_reduce(loss)
            loss /= world_size
        losses.append(float(loss))
        norms.append(float(engine.get_global_grad_norm()))
    result = {"losses": losses, "grad_norms": norms, "world_size": world_size,
              "gradient_accumulation_steps": args.gradient_accumulation_steps,
              "deepspeed_config": args.deepspeed_config, "micro_batch_size": micro, "num_layers": model_config.num_layers}
    release_engine(engine)
    del engine
    gc.collect()
    return result


def data_parallel_check(reference: dict, tiny: bool, device) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = run_dp_engine(tiny, world, world, rank, device)
    loss_diffs = [abs(a - b) / abs(b) for a, b in zip(dp["losses"], reference["losses"])]
    norm_diffs = [abs(a - b) / abs(b) for a, b in zip(dp["grad_norms"], reference["grad_norms"])]
    result = {"dp_size": world, "reference": reference, "data_parallel": dp,
              "loss_relative_diffs": loss_diffs, "grad_norm_relative_diffs": norm_diffs,
              "tolerances": {"grad_norm": DP_GRAD_NORM_TOLERANCE, "loss": DP_LOSS_TOLERANCE}}
    result["same_deepspeed_config"] = dp["deepspeed_config"] == reference["deepspeed_config"]
    result["ok"] = (len(loss_diffs) == DP_STEPS and max(norm_diffs) <= DP_GRAD_NORM_TOLERANCE
                    and max(loss_diffs) <= DP_LOSS_TOLERANCE and result["same_deepspeed_config"])
    log(f"DP={world} bf16 vs 1 GPU: loss diffs {['%.1e' % d for d in loss_diffs]}, grad-norm diffs "
        f"{['%.1e' % d for d in norm_diffs]}")
    return result


# --------------------------------------------------------------------------- 3. throughput


def throughput_check(tiny: bool, gpu: dict, device, steps: int) -> dict:
    """lev-1.2b and tied-1.2b as the Slurm scripts run them on this node (data-parallel over
    every process of the job), trained side by side at a constant learning rate, steps
    interleaved (gpu_check_training.train_interleaved): step time, tokens/s, MFU, memory."""
    world, rank = dist.get_world_size(), dist.get_rank()
    peak = gpu["peak_tflops"] * 1e12 if gpu["peak_tflops"] else None
    argvs = {kind: slurm_train_argv(f"train_{kind}_1b.sh", world, gpu["gpu_type"] or "h100",
                                    f"tiny-{kind}" if tiny else None) for kind in ("lev", "tied")}
    # On CPU (--tiny) torch.compile of the layers would take most of the run's time.
    overrides = {**CONSTANT_LR, **({"--no-compile-layers": ""} if tiny else {})}
    report = train_interleaved(argvs, world, rank, device, steps, overrides, peak, None, {})
    for kind, result in report["kinds"].items():
        log(f"{kind}: {1000 * result['step_time_s_median']:.0f} ms/step (accumulation "
            f"{result['gradient_accumulation_steps']} x micro-batch {result['micro_batch_size']}), MFU {result['mfu']}")
    ratio = report["lev_over_tied_step_time"]
    report["ok"] = ratio["comparable"] and all(
        all(math.isfinite(loss) for loss in k["losses"]) and k["loss_falls"]["falls"] and not k["learning_rate_problems"]
        for k in report["kinds"].values())
    return report


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny configs (a CPU run of the logic)")
    p.add_argument("--stage", choices=("reference", "checks"), default="checks",
                   help="reference: the 1-GPU run of the DP check (one process, before torchrun)")
    p.add_argument("--dp-size", type=int, help="reference: the data-parallel size it stands in for")
    p.add_argument("--reference", help="the reference stage's JSON (needed with 2+ processes)")
    p.add_argument("--steps", type=int, default=12,
                   help="optimizer steps per kind (throughput; the first compiles and is not timed; at least 10)")
    p.add_argument("--output", help="rank 0 writes the JSON here after every stage")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    started = time.time()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check_multi.py: error: torch sees no GPU; --device cpu --tiny runs the logic on the CPU")
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported
    from megatron_lev.distributed.launch import init_distributed
    from megatron_lev.distributed.rng import set_seed
    from megatron_lev.distributed.state import destroy_parallel, initialize_model_parallel

    if args.stage == "reference":
        if not args.dp_size or args.dp_size < 2:
            raise SystemExit("gpu_check_multi.py: error: --stage reference needs --dp-size N >= 2")
        with contextlib.redirect_stdout(sys.stderr):
            device = torch.device(args.device)
            bench_train.start_process_group(device)
            result = run_dp_engine(args.tiny, args.dp_size, 1, 0, device)
            destroy_parallel()
        from megatron_lev.utils.files import atomic_path

        with atomic_path(args.reference) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f)
        return {**result, "ok": True}

    launch = init_distributed()  # torchrun's environment; nccl on GPUs
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world > 1 and world % 2:
        raise SystemExit(f"gpu_check_multi.py: error: needs 1 or an even number of processes, got {world}")
    reference = None
    if world > 1:
        if not args.reference:
            raise SystemExit("gpu_check_multi.py: error: --reference (the --stage reference JSON) is needed at 2+ GPUs")
        with open(args.reference, encoding="utf-8") as f:
            reference = json.load(f)
        if reference.get("world_size") != 1 or len(reference.get("losses", ())) != DP_STEPS:
            raise SystemExit(f"gpu_check_multi.py: error: {args.reference} is not a --stage reference result")
    gpu = gpu_variant(torch.cuda.get_device_name(device)) if device.type == "cuda" else gpu_variant("")
    report = {"check": "gpu_check_multi", "environment": bench_train.environment(device), **gpu,
              "processes": world, "launcher": launch.launcher, "stages_done": []}
    stages = (
        ("tensor_parallel", lambda: tensor_parallel_check(*(("tiny-lev", 2, 2, 16) if args.tiny else
                                                           ("lev-1.2b", 2, 2, 512)), device)),
        ("data_parallel", lambda: data_parallel_check(reference, args.tiny, device)),
        ("throughput", lambda: throughput_check(args.tiny, gpu, device, args.steps)),
    )
    if world == 1:  # one GPU: its single-GPU part (the Slurm scripts' per-GPU work); the rest needs two
        for name in ("tensor_parallel", "data_parallel"):
            report[name] = {"skipped": "needs >= 2 GPUs", "ok": True}
        stages = stages[2:]
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON only (DeepSpeed prints)
            for name, run in stages:
                initialize_model_parallel(1, 1)
                set_seed(1234)
                report[name] = run()
                report["stages_done"].append(name)
                if rank == 0:
                    save_partial(report, args.output)
    except KeyboardInterrupt:  # gpu_check_multi.sh's time limit: keep what was measured
        report["interrupted"] = "time limit"
    report["ok"] = len(report["stages_done"]) == len(stages) and all(report[n]["ok"] for n, _ in stages)
    report["finished"] = True
    report["wall_s"] = time.time() - started
    if rank == 0:
        bench_train.print_json(report, args.output)
    destroy_parallel()
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
