"""A Hugging Face model folder -> a training checkpoint at any TP / PP (tools/convert_from_hf.py).

The checkpoint is written by the trainer's own code, so it is exactly what
`python -m megatron_lev.train` saves: TP x PP CPU processes (gloo) each build the model
(`train.build_engine`: the plain model, or the pipeline module when PP > 1, under
DeepSpeed ZeRO-1), copy in their slices of the weights (convert.load_full_state_dict),
refresh DeepSpeed's fp32 master copies, and `checkpointing.save_checkpoint` writes
`SAVE/iter_0000000/` with `latest`, `config.json` and the completion marker.

Continue training or fine-tune from it with

    python -m megatron_lev.train --config SAVE/model.yaml --load SAVE --no-load-optim ...

`--no-load-optim` starts a fresh optimizer and LR schedule from your flags (the checkpoint's
are only placeholders, iteration 0). `SAVE/model.yaml` holds the model section read from the
Hugging Face config, plus the layout and tokenizer; pass `--config` to the converter instead
to record your own training YAML, whose model section must describe the same model.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import tempfile
import traceback
from typing import Optional

import torch
import yaml

from megatron_lev.hf.export import (ExportError, check_hf_tokenizer, infer_tokenizer_type, read_hf_model,
                                    set_release_modes)

# Fields a training YAML may set differently from the Hugging Face config without changing
# the weights' meaning (initialisation seed, dropout).
_FREE_FIELDS = ("init_seed", "hidden_dropout", "attention_dropout")
# Learning rate recorded when no --config gives one: the optimizer state written is fresh
# and meant to be replaced (--no-load-optim); this is only a well-formed placeholder.
PLACEHOLDER_LR = 3.0e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _training_yaml(config: Optional[str], hf_section: dict) -> tuple[str, dict, dict]:
    """(config path, raw model section, training section) for the checkpoint's run config."""
    from megatron_lev.configs import config_path, load_config
    from megatron_lev.models.config import model_config_from_dict

    if config is None:
        return "", hf_section, {}
    data = load_config(config)
    theirs = model_config_from_dict(data["model"]).to_dict()
    diffs = [f"{k}: {theirs.get(k)!r} in {config}, {hf_section.get(k)!r} in the Hugging Face model"
             for k in sorted(set(theirs) | set(hf_section)) if k not in _FREE_FIELDS and theirs.get(k) != hf_section.get(k)]
    if diffs:
        raise ExportError(f"--config {config} describes another model than --load: " + "; ".join(diffs))
    return str(config_path(config)), dict(data["model"]), dict(data.get("training") or {})


def _run_args(config_file: str, model_section: dict, training: dict, tp: int, pp: int, bf16: bool,
              tokenizer: Optional[str], seq_length: int, argv: list[str]) -> argparse.Namespace:
    """The trainer's args for a 1-replica ZeRO-1 run with this config (validate_args' derived
    fields filled in for data-parallel size 1)."""
    from megatron_lev.training.arguments import TRAINING_DEFAULTS, _schedule_in_samples, recompute_setting

    args = argparse.Namespace(**{**TRAINING_DEFAULTS, **training})
    args.config, args.argv, args.model, args.given_flags = config_file, argv, model_section, []
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.bf16 = bool(bf16 or args.bf16)
    args.zero_stage, args.deepspeed_config = 1, None
    args.data_parallel_size = args.gradient_accumulation_steps = 1
    args.seq_length = args.seq_length or seq_length
    args.tokens_per_step = args.seq_length
    if args.train_iters is None and args.train_tokens and args.global_batch_size:
        # The YAML's run length, for the (placeholder) LR schedule saved with the checkpoint.
        args.train_iters = math.ceil(args.train_tokens / (args.global_batch_size * args.seq_length))
    args.train_iters = args.train_iters or 1
    args.train_tokens = None
    args.micro_batch_size = args.global_batch_size = 1
    args.lr = args.lr if args.lr is not None else PLACEHOLDER_LR
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    # validate_args' derived fields that building the engine reads.
    _schedule_in_samples(args)
    args.recompute = recompute_setting(args)
    if tokenizer is not None:
        args.tokenizer_type, args.tokenizer_model = infer_tokenizer_type(tokenizer), os.path.abspath(tokenizer)
    return args


