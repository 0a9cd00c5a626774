"""The trainer's set-up pieces, in-process: flags over YAML, batch arithmetic, the DeepSpeed
config, weight-decay groups, the LR schedule, checkpoint bookkeeping, the FLOPs formula."""
import json
import math
import os

import pytest
import torch

from megatron_lev.checkpointing.catalog import (COMPLETE_MARKER, CONFIG_FILE, checkpoint_tag, find_latest,
                                                read_checkpoint_config)
from megatron_lev.checkpointing.save import prune_checkpoints
from megatron_lev.checkpointing.universal import layout_changes
from megatron_lev.training.arguments import effective_config, parse_args, validate_args
from megatron_lev.training.ds_config import build_deepspeed_config
from megatron_lev.training.flops import FlopsModel, peak_flops_per_device, training_flops
from megatron_lev.training.optim import param_groups, uses_weight_decay
from megatron_lev.training.validation import check_resume_compatible
from megatron_lev.utils.errors import ConfigError

DATA = ["--data-path", "/nonexistent/prefix", "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", "/nonexistent/spm.model"]


def args_for(*flags, world_size=2):
    return validate_args(parse_args(["--config", "tiny-lev", *DATA, *flags]), world_size)


def test_flags_win_over_yaml_over_defaults():
    args = args_for("--lr", "0.5", "--train-iters", "7", "--num-layers", "3")
    assert args.lr == 0.5  # flag
    assert args.weight_decay == 0.1 and args.micro_batch_size == 4  # tiny-lev.yaml training:
    assert args.adam_eps == 1e-8 and args.zero_stage is None  # built-in defaults
    assert args.train_iters == 7 and args.lr_decay_iters == 7
    assert args.model["num_layers"] == 3 and args.model["embedding"] == "lev"
    assert args.given_flags == sorted(["lr", "train_iters", "num_layers", "data_path", "tokenizer_type",
                                       "tokenizer_model"])
    # --train-tokens replaces the YAML's train_iters: ceil(tokens / (global batch x seq)).
    args = args_for("--train-tokens", "10000")
    assert args.tokens_per_step == 8 * 64 and args.train_iters == math.ceil(10000 / 512)
    cfg = effective_config(args)
    assert cfg["training"]["gradient_accumulation_steps"] == 1 and cfg["model"]["embedding"] == "lev"


def test_batch_arithmetic():
    args = args_for(world_size=2)
    assert (args.data_parallel_size, args.gradient_accumulation_steps) == (2, 1)
    args = args_for("--tensor-model-parallel-size", "2", world_size=2)
    assert (args.data_parallel_size, args.gradient_accumulation_steps) == (1, 2)
    with pytest.raises(ConfigError) as err:
        args_for("--global-batch-size", "12", world_size=2)
    assert str(err.value) == (
        "--global-batch-size 12 must be a multiple of --micro-batch-size 4 x data-parallel size 2 (= world 2 / "
        "(--tensor-model-parallel-size 1 x --pipeline-model-parallel-size 1)) = 8")
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size 4 x --pipeline-model-parallel-size 1 = 4 "
                                          r"does not divide the world size 2"):
        args_for("--tensor-model-parallel-size", "4", world_size=2)


def test_bad_yaml_training_key_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {embedding: lev}\ntraining: {micro_batch_sise: 4}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: training.micro_batch_sise is not a flag"):
        parse_args(["--config", str(path), *DATA])


