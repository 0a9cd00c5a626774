"""Training checkpoints <-> Hugging Face model folders (library code of tools/convert_to_hf.py
and tools/convert_from_hf.py).

Export (`export_checkpoint`): a checkpoint of any TP / PP / ZeRO layout is merged into one
full state dict (megatron_lev.checkpointing.convert), renamed to transformers' LLaMA names and written as

    config.json  generation_config.json  model.safetensors (or shards + index)  README.md
    tokenizer.json  tokenizer_config.json  [tokenizer.model]

(config.json has `torch_dtype` beside `dtype` and tokenizer_config.json names
`PreTrainedTokenizerFast`, so transformers 4.x loads the folder as 5.x does; README.md is
the model card, with Hub model-index metadata.)
    configuration_lev.py  modeling_lev.py  lev.py                (embedding: lev only)

`embedding: lev` becomes `LevForCausalLM` (remote code, `auto_map`); with
`materialize_embeddings` the generator is evaluated on every id and written as the
`embed_tokens` table of a standard `LlamaForCausalLM`. `tied` / `untied` are standard
`LlamaForCausalLM` (tied through `tie_word_embeddings`).

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

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from typing import Optional

import torch
import yaml

from megatron_lev.checkpointing.layout import LEV_PREFIX, expected_parameter_names
from megatron_lev.hf.trust import LEV_AUTO_MAP, REMOTE_CODE_FILES
from megatron_lev.models.config import LeviathanConfig, model_config_from_dict
from megatron_lev.utils.errors import CheckpointError

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


class ExportError(CheckpointError):
    """A model, folder or tokenizer that cannot be converted; the message names it."""


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
    else:
        out["model.embed_tokens.weight"] = full["embedding.weight"]
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for suffix, hf_suffix in _LAYER_MAP.items():
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
        for suffix, hf_suffix in _LAYER_MAP.items():
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


@dataclass
class SpecialTokens:
    bos: Optional[int]
    eos: int
    pad: Optional[int]


def hf_config(cfg: LeviathanConfig, tokens: SpecialTokens, dtype: torch.dtype, materialize: bool = False):
    """The transformers config of a model: LevConfig (remote code) or LlamaConfig."""
    from transformers import LlamaConfig

    from megatron_lev.hf.configuration_lev import LevConfig

    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, head_dim=cfg.kv_channels, hidden_act="silu",
        max_position_embeddings=cfg.seq_length, initializer_range=cfg.init_method_std,
        rms_norm_eps=cfg.layernorm_epsilon, rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
        attention_bias=False, mlp_bias=False, attention_dropout=0.0, tie_word_embeddings=cfg.embedding == "tied",
        bos_token_id=tokens.bos, eos_token_id=tokens.eos, pad_token_id=tokens.pad, use_cache=True,
    )
    section = cfg.to_dict()
    if cfg.embedding == "lev" and not materialize:
        config = LevConfig(lev=section["lev"], **common)
        config.auto_map = dict(LEV_AUTO_MAP)
        config.architectures = ["LevForCausalLM"]
    else:
        config = LlamaConfig(**common)
        config.architectures = ["LlamaForCausalLM"]
        # A table model from here on (materialized LEV: untied); no generator fields.
        section = {**section, "embedding": "tied" if cfg.embedding == "tied" else "untied", "lev": {}}
    config.dtype = dtype
    config.rope_theta = float(cfg.rotary_base)  # for tools that read config.json's LLaMA-v4 key (llama.cpp)
    setattr(config, MODEL_SECTION_KEY, section)
    return config


def model_section_from_hf_config(config: dict, source: str) -> dict:
    """A YAML `model:` section from a config.json (ours or any LLaMA's)."""
    model_type = config.get("model_type")
    if model_type not in ("llama", "leviathan"):
        raise ExportError(f"{source}: unknown layout: model_type {model_type!r} (expected 'llama' or 'leviathan')")
    unsupported = [f"{k}={config.get(k)!r}" for k, ok in (
        ("hidden_act", config.get("hidden_act", "silu") == "silu"),
        ("attention_bias", not config.get("attention_bias", False)),
        ("mlp_bias", not config.get("mlp_bias", False)),
        ("rope_parameters", (config.get("rope_parameters") or {}).get("rope_type", "default") == "default"),
        ("rope_scaling", not config.get("rope_scaling")),
    ) if not ok]
    if unsupported:
        raise ExportError(f"{source}: {', '.join(unsupported)} is not a Leviathan decoder (SwiGLU, no biases, plain RoPE)")
    rope = config.get("rope_parameters") or {}
    heads = config["num_attention_heads"]
    section = dict(config.get(MODEL_SECTION_KEY) or {})
    section.update(
        vocab_size=config["vocab_size"], num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"], num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=config.get("head_dim") or config["hidden_size"] // heads,
        seq_length=config.get("max_position_embeddings", section.get("seq_length", 2048)),
        rotary_base=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        layernorm_epsilon=config.get("rms_norm_eps", 1e-6),
    )
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


# --------------------------------------------------------------------------- tokenizer


def infer_tokenizer_type(path: str) -> str:
    if os.path.isdir(path) or path.endswith(".json"):
        return "HuggingFaceTokenizer"
    return "SentencePieceTokenizer"


def load_tokenizer(tokenizer_type: Optional[str], tokenizer_model: str, vocab_size: int, flag: str = "--tokenizer-model",
                   vocab_file: Optional[str] = None, merge_file: Optional[str] = None):
    """Our pre-training tokenizer, checked against the model: it may not produce an id the
    model cannot embed (fewer tokens than vocab_size is fine: padded vocabularies such as
    GPT-NeoX's 50,277 tokens in a 50,304-row model). GPT2BPETokenizer: vocab_file/merge_file."""
    from megatron_lev.data.tokenizer import build_tokenizer

    if tokenizer_type == "GPT2BPETokenizer":
        try:
            tokenizer = build_tokenizer(tokenizer_type, None, vocab_file, merge_file)
        except (FileNotFoundError, ValueError) as exc:
            raise ExportError(f"{flag}: {exc}") from None
        tokenizer_model = f"--vocab-file {vocab_file} --merge-file {merge_file}"
    elif not tokenizer_model or not os.path.exists(tokenizer_model):
        raise ExportError(f"{flag} {tokenizer_model}: no such file")
    else:
        tokenizer = build_tokenizer(tokenizer_type or infer_tokenizer_type(tokenizer_model), tokenizer_model)
    if tokenizer.vocab_size > vocab_size:
        raise ExportError(f"{flag} {tokenizer_model} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                          f"{vocab_size}: not the tokenizer this model was trained with")
    return tokenizer


def special_tokens(tokenizer) -> SpecialTokens:
    pad = tokenizer.pad if tokenizer.pad is not None and tokenizer.pad >= 0 else None
    return SpecialTokens(bos=tokenizer.bos, eos=tokenizer.eod, pad=pad)


def _spm_to_tokenizers(model_path: str):
    """A `tokenizers` Tokenizer that encodes exactly like SentencePiece (BPE or unigram)."""
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    proto = import_protobuf().ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    if proto.trainer_spec.model_type == 1:  # unigram
        vocab = [(p.piece, p.score) for p in proto.pieces]
    else:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    # legacy=True follows SentencePiece's own dummy prefix (one "▁" before the text).
    return SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)


def write_tokenizer(tokenizer, out_dir: str, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json (AutoTokenizer), plus SentencePiece's
    tokenizer.model when that is the source (for llama.cpp and SentencePiece users).

    No BOS/EOS is added on encode: pre-training never saw them (documents end with EOD).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from megatron_lev.data.tokenizer import GPT2BPETokenizer, SentencePieceTokenizer

    if isinstance(tokenizer, SentencePieceTokenizer):
        backend = _spm_to_tokenizers(tokenizer.path)
        shutil.copyfile(tokenizer.path, os.path.join(out_dir, "tokenizer.model"))
        unk = tokenizer._sp.unk_id()
    elif isinstance(tokenizer, GPT2BPETokenizer):
        backend, unk = tokenizer.backend_tokenizer(), None  # GPT-2's byte-level BPE as tokenizer.json
    else:
        path = tokenizer.path
        backend = Tokenizer.from_file(os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path)
        unk = None

    def piece(i):
        return None if i is None or i < 0 else tokenizer.inv_vocab[i]

    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=piece(tokenizer.bos), eos_token=piece(tokenizer.eod),
        pad_token=piece(tokenizer.pad), unk_token=piece(unk), model_max_length=model_max_length,
        clean_up_tokenization_spaces=False)
    hf.save_pretrained(out_dir)
    # transformers 5 names its own class (TokenizersBackend), which transformers 4.x and the
    # vLLM builds that pin it cannot import; both map PreTrainedTokenizerFast to tokenizer.json.
    _update_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_class="PreTrainedTokenizerFast")


