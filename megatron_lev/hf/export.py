"""Training checkpoints <-> Hugging Face model folders (library code of tools/convert_to_hf.py
and tools/convert_from_hf.py).

Export (`export_checkpoint`): a checkpoint of any TP / PP / ZeRO layout is merged into one
full state dict (megatron_lev.checkpointing.convert), renamed to transformers' LLaMA names and written as

    config.json  generation_config.json  model.safetensors (or shards + index)  README.md
    tokenizer.json  tokenizer_config.json  [tokenizer.model]

(config.json has `torch_dtype` beside `dtype` and tokenizer_config.json names
`PreTrainedTokenizerFast`, so transformers 4.x loads the folder as 5.x does; README.md is
the model card, with Hub model-index metadata.)
    configuration_lev.py  modeling_lev.py  lev.py  lev_config.py  (embedding: lev only)

`embedding: lev` becomes `LevForCausalLM` (remote code, `auto_map`); with
`materialize_embeddings` the generator is evaluated on every id and written as the
`embed_tokens` table of a standard `LlamaForCausalLM`. `tied` / `untied` are standard
`LlamaForCausalLM` (tied through `tie_word_embeddings`; a frozen untied table is exported as it
is). `factorized` exports only with `materialize_embeddings`: the V x r table times the r -> hidden
projection is the `embed_tokens` table of an untied `LlamaForCausalLM`.

Name mapping (ours -> transformers'), per layer i:

    embedding.weight                  model.embed_tokens.weight
    embedding.generator.<LEV param>   model.embed_tokens.generator.<LEV param>
    layers.i.input_norm.weight        model.layers.i.input_layernorm.weight
    layers.i.attention.qkv.weight     model.layers.i.self_attn.{q,k,v}_proj.weight
                                      (rows grouped per kv head: [q x heads/group, k, v] x groups)
    layers.i.attention.out_proj.weight  model.layers.i.self_attn.o_proj.weight
    layers.i.mlp_norm.weight          model.layers.i.post_attention_layernorm.weight
    layers.i.mlp.gate_up.weight       model.layers.i.mlp.{gate,up}_proj.weight ([gate; up])
    layers.i.mlp.down.weight          model.layers.i.mlp.down_proj.weight
    final_norm.weight                 model.norm.weight
    output_layer.weight               lm_head.weight

RoPE needs no permutation: models/layers.py rotates two halves (`rotate_half`), as transformers does.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Optional

import torch

from megatron_lev.checkpointing.layout import FACTORIZED_PROJECTION, LEV_PREFIX, expected_parameter_names
from megatron_lev.hf.card import Provenance, model_card, run_provenance
from megatron_lev.hf.tokenizers import (SpecialTokens, infer_tokenizer_type, load_tokenizer, special_tokens,
                                        write_tokenizer)
from megatron_lev.hf.trust import LEV_AUTO_MAP, REMOTE_CODE_FILES
from megatron_lev.models.config import LeviathanConfig, model_config_from_dict
from megatron_lev.models.settings import hf_config_fields, model_fields_from_hf_config
from megatron_lev.utils.errors import ExportError
from megatron_lev.utils.files import update_json_file

HF_LEV_PREFIX = "model.embed_tokens.generator."
# The resolved YAML `model:` section, kept in config.json so an import restores it exactly.
MODEL_SECTION_KEY = "megatron_lev_model"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_LAYER_MAP = {  # our per-layer suffix -> transformers' (one-to-one ones)
    "input_norm.weight": "input_layernorm.weight",
    "attention.out_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}

_QK_NORM_MAP = {"attention.q_norm.weight": "self_attn.q_norm.weight",  # qk_layernorm (Qwen3's names)
                "attention.k_norm.weight": "self_attn.k_norm.weight"}


# --------------------------------------------------------------------------- weights


def _qkv_split(qkv: torch.Tensor, cfg: LeviathanConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, per_group, dh = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.kv_channels
    w = qkv.view(groups, per_group + 2, dh, -1)
    q = w[:, :per_group].reshape(groups * per_group * dh, -1)
    return q.contiguous(), w[:, -2].reshape(groups * dh, -1).contiguous(), w[:, -1].reshape(groups * dh, -1).contiguous()


def _qkv_join(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: LeviathanConfig) -> torch.Tensor:
    groups, per_group, dh = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.kv_channels
    hidden = q.shape[-1]
    w = torch.cat([q.view(groups, per_group, dh, hidden), k.view(groups, 1, dh, hidden),
                   v.view(groups, 1, dh, hidden)], dim=1)
    return w.reshape(-1, hidden).contiguous()


@torch.no_grad()
def materialize_lev_table(full: dict[str, torch.Tensor], cfg: LeviathanConfig, chunk: int = 4096) -> torch.Tensor:
    """The LEV generator evaluated on every id: the [vocab_size, hidden] float32 table that
    makes a LEV model a plain LLaMA. Row i equals the model's embedding of id i exactly."""
    from megatron_lev.lev.generator import LEVGenerator

    lev_cfg = cfg.lev_config()
    generator = LEVGenerator(lev_cfg, dtype=full[LEV_PREFIX + "w_out"].dtype)
    generator.load_full_parameters({name: full[LEV_PREFIX + name] for name, _ in generator.named_parameters()})
    from megatron_lev.utils.progress import progress_bar

    ids = torch.arange(cfg.vocab_size)
    return torch.cat([generator(ids[start:start + chunk]) for start in
                      progress_bar(range(0, cfg.vocab_size, chunk), "materializing LEV embeddings", unit="chunk")])


