"""megatron-core's GPTModel with the LEV embedding (models/gpt_lev.py) against this project's
decoder with the same weights: logits, loss and gradients at TP=1 and TP=2 (2 gloo ranks), the
sequence-parallel embedding, a torch_dist checkpoint saved at TP=2 and loaded at TP=1, the
conversion of its checkpoints (torch_dist and legacy torch) to this project's layout and to a
Hugging Face export, and the padding-logit loss gap users are told about (docs/megatron-lm.md).

The CPU stand-ins for GPTModel's CUDA uses are in tests/mcore_cpu.py (test-only patches).
"""
import argparse
import json
import os

import pytest
import torch
import torch.distributed as dist

from megatron_lev.configs import load_config
from megatron_lev.models.config import model_config_from_dict
from tests.distributed import one_in_process_rank, run_distributed
from tests.mcore_cpu import causal_mask, copy_weights_to_gpt, patch_mcore_for_cpu
from tests.megatron_lm_record import recorded, recorded_namespace

VOCAB, BATCH, SEQ, ITERATION = 1024, 2, 16, 7  # 1024: no vocabulary padding at TP 1 or 2
SECTION = {**load_config("tiny-lev")["model"], "vocab_size": VOCAB}
# Megatron-LM's --qk-layernorm --rotary-percent 0.5 (the two settings pretrain_lev_gpt.py carried wrongly
# before), with --lev-output-norm (the LEV norm after the sum over TP ranks' heads).
QK_PARTIAL_ROPE = {**SECTION, "qk_layernorm": True, "rotary_percent": 0.5,
                   "lev": {**SECTION["lev"], "output_norm": True, "output_norm_init": 0.5}}
# fp32 bounds (relative to the largest magnitude of each tensor).
LOGITS_RTOL, LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5, 1e-4


def _data(vocab=VOCAB):
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.25).float()
    return tokens[:, :-1], tokens[:, 1:], mask, torch.arange(SEQ).expand(BATCH, SEQ)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()


def _compare(ours, gpt, vocab=VOCAB) -> dict:
    """Forward and backward both models on one batch; max relative differences."""
    from megatron_lev.models.mcore_args import to_mcore_name

    ids, labels, mask, pos = _data(vocab)
    logits_ours, logits_gpt = ours(ids, pos).detach(), gpt(ids, pos, causal_mask(SEQ)).detach()
    loss_ours = ours(ids, pos, labels=labels, loss_mask=mask)
    per_token = gpt(ids, pos, causal_mask(SEQ), labels=labels)
    loss_gpt = (per_token * mask).sum() / mask.sum()
    loss_ours.backward()
    loss_gpt.backward()
    gpt_params = dict(gpt.named_parameters())
    if ours.config.qk_layernorm and ours.config.tensor_model_parallel_size > 1:
        from megatron.core import parallel_state

        # Megatron-LM's finalize_model_grads sums the q/k_layernorm gradients over TP (each rank holds
        # other heads); the step would see these. Ours are summed in the backward already.
        for name, param in gpt_params.items():
            if "q_layernorm" in name or "k_layernorm" in name:
                dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
    grads = {name: _rel(p.grad, gpt_params[to_mcore_name(name)].grad) for name, p in ours.named_parameters()}
    first_pad = ours.output_layer.vocab_size - ours.output_layer.vocab_start  # compare real columns only
    real = slice(0, max(0, min(first_pad, logits_ours.shape[-1])))
    return {"logits": _rel(logits_ours[..., real], logits_gpt[..., real]), "loss_ours": loss_ours.item(),
            "loss_gpt": loss_gpt.item(), "loss": abs(loss_ours.item() - loss_gpt.item()) / abs(loss_ours.item()),
            "grad": max(grads.values()), "grads": grads, "logits_gpt": logits_gpt}