def test_deepspeed_config_filled_from_flags_and_checked(tmp_path):
    args = args_for("--global-batch-size", "16", "--clip-grad", "0.5", "--bf16", "--zero-stage", "2")
    ds = build_deepspeed_config(args)
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 2 and ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": True} and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["zero_optimization"]["stage"] == 2 and args.deepspeed_config_path.endswith("zero2.json")
    for name in ("zero1", "zero3", "zero3_offload"):
        stage = build_deepspeed_config(args_for("--deepspeed-config", name))["zero_optimization"]["stage"]
        assert stage == (1 if name == "zero1" else 3)

    # PP > 1 needs ZeRO <= 1, and says why.
    with pytest.raises(ConfigError) as err:
        build_deepspeed_config(args_for("--pipeline-model-parallel-size", "2", "--zero-stage", "2",
                                        "--global-batch-size", "4"))
    assert "--pipeline-model-parallel-size 2 needs ZeRO stage <= 1, got stage 2" in str(err.value)
    assert "pipeline engine accumulates" in str(err.value)

    # An explicit JSON value must agree with the flag; optimizer sections and stage 0 are refused.
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_batch_size": 32, "zero_optimization": {"stage": 1}}))
    with pytest.raises(ConfigError, match=r"train_batch_size is 32 but --global-batch-size gives 8"):
        build_deepspeed_config(args_for("--deepspeed-config", str(bad)))
    bad.write_text(json.dumps({"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 1}}))
    with pytest.raises(ConfigError, match=r"remove the 'optimizer' section"):
        build_deepspeed_config(args_for("--deepspeed-config", str(bad)))
    bad.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    with pytest.raises(ConfigError, match=r"zero_optimization.stage 0 is not supported"):
        build_deepspeed_config(args_for("--deepspeed-config", str(bad)))
    bad.write_text("{\n  \"bf16\": oops\n}")
    with pytest.raises(ConfigError, match=r"ds.json:2: invalid JSON"):
        build_deepspeed_config(args_for("--deepspeed-config", str(bad)))


def test_weight_decay_groups_exclude_norms_biases_and_lev_codebooks_layernorm():
    from megatron_lev.lev.generator import LEVConfig, LEVGenerator

    model = torch.nn.Module()
    model.embedding = LEVGenerator(LEVConfig(vocab_size=100, hidden_size=8, seed_dim=4, num_heads=2, num_knots=4,
                                             num_modes=4))
    model.norm = torch.nn.LayerNorm(8)
    model.proj = torch.nn.Linear(8, 8)
    groups = param_groups(model, weight_decay=0.1)
    decayed = dict(zip(["decay", "no_decay"], groups))
    assert decayed["decay"]["weight_decay"] == 0.1 and decayed["no_decay"]["weight_decay"] == 0.0
    assert sorted(decayed["decay"]["param_names"]) == ["embedding.delta", "embedding.w_out", "embedding.w_seed",
                                                       "proj.weight"]
    assert sorted(decayed["no_decay"]["param_names"]) == ["embedding.codebooks", "embedding.ln_beta",
                                                          "embedding.ln_gamma", "norm.bias", "norm.weight",
                                                          "proj.bias"]
    # The same rule on the model's (and the pipeline form's) names.
    assert not uses_weight_decay("3.embedding.codebooks", torch.nn.Parameter(torch.ones(3, 4, 5)))
    assert uses_weight_decay("tied_modules.embedding.weight", torch.nn.Parameter(torch.ones(4, 5)))


def _schedule(*flags, world_size=1):
    from megatron_lev.training.optim import build_lr_scheduler

    args = args_for(*flags, world_size=world_size)
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "weight_decay": args.weight_decay},
              {"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    return args, opt, build_lr_scheduler(opt, args)


def _lrs(opt, sched, steps):
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step()  # as DeepSpeed does after an applied step: one global batch of samples
    return out


def test_lr_schedule_is_megatrons():
    """megatron-core's OptimizerParamScheduler in samples: warmup from --lr-warmup-init (step 0
    at 0), cosine to --min-lr, WSD, sample-based flags; weight decay stays off the no-decay group."""
    args, opt, sched = _schedule("--lr", "1.0", "--min-lr", "0.1", "--train-iters", "14", "--lr-warmup-iters", "4",
                                 "--lr-decay-style", "cosine", "--global-batch-size", "8")
    assert (args.lr_warmup_steps, args.lr_decay_steps) == (32, 112)  # samples: iterations x 8
    lrs = _lrs(opt, sched, 15)
    assert lrs[:5] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert lrs[9] == pytest.approx(0.55, abs=1e-12)  # halfway through decay: (max + min) / 2
    assert lrs[14] == pytest.approx(0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    # The same schedule from --train-samples / --lr-*-samples, and from --lr-warmup-fraction.
    _, opt2, sched2 = _schedule("--lr", "1.0", "--min-lr", "0.1", "--train-samples", "112", "--lr-warmup-samples",
                                "32", "--lr-decay-style", "cosine", "--global-batch-size", "8")
    assert _lrs(opt2, sched2, 15) == lrs
    _, opt3, sched3 = _schedule("--lr", "1.0", "--min-lr", "0.1", "--train-iters", "14", "--lr-warmup-fraction",
                                str(4 / 14), "--lr-decay-style", "cosine", "--global-batch-size", "8")
    assert _lrs(opt3, sched3, 15) == pytest.approx(lrs, abs=1e-12)
    # WSD: constant, then the last 4 iterations decay linearly to min-lr.
    _, opt4, sched4 = _schedule("--lr", "1.0", "--min-lr", "0.0", "--train-iters", "10", "--lr-warmup-iters", "0",
                                "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear", "--lr-wsd-decay-iters",
                                "4", "--global-batch-size", "8")
    assert _lrs(opt4, sched4, 11) == pytest.approx([1, 1, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0])
    # Weight decay rising linearly from --start- to --end-weight-decay over the run.
    _, opt5, sched5 = _schedule("--lr", "1.0", "--train-iters", "4", "--lr-warmup-iters", "0", "--start-weight-decay",
                                "0.0", "--end-weight-decay", "0.2", "--weight-decay-incr-style", "linear")
    wds = []
    for _ in range(5):
        wds += [g["weight_decay"] for g in opt5.param_groups]
        sched5.step()
    assert wds == pytest.approx([0, 0, 0.05, 0, 0.1, 0, 0.15, 0, 0.2, 0])
    # Its state round-trips into a fresh scheduler (DeepSpeed checkpoints it).
    _, fresh_opt, fresh = _schedule("--lr", "1.0", "--min-lr", "0.1", "--train-iters", "14", "--lr-warmup-iters", "4",
                                    "--lr-decay-style", "cosine", "--global-batch-size", "8")
    fresh.load_state_dict(sched.state_dict())
    assert fresh.num_steps == 15 * 8 and fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    with pytest.raises(ConfigError, match="--lr-warmup-fraction and --lr-warmup-iters"):
        args_for("--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3")
    with pytest.raises(ConfigError, match="--lr-decay-style WSD needs --lr-wsd-decay-iters"):
        args_for("--lr-decay-style", "WSD")
    with pytest.raises(ConfigError, match="--lr-warmup-iters cannot be used with --train-samples"):
        args_for("--train-samples", "800", "--lr-warmup-iters", "3")


def test_resume_with_another_schedule_is_refused_unless_told():
    """Megatron's rule: a changed schedule on resume needs --override-opt_param-scheduler or
    --use-checkpoint-opt_param-scheduler; the checkpoint's or the flags' values then win."""
    from megatron_lev.training.validation import check_resume_schedule

    old = args_for("--train-iters", "20")
    saved = effective_config(old)
    new = args_for("--train-iters", "40", "--load", "/ckpt")
    with pytest.raises(ConfigError, match=r"LR schedule differs.*lr_decay_steps 160 -> 320.*--override-opt_param"):
        check_resume_schedule(new, saved, effective_config(new))
    check_resume_schedule(args_for("--train-iters", "20", "--load", "/ckpt"), saved, saved)  # same schedule: fine
    _, old_opt, old_sched = _schedule("--train-iters", "20")
    for _ in range(5):
        old_sched.step()
    for flag, decay_steps in (("--use-checkpoint-opt_param-scheduler", 160), ("--override-opt_param-scheduler", 320)):
        args, opt, sched = _schedule("--train-iters", "40", "--load", "/ckpt", flag)
        check_resume_schedule(args, saved, effective_config(args))
        sched.load_state_dict(old_sched.state_dict())
        assert sched.lr_decay_steps == decay_steps and sched.num_steps == 5 * 8


def test_recompute_flags_reach_the_model():
    """--recompute-activations is Megatron's selective recompute; granularity/method/num-layers
    reach the model's full (uniform/block) recompute."""
    from megatron_lev.training.validation import build_model_config

    cfg = build_model_config(args_for("--recompute-activations"))
    assert (cfg.recompute_granularity, cfg.recompute_modules) == ("selective", ["core_attn"])
    cfg = build_model_config(args_for("--recompute-granularity", "full", "--recompute-method", "block",
                                      "--recompute-num-layers", "1"))
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "block", 1)
    assert build_model_config(args_for()).recompute_granularity is None
    with pytest.raises(ConfigError, match="--recompute-granularity full needs --recompute-method"):
        args_for("--recompute-granularity", "full")


def _fake_checkpoint(root, iteration, complete=True, config=None):
    tag = checkpoint_tag(iteration)
    os.makedirs(root / tag / "rng", exist_ok=True)
    (root / tag / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    if config is not None:
        (root / tag / CONFIG_FILE).write_text(json.dumps(config))
    if complete:
        (root / tag / COMPLETE_MARKER).write_text("{}")
    return tag


def test_latest_never_picks_a_half_written_checkpoint_and_pruning(tmp_path):
    assert find_latest(str(tmp_path / "missing")) is None  # --load of nothing: fresh start
    assert find_latest(str(tmp_path)) is None
    for it in (2, 4, 6):
        _fake_checkpoint(tmp_path, it)
    (tmp_path / "latest").write_text("iter_0000006")
    _fake_checkpoint(tmp_path, 8, complete=False)  # killed mid-save
    assert find_latest(str(tmp_path)) == "iter_0000006"
    (tmp_path / "latest").write_text("iter_0000008")  # even if `latest` names it
    with pytest.warns(UserWarning, match="not a complete checkpoint"):
        assert find_latest(str(tmp_path)) == "iter_0000006"
    (tmp_path / "latest").unlink()  # died between the marker and `latest`
    assert find_latest(str(tmp_path)) == "iter_0000006"

    _fake_checkpoint(tmp_path, 1, complete=False)  # debris older than the newest complete one
    deleted = prune_checkpoints(str(tmp_path), keep_last=2)
    assert sorted(deleted) == ["iter_0000001", "iter_0000002"]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004", "iter_0000006", "iter_0000008"]


def test_resume_refuses_a_different_model_naming_the_fields(tmp_path):
    saved = {"model": {"embedding": "lev", "hidden_size": 64, "num_layers": 2, "init_seed": 1},
             "training": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}}
    tag = _fake_checkpoint(tmp_path, 3, config=saved)
    same = json.loads(json.dumps(saved))
    same["model"]["init_seed"] = 5  # only matters before step 1
    written = read_checkpoint_config(str(tmp_path), tag)
    check_resume_compatible(str(tmp_path), tag, written, same)
    other = json.loads(json.dumps(saved))
    other["model"].update(embedding="tied", hidden_size=128)
    other["training"]["tensor_model_parallel_size"] = 2
    with pytest.raises(ConfigError) as err:
        check_resume_compatible(str(tmp_path), tag, written, other)
    assert str(err.value) == (
        f"--load {tmp_path}: checkpoint iter_0000003 was saved with a different model config (embedding: 'lev' in "
        "the checkpoint, 'tied' now; hidden_size: 64 in the checkpoint, 128 now); resume with the checkpoint's "
        "settings or use a new --save directory")
    # Another parallel layout is not refused: it resumes through a universal checkpoint (tests/test_bf16.py).
    assert layout_changes(written, other) == ["tensor_model_parallel_size: 1 -> 2"]
    assert layout_changes(written, same) == []


def test_flops_formula():
    m = FlopsModel(num_layers=2, hidden_size=8, ffn_hidden_size=16, kv_width=4, padded_vocab_size=32,
                   seq_length=10, lev_heads=2, lev_seed_dim=3, lev_knots=4, lev_modes=5)
    # per layer: qkv 8*(8+2*4)=128, out 64, mlp 3*8*16=384 -> 576; 2 layers + head 8*32=256 -> 1408
    assert m.matmul_params == 1408
    assert m.transformer_flops_per_token() == 6 * 1408 + 12 * 2 * 8 * 10
    assert m.lev_flops_per_distinct_token() == 3 * 2 * (2 * 9 + 2 * 3 * 4 * 5 + 2 * 5 * 8)
    assert training_flops(m, tokens=100, distinct_tokens=7) == 100 * (6 * 1408 + 1920) + 7 * 3 * 2 * 218
    table = FlopsModel(2, 8, 16, 4, 32, 10)
    assert table.lev_flops_per_distinct_token() == 0
    assert peak_flops_per_device("h100", None) == 989e12 and peak_flops_per_device("a100", 100.0) == 100e12
    assert peak_flops_per_device(None, None) is None


def test_vocab_size_follows_the_tokenizer_unless_pinned(tmp_path):
    """Issue 25: as Megatron-LM, the tokenizer gives the vocabulary, padded to a multiple of
    --make-vocab-size-divisible-by x TP; a packaged config's vocab_size (tiny-lev: 1000) is only a
    default, a user's YAML that sets it keeps it, and one smaller than the tokenizer is refused."""
    from megatron_lev.training.tokenizer_args import derive_vocab_size
    from megatron_lev.training.validation import build_model_config

    args = args_for("--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "128")
    assert args.vocab_size_source is None and args.model["vocab_size"] == 1000  # tiny-lev.yaml's default
    assert derive_vocab_size(args, 4000) == 4096
    config = build_model_config(args)
    assert (config.vocab_size, config.padded_vocab_size) == (4000, 4096)  # multiple of 128 x 2
    # Resuming: the checkpoint's vocabulary stays when the tokenizer fits (a run saved while
    # lev-125m's 50304 pinned it); a larger tokenizer wins (the resume check then refuses the change).
    args = args_for()
    assert derive_vocab_size(args, 50277, checkpoint_vocab_size=50304) == 50304 and args.model["vocab_size"] == 50304
    assert derive_vocab_size(args, 4000, checkpoint_vocab_size=1000) == 4096 and args.model["vocab_size"] == 4000
    unpinned = tmp_path / "unpinned.yaml"
    unpinned.write_text("base: tiny-lev\nmodel:\n  vocab_size: null\n")
    args = validate_args(parse_args(["--config", str(unpinned), *DATA]), 1)
    assert args.vocab_size_source is None and derive_vocab_size(args, 8000) == 8064  # multiple of 128
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text("base: tiny-lev\nmodel:\n  vocab_size: 50304\n")
    child = tmp_path / "child.yaml"  # a user's file that inherits the pin
    child.write_text("base: pinned.yaml\nmodel:\n  num_layers: 1\n")
    for path, source in ((pinned, pinned), (child, pinned)):
        args = validate_args(parse_args(["--config", str(path), *DATA]), 1)
        assert args.vocab_size_source == str(source)
        assert derive_vocab_size(args, 50277) == 50304 and build_model_config(args).vocab_size == 50304
    small = tmp_path / "small.yaml"
    small.write_text("base: tiny-lev\nmodel:\n  vocab_size: 500\n")
    with pytest.raises(ConfigError) as err:
        derive_vocab_size(validate_args(parse_args(["--config", str(small), *DATA]), 1), 1000)
    assert str(err.value) == (f"{small}: model.vocab_size 500 is smaller than the 1000 tokens of --tokenizer-model "
                              "/nonexistent/spm.model: remove vocab_size (the tokenizer sets it) or raise it")


@pytest.mark.parametrize("vocab_size, divisible_by, tp, padded", [
    # Megatron-LM core_v0.16.1's _vocab_size_with_padding (megatron/training/tokenizer/tokenizer.py), run on
    # these inputs: GPT-2 (50257), GPT-NeoX (50277), 4k and a size already a multiple.
    (50257, 128, 1, 50304), (50257, 128, 2, 50432), (50277, 128, 1, 50304), (50277, 128, 2, 50432),
    (4000, 128, 1, 4096), (4000, 128, 2, 4096), (4100, 128, 1, 4224), (4100, 128, 2, 4352),
    (1000, 64, 2, 1024), (4096, 128, 2, 4096), (3000, 1, 1, 3000), (3001, 1, 2, 3002),
])
def test_vocab_padding_is_megatrons(vocab_size, divisible_by, tp, padded):
    from megatron_lev.models.config import pad_vocab_size
    from megatron_lev.training.tokenizer_args import padded_vocab_line

    assert pad_vocab_size(vocab_size, divisible_by, tp) == padded
    assert padded_vocab_line(vocab_size, padded) == (f" > padded vocab (size: {vocab_size}) with "
                                                     f"{padded - vocab_size} dummy tokens (new size: {padded})")


def test_validation_runs_every_check_without_a_process_group(tmp_path, tiny_dataset, spm_tokenizer, capsys):
    """`python -m megatron_lev.training.validation` (what a dry run calls) runs the trainer's own
    start-up checks in this process: a good run prints its summary and exits 0; the first
    problem, wherever it lies (flag, data, checkpoint), is the trainer's one-line error and 2."""
    import torch.distributed as dist

    from megatron_lev.training.validation import main

    good = ["--config", "tiny-lev", "--data-path", tiny_dataset, "--split", "90,5,5", "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", spm_tokenizer, "--train-iters", "4",
            "--save", str(tmp_path / "run")]
    assert main(["--world-size", "2", *good]) == 0
    out = capsys.readouterr().out
    # Megatron's padding line first (tokenizer: 1000 tokens), then the summary.
    assert out.startswith(" > padded vocab (size: 1000) with 24 dummy tokens (new size: 1024)\nconfig ")
    assert "TP 1 x PP 1 x DP 2" in out
    assert not dist.is_initialized()
    assert main(["--world-size", "3", *good]) == 2  # global batch 8 does not split over 3 ranks
    assert capsys.readouterr().err.splitlines() == [
        "megatron_lev.train: error: --global-batch-size 8 must be a multiple of --micro-batch-size 4 x "
        "data-parallel size 3 (= world 3 / (--tensor-model-parallel-size 1 x --pipeline-model-parallel-size 1)) = 12"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert main(["--world-size", "2", *good]) == 2  # another run's folder, without --load
    assert capsys.readouterr().err.startswith(f"megatron_lev.train: error: --save {tmp_path / 'run'}: the folder "
                                              "is not empty (metrics.jsonl)")


def test_a_deepspeed_with_the_overlap_comm_races_is_refused_for_zero_1_and_2(tmp_path, tiny_dataset, spm_tokenizer,
                                                                           capsys, monkeypatch):
    """Issue 22: ZeRO-1/2 + overlap_comm (the Slurm default: zero2.json) on a DeepSpeed older than
    0.19.3 (PR #8080) is refused at start-up in one line: the version, the fix, the workaround."""
    import importlib.metadata

    from megatron_lev.training.validation import DEEPSPEED_OVERLAP_COMM_FIXED, main

    from packaging.version import Version

    real_version = importlib.metadata.version
    assert Version(real_version("deepspeed")) >= Version(DEEPSPEED_OVERLAP_COMM_FIXED)  # this venv's passes
    installed = {"deepspeed": "0.18.4"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed.get(name) or real_version(name))
    good = ["--config", "tiny-lev", "--data-path", tiny_dataset, "--split", "90,5,5", "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", spm_tokenizer, "--train-iters", "4"]
    zero2_args = args_for("--zero-stage", "2")
    build_deepspeed_config(zero2_args)
    zero2 = zero2_args.deepspeed_config_path
    assert main(["--world-size", "2", *good, "--zero-stage", "2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "megatron_lev.train: error: DeepSpeed 0.18.4 with ZeRO stage 2 and overlap_comm can corrupt gradients "
        "(races in its gradient buckets, deepspeedai/DeepSpeed#7188 and #8061, fixed in 0.19.3 by PR #8080): "
        f"install deepspeed>=0.19.3, or set \"overlap_comm\": false in {zero2} (--deepspeed-config)"]
    assert main(["--world-size", "2", *good, "--zero-stage", "1"]) == 2  # zero1.json overlaps too
    assert "with ZeRO stage 1 and overlap_comm" in capsys.readouterr().err
    # The workaround, ZeRO-3, and a fixed DeepSpeed all start.
    no_overlap = tmp_path / "zero2_no_overlap.json"
    no_overlap.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": False}}))
    assert main(["--world-size", "2", *good, "--deepspeed-config", str(no_overlap)]) == 0
    assert main(["--world-size", "2", *good, "--zero-stage", "3"]) == 0
    installed["deepspeed"] = DEEPSPEED_OVERLAP_COMM_FIXED
    assert main(["--world-size", "2", *good, "--zero-stage", "2"]) == 0


def test_third_party_chatter_is_debug_output(capsys, caplog):
    """DeepSpeed's print()s around engine building go to the debug log (shown with --logging-level
    10, and on stderr when the block fails); megatron-core's warnings that do not apply are
    filtered for megatron.core's modules only."""
    import logging
    import warnings

    from megatron_lev.utils.run_log import NOISY_MEGATRON_CORE_WARNINGS, StartupTimer, configure_logging, quiet_prints

    with caplog.at_level(logging.DEBUG, logger="megatron_lev"):
        with quiet_prints(None, "deepspeed.initialize"):
            print("MA 0.53 GB         Max_MA 0.53 GB")
    assert capsys.readouterr().out == ""
    assert caplog.messages == ["deepspeed.initialize: MA 0.53 GB         Max_MA 0.53 GB"]
    with quiet_prints(10, "deepspeed.initialize"):
        print("begin bf16_optimizer")
    assert capsys.readouterr().out == "begin bf16_optimizer\n"
    with pytest.raises(RuntimeError, match="boom"), quiet_prints(None, "deepspeed.initialize"):
        print("what led to it")
        raise RuntimeError("boom")
    assert capsys.readouterr() == ("", "what led to it\n")

    message = NOISY_MEGATRON_CORE_WARNINGS[0] + " to 1 for maximum speedup"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        configure_logging(None)
        for module in ("megatron.core.tensor_parallel.layers", "megatron_lev.models.layers"):
            warnings.warn_explicit(message, UserWarning, "layers.py", 738, module=module)
    assert [w.filename for w in caught] == ["layers.py"] and len(caught) == 1  # only the non-megatron.core one

    # DeepSpeed's memory reports (a gc.collect() and three printed lines each) are skipped while
    # the engine is built, and only then.
    from deepspeed.runtime import bf16_optimizer, utils as ds_utils

    from megatron_lev.utils.run_log import quiet_deepspeed

    original = ds_utils.see_memory_usage
    with caplog.at_level(logging.DEBUG, logger="megatron_lev"), quiet_deepspeed(None):
        assert bf16_optimizer.see_memory_usage is not original
        bf16_optimizer.see_memory_usage("begin bf16_optimizer", force=True)
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
    assert bf16_optimizer.see_memory_usage is original and capsys.readouterr() == ("", "")
    assert caplog.messages[-2:] == ["deepspeed memory report skipped: begin bf16_optimizer",
                                    "deepspeed.initialize: DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built "
                                    "successfully"]
    with quiet_deepspeed(10):
        assert bf16_optimizer.see_memory_usage is original

    # The engine is built without DeepSpeed's CPU shared-memory all-reduce for inference (a g++
    # build at start-up; training never calls it).
    import importlib

    from megatron_lev.training.engine import without_inference_comm_op

    ds_comm = importlib.import_module("deepspeed.comm.torch")
    build = ds_comm.build_shm_op
    with without_inference_comm_op():
        assert ds_comm.build_shm_op() is None
    assert ds_comm.build_shm_op is build

    timer = StartupTimer(start=0.0)
    timer.last = 0.0
    timer.phases = [("imports", 4.25), ("validation", 0.5)]
    timer.last = 4.75
    assert timer.line() == " > start-up (seconds): imports 4.25, validation 0.50; 4.8 in all before the first step"
