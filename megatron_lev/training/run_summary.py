"""The effective configuration as a run prints it at start: a few lines (`summarize_config`) and
the whole of it as YAML (`format_config`, what `config.yaml` beside the checkpoints holds)."""
from __future__ import annotations

import yaml


def summarize_config(cfg: dict, full_path: str) -> str:
    """A few lines of the effective configuration for stdout (the whole of it is in `full_path`)."""
    from megatron_lev.models.config import pad_vocab_size  # torch: only when a run starts

    m, t = cfg["model"], cfg["training"]
    ds = cfg.get("deepspeed", {})
    padded = pad_vocab_size(m["vocab_size"], m.get("make_vocab_size_divisible_by", 128),
                            t["tensor_model_parallel_size"])
    zero = ds.get("zero_optimization", {}).get("stage")
    lines = [
        f"config {cfg['config']}: {m.get('embedding')} model"
        + (" (input table frozen)" if m.get("freeze_input_embedding") else "")
        + (f" (rank {m.get('embedding_rank')})" if m.get("embedding") == "factorized" else "")
        + f", {m.get('num_layers')} layers x {m.get('hidden_size')}, "
        f"vocab {m['vocab_size']} (padded {padded})",
        f"parallel: TP {t['tensor_model_parallel_size']} x PP {t['pipeline_model_parallel_size']} x DP "
        f"{t.get('data_parallel_size')}, ZeRO-{zero}, {'bf16' if t['bf16'] else 'fp32'}; batch {t['global_batch_size']}"
        f" x {t['seq_length']} tokens (micro {t['micro_batch_size']}, accumulation {t.get('gradient_accumulation_steps')})",
        f"schedule: {t['train_iters']} iterations, lr {t['lr']:g} {t['lr_decay_style']} -> {t['min_lr']:g}, "
        + (f"input side and output layer {t['decoupled_lr']:g} -> "
           f"{t['min_lr'] if t.get('decoupled_min_lr') is None else t['decoupled_min_lr']:g}, "
           if t.get("decoupled_lr") is not None else "")
        + (f"LEV generator x{t['lev_lr_mult']:g}, " if t.get("lev_lr_mult", 1.0) != 1.0 else "")
        + (f"LEV generator clipped apart at {t['lev_clip_grad']:g}, " if t.get("lev_clip_grad") is not None else "")
        + ("LEV generator without weight decay, " if t.get("lev_no_weight_decay") else "")
        + "warmup "
        f"{t.get('lr_warmup_steps', 0) / t['global_batch_size']:g} iterations; data {' '.join(map(str, t['data_path'] or t['train_data_path'] or []))}",
        f"full configuration: {full_path}",
    ]
    return "\n".join(lines)


def format_config(cfg: dict) -> str:
    return yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None, width=100)