@torch.no_grad()
def materialize_factorized_table(full: dict[str, torch.Tensor]) -> torch.Tensor:
    """The factorised input side as one [vocab_size, hidden] table: the V x r table times the
    r -> hidden projection (in float64, rounded once to the table's dtype), so that row i is the
    model's embedding of id i up to that rounding."""
    table, projection = full["embedding.weight"], full[FACTORIZED_PROJECTION]
    return (table.double() @ projection.double().t()).to(table.dtype)


def _layer_map(cfg: LeviathanConfig) -> dict[str, str]:
    return {**_LAYER_MAP, **(_QK_NORM_MAP if cfg.qk_layernorm else {})}


def to_hf_state_dict(full: dict[str, torch.Tensor], cfg: LeviathanConfig, materialize: bool = False) -> dict[str, torch.Tensor]:
    """A full state dict (checkpointing/layout.py) in transformers' LLaMA / LevForCausalLM names."""
    out = {}
    if cfg.embedding == "lev":
        if materialize:
            out["model.embed_tokens.weight"] = materialize_lev_table(full, cfg)
        else:
            for name, tensor in full.items():
                if name.startswith(LEV_PREFIX):
                    out[HF_LEV_PREFIX + name[len(LEV_PREFIX):]] = tensor
    elif cfg.embedding == "factorized":  # materialized only (check_export_kind)
        out["model.embed_tokens.weight"] = materialize_factorized_table(full)
    else:
        out["model.embed_tokens.weight"] = full["embedding.weight"]
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for suffix, hf_suffix in _layer_map(cfg).items():
            out[theirs + hf_suffix] = full[ours + suffix]
        q, k, v = _qkv_split(full[ours + "attention.qkv.weight"], cfg)
        out[theirs + "self_attn.q_proj.weight"], out[theirs + "self_attn.k_proj.weight"] = q, k
        out[theirs + "self_attn.v_proj.weight"] = v
        gate, up = full[ours + "mlp.gate_up.weight"].chunk(2, dim=0)
        out[theirs + "mlp.gate_proj.weight"], out[theirs + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
    out["model.norm.weight"] = full["final_norm.weight"]
    if cfg.embedding != "tied":
        out["lm_head.weight"] = full["output_layer.weight"]
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], cfg: LeviathanConfig, source: str) -> dict[str, torch.Tensor]:
    """transformers' names -> a full state dict (inverse of to_hf_state_dict, not materialized)."""

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ExportError(f"{source}: the model has no tensor {name!r}")
        return hf[name]

    full = {}
    if cfg.embedding == "lev":
        for key in [k for k in hf if k.startswith(HF_LEV_PREFIX)]:
            full[LEV_PREFIX + key[len(HF_LEV_PREFIX):]] = hf[key]
    else:
        full["embedding.weight"] = take("model.embed_tokens.weight")
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for suffix, hf_suffix in _layer_map(cfg).items():
            full[ours + suffix] = take(theirs + hf_suffix)
        full[ours + "attention.qkv.weight"] = _qkv_join(*(take(theirs + f"self_attn.{p}_proj.weight") for p in "qkv"),
                                                        cfg)
        full[ours + "mlp.gate_up.weight"] = torch.cat([take(theirs + "mlp.gate_proj.weight"),
                                                       take(theirs + "mlp.up_proj.weight")])
    full["final_norm.weight"] = take("model.norm.weight")
    if cfg.embedding != "tied":
        full["output_layer.weight"] = take("lm_head.weight")
    expected = set(expected_parameter_names(cfg))
    if set(full) != expected:
        missing, extra = sorted(expected - set(full)), sorted(set(full) - expected)
        raise ExportError(f"{source}: {'missing ' + str(missing[:3]) if missing else 'unexpected ' + str(extra[:3])} "
                          f"for an embedding={cfg.embedding!r} model")
    return full


# --------------------------------------------------------------------------- configs