def _models(tp: int, section=SECTION, **gpt_overrides):
    from megatron_lev.models.decoder import LeviathanModel
    from megatron_lev.models.gpt_lev import build_lev_gpt_model_from_config

    config = model_config_from_dict(section, tensor_model_parallel_size=tp)
    ours = LeviathanModel(config)
    if config.qk_layernorm:  # scales away from 1, so that each one matters (the same on every rank)
        with torch.no_grad():
            for name, param in ours.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.copy_(1 + 0.5 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    gpt = build_lev_gpt_model_from_config(config, **gpt_overrides)
    copy_weights_to_gpt(ours, gpt)
    return config, ours, gpt


def saved_args(tp: int, fmt: str, **changes) -> argparse.Namespace:
    """The arguments Megatron-LM saves with a checkpoint of this run: the recorded namespace (its
    dtypes and megatron-core's enums included), after `ITERATION` steps at `tp`, with what the
    model builder and the training loop add (lev_vocab_size, padded_vocab_size, consumed samples)."""
    from megatron.core.enums import ModelType

    return recorded_namespace(tensor_model_parallel_size=tp, ckpt_format=fmt, lev_vocab_size=VOCAB,
                              padded_vocab_size=VOCAB, consumed_train_samples=ITERATION * 8,
                              data_path=["/data/pile/pile_text_document"], model_type=ModelType.encoder_or_decoder,
                              **changes)


def _save_megatron_lm_checkpoints(gpt, root: str, rank: int) -> None:
    """The model as Megatron-LM saves it: torch_dist (megatron-core dist_checkpointing of
    {"model": sharded_state_dict} and the common entries, saved args included: common.pt) and legacy
    torch (mp_rank_TT/model_optim_rng.pt)."""
    from megatron.core import dist_checkpointing

    tag = f"iter_{ITERATION:07d}"
    for fmt in ("torch_dist", "torch"):
        os.makedirs(os.path.join(root, fmt, tag), exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": gpt.sharded_state_dict(), "iteration": ITERATION, "checkpoint_version": 3.0,
                             "args": saved_args(2, "torch_dist")}, os.path.join(root, "torch_dist", tag))
    legacy = os.path.join(root, "torch", tag, f"mp_rank_{rank:02d}")
    os.makedirs(legacy, exist_ok=True)
    torch.save({"args": saved_args(2, "torch"), "iteration": ITERATION,
                "checkpoint_version": 3.0, "model": gpt.state_dict_for_save_checkpoint()},
               os.path.join(legacy, "model_optim_rng.pt"))
    if rank == 0:
        for fmt in ("torch_dist", "torch"):
            with open(os.path.join(root, fmt, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(ITERATION))
    dist.barrier()


def _tp2_rank(rank, world_size, root):
    from megatron_lev.distributed.state import initialize_model_parallel
    from megatron_lev.models.decoder import gather_logits
    from megatron_lev.models.gpt_lev import LEVLanguageModelEmbedding
    from megatron_lev.models.mcore_args import transformer_config_from_model_config

    patch_mcore_for_cpu()
    initialize_model_parallel(tensor_model_parallel_size=2)
    _, ours, gpt = _models(2, QK_PARTIAL_ROPE)
    out = {"qk": _compare(ours, gpt)}
    out["qk"]["logits_full"] = gather_logits(out["qk"].pop("logits_gpt"), VOCAB)
    config, ours, gpt = _models(2)
    out.update(_compare(ours, gpt))
    out["logits_full"] = gather_logits(out.pop("logits_gpt"), VOCAB)

    # Sequence parallelism: the embedding's [s/2, b, h] is this rank's half of the non-SP output,
    # and the same upstream gradient gives the same parameter gradients.
    sp = LEVLanguageModelEmbedding(transformer_config_from_model_config(config, sequence_parallel=True),
                                   config.lev_config())
    sp.load_state_dict(gpt.embedding.state_dict())
    ids, _, _, pos = _data()
    upstream = torch.randn(SEQ, BATCH, config.hidden_size, generator=torch.Generator().manual_seed(5))
    gpt.zero_grad()
    full = gpt.embedding(ids, pos)
    (full * upstream).sum().backward()
    half = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
    split = sp(ids, pos)
    (split * upstream[half]).sum().backward()
    sp_grads = dict(sp.named_parameters())
    out["sp_shape"] = tuple(split.shape)
    out["sp_output_diff"] = (split - full[half]).abs().max().item()
    out["sp_grad_diff"] = max((p.grad - sp_grads[n].grad).abs().max().item()
                              for n, p in gpt.embedding.named_parameters())
    _save_megatron_lm_checkpoints(gpt, root, rank)
    return out


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron_lm_ckpt"))
    results = run_distributed(_tp2_rank, world_size=2, args=(root,))
    return {"root": root, "ranks": results}


@pytest.fixture(scope="module")
def tp1():
    """One in-process rank (TP = 1) with the CPU stand-ins; the models of the TP=1 comparison."""
    with pytest.MonkeyPatch.context() as monkeypatch, one_in_process_rank():
        patch_mcore_for_cpu(monkeypatch)
        config, ours, gpt = _models(1)
        yield {"config": config, "ours": ours, "gpt": gpt, "diffs": _compare(ours, gpt)}


def test_gpt_model_with_lev_equals_ours_tp1(tp1):
    d = tp1["diffs"]
    print(f"TP=1: logits {d['logits']:.2e}, loss {d['loss']:.2e}, grads {d['grad']:.2e} (max relative)")
    assert d["logits"] < LOGITS_RTOL and d["loss"] < LOSS_RTOL and d["grad"] < GRAD_RTOL, d
    assert len(d["grads"]) == 6 + 6 * SECTION["num_layers"] + 2  # every parameter compared
    assert 6.0 < d["loss_ours"] < 8.0  # ~ln(1024): a real loss, not a degenerate one


def test_gpt_model_with_lev_equals_ours_tp2(tp2, tp1):
    for rank, d in enumerate(tp2["ranks"]):
        print(f"TP=2 rank {rank}: logits {d['logits']:.2e}, loss {d['loss']:.2e}, grads {d['grad']:.2e}")
        assert d["logits"] < LOGITS_RTOL and d["loss"] < LOSS_RTOL and d["grad"] < GRAD_RTOL, (rank, d)
        # TP=2 is the TP=1 model: the gathered logits agree across the layouts.
        assert _rel(tp1["diffs"]["logits_gpt"], d["logits_full"]) < LOGITS_RTOL


def test_qk_layernorm_and_partial_rope_equal_ours_tp2(tp2, tp1):
    """--qk-layernorm --rotary-percent 0.5 --lev-output-norm at TP=2: GPTModel's q/k_layernorm (their
    gradients summed over TP, as Megatron-LM does), its partial RoPE and LEV's output norm equal this
    project's decoder, and the TP=1 model."""
    _, ours, gpt = _models(1, QK_PARTIAL_ROPE)  # (tp1: the in-process rank and the CPU stand-ins)
    tp1_logits = _compare(ours, gpt)["logits_gpt"]
    assert _rel(tp1_logits, tp1["diffs"]["logits_gpt"]) > 1e-3  # the settings change the model
    for rank, d in enumerate(tp2["ranks"]):
        d = d["qk"]
        print(f"TP=2 qk_layernorm + rotary_percent 0.5, rank {rank}: logits {d['logits']:.2e}, grads {d['grad']:.2e}")
        assert d["logits"] < LOGITS_RTOL and d["loss"] < LOSS_RTOL and d["grad"] < GRAD_RTOL, (rank, d)
        assert {name for name in d["grads"] if "_norm." in name and "attention" in name} == {
            f"layers.{i}.attention.{q}_norm.weight" for i in range(2) for q in "qk"}
        assert _rel(tp1_logits, d["logits_full"]) < LOGITS_RTOL


def test_sequence_parallel_embedding_is_the_sequence_split(tp2):
    for rank, d in enumerate(tp2["ranks"]):
        assert d["sp_shape"] == (SEQ // 2, BATCH, SECTION["hidden_size"])
        assert d["sp_output_diff"] == 0.0 and d["sp_grad_diff"] < 1e-6, (rank, d)


def test_torch_dist_saved_at_tp2_loads_at_tp1(tp2, tp1):
    from megatron.core import dist_checkpointing

    from megatron_lev.models.gpt_lev import build_lev_gpt_model_from_config

    fresh = build_lev_gpt_model_from_config(model_config_from_dict({**SECTION, "init_seed": 99}))
    ours = dict(tp1["gpt"].named_parameters())
    assert not torch.equal(fresh.output_layer.weight, ours["output_layer.weight"])  # a load has to change it
    path = os.path.join(tp2["root"], "torch_dist", f"iter_{ITERATION:07d}")
    loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()}, path)
    fresh.load_state_dict(loaded["model"])
    for name, param in fresh.named_parameters():
        assert torch.equal(param, ours[name]), name
    ids, _, _, pos = _data()
    with torch.no_grad():
        logits = fresh(ids, pos, causal_mask(SEQ))
    diff = _rel(tp2["ranks"][0]["logits_full"], logits)
    print(f"torch_dist TP=2 -> TP=1: logits max relative diff {diff:.2e}")
    assert diff < LOGITS_RTOL


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_megatron_lm_checkpoint_reads_as_our_full_state_dict(fmt, tp2, tp1):
    from megatron_lev.checkpointing.mcore import read_mcore_checkpoint

    full, source = read_mcore_checkpoint(os.path.join(tp2["root"], fmt), tp1["config"])
    assert source.endswith(f"iter_{ITERATION:07d}")
    ours = {n: p.detach() for n, p in tp1["ours"].named_parameters()}
    assert list(full) == list(ours)
    for name, tensor in full.items():
        assert torch.equal(tensor, ours[name]), name


