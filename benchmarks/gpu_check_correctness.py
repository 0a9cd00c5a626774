"""benchmarks/gpu_check.py's correctness stages, at small sizes: bf16 training against fp32 on the
same weights and batches (gpu_check_rules.bf16_loss_bounds), a save and resume on the device
(resumed vs uninterrupted), and megatron-core's GPTModel with the LEV embedding against
LeviathanModel on the same weights (fp32 forward and backward, then one bf16 step).
"""
from __future__ import annotations

import contextlib
import sys
import tempfile

import torch

import bench_train
from gpu_check_rules import (GPT_BF16_TOLERANCE, GPT_FP32_TOLERANCE, bf16_loss_bounds, compare_curves, compare_resume)
from gpu_check_training import (allocated, build_trainer_engine, free_memory, optimizer_step, release_engine,
                                slurm_train_argv)

# The sizes these stages run at: the 1.2B model's widths, vocabulary and LEV generator at 2
# layers on a GPU (the fused kernels and the real GEMM shapes), the tiny test config on CPU.
SMALL = {"cuda": {"config": "lev-1.2b", "num_layers": 2, "micro_batch_size": 4, "seq_length": 512},
         "cpu": {"config": "tiny-lev", "num_layers": 2, "micro_batch_size": 2, "seq_length": 64}}
BF16_STEPS = 12
RESUME_STEPS, RESUME_SAVE_AT = 6, 3
# The resume stage's peak rate (linear decay to a tenth over the run): at 1e-3 the defects the
# stage guards against move the loss by 1.7e-3 to 4e-3 of it (gpu_check_rules.RESUME_TOLERANCE).
RESUME_LR = 1e-3