def _update_json(path: str, **keys) -> None:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data.update(keys)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


@dataclass
class Provenance:
    """What the model card says about where the weights come from (all optional)."""

    iteration: Optional[int] = None
    tokens: Optional[int] = None  # training tokens seen
    data: Optional[str] = None  # --data-path (or --train-data-path)
    valid_loss: Optional[float] = None  # the run's last validation loss at or before the checkpoint
    source: Optional[str] = None  # the checkpoint folder


def _public_names(paths: str) -> str:
    """A released card names files, not where they sat: the base name of every path in a
    space-separated list (blend weights pass through), so no local directory leaks."""
    return " ".join(os.path.basename(p.rstrip("/")) or p for p in paths.split())


def _run_and_tag(checkpoint: str) -> str:
    """`run/iter_0000010` of a checkpoint folder: which run and iteration, not where it sat."""
    path = os.path.normpath(checkpoint)
    return os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))


def run_provenance(info) -> Provenance:
    """A checkpoint's provenance: iteration, tokens (iterations x global batch x sequence),
    data paths and its run's last logged validation loss (metrics.jsonl)."""
    training = info.config.get("training") or {}
    tokens = info.iteration * training["tokens_per_step"] if training.get("tokens_per_step") else None
    data = training.get("data_path") or training.get("train_data_path")
    valid = None
    metrics = training.get("metrics_file") or os.path.join(info.load_dir, "metrics.jsonl")
    if metrics and os.path.isfile(metrics):
        with open(metrics, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "valid_loss" in record and record.get("iteration", 0) <= info.iteration:
                    valid = float(record["valid_loss"])
    return Provenance(iteration=info.iteration, tokens=tokens, data=" ".join(map(str, data)) if data else None,
                      valid_loss=valid, source=info.path)


def model_card(name: str, cfg: LeviathanConfig, parameters: int, dtype: torch.dtype, materialize: bool,
               provenance: Provenance) -> str:
    """README.md: Hub metadata (model-index with the validation loss when known), then what
    the model is and how to load it, with and without remote code."""
    remote = cfg.embedding == "lev" and not materialize
    kind = ("Leviathan (LEV embedding generator, remote code LevForCausalLM)" if remote else
            "LLaMA-architecture decoder (LlamaForCausalLM)" +
            (", LEV embeddings materialized into a table" if cfg.embedding == "lev" else f", {cfg.embedding} embeddings"))
    meta = {"library_name": "transformers", "pipeline_tag": "text-generation",
            "tags": ["megatron_lev", "leviathan" if cfg.embedding == "lev" else "llama", "llama"]}
    if provenance.valid_loss is not None:
        dataset = os.path.basename(provenance.data.split()[-1]) if provenance.data else "validation split"
        meta["model-index"] = [{"name": name, "results": [{
            "task": {"type": "text-generation", "name": "Causal language modeling"},
            "dataset": {"type": dataset, "name": dataset, "split": "validation"},
            "metrics": [{"type": "loss", "name": "validation loss", "value": round(provenance.valid_loss, 4)},
                        {"type": "perplexity", "name": "validation perplexity",
                         "value": round(math.exp(min(provenance.valid_loss, 50.0)), 2)}]}]}]
    # With remote code, AutoTokenizer reads config.json's auto_map too: without the flag it asks "[y/N]".
    trust = ", trust_remote_code=True" if remote else ""
    load = [f'tokenizer = AutoTokenizer.from_pretrained("{name}"{trust})',
            f'model = AutoModelForCausalLM.from_pretrained("{name}"{trust})']
    rows = [("architecture", kind),
            ("parameters", f"{parameters:,}"),
            ("layers x hidden size", f"{cfg.num_layers} x {cfg.hidden_size} ({cfg.num_attention_heads} heads, "
                                     f"{cfg.num_query_groups or cfg.num_attention_heads} kv heads)"),
            ("vocabulary", f"{cfg.vocab_size:,}"), ("context length", f"{cfg.seq_length:,}"),
            ("weights dtype", str(dtype).replace("torch.", "")),
            ("training iterations", f"{provenance.iteration:,}" if provenance.iteration is not None else "unknown"),
            ("training tokens", f"{provenance.tokens:,}" if provenance.tokens is not None else "unknown"),
            ("training data", f"`{_public_names(provenance.data)}`" if provenance.data else "unknown"),
            ("validation loss", f"{provenance.valid_loss:.4f} (perplexity {math.exp(min(provenance.valid_loss, 50)):.2f})"
             if provenance.valid_loss is not None else "not measured")]
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "", f"# {name}", "",
             f"Exported by megatron_lev's `tools/convert_to_hf.py`"
             + (f" from checkpoint `{_run_and_tag(provenance.source)}`." if provenance.source else "."), "",
             "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows), "",
             "## Load", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
             *load, "```", ""]
    if remote:
        lines += ["The LEV generator is Python code shipped in this folder (`modeling_lev.py`, `lev.py`), hence "
                  "`trust_remote_code=True`. Without remote code, export with `--materialize-embeddings`: the "
                  "generated table makes a standard `LlamaForCausalLM` with the same outputs.", ""]
    lines += ["The tokenizer adds no BOS/EOS when encoding (pre-training saw none); documents end with "
              "the EOS token.", ""]
    return "\n".join(lines)


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

    if materialize and cfg.embedding != "lev":
        raise ExportError(f"--materialize-embeddings: only for embedding: lev models (this one is {cfg.embedding})")
    dtype = dtype or next(iter(full.values())).dtype
    tokens = special_tokens(tokenizer)
    tmp = _prepare_output(output)
    try:
        state = {k: v.to(dtype) for k, v in to_hf_state_dict(full, cfg, materialize).items()}
        write_safetensors(state, tmp, max_shard_size)
        config = hf_config(cfg, tokens, dtype, materialize)
        config.save_pretrained(tmp)
        # transformers >= 4.56 reads `dtype`, older 4.x (and tools pinned to them) `torch_dtype`.
        _update_json(os.path.join(tmp, "config.json"), torch_dtype=str(dtype).replace("torch.", ""))
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
                      materialize: bool = False, max_shard_size: str | int = "5GB") -> str:
    """tools/convert_to_hf.py: a training checkpoint -> a Hugging Face folder.

    The tokenizer defaults to the one the checkpoint's run trained with.
    """
    from megatron_lev.checkpointing.convert import find_checkpoint, read_checkpoint

    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    info = find_checkpoint(load_dir, iteration)
    cfg = info.model_config()
    training = info.config.get("training") or {}
    flag = "--tokenizer-model"
    if tokenizer_model is None:
        tokenizer_model, flag = training.get("tokenizer_model"), f"the checkpoint's tokenizer (pass --tokenizer-model)"
        tokenizer_type = tokenizer_type or training.get("tokenizer_type")
    tokenizer = load_tokenizer(tokenizer_type, tokenizer_model, cfg.vocab_size, flag,
                               training.get("vocab_file"), training.get("merge_file"))
    full = read_checkpoint(info)
    return save_hf_model(full, cfg, output, tokenizer, DTYPES[dtype] if dtype else None, materialize, max_shard_size,
                         provenance=run_provenance(info))


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