def hf_config(cfg: LeviathanConfig, tokens: SpecialTokens, dtype: torch.dtype, materialize: bool = False):
    """The transformers config of a model: LevConfig (remote code) or LlamaConfig; the keys of the
    model's settings come from models/settings.py."""
    from transformers import LlamaConfig

    from megatron_lev.hf.configuration_lev import LevConfig

    common = dict(hf_config_fields(cfg), bos_token_id=tokens.bos, eos_token_id=tokens.eos, pad_token_id=tokens.pad,
                  use_cache=True)
    section = cfg.to_dict()
    if cfg.embedding == "lev" and not materialize:
        config = LevConfig(lev=section["lev"], qk_layernorm=cfg.qk_layernorm, **common)
        config.auto_map = dict(LEV_AUTO_MAP)
        config.architectures = ["LevForCausalLM"]
    else:
        config = LlamaConfig(**common)
        config.architectures = ["LlamaForCausalLM"]
        # A table model from here on (materialized LEV or factorised table: untied); no generator fields.
        section = {**section, "embedding": "tied" if cfg.embedding == "tied" else "untied", "lev": {},
                   "embedding_rank": None}
    config.dtype = dtype
    config.rope_theta = float(cfg.rotary_base)  # for tools that read config.json's LLaMA-v4 key (llama.cpp)
    setattr(config, MODEL_SECTION_KEY, section)
    return config


def check_export_kind(cfg: LeviathanConfig, materialize: bool) -> None:
    """Refuse, before any tensor is read, an input side a Hugging Face folder cannot hold."""
    if materialize and cfg.embedding not in ("lev", "factorized"):
        raise ExportError(f"--materialize-embeddings: only for embedding: lev or factorized models (this one is "
                          f"{cfg.embedding})")
    if cfg.embedding == "factorized" and not materialize:
        raise ExportError("embedding: factorized: no transformers architecture has a factorised input side (a V x r "
                          "table and an r -> hidden projection); export with --materialize-embeddings, which writes "
                          "their product as the table of an untied LlamaForCausalLM")
    if materialize or cfg.embedding != "lev":
        check_llama_export(cfg, materialize)


def check_llama_export(cfg: LeviathanConfig, materialize: bool) -> None:
    """A standard LlamaForCausalLM has neither q/k norms nor partial RoPE (only LevForCausalLM does)."""
    what = [flag for flag, on in (("qk_layernorm", cfg.qk_layernorm),
                                  (f"rotary_percent {cfg.rotary_percent}", cfg.rotary_percent < 1.0)) if on]
    if what:
        how = ("export without --materialize-embeddings (LevForCausalLM has both)" if materialize else
               "no standard transformers architecture has both")
        raise ExportError(f"{' and '.join(what)}: a LlamaForCausalLM export cannot express it; {how}")


def model_section_from_hf_config(config: dict, source: str) -> dict:
    """A YAML `model:` section from a config.json (ours or any LLaMA's)."""
    model_type = config.get("model_type")
    if model_type not in ("llama", "leviathan"):
        raise ExportError(f"{source}: unknown layout: model_type {model_type!r} (expected 'llama' or 'leviathan')")
    try:
        fields = model_fields_from_hf_config(config, source)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    section = {**dict(config.get(MODEL_SECTION_KEY) or {}), **fields}
    section.setdefault("seq_length", 2048)
    if model_type == "leviathan":
        section["embedding"], section["lev"] = "lev", dict(config.get("lev") or {})
    else:
        section["embedding"] = "tied" if config.get("tie_word_embeddings") else "untied"
        section["lev"] = {}
    return section


# --------------------------------------------------------------------------- safetensors


def _check_shard_size(max_shard_size: str | int) -> str | int:
    if isinstance(max_shard_size, int) or re.fullmatch(r"\d+(\.\d+)?\s*[KMGT]?i?B", str(max_shard_size), re.I):
        return max_shard_size
    raise ExportError(f"--max-shard-size {max_shard_size!r}: expected a size such as 5GB, 500MB or 2GiB")


def write_safetensors(state: dict[str, torch.Tensor], out_dir: str, max_shard_size: str | int = "5GB") -> list[str]:
    """transformers' layout: model.safetensors, or model-0000k-of-0000n.safetensors + index."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(state, max_shard_size=_check_shard_size(max_shard_size))
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n].contiguous() for n in names}, os.path.join(out_dir, filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    return sorted(split.filename_to_tensors)


def read_safetensors(hf_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's model.safetensors or of the shards its index names."""
    from safetensors.torch import load_file

    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ExportError(f"{hf_dir}: unknown layout: no model.safetensors or model.safetensors.index.json")
    state = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
            raise ExportError(f"{path}: missing shard (named by {index_path})")
        state.update(load_file(path))
    return state


# --------------------------------------------------------------------------- export


