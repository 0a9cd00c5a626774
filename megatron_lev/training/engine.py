"""The DeepSpeed engine of a run: the model (plain for PP = 1 under ZeRO 1/2/3, DeepSpeed's
PipelineModule for PP > 1), optionally compiled layer by layer, with AdamW's weight-decay groups
and Megatron's LR schedule (optim.py). DeepSpeed owns clipping (its grad norm counts replicated
parameters once over TP and sums shards over TP/PP/DP) and skips a step whose gradient norm is
not finite; `poison_nonfinite` makes sure a non-finite loss gives one."""
from __future__ import annotations

import contextlib

import torch

from megatron_lev.distributed.state import DeepSpeedMPU, print_rank_0
from megatron_lev.models.init_stats import init_statistics_line
from megatron_lev.models.layers import start_lev_from_fit
from megatron_lev.training.ds_config import offloads_optimizer
from megatron_lev.training.optim import build_lr_scheduler, build_optimizer
from megatron_lev.utils.errors import ConfigError
from megatron_lev.utils.run_log import quiet_deepspeed


def poison_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """A non-finite loss must skip the step; DeepSpeed skips on a non-finite gradient
    norm, so make sure one follows: multiply by NaN when the loss is not finite (no
    host sync; a finite loss is multiplied by exactly 1)."""
    scale = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan")).to(loss.dtype)
    return loss * scale


def _poisoned(loss_fn):
    def wrapped(*args, **kwargs):
        return poison_nonfinite(loss_fn(*args, **kwargs))

    return wrapped


@contextlib.contextmanager
def without_inference_comm_op():
    """DeepSpeed's communication backend JIT-builds, on the CPU accelerator, a shared-memory
    all-reduce (deepspeed_shm_comm) when it starts. Only DeepSpeed-Inference calls it
    (`inference_all_reduce`, which uses torch's all-reduce without it); training never does.
    Its g++ build took 28-40 s of the start-up here whenever ~/.cache/torch_extensions held a
    build with other flags (docs/performance.md), so the engine is built without it."""
    import importlib

    ds_comm = importlib.import_module("deepspeed.comm.torch")  # the module (the package's `torch` is torch)
    original = getattr(ds_comm, "build_shm_op", None)
    if original is None:  # another DeepSpeed: nothing to skip
        yield
        return
    ds_comm.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_comm.build_shm_op = original


def attention_line(module, name: str) -> None:
    """Every attention's SDPA backends for `--attention-backend name` on the module's device, said once."""
    from megatron_lev.models.transformer import set_attention_backend

    try:
        backends = set_attention_backend(module, name, next(module.parameters()).device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    order = ", ".join(b.name.lower() for b in backends) if backends is not None else "torch's own order"
    print_rank_0(f"attention: torch SDPA, backends {order} (--attention-backend {name})")


def build_engine(args, model_config, ds_config: dict, fresh_start: bool = True):
    """DeepSpeed engine over the plain model (PP = 1) or the pipeline module (PP > 1).
    `fresh_start` (no checkpoint to resume): a LEV generator starts from `model.lev_init_from`
    when the config names one."""
    import deepspeed

    if args.pipeline_model_parallel_size > 1:
        from megatron_lev.models.pipeline import build_pipeline_model

        module = build_pipeline_model(model_config)  # recompute interval from the config
        module.loss_fn = _poisoned(module.loss_fn)
        mpu = None  # the PipelineModule carries its topology
    else:
        from megatron_lev.models.decoder import LeviathanModel

        module = LeviathanModel(model_config)
        mpu = DeepSpeedMPU()
    if fresh_start and model_config.lev_init_from is not None:
        start_lev_from_fit(module, model_config)  # global rank 0 is on the first stage, with the embedding
        print_rank_0(f"LEV generator started from {model_config.lev_init_from} (model.lev_init_from)")
    if torch.cuda.is_available():
        module = module.cuda()
    attention_line(module, getattr(args, "attention_backend", None) or "auto")
    line = init_statistics_line(module, model_config.vocab_size, model_config.embedding)
    if line is not None:  # the first pipeline stage; printed by global rank 0
        print_rank_0(line)
    if getattr(args, "compile_layers", False):
        from megatron_lev.models.transformer import compile_decoder_layers

        compile_decoder_layers(module)
    offload = offloads_optimizer(ds_config)
    optimizer = build_optimizer(module, lr=args.lr, weight_decay=args.weight_decay,
                                betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, offload=offload,
                                decoupled_lr=args.decoupled_lr, lev_separate=lev_groups_apart(args),
                                lev_no_decay=getattr(args, "lev_no_weight_decay", False))
    if offload and type(optimizer).__name__ != "DeepSpeedCPUAdam":
        ds_config["zero_force_ds_cpu_optimizer"] = False  # the CPU Adam op could not be built here

    def scheduler(opt):
        return build_lr_scheduler(opt, args)

    # DeepSpeed's bf16 optimizer reports memory six times (a gc.collect() and three printed lines
    # each): skipped unless --logging-level 10.
    with quiet_deepspeed(getattr(args, "logging_level", None)), without_inference_comm_op():
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config, mpu=mpu)
    if getattr(args, "lev_clip_grad", None) is not None:
        from megatron_lev.training.clipping import install_family_clipping

        install_family_clipping(engine.optimizer, args.lev_clip_grad, args.clip_grad)
    return engine


def lev_groups_apart(args) -> bool:
    """Whether the LEV generator gets optimizer groups of its own (--lev-lr-mult, --lev-clip-grad)."""
    return getattr(args, "lev_lr_mult", 1.0) != 1.0 or getattr(args, "lev_clip_grad", None) is not None