def _word_level_tokenizer(path: str, size: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(path)
    return path


def _convert(load: str, out: str, *flags: str, capsys=None) -> tuple[int, str]:
    from megatron_lev.hf.cli import convert_from_mcore_main

    if capsys is not None:
        capsys.readouterr()
    code = convert_from_mcore_main(["--load", load, "--output", out, *flags])
    return code, capsys.readouterr().err.strip() if capsys is not None else ""


def test_convert_from_mcore_reads_the_model_from_the_checkpoint(tp2, tp1, tmp_path, capsys):
    """No sidecar: the model's settings are the arguments Megatron-LM saved in common.pt; the export
    has the GPTModel's logits, and its card says where it came from (read from the same arguments)."""
    from transformers import AutoModelForCausalLM

    tokenizer = _word_level_tokenizer(str(tmp_path / "tokenizer.json"), VOCAB)
    out = str(tmp_path / "hf")
    code, err = _convert(os.path.join(tp2["root"], "torch_dist"), out, "--tokenizer-model", tokenizer, capsys=capsys)
    assert code == 0, err
    assert json.load(open(os.path.join(out, "config.json")))["vocab_size"] == VOCAB
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, trust_remote_code=True).eval()
    ids, _, _, _ = _data()
    with torch.no_grad():
        logits = model(ids).logits
    diff = _rel(tp1["diffs"]["logits_gpt"], logits)
    with capsys.disabled():
        print(f"HF export vs the GPTModel: logits max relative diff {diff:.2e}")
    assert diff < LOGITS_RTOL
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    for line in ("Exported by megatron_lev's `megatron-lev-convert-from-mcore` from checkpoint `torch_dist/iter_0000007`.",
                 "| trained with | Megatron-LM (pretrain_lev_gpt.py), TP 2 x PP 1, torch_dist checkpoint |",
                 "| training iterations | 7 |", f"| training tokens | {ITERATION * 8 * 64:,} |",
                 "| training data | `pile_text_document` |"):
        assert line in card, line


