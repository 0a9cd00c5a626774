#!/usr/bin/env python
"""Training step time and tokens/s of `lev` vs `tied` vs `untied` (vs `plain`) on the same backbone.

    python benchmarks/bench_train.py                          # the demo size and a 125M model, CPU
    python benchmarks/bench_train.py --sizes demo --repeats 7 --steps 3
    python benchmarks/bench_train.py --sizes 1.2b --bf16 --gpu-type h100     # on a GPU

One process. Every embedding kind gets its own DeepSpeed engine, built exactly as
`python -m megatron_lev.train` builds it (flags over the YAML, `build_deepspeed_config`,
`build_engine`: ZeRO-1, AdamW with its weight-decay groups, clipping), and trains on the
same micro-batches. The kinds are interleaved: each repetition times `--steps` steps of
every kind, in an order rotated from one repetition to the next, so load drift on a
shared machine hits all kinds alike; the reported step time is the median over all timed
steps. A step is one micro-batch: forward, backward, optimizer step.

`plain` is the tied model as a transformers `LlamaForCausalLM` (same shape, tied embeddings,
padded vocabulary) trained by a plain PyTorch loop (torch AdamW, clipping, float32 cross
entropy) in the same process and interleaving: `tied_over_plain` is what our framework
(megatron-core layers, DeepSpeed) costs over plain PyTorch. LEV's distinct ids are computed
outside the timed step, as the trainer's data loader does.

Tokens: Zipf-distributed synthetic ids by default (natural text's rank-frequency law, so
the LEV generator sees a realistic number of distinct ids per micro-batch: it evaluates
each distinct id once), or windows of a real indexed dataset with `--data-path`.

Sizes: `demo` is the demo's model (demo-*.yaml) at its micro-batch; `125m` is the
lev-200m recipe at GPT-3 Small's shape (12 x 768, 12 heads, SwiGLU 2048: 125 M parameters
with LEV, 124 M tied); `1.2b` is lev-1.2b (for GPUs).

Output: one JSON object; per size, per kind the median/min step time, tokens/s, model
TFLOP/s (megatron_lev.training.flops, the trainer's formula), MFU when a peak is known, and on
CUDA the memory; and the ratios `lev_over_tied` / `untied_over_tied` / `tied_over_plain` of the median step
times (>1: slower). On a shared machine wall time is noisy: `ratios_of_fastest_step`
and, on CPU, `ratios_of_cpu_time` (process CPU seconds per step) are less disturbed by other
processes; the CPU load average at start and end is reported.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np
import torch

if not torch.cuda.is_available():  # before DeepSpeed is imported: its CPU accelerator
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

KINDS = ("lev", "tied", "untied", "plain")
# plain: the tied model as a plain transformers LlamaForCausalLM (same shape, padded vocabulary,
# tied embeddings) trained by a plain PyTorch loop: torch AdamW (its default implementation),
# gradient clipping, float32 cross entropy. `tied_over_plain` is our framework's overhead.


@dataclass(frozen=True)
class Size:
    """A benchmark size: a packaged config, model overrides (Megatron flag names) and the
    batch (None: the config's training micro-batch / sequence length)."""

    config: str
    micro_batch_size: Optional[int] = None
    seq_length: Optional[int] = None
    overrides: dict = field(default_factory=dict)
    repeats: int = 5
    steps: int = 2

    def resolved(self, **changes) -> "Size":
        """This size with `changes` applied (None values ignored) and the batch filled in
        from the config's training: section."""
        from megatron_lev.configs import load_config

        size = replace(self, **{k: v for k, v in changes.items() if v is not None})
        training = load_config(size.config).get("training") or {}
        return replace(size, micro_batch_size=size.micro_batch_size or training["micro_batch_size"],
                       seq_length=size.seq_length or training["seq_length"])


SIZES = {
    "demo": Size("demo-lev", repeats=5, steps=3),  # the demo's own micro-batch and sequence length
    "125m": Size("lev-200m", micro_batch_size=2, seq_length=512, repeats=3, steps=1,
                 overrides={"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                            "num_query_groups": 12, "ffn_hidden_size": 2048}),
    "1.2b": Size("lev-1.2b", micro_batch_size=8, seq_length=2048, repeats=5, steps=3),
}


# --------------------------------------------------------------------------- batches


def zipf_batches(vocab_size: int, micro_batch_size: int, seq_length: int, count: int, seed: int = 1234,
                 exponent: float = 1.0) -> list[torch.Tensor]:
    """`count` micro-batches [b, s + 1] of ids drawn with P(rank k) ~ 1 / (k + 2.7)^exponent
    (Zipf-Mandelbrot, the usual fit to word frequencies), ranks shuffled over the ids."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(vocab_size, dtype=np.float64)
    p = 1.0 / (ranks + 2.7) ** exponent
    p /= p.sum()
    ids_by_rank = rng.permutation(vocab_size)
    draws = rng.choice(vocab_size, size=(count, micro_batch_size, seq_length + 1), p=p)
    return [torch.from_numpy(ids_by_rank[d]).long() for d in draws]


def dataset_batches(prefix: str, vocab_size: int, micro_batch_size: int, seq_length: int,
                    count: int) -> list[torch.Tensor]:
    """`count` micro-batches of consecutive windows of a megatron-core indexed dataset."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_lev.data.datasets import check_dataset_prefix

    check_dataset_prefix(prefix)
    dataset = IndexedDataset(prefix)
    tokens = np.concatenate([dataset[i] for i in range(len(dataset))])
    need = count * micro_batch_size * (seq_length + 1)
    if tokens.size < need:
        raise ValueError(f"--data-path {prefix}: {tokens.size} tokens, the benchmark needs {need}")
    if int(tokens.max()) >= vocab_size:
        raise ValueError(f"--data-path {prefix}: holds id {int(tokens.max())} >= the model's vocab_size {vocab_size}")
    windows = torch.from_numpy(tokens[:need].astype(np.int64)).view(count, micro_batch_size, seq_length + 1)
    return list(windows)


def as_inputs(window: torch.Tensor, device, vocab_size: int) -> dict:
    """[b, s + 1] ids -> the trainer's micro-batch (tokens, labels, loss_mask, position_ids, and
    LEV's distinct ids as the trainer's data loader computes them on CPU)."""
    from megatron_lev.lev.generator import ids_to_evaluate

    tokens, labels = window[:, :-1].contiguous(), window[:, 1:]
    b, s = tokens.shape
    lev_ids, lev_inverse = ids_to_evaluate(tokens, vocab_size, unique=True)
    return {"tokens": tokens.to(device), "labels": labels.contiguous().to(device),
            "loss_mask": torch.ones(b, s, device=device),
            "position_ids": torch.arange(s, device=device).unsqueeze(0).expand(b, s),
            "lev_ids": lev_ids.to(device), "lev_inverse": lev_inverse.to(device)}


# --------------------------------------------------------------------------- engines


@dataclass
class Run:
    kind: str
    engine: object
    model_config: object
    flops_model: object
    parameters: int
    static_memory_gb: Optional[float]  # CUDA: memory the engine holds (weights, grads, optimizer after a step)
    step_times: list = field(default_factory=list)
    cpu_times: list = field(default_factory=list)  # process CPU seconds per step (all threads)
    distinct_ids: list = field(default_factory=list)
    activation_peak_gb: float = 0.0
    losses: list = field(default_factory=list)


def trainer_argv(size: Size, kind: str, bf16: bool, num_layers: Optional[int] = None) -> list[str]:
    """The flags of a `megatron_lev.train` run of this size (data flags are placeholders: the
    benchmark feeds its own batches)."""
    overrides = dict(size.overrides, **({"num_layers": num_layers} if num_layers else {}))
    argv = ["--config", size.config, "--embedding", kind, "--micro-batch-size", str(size.micro_batch_size),
            "--global-batch-size", str(size.micro_batch_size), "--seq-length", str(size.seq_length),
            "--train-iters", "1000000", "--lr-warmup-iters", "0", "--zero-stage", "1",
            "--bf16" if bf16 else "--no-bf16",
            "--data-path", "/benchmark/synthetic", "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", "/benchmark/none.model"]
    for name, value in overrides.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


class PlainLlamaEngine:
    """The tied model as transformers' LlamaForCausalLM in a plain PyTorch training loop,
    called like a DeepSpeed engine (engine(tokens, ...), backward, step)."""

    def __init__(self, model_config, args, device):
        from transformers import LlamaConfig, LlamaForCausalLM

        c = model_config
        hf_config = LlamaConfig(
            vocab_size=c.padded_vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
            num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_query_groups, head_dim=c.kv_channels, max_position_embeddings=c.seq_length,
            rms_norm_eps=c.layernorm_epsilon, rope_theta=c.rotary_base, tie_word_embeddings=True,
            attention_bias=False, mlp_bias=False, attn_implementation="sdpa",
            dtype=torch.bfloat16 if args.bf16 else torch.float32)
        self.model = LlamaForCausalLM(hf_config).to(device=device, dtype=torch.bfloat16 if args.bf16 else torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                           eps=args.adam_eps, weight_decay=args.weight_decay)
        self.clip_grad = args.clip_grad

    def train(self):
        self.model.train()

    def __call__(self, tokens, position_ids=None, labels=None, loss_mask=None, **_):
        logits = self.model(input_ids=tokens, position_ids=position_ids).logits
        losses = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        return (losses * loss_mask.flatten()).sum() / loss_mask.sum()

    def backward(self, loss):
        loss.backward()

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def build_run(size: Size, kind: str, bf16: bool, num_layers: Optional[int] = None) -> Run:
    from megatron_lev.models.param_count import count_parameters
    from megatron_lev.training.arguments import parse_args, validate_args
    from megatron_lev.training.ds_config import build_deepspeed_config
    from megatron_lev.training.engine import build_engine
    from megatron_lev.training.flops import flops_model
    from megatron_lev.training.validation import build_model_config

    plain = kind == "plain"
    args = validate_args(parse_args(trainer_argv(size, "tied" if plain else kind, bf16, num_layers)), world_size=1)
    ds_config = build_deepspeed_config(args)
    model_config = build_model_config(args)
    before = _cuda_allocated_gb()
    if plain:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        engine = PlainLlamaEngine(model_config, args, device)
    else:
        engine = build_engine(args, model_config, ds_config)
    static = None if before is None else _cuda_allocated_gb() - before
    return Run(kind, engine, model_config, flops_model(model_config, size.seq_length),
               count_parameters(model_config)["total"], static)


def _cuda_allocated_gb() -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 2**30


def train_steps(run: Run, batches: list[dict], start: int, steps: int) -> None:
    """`steps` timed optimizer steps (one micro-batch each) on batches[start:], as the
    trainer's train_step does them."""
    from megatron_lev.training.batches import model_inputs

    engine = run.engine
    engine.train()
    cuda = torch.cuda.is_available()
    for i in range(steps):
        b = batches[(start + i) % len(batches)]
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = engine(b["tokens"], **model_inputs(b))
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
            run.activation_peak_gb = max(run.activation_peak_gb, (torch.cuda.max_memory_allocated() - base) / 2**30)
        run.step_times.append(time.perf_counter() - t0)
        run.cpu_times.append(time.process_time() - c0)
        run.losses.append(float(loss.detach()))
        run.distinct_ids.append(b["lev_ids"].numel())


def summarize(run: Run, size: Size, peak_flops: Optional[float]) -> dict:
    from megatron_lev.training.flops import training_flops

    tokens = size.micro_batch_size * size.seq_length
    median = statistics.median(run.step_times)
    distinct = statistics.mean(run.distinct_ids) if run.kind == "lev" else 0
    flops = training_flops(run.flops_model, tokens, distinct)
    out = {
        "parameters": run.parameters,
        "step_time_s_median": median,
        "step_time_s_min": min(run.step_times),
        "step_times_s": [round(t, 5) for t in run.step_times],
        "tokens_per_s": tokens / median,
        "model_tflops_per_s": flops / median / 1e12,
        "mfu": flops / median / peak_flops if peak_flops else None,
        "distinct_ids_per_micro_batch": statistics.mean(run.distinct_ids),
        "final_loss": run.losses[-1],
    }
    if not torch.cuda.is_available():
        out["cpu_time_s_median"] = statistics.median(run.cpu_times)
    if run.static_memory_gb is not None:
        out["memory_gb"] = {"model_and_optimizer_states": run.static_memory_gb,
                            "step_peak_above_states": run.activation_peak_gb,
                            "peak_if_alone": run.static_memory_gb + run.activation_peak_gb}
    return out


# --------------------------------------------------------------------------- the benchmark


def bench_size(name: str, size: Size, kinds, *, bf16: bool, device, data_path: Optional[str],
               peak_flops: Optional[float], warmup: int, num_layers: Optional[int] = None, log=sys.stderr) -> dict:
    """Build one engine per kind, warm each up, then interleave timed blocks; free them after."""
    runs = {}
    try:
        for kind in kinds:
            runs[kind] = build_run(size, kind, bf16, num_layers)
        vocab = runs[kinds[0]].model_config.vocab_size
        count = warmup + size.repeats * size.steps
        windows = (dataset_batches(data_path, vocab, size.micro_batch_size, size.seq_length, count) if data_path
                   else zipf_batches(vocab, size.micro_batch_size, size.seq_length, count))
        batches = [as_inputs(w, device, vocab) for w in windows]
        for run in runs.values():  # warm-up steps are not timed
            before = _cuda_allocated_gb()
            train_steps(run, batches, 0, warmup)
            if before is not None and warmup:
                # Adam's moments are allocated by the first optimizer step: they are states too.
                run.static_memory_gb += _cuda_allocated_gb() - before
            run.step_times, run.cpu_times, run.losses, run.distinct_ids, run.activation_peak_gb = [], [], [], [], 0.0
        for rep in range(size.repeats):
            order = list(kinds[rep % len(kinds):]) + list(kinds[:rep % len(kinds)])
            for kind in order:
                train_steps(runs[kind], batches, warmup + rep * size.steps, size.steps)
            print(f"[{name}] repetition {rep + 1}/{size.repeats}: "
                  + ", ".join(f"{k} {1000 * statistics.median(runs[k].step_times):.1f} ms" for k in kinds),
                  file=log, flush=True)
        first = runs[kinds[0]].model_config
        result = {
            "config": size.config, "overrides": dict(size.overrides, **({"num_layers": num_layers} if num_layers else {})),
            "num_layers": first.num_layers, "hidden_size": first.hidden_size,
            "micro_batch_size": size.micro_batch_size, "seq_length": size.seq_length,
            "tokens_per_step": size.micro_batch_size * size.seq_length,
            "repeats": size.repeats, "steps_per_repeat": size.steps, "warmup_steps": warmup,
            "kinds": {k: summarize(r, size, peak_flops) for k, r in runs.items()},
        }
        if "tied" in kinds:
            result["ratios"] = _ratios(result["kinds"], "step_time_s_median")
            # Less disturbed by other processes on a shared machine: the fastest step, and on CPU
            # the CPU time the steps consumed.
            result["ratios_of_fastest_step"] = _ratios(result["kinds"], "step_time_s_min")
            if device.type == "cpu":
                result["ratios_of_cpu_time"] = _ratios(result["kinds"], "cpu_time_s_median")
        return result
    finally:
        for run in runs.values():  # ZeRO's hooks keep an engine alive until it is destroyed
            getattr(run.engine, "destroy", lambda: None)()
        runs.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _ratios(kinds: dict, key: str) -> dict:
    ratios = {f"{k}_over_tied": v[key] / kinds["tied"][key] for k, v in kinds.items() if k not in ("tied", "plain")}
    if "plain" in kinds:  # our framework against a plain PyTorch loop on the same model
        ratios["tied_over_plain"] = kinds["tied"][key] / kinds["plain"][key]
    return ratios


def environment(device) -> dict:
    env = {"torch": torch.__version__, "device": str(device), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu_count"] = os.cpu_count()
        try:
            env["load_average_1m"] = os.getloadavg()[0]
        except OSError:
            pass
    return env


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["demo", "125m"], choices=sorted(SIZES))
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--repeats", type=int, help="interleaved repetitions (default: per size)")
    p.add_argument("--steps", type=int, help="timed steps per kind per repetition (default: per size)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per kind first")
    p.add_argument("--micro-batch-size", type=int, help="default: per size")
    p.add_argument("--seq-length", type=int, help="default: per size")
    p.add_argument("--num-layers", type=int, help="override the depth (e.g. to fit a GPU)")
    p.add_argument("--data-path", help="indexed dataset prefix for real tokens (default: Zipf synthetic ids)")
    p.add_argument("--bf16", action="store_true", help="train in bf16 (as --bf16 runs do)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--gpu-type", choices=("a100", "h100", "h200"), help="peak bf16 FLOP/s for MFU")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s for MFU (overrides --gpu-type)")
    p.add_argument("--output", help="also write the JSON here")
    return p


def start_process_group(device: torch.device) -> None:
    """A one-rank process group and megatron-core's TP=PP=1 groups (DeepSpeed needs both)."""
    from megatron_lev.distributed.launch import init_distributed
    from megatron_lev.distributed.rng import set_seed
    from megatron_lev.distributed.state import initialize_model_parallel

    init_distributed(backend="nccl" if device.type == "cuda" else "gloo")
    initialize_model_parallel(1, 1)
    set_seed(1234)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    from megatron_lev.training.flops import peak_flops_per_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the trainer would run
    if device.type == "cpu" and args.bf16:
        print("bench_train.py: note: --bf16 on CPU measures CPU bf16 kernels", file=sys.stderr)
    for name in ("repeats", "steps", "micro_batch_size", "seq_length", "num_layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"bench_train.py: error: --{name.replace('_', '-')} must be >= 1, got {value}")
    peak = peak_flops_per_device(args.gpu_type, args.peak_tflops)
    report = {"benchmark": "bench_train", "environment": environment(device), "bf16": args.bf16,
              "data": args.data_path or "zipf synthetic ids (exponent 1.0)", "sizes": {}}
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON only (DeepSpeed prints)
        start_process_group(device)
        for name in args.sizes:
            size = SIZES[name].resolved(micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                                        repeats=args.repeats, steps=args.steps)
            report["sizes"][name] = bench_size(name, size, tuple(args.kinds), bf16=args.bf16, device=device,
                                               data_path=args.data_path, peak_flops=peak, warmup=args.warmup,
                                               num_layers=args.num_layers)
    return finish_report(report, device, args.output)


def finish_report(report: dict, device, output: Optional[str]) -> dict:
    """The end of a benchmark: the load average at the end (CPU), the JSON out; the report."""
    if device.type == "cpu":
        report["environment"]["load_average_1m_end"] = os.getloadavg()[0]
    print_json(report, output)
    return report


def print_json(report: dict, output: Optional[str]) -> None:
    """The report on stdout, and atomically in `output` when given."""
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if output:
        tmp = f"{output}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(tmp, output)


if __name__ == "__main__":
    main()