def _prepare_output(output: str) -> str:
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ExportError(f"--output {output}: exists and is not empty; remove it or choose another folder")
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(output))}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def set_release_modes(folder: str) -> None:
    """Files 0644, folders 0755, whatever the umask (safetensors writes 0600, mkdtemp 0700):
    released models are read by teammates on shared filesystems."""
    os.chmod(folder, 0o755)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)


def _finish_output(tmp: str, output: str) -> None:
    set_release_modes(tmp)
    if os.path.isdir(output):
        os.rmdir(output)  # empty (checked by _prepare_output)
    os.replace(tmp, output)


def save_hf_model(full: dict[str, torch.Tensor], cfg: LeviathanConfig, output: str, tokenizer,
                  dtype: Optional[torch.dtype] = None, materialize: bool = False,
                  max_shard_size: str | int = "5GB", provenance: Optional[Provenance] = None) -> str:
    """Write a full state dict as a Hugging Face folder (temp folder, renamed when complete)."""
    from transformers import GenerationConfig

    check_export_kind(cfg, materialize)
    dtype = dtype or next(iter(full.values())).dtype
    tokens = special_tokens(tokenizer)
    tmp = _prepare_output(output)
    try:
        state = {k: v.to(dtype) for k, v in to_hf_state_dict(full, cfg, materialize).items()}
        write_safetensors(state, tmp, max_shard_size)
        config = hf_config(cfg, tokens, dtype, materialize)
        config.save_pretrained(tmp)
        # transformers >= 4.56 reads `dtype`, older 4.x (and tools pinned to them) `torch_dtype`.
        update_json_file(os.path.join(tmp, "config.json"), torch_dtype=str(dtype).replace("torch.", ""))
        parameters = sum(t.numel() for k, t in state.items() if not (cfg.embedding == "tied" and k == "lm_head.weight"))
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(model_card(os.path.basename(os.path.abspath(output)), cfg, parameters, dtype, materialize,
                               provenance or Provenance()))
        GenerationConfig(bos_token_id=tokens.bos, eos_token_id=tokens.eos, pad_token_id=tokens.pad).save_pretrained(tmp)
        if cfg.embedding == "lev" and not materialize:
            for name, source in REMOTE_CODE_FILES.items():
                shutil.copyfile(source, os.path.join(tmp, name))
        write_tokenizer(tokenizer, tmp, cfg.seq_length)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _finish_output(tmp, output)
    return output


def export_checkpoint(load_dir: str, output: str, iteration: Optional[int] = None, dtype: Optional[str] = None,
                      tokenizer_type: Optional[str] = None, tokenizer_model: Optional[str] = None,
                      materialize: bool = False, max_shard_size: str | int = "5GB",
                      vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                      card: Optional[dict] = None) -> str:
    """tools/convert_to_hf.py: a training checkpoint -> a Hugging Face folder.

    The tokenizer defaults to the one the checkpoint's run trained with (GPT2BPETokenizer's files:
    `vocab_file` / `merge_file` where given). `card`: Provenance fields to set (licence, dataset,
    downstream results), over those read from the run.
    """
    from megatron_lev.checkpointing.convert import find_checkpoint, read_checkpoint

    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    info = find_checkpoint(load_dir, iteration)
    cfg = info.model_config()
    check_export_kind(cfg, materialize)
    training = info.config.get("training") or {}
    flag = "--tokenizer-model"
    if tokenizer_model is None:
        tokenizer_model, flag = training.get("tokenizer_model"), f"the checkpoint's tokenizer (pass --tokenizer-model)"
        tokenizer_type = tokenizer_type or training.get("tokenizer_type")
    tokenizer = load_tokenizer(tokenizer_type, tokenizer_model, cfg.vocab_size, flag,
                               vocab_file or training.get("vocab_file"), merge_file or training.get("merge_file"))
    full = read_checkpoint(info)
    return save_hf_model(full, cfg, output, tokenizer, DTYPES[dtype] if dtype else None, materialize, max_shard_size,
                         provenance=dataclasses.replace(run_provenance(info), **(card or {})))


def read_hf_model(hf_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """A Hugging Face folder -> (YAML `model:` section, full state dict in float32... or its dtype)."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ExportError(f"--load {hf_dir}: no config.json: not a Hugging Face model folder")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    section = model_section_from_hf_config(config, config_path)
    cfg = model_config_from_dict(section)
    full = from_hf_state_dict(read_safetensors(hf_dir), cfg, hf_dir)
    return cfg.to_dict(), full


def check_hf_tokenizer(hf_dir: str, vocab_size: int) -> Optional[str]:
    """The folder's tokenizer (tokenizer.model preferred, else tokenizer.json), checked
    against vocab_size; None when the folder has no tokenizer."""
    for name in ("tokenizer.model", "tokenizer.json"):
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            load_tokenizer(infer_tokenizer_type(path), path, vocab_size, flag=f"--load {hf_dir}: {name}")
            return path
    return None