def test_convert_from_mcore_config_must_agree_and_tokenizer_is_needed(tp2, tmp_path, capsys):
    """A YAML is still accepted, if it describes the checkpoint's model (the legacy layout here); one
    that does not, or a NullTokenizer run without a tokenizer, is one line and exit 2."""
    import yaml

    tokenizer = _word_level_tokenizer(str(tmp_path / "tokenizer.json"), VOCAB)
    legacy = os.path.join(tp2["root"], "torch")
    good, bad = tmp_path / "model.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump({"model": {**SECTION, "hidden_dropout": 0.1}}))  # dropout: not the weights' meaning
    bad.write_text(yaml.safe_dump({"model": {**SECTION, "ffn_hidden_size": 256}}))
    assert _convert(legacy, str(tmp_path / "a"), "--config", str(good), "--tokenizer-model", tokenizer,
                    capsys=capsys)[0] == 0
    code, err = _convert(legacy, str(tmp_path / "b"), "--config", str(bad), "--tokenizer-model", tokenizer,
                         capsys=capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"convert_from_mcore: error: --config {bad} describes another model than ") and \
        err.endswith("(ffn_hidden_size: 256 in it, 192 in the checkpoint's arguments)"), err
    code, err = _convert(legacy, str(tmp_path / "c"), capsys=capsys)
    assert code == 2 and err == ("convert_from_mcore: error: the checkpoint was trained with --tokenizer-type "
                                 "NullTokenizer (ids without text): pass --tokenizer-type/--tokenizer-model (or "
                                 "--vocab-file/--merge-file) for the tokenizer its ids stand for")
    assert not any(p.name in "abc" and p.name != "a" for p in tmp_path.iterdir())  # nothing half-written


