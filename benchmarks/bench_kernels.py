#!/usr/bin/env python
"""What one training micro-batch launches on a GPU: kernels, host syncs, bytes, as JSON.

    python benchmarks/bench_kernels.py                 # LEV layer and one decoder layer, 1.2B shapes
    python benchmarks/bench_kernels.py --parts lev --tokens 16384

Runs on CPU and counts the aten operators each part dispatches forward and backward
(megatron_lev.utils.profiling.KernelCounter: a computing operator is one launched kernel to a
first approximation; views and allocations launch none), the host synchronisations
(operators whose result the host must read: `unique`, `.item()`, ...) and an estimate of
the bytes moved (inputs + outputs of every computing operator, i.e. nothing fused).

Parts (shapes of configs/lev-1.2b.yaml: D = 2048, 16 heads of 128, ffn 5632, V = 50,304;
LEV k=3, d_s=128, h=8, kappa=16, r=64):

  lev/fused_loader_ids   the CUDA path: LEV's fused Triton mode kernels (lev/kernels.py) and
                         the distinct ids shipped by the data loader. Traced on CPU: the
                         fused kernels' CPU implementation is replaced by a stand-in that
                         returns zeros (the counts and syncs do not depend on the values; a
                         real interpreted launch at these shapes takes minutes). Also the
                         backward kernel's grid at the distinct-id count
                         (`fused_backward_grid`: h * d_s columns times `row_splits`).
  lev/torch_step_ids     today's CPU path and the previous CUDA path: the per-head dense-basis
                         loop, distinct ids found in the step (`unique` + a range check).
  decoder/eager          one DecoderLayer, forward and backward, eager.
  training_step          one whole step of the demo LEV model as the trainer runs it
                         (DeepSpeed engine, ZeRO-1, fused AdamW, ids from the loader): kernels,
                         host syncs (DeepSpeed's overflow check and gradient norm read values
                         back) and the copies the framework makes.
  decoder/compiled       the same layer under torch.compile (--compile-layers): inductor's
                         generated kernels (fused pointwise/reductions, forward and backward,
                         torch._inductor.metrics) plus the library calls it keeps (matmuls,
                         attention: counted from the eager trace).

The LEV counts are at `--tokens` Zipf-distributed ids (bytes depend on the distinct-id
count, reported); the decoder's kernel counts do not depend on the batch, its bytes are
for `--decoder-tokens` (scale linearly).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_train

from megatron_lev.lev import generator as lev  # noqa: E402
from megatron_lev.lev import dispatch as lev_dispatch  # noqa: E402
from megatron_lev.lev.parallel import ParallelLEVEmbedding  # noqa: E402
from megatron_lev.utils.profiling import KernelCounter  # noqa: E402

LEV_1_2B = dict(vocab_size=50_304, hidden_size=2048)
LIBRARY_OPS = ("aten::mm", "aten::addmm", "aten::bmm")  # kept as library calls by inductor


def zipf_ids(vocab_size: int, shape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
    return torch.multinomial(weights, math.prod(shape), replacement=True, generator=g).view(shape)


def use_fused_stand_in() -> None:
    """Route CPU tensors through the fused path, with a CPU stand-in for the kernels."""
    from megatron_lev.lev import kernels as lev_kernels

    lev_dispatch.FUSED_MODES_DEVICES = ("cuda", "cpu")
    lev_kernels.available = lambda device: True
    lev_kernels.modes_forward_op.register_kernel("cpu")(
        lambda x, delta, eps, chunk, mode_max: x.new_zeros(x.shape[0], x.shape[1], delta.shape[3]))
    lev_kernels.modes_backward_op.register_kernel("cpu")(
        lambda x, delta, grad_modes, modes, eps, mode_max: (torch.zeros_like(x), torch.zeros_like(delta)))


def count(step) -> dict:
    """KernelCounter over forward and backward separately."""
    with KernelCounter() as forward:
        out = step()
    grad = torch.ones_like(out)
    with KernelCounter() as backward:
        out.backward(grad)
    f, b = forward.summary(), backward.summary()
    return {"kernels_forward": f["kernels"], "kernels_backward": b["kernels"],
            "kernels_total": f["kernels"] + b["kernels"], "host_syncs": f["host_syncs"] + b["host_syncs"],
            "host_sync_ops": {**f["host_sync_ops"], **b["host_sync_ops"]},
            "bytes_moved_GB": round((f["bytes_moved"] + b["bytes_moved"]) / 1e9, 3),
            "ops_forward": f["ops"], "ops_backward": b["ops"]}


def lev_part(tokens: int, seq: int) -> dict:
    from megatron_lev.data.datasets import collate_pretraining_batch

    ids = zipf_ids(LEV_1_2B["vocab_size"], (tokens // seq, seq))
    cfg = lev.LEVConfig(**LEV_1_2B)
    layer = ParallelLEVEmbedding(cfg)
    result = {"tokens": tokens, "distinct_ids": int(ids.unique().numel())}
    result["torch_step_ids"] = count(lambda: layer(ids))
    layer.zero_grad(set_to_none=True)
    batch = collate_pretraining_batch([{"tokens": row, "labels": row, "loss_mask": torch.ones(seq),
                                        "position_ids": torch.arange(seq)} for row in ids], cfg.vocab_size)
    use_fused_stand_in()
    result["fused_loader_ids"] = count(lambda: layer(batch["tokens"], batch["lev_ids"], batch["lev_inverse"]))
    result["fused_backward_grid"] = backward_grid(result["distinct_ids"], cfg)
    return result


def backward_grid(rows: int, cfg) -> dict:
    """The fused backward's launch at `rows` distinct ids (lev/kernels.py row_splits): programs
    and the float32 workspace of the splits' partial grad_delta (none at one split)."""
    from megatron_lev.lev import kernels as lev_kernels

    columns = cfg.num_heads * cfg.seed_dim
    splits, rows_per_split = lev_kernels.row_splits(rows, columns)
    workspace = splits * columns * cfg.num_knots * cfg.num_modes * 4 if splits > 1 else 0
    return {"columns": columns, "row_splits": splits, "rows_per_split": rows_per_split,
            "programs": columns * splits, "target_programs": lev_kernels.TARGET_BACKWARD_PROGRAMS,
            "workspace_MB": round(workspace / 1e6, 2)}