def _import_rank(rank: int, world: int, port: int, full_path: str, args: argparse.Namespace, save_dir: str,
                 error_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from megatron_lev.checkpointing.save import save_checkpoint
    from megatron_lev.distributed.launch import init_distributed
    from megatron_lev.distributed.rng import set_seed
    from megatron_lev.distributed.state import destroy_parallel, initialize_model_parallel

    try:
        from megatron.core import parallel_state

        from megatron_lev.checkpointing.layout import load_full_state_dict
        from megatron_lev.checkpointing.safe_load import safe_torch_load
        from megatron_lev.models.pipeline import pipeline_to_model_key
        from megatron_lev.training.arguments import effective_config
        from megatron_lev.training.ds_config import build_deepspeed_config
        from megatron_lev.training.engine import build_engine
        from megatron_lev.training.trainer import TrainState
        from megatron_lev.training.validation import build_model_config

        init_distributed(backend="gloo")
        initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        set_seed(args.seed)
        model_config = build_model_config(args)
        ds_config = build_deepspeed_config(args)
        engine = build_engine(args, model_config, ds_config)
        full = safe_torch_load(full_path, mmap=True)
        num_layers = model_config.num_layers
        to_model_key = ((lambda name: pipeline_to_model_key(name, num_layers))
                        if args.pipeline_model_parallel_size > 1 else (lambda name: name))
        load_full_state_dict(engine.module, full, model_config, parallel_state.get_tensor_model_parallel_rank(),
                             to_model_key)
        engine.optimizer.refresh_fp32_params()  # DeepSpeed's fp32 master weights <- the loaded ones
        config = effective_config(args, model_config.to_dict())
        config["deepspeed"] = ds_config
        save_checkpoint(engine, save_dir, 0, TrainState().client_state(config), config)
    except BaseException:
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        destroy_parallel()


def import_hf_model(hf_dir: str, save_dir: str, tensor_model_parallel_size: int = 1,
                    pipeline_model_parallel_size: int = 1, config: Optional[str] = None, bf16: bool = False,
                    argv: Optional[list[str]] = None) -> str:
    """Write `save_dir/iter_0000000` (+ latest, model.yaml) from a Hugging Face folder."""
    import torch.multiprocessing as mp

    from megatron_lev.models.config import model_config_from_dict

    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ExportError(f"--tensor-model-parallel-size {tp} / --pipeline-model-parallel-size {pp}: must be >= 1")
    if os.path.isdir(save_dir) and os.listdir(save_dir):
        raise ExportError(f"--save {save_dir}: exists and is not empty; choose a new directory")
    section, full = read_hf_model(hf_dir)
    model_config_from_dict(section, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)  # clear errors now
    tokenizer = check_hf_tokenizer(hf_dir, section["vocab_size"])
    config_file, model_section, training = _training_yaml(config, section)
    parent = os.path.dirname(os.path.abspath(save_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_save = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(save_dir))}.tmp-", dir=parent)
    try:
        if not config_file:  # record the model section as a config the trainer can be pointed at
            config_file = os.path.join(os.path.abspath(save_dir), "model.yaml")
            written = {"model": model_section, "training": {
                "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                "seq_length": section["seq_length"]}}
            if tokenizer is not None:
                written["training"].update(tokenizer_type=infer_tokenizer_type(tokenizer),
                                           tokenizer_model=os.path.abspath(tokenizer))
            with open(os.path.join(tmp_save, "model.yaml"), "w", encoding="utf-8") as f:
                yaml.safe_dump(written, f, sort_keys=False, default_flow_style=None, width=100)
        args = _run_args(config_file, model_section, training, tp, pp, bf16, tokenizer, section["seq_length"],
                         argv or [])
        world = tp * pp
        with tempfile.TemporaryDirectory(prefix="megatron_lev_import_") as work:
            full_path = os.path.join(work, "full.pt")
            torch.save(full, full_path)
            del full
            ctx = mp.get_context("spawn")
            port = _free_port()
            procs = [ctx.Process(target=_import_rank, args=(r, world, port, full_path, args, tmp_save, work))
                     for r in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            errors = [open(os.path.join(work, f), encoding="utf-8").read()
                      for f in sorted(os.listdir(work)) if f.startswith("rank")]
            if errors or any(p.exitcode != 0 for p in procs):
                raise RuntimeError("import failed:\n" + (errors[0] if errors else
                                   f"exit codes {[p.exitcode for p in procs]}"))
        set_release_modes(tmp_save)
        if os.path.isdir(save_dir):
            os.rmdir(save_dir)
        os.replace(tmp_save, save_dir)
    except BaseException:
        shutil.rmtree(tmp_save, ignore_errors=True)
        raise
    return save_dir