@pytest.mark.parametrize("damage", ["missing torch_dist shard", "truncated torch_dist shard", "missing common.pt",
                                    "missing legacy rank", "truncated legacy file"])
def test_damaged_megatron_lm_checkpoint_is_one_line_exit_2(damage, tp2, tmp_path, capsys):
    import shutil

    fmt = "torch_dist" if "legacy" not in damage else "torch"
    load = str(tmp_path / fmt)
    shutil.copytree(os.path.join(tp2["root"], fmt), load)
    tag = os.path.join(load, f"iter_{ITERATION:07d}")
    target = {"missing torch_dist shard": "__1_0.distcp", "truncated torch_dist shard": "__0_0.distcp",
              "missing common.pt": "common.pt", "missing legacy rank": "mp_rank_01",
              "truncated legacy file": "mp_rank_01/model_optim_rng.pt"}[damage]
    path = os.path.join(tag, target)
    if damage.startswith("truncated"):
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    else:
        (shutil.rmtree if os.path.isdir(path) else os.remove)(path)
    tokenizer = _word_level_tokenizer(str(tmp_path / "tokenizer.json"), VOCAB)
    code, err = _convert(load, str(tmp_path / "hf"), "--tokenizer-model", tokenizer, capsys=capsys)
    expected = {"missing torch_dist shard": f"{path}: missing shard (named by {tag}/.metadata)",
                "truncated torch_dist shard": f"{path}: truncated shard (",
                "missing common.pt": f"{path}: missing (every torch_dist checkpoint of Megatron-LM has one)",
                "missing legacy rank": f"{tag}: tensor-parallel ranks [0] of the 2 the checkpoint was saved with",
                "truncated legacy file": f"{path}: cannot be read, damaged or truncated"}[damage]
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("convert_from_mcore: error: " + expected), err
    assert not os.path.exists(tmp_path / "hf")