def decoder_part(tokens: int, seq: int, compiled: bool) -> dict:
    from megatron_lev.configs import load_config  # noqa: F401  (packaged YAMLs)
    from megatron_lev.distributed.launch import init_distributed
    from megatron_lev.distributed.state import initialize_model_parallel
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.layers import rotary_cos_sin
    from megatron_lev.models.transformer import DecoderLayer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    init_distributed(backend="gloo")
    initialize_model_parallel(1, 1)
    section = load_config("lev-1.2b")["model"]
    config = model_config_from_dict(section)
    layer = DecoderLayer(config, 0)
    batch = max(1, tokens // seq)
    hidden = torch.randn(seq, batch, config.hidden_size, requires_grad=True)
    cos, sin = rotary_cos_sin(torch.arange(seq).expand(batch, seq), config.kv_channels, config.rotary_base)
    result = {"tokens": seq * batch, "eager": count(lambda: layer(hidden, cos, sin))}
    if compiled:
        from torch._inductor import metrics

        compiled_layer = torch.compile(layer, dynamic=False)
        metrics.reset()
        out = compiled_layer(hidden, cos, sin)
        out.backward(torch.ones_like(out))
        # Inductor generates the fused kernels and calls the library for matmuls and
        # attention, as many as eager makes (a dispatch mode cannot watch compiled code).
        eager_ops = {**result["eager"]["ops_forward"]}
        for name, n in result["eager"]["ops_backward"].items():
            eager_ops[name] = eager_ops.get(name, 0) + n
        library = sum(n for name, n in eager_ops.items() if name in LIBRARY_OPS or "attention" in name)
        result["compiled"] = {"generated_kernels": metrics.generated_kernel_count, "library_calls": library,
                              "kernels_total": metrics.generated_kernel_count + library}
    return result


def step_part(size_name: str) -> dict:
    """One whole training step of the LEV model (forward, backward, DeepSpeed's optimizer
    step), built as the trainer builds it (bench_train.build_run): kernels and host syncs."""
    import contextlib

    import bench_train

    with contextlib.redirect_stdout(sys.stderr):
        bench_train.start_process_group(torch.device("cpu"))
        size = bench_train.SIZES[size_name].resolved()
        run = bench_train.build_run(size, "lev", False)
        vocab = run.model_config.vocab_size
        windows = bench_train.zipf_batches(vocab, size.micro_batch_size, size.seq_length, 2)
        batches = [bench_train.as_inputs(w, "cpu", vocab) for w in windows]
        bench_train.train_steps(run, batches, 0, 1)  # warm-up: optimizer states exist
        with KernelCounter() as counter:
            bench_train.train_steps(run, batches, 1, 1)
    summary = counter.summary()
    return {"size": size_name, "kernels": summary["kernels"], "host_syncs": summary["host_syncs"],
            "host_sync_ops": summary["host_sync_ops"],
            "copies": {k: v for k, v in summary["ops"].items() if k in ("aten::copy_", "aten::cat", "aten::_to_copy",
                                                                       "aten::clone")}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["lev", "decoder", "step"], choices=["lev", "decoder", "step"])
    p.add_argument("--step-size", default="demo", help="bench_train size of the whole-step count (default demo)")
    p.add_argument("--tokens", type=int, default=16384, help="LEV micro-batch tokens (default 16k)")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--decoder-tokens", type=int, default=1024, help="decoder layer tokens (CPU time)")
    p.add_argument("--compile-layers", action="store_true", help="also count the torch.compile'd layer")
    p.add_argument("--output", help="also write the JSON here")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    report = {"torch": torch.__version__}
    if "decoder" in args.parts:  # first: the LEV part swaps in the fused stand-in
        report["decoder_layer_1.2b"] = decoder_part(args.decoder_tokens, min(args.seq_length, args.decoder_tokens),
                                                    args.compile_layers)
    if "step" in args.parts:  # before the LEV part's stand-in: the real CPU path
        report["training_step"] = step_part(args.step_size)
    if "lev" in args.parts:
        report["lev_1.2b"] = lev_part(args.tokens, args.seq_length)
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        from megatron_lev.utils.files import atomic_path

        with atomic_path(args.output) as tmp, open(tmp, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