def log(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def true_fp32():
    """float32 matmuls in float32 (no TF32) while inside; the previous settings after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def small_argv(device, gpu_type: str) -> tuple[list[str], dict]:
    """The Slurm scripts' LEV command (ZeRO-2 + overlap_comm) at the small size, eager layers."""
    size = SMALL[device.type]
    argv = slurm_train_argv("train_lev_1b.sh", 8, gpu_type, size["config"])
    overrides = {"--num-layers": size["num_layers"], "--micro-batch-size": size["micro_batch_size"],
                 "--global-batch-size": size["micro_batch_size"], "--seq-length": size["seq_length"],
                 "--no-compile-layers": ""}
    return [a for a in argv if a not in ("--bf16", "--no-bf16")], overrides


def small_batches(vocab: int, device, count: int, seed: int) -> list[dict]:
    size = SMALL[device.type]
    windows = bench_train.zipf_batches(vocab, size["micro_batch_size"], size["seq_length"], count, seed=seed)
    return [bench_train.as_inputs(w, device, vocab) for w in windows]


# --------------------------------------------------------------------------- bf16 vs fp32


def max_abs_logit(engine, batch: dict, vocab: int) -> float:
    with torch.no_grad():
        logits = engine.module(batch["tokens"], batch["position_ids"], lev_ids=batch["lev_ids"],
                               lev_inverse=batch["lev_inverse"])
    return float(logits[..., :vocab].abs().max())


def bf16_vs_fp32(device, gpu_type: str) -> dict:
    """The same initial weights trained on the same batches in fp32 and in bf16 (the trainer's
    engine, constant learning rate): the two loss curves step by step against
    gpu_check_rules.bf16_loss_bounds, which the fp32 run's logits and curve parametrise."""
    argv, overrides = small_argv(device, gpu_type)
    overrides.update({"--lr-warmup-iters": 0, "--lr-decay-style": "constant"})
    curves, batches, num_layers = {}, None, None
    for precision in ("fp32", "bf16"):
        with true_fp32():
            args, model_config, engine = build_trainer_engine(
                argv + ["--bf16" if precision == "bf16" else "--no-bf16"], 1, overrides)
            vocab, num_layers = model_config.vocab_size, model_config.num_layers
            batches = batches or small_batches(vocab, device, BF16_STEPS, seed=21)
            losses, logits = [], []
            for batch in batches:
                if precision == "fp32":
                    logits.append(max_abs_logit(engine, batch, vocab))
                losses.append(float(optimizer_step(engine, [batch])))
            curves[precision] = {"losses": losses, "max_abs_logits": logits, "bf16": bool(args.bf16)}
        release_engine(engine)
        del engine
        free_memory(device)
    fp32, bf16 = curves["fp32"], curves["bf16"]
    bounds = bf16_loss_bounds(num_layers, fp32["losses"], fp32["max_abs_logits"])
    result = {"config": SMALL[device.type]["config"], "num_layers": num_layers, "steps": BF16_STEPS,
              "fp32_losses": fp32["losses"], "bf16_losses": bf16["losses"], "fp32_max_abs_logits": fp32["max_abs_logits"],
              "bound": "eps * (2 * max|logit| + total variation of the fp32 curve so far), eps = (14 L + 3) * 2^-8",
              **compare_curves(fp32["losses"], bf16["losses"], bounds)}
    result["ok"] = result["within"] and fp32["bf16"] is False and bf16["bf16"] is True
    if not result["ok"]:
        result["why"] = (f"step {result['worst_step']}: |bf16 - fp32| {result['diffs'][result['worst_step']]:.4g} > "
                         f"bound {bounds[result['worst_step']]:.4g}")
    log(f"bf16 vs fp32 ({BF16_STEPS} steps): worst |dL| / bound {result['worst_diff_over_bound']:.3f}")
    return result


# --------------------------------------------------------------------------- save and resume


def _weights_checksum(module: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(sum(p.float().sum() for p in module.parameters()))


def save_resume(device, gpu_type: str) -> dict:
    """bf16 training as the Slurm scripts run it (ZeRO-2), with a learning rate that changes every
    step (linear decay over the run): RESUME_STEPS steps uninterrupted, against RESUME_SAVE_AT
    steps, a checkpoint (checkpointing.save), a new engine with other initial weights (another
    --seed) loading it (checkpointing.load), and the remaining steps."""
    from megatron_lev.checkpointing.load import load_checkpoint
    from megatron_lev.checkpointing.save import save_checkpoint
    from megatron_lev.training.arguments import effective_config
    from megatron_lev.training.trainer import TrainState

    argv, overrides = small_argv(device, gpu_type)
    argv += ["--bf16"]
    overrides.update({"--lr": RESUME_LR, "--min-lr": RESUME_LR / 10, "--lr-warmup-iters": 0, "--lr-decay-style": "linear",
                      "--train-iters": RESUME_STEPS, "--lr-decay-iters": RESUME_STEPS})
    runs = {"uninterrupted": [], "resumed": []}
    lrs = {"uninterrupted": [], "resumed": []}
    with tempfile.TemporaryDirectory(prefix="gpu_check_resume_") as save_dir:
        batches = None
        for run, seed, steps in (("uninterrupted", 1234, range(RESUME_STEPS)), ("resumed", 1234, range(RESUME_SAVE_AT)),
                                 ("resumed", 4321, range(RESUME_SAVE_AT, RESUME_STEPS))):
            args, model_config, engine = build_trainer_engine(argv, 1, {**overrides, "--seed": seed})
            batches = batches or small_batches(model_config.vocab_size, device, RESUME_STEPS, seed=31)
            if steps.start:  # another seed's weights, replaced by the checkpoint's
                before = _weights_checksum(engine.module)
                load_checkpoint(engine, save_dir, tag)
                weights_replaced = _weights_checksum(engine.module) != before
            for step in steps:
                lrs[run].append(float(engine.get_lr()[0]))
                runs[run].append(float(optimizer_step(engine, [batches[step]])))
            if run == "resumed" and not steps.start:
                config = effective_config(args)
                tag = save_checkpoint(engine, save_dir, RESUME_SAVE_AT,
                                      TrainState(iteration=RESUME_SAVE_AT).client_state(config), config)
            release_engine(engine)
            del engine
            free_memory(device)
    result = {"config": SMALL[device.type]["config"], "steps": RESUME_STEPS, "saved_after": RESUME_SAVE_AT,
              "checkpoint_tag": tag, "losses": runs, "lrs": lrs, "bf16": True, "weights_replaced": weights_replaced,
              **compare_resume(runs["uninterrupted"], runs["resumed"], RESUME_SAVE_AT)}
    result["ok"] = result["within"] and lrs["uninterrupted"] == lrs["resumed"] and weights_replaced
    if not result["ok"]:
        result["why"] = (f"resumed vs uninterrupted: relative loss differences {result['relative_diffs']} "
                         f"(tolerance {result['tolerance']}), rates {lrs}")
    log(f"save and resume: bit-exact {result['bit_exact']}, relative differences {result['relative_diffs']}")
    return result


# --------------------------------------------------------------------------- GPTModel + LEV


def _gpt_losses(ours, gpt, batch: dict, mask: torch.Tensor, vocab: int) -> tuple:
    """Both models' logits (real vocabulary columns) and masked-mean losses on `batch`."""
    ids, pos, labels, loss_mask = batch["tokens"], batch["position_ids"], batch["labels"], batch["loss_mask"]
    logits = (ours(ids, pos)[..., :vocab], gpt(ids, pos, mask)[..., :vocab])
    per_token = gpt(ids, pos, mask, labels=labels)
    return logits, (ours(ids, pos, labels=labels, loss_mask=loss_mask), (per_token * loss_mask).sum() / loss_mask.sum())


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


def _gpt_pair(section: dict, device, layer_spec: str, bf16: bool):
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.decoder import LeviathanModel
    from megatron_lev.models.gpt_lev import build_lev_gpt_model_from_config
    from megatron_lev.models.mcore_args import to_mcore_name

    config = model_config_from_dict(section, bf16=bf16)
    ours = LeviathanModel(config).to(device)
    gpt = build_lev_gpt_model_from_config(config, layer_spec=layer_spec).to(device)
    target = dict(gpt.named_parameters())
    with torch.no_grad():
        for name, param in ours.named_parameters():
            target[to_mcore_name(name, transformer_engine=layer_spec == "transformer_engine")].copy_(param)
    return ours, gpt, {name: to_mcore_name(name, transformer_engine=layer_spec == "transformer_engine")
                       for name, _ in ours.named_parameters()}


def gpt_fp32(section: dict, device, layer_spec: str, batch: dict, mask) -> dict:
    """Logits, loss and every gradient of GPTModel+LEV (`layer_spec`) against LeviathanModel."""
    with true_fp32():
        ours, gpt, names = _gpt_pair(section, device, layer_spec, bf16=False)
        (logits_ours, logits_gpt), (loss_ours, loss_gpt) = _gpt_losses(ours, gpt, batch, mask, section["vocab_size"])
        loss_ours.backward()
        loss_gpt.backward()
    gpt_params = dict(gpt.named_parameters())
    grads = {name: _relative(gpt_params[names[name]].grad, p.grad) for name, p in ours.named_parameters()}
    worst = max(grads, key=grads.get)
    loss_ours, loss_gpt = float(loss_ours.detach()), float(loss_gpt.detach())
    result = {"logits": _relative(logits_gpt, logits_ours), "loss_ours": loss_ours, "loss_gpt": loss_gpt,
              "loss": abs(loss_gpt - loss_ours) / abs(loss_ours),
              "grads": grads[worst], "grads_worst_parameter": worst, "tolerance": GPT_FP32_TOLERANCE}
    result["ok"] = all(result[k] <= GPT_FP32_TOLERANCE[k] for k in GPT_FP32_TOLERANCE)
    return result


def gpt_bf16_step(section: dict, device, batch: dict, mask, lr: float) -> dict:
    """bf16 GPTModel+LEV and LeviathanModel from the same weights: loss, one AdamW step each (torch's
    AdamW on the bf16 parameters), loss again on the same batch: equal within GPT_BF16_TOLERANCE
    before and after, and lower after."""
    ours, gpt, _ = _gpt_pair(section, device, "local", bf16=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=lr, fused=device.type == "cuda") for m in (ours, gpt)]
    _, (before_ours, before_gpt) = _gpt_losses(ours, gpt, batch, mask, section["vocab_size"])
    (before_ours + before_gpt).backward()  # the two graphs are disjoint: each model its own gradient
    for optimizer in optimizers:
        optimizer.step()
    with torch.no_grad():
        _, (after_ours, after_gpt) = _gpt_losses(ours, gpt, batch, mask, section["vocab_size"])
    losses = {"before": [float(before_ours.detach()), float(before_gpt.detach())],
              "after": [float(after_ours), float(after_gpt)]}
    diffs = {k: abs(v[1] - v[0]) / abs(v[0]) for k, v in losses.items()}
    result = {"losses_ours_gpt": losses, "relative_diffs": diffs, "tolerance": GPT_BF16_TOLERANCE, "lr": lr,
              "dtype": str(gpt.output_layer.weight.dtype)}  # megatron-core's torch norms keep float32 weights
    result["ok"] = (max(diffs.values()) <= GPT_BF16_TOLERANCE and losses["after"][1] < losses["before"][1]
                    and result["dtype"] == "torch.bfloat16")
    return result


def megatron_gpt(device) -> dict:
    """GPTModel+LEV (megatron-core's local spec, and TransformerEngine's where it imports) against
    LeviathanModel on the same weights and batch, float32: logits, loss, every gradient; then one
    bf16 step of the local-spec model. On CPU, megatron-core's four CUDA-only spots get the test
    stand-ins (tests/mcore_cpu.py); on a GPU nothing is patched."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_lev.configs import load_config
    from megatron_lev.distributed.rng import set_seed

    if device.type == "cpu":
        from tests.mcore_cpu import patch_mcore_for_cpu

        patch_mcore_for_cpu()
    size = SMALL[device.type]
    # A vocabulary the padding leaves alone (GPTModel's loss counts padding columns, ours does not).
    section = {**load_config(size["config"])["model"], "num_layers": size["num_layers"]}
    if section["vocab_size"] % 128:
        section["vocab_size"] = 1024
    (batch,) = small_batches(section["vocab_size"], device, 1, seed=41)
    batch["loss_mask"] = (torch.rand(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(4)) > 0.25
                          ).float().to(device)
    seq = batch["tokens"].shape[1]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    result = {"config": size["config"], "num_layers": size["num_layers"], "vocab_size": section["vocab_size"],
              "batch": list(batch["tokens"].shape), "before_bytes": allocated(device)}
    for spec in ("local", "transformer_engine"):
        if spec == "transformer_engine" and not gpt_layer_specs.HAVE_TE:
            result[spec] = {"skipped": f"transformer_engine does not import here ({_import_error('transformer_engine')})"}
            continue
        set_seed(1234)
        result[spec] = gpt_fp32(section, device, spec, batch, mask)
        log(f"GPTModel+LEV ({spec} spec) vs LeviathanModel, fp32: logits {result[spec]['logits']:.1e}, loss "
            f"{result[spec]['loss']:.1e}, grads {result[spec]['grads']:.1e}")
        free_memory(device)
    set_seed(1234)
    result["bf16_step"] = gpt_bf16_step(section, device, batch, mask, lr=1e-3)
    log(f"GPTModel+LEV bf16 step: losses {result['bf16_step']['losses_ours_gpt']}")
    free_memory(device)
    result["ok"] = all(result[k].get("ok", True) for k in ("local", "transformer_engine", "bf16_step"))
    if not result["ok"]:
        result["why"] = "; ".join(f"{k}: {result[k]}" for k in ("local", "transformer_engine", "bf16_step")
                                  if not result[k].get("ok", True))
    return result


def _import_error(module: str) -> str:
    try:
        __import__(module)
    except Exception as exc:  # noqa: BLE001 - what stops it, in one line
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    return "imports, but megatron-core's spec says it is unavailable"