def test_gpt_models_rope_ignores_position_ids(tp1):
    """What docs/megatron-lm.md warns about: positions reset mid-sequence (--reset-position-ids)
    change our logits, not GPTModel's (a uniform shift would change neither: RoPE is relative)."""
    ids, _, _, pos = _data()
    with torch.no_grad():
        shifted = pos % (SEQ // 2)  # a second document starts half-way
        ours = _rel(tp1["ours"](ids, pos), tp1["ours"](ids, shifted))
        gpt = _rel(tp1["gpt"](ids, pos, causal_mask(SEQ)), tp1["gpt"](ids, shifted, causal_mask(SEQ)))
    assert gpt == 0.0 and ours > 1e-5, (gpt, ours)  # measured 1.6e-4 (fp32 noise: ~2e-7)


@pytest.mark.parametrize("vocab, low, high", [(1000, 0.020, 0.026), (8000, 0.006, 0.009)])
def test_padding_logits_raise_gpt_models_loss(vocab, low, high, tp1):
    """GPTModel keeps the padding columns (logit 0) in its softmax; ours masks them. The gap is
    about log(padded / vocab) at initialisation (log(1024/1000) = 0.0237, log(8064/8000) = 0.0080)."""
    config, ours, gpt = _models(1, {**SECTION, "vocab_size": vocab})
    assert config.padded_vocab_size == {1000: 1024, 8000: 8064}[vocab]
    d = _compare(ours, gpt, vocab)
    gap = d["loss_gpt"] - d["loss_ours"]
    print(f"V={vocab} padded to {config.padded_vocab_size}: GPTModel's loss is higher by {gap:.4f}; "
          f"real-column logits max relative diff {d['logits']:.2e}")
    assert low < gap < high and d["logits"] < LOGITS_RTOL


# --------------------------------------------------------------------------- Megatron-LM's provider


def test_add_lev_args_has_one_flag_per_lev_field():
    import dataclasses

    from megatron_lev.lev.generator import LEVConfig
    from megatron_lev.megatron_lm.arguments import add_lev_args

    parser = add_lev_args(argparse.ArgumentParser())
    flags = {opt for action in parser._actions for opt in action.option_strings if opt.startswith("--lev-")}
    fields = {f.name for f in dataclasses.fields(LEVConfig)} - {"vocab_size", "hidden_size"}
    assert {f.removeprefix("--lev-").replace("-", "_") for f in flags if not f.startswith("--no-")} == fields
    args = parser.parse_args(["--lev-num-heads", "2", "--no-lev-unique-ids", "--lev-digit-base", "20",
                              "--lev-init-std", "0.01", "--lev-digit-order", "lsb_first"])
    assert (args.lev_num_heads, args.lev_unique_ids, args.lev_digit_base, args.lev_init_std,
            args.lev_digit_order, args.lev_num_modes) == (2, False, 20, 0.01, "lsb_first", 64)


def test_provider_builds_from_megatron_lm_namespace(tp1):
    from megatron_lev.lev.generator import LEVConfig
    from megatron_lev.megatron_lm.arguments import model_section_from_args
    from megatron_lev.megatron_lm.provider import lev_gpt_builder
    from megatron_lev.models.gpt_lev import LEVLanguageModelEmbedding

    args, record = recorded_namespace(), recorded()
    assert record["megatron_lm"].startswith("core_v0.16.1") and len(record["args"]) > 600
    assert args.lev_num_heads == 4 and args.padded_vocab_size is None  # set by Megatron-LM's tokenizer later
    model = lev_gpt_builder(args, True, True)
    assert isinstance(model.embedding, LEVLanguageModelEmbedding) and not model.share_embeddings_and_output_weights
    # NullTokenizer --vocab-size 1023: 1023 ids and its EOD (Megatron-LM's rule), recorded for the converter.
    assert args.lev_vocab_size == VOCAB
    assert model.embedding.lev_config == LEVConfig(vocab_size=VOCAB, hidden_size=64, num_heads=4, seed_dim=16,
                                                   num_knots=8, num_modes=16)
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_query_groups, cfg.normalization,
            cfg.gated_linear_unit, cfg.add_bias_linear, cfg.hidden_dropout) == (2, 64, 192, 2, "RMSNorm", True, False, 0.0)
    assert model.output_layer.weight.shape == (VOCAB, 64) and model.rotary_pos_emb.inv_freq.shape == (8,)
    # --seed seeds LEV as init_seed does here: the generator is this project's, weight for weight.
    ours = dict(tp1["ours"].named_parameters())
    for name, param in model.embedding.named_parameters():
        assert torch.equal(param, ours["embedding." + name]), name
    # The model section read from the namespace (what the converter reads from a checkpoint's saved
    # arguments) describes the same model.
    assert model_config_from_dict(model_section_from_args(args, VOCAB)).to_dict() == tp1["config"].to_dict()

    # --qk-layernorm reaches the layer spec (it was dropped there: q_layernorm was an IdentityOp).
    attention = lev_gpt_builder(recorded_namespace(qk_layernorm=True)).decoder.layers[0].self_attention
    assert isinstance(attention.q_layernorm, torch.nn.RMSNorm) and isinstance(attention.k_layernorm, torch.nn.RMSNorm)
    assert attention.q_layernorm.weight.shape == (16,)

    args.untie_embeddings_and_output_weights = False
    with pytest.raises(ValueError, match="^--untie-embeddings-and-output-weights is required"):
        lev_gpt_builder(args)


class _Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_megatron_lm_checkpoints_are_refused(tp1, tmp_path):
    """A torch_dist `.metadata` or a legacy model_optim_rng.pt whose pickle would run code is
    refused with one line naming the file, and the code does not run."""
    import pickle

    from megatron_lev.checkpointing.mcore import read_mcore_checkpoint
    from megatron_lev.checkpointing.safe_load import UnsafeCheckpointError

    marker = tmp_path / "pwned"
    dcp_dir = tmp_path / "torch_dist" / "iter_0000001"
    dcp_dir.mkdir(parents=True)
    (dcp_dir / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(_Hostile(marker)))
    legacy = tmp_path / "torch" / "iter_0000001" / "mp_rank_00"
    legacy.mkdir(parents=True)
    torch.save({"model": {}, "args": _Hostile(marker)}, legacy / "model_optim_rng.pt")
    for folder, file in ((dcp_dir, dcp_dir / ".metadata"), (legacy.parent, legacy / "model_optim_rng.pt")):
        with pytest.raises(UnsafeCheckpointError) as err:
            read_mcore_checkpoint(str(folder), tp1["config"])
        message = str(err.value)
        assert message.startswith(f"{file}: refused: loading it would ") and "\n" not in message, message
        assert "posix.system" in message or "os.system" in message
    assert not marker.exists()


def test_layer_specs_and_transformer_engine_names(tp1):
    """TransformerEngine's spec where it imports (a clear error where not); its fused-norm names
    map to ours as the local spec's do."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_lev.models.gpt_lev import layer_spec_for
    from megatron_lev.models.mcore_args import from_mcore_name, to_mcore_name

    config = tp1["gpt"].config
    if gpt_layer_specs.HAVE_TE:
        assert layer_spec_for("transformer_engine", config) is not None
    else:
        with pytest.raises(ImportError, match="^layer spec 'transformer_engine': transformer_engine does not import"):
            layer_spec_for("transformer_engine", config)
    with pytest.raises(ValueError, match="^layer_spec 'fast': expected one of local, transformer_engine"):
        layer_spec_for("fast", config)
    for name, _ in tp1["ours"].named_parameters():
        for te in (False, True):
            assert from_mcore_name(to_mcore_name(name, transformer_engine=te)) == name
    assert to_mcore_name("layers.1.mlp_norm.weight", transformer_engine=True) == "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    assert from_mcore_name("decoder.layers.0.self_attention.linear_qkv._extra_state") is None
    with pytest.raises(KeyError, match="decoder.layers.0.mlp.router.weight: not a parameter of a GPTModel with the LEV"):
        from_mcore_name("decoder.layers.0.mlp.router.weight")
