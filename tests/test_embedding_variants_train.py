"""The issue-42 input sides trained end to end on CPU (gloo, 2 ranks, tiny configs, the
tiny_dataset fixture; tests/test_train.py's harness): the frozen random input table
(`tiny-untied --freeze-input-embedding`) and the factorised one (`--embedding factorized
--embedding-rank 16`). Runs resume bit for bit, every parallel layout (DP=2 under ZeRO-1/2/3,
TP=2, PP=2) gives the same losses, the frozen table in every checkpoint is bit-identical to its
initialisation while the factorised table and projection train, and `python -m
megatron_lev.evaluate` scores the checkpoints (and their Hugging Face exports) with the run's
own validation loss.

All 2-rank runs share one launch; each stops after 3 or 6 of a 30-step schedule.
"""
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_train import LOSS_ATOL, read_metrics, train_flags, train_records

RANK = 16
VARIANTS = {"frozen": ("--config", "tiny-untied", "--freeze-input-embedding"),
            "fact": ("--config", "tiny-untied", "--embedding", "factorized", "--embedding-rank", str(RANK))}
LAYOUT_FLAGS = {"z2": ("--zero-stage", "2"), "z3": ("--zero-stage", "3"), "tp2": ("--tensor-model-parallel-size", "2"),
                "pp2": ("--pipeline-model-parallel-size", "2")}
# Per variant: full = 6 steps (DP=2, ZeRO-1); resume = 3 steps, stop, --load, 3 more; layouts = 3 steps.
SAVE = ("--save-interval", "3", "--eval-interval", "3")
RUNS = {}
for _v, _flags in VARIANTS.items():
    RUNS.update({f"{_v}_full": (*_flags, "--zero-stage", "1", "--exit-interval", "6"),
                 f"{_v}_a": (*_flags, "--zero-stage", "1", "--exit-interval", "3"),
                 f"{_v}_b": (*_flags, "--zero-stage", "1", "--exit-interval", "6")})
    RUNS.update({f"{_v}_{layout}": (*_flags, *flags, "--exit-interval", "3") for layout, flags in LAYOUT_FLAGS.items()})
RESUMED = {f"{v}_a": f"{v}_b" for v in VARIANTS}  # first half -> second half (one --save directory)
LAYOUTS = {f"{v}_full": tuple(f"{v}_{layout}" for layout in LAYOUT_FLAGS) for v in VARIANTS}


def _save_dir(work: str, run: str) -> str:
    first = next((a for a, b in RESUMED.items() if b == run), run)
    return os.path.join(work, "ckpt", first)


def _train(rank, world_size, runs):
    from megatron_lev.train import main

    return [main(argv) for argv in runs]


@pytest.fixture(scope="module")
def runs(tiny_dataset, spm_tokenizer, tmp_path_factory) -> str:
    """Every 2-rank run of this file, in one launch. Returns the work directory."""
    work = str(tmp_path_factory.mktemp("variants"))
    argvs = []
    for name, flags in RUNS.items():
        load = ("--load", _save_dir(work, name)) if name in RESUMED.values() else ()
        argvs.append(train_flags(tiny_dataset, spm_tokenizer, work, name, *flags, *SAVE,
                                 "--save", _save_dir(work, name), *load))
    codes = run_distributed(_train, world_size=2, args=(argvs,), timeout=1500)
    assert codes[0] == codes[1] == [0] * len(RUNS), dict(zip(RUNS, codes[0]))
    return work


def test_resume_is_exact(runs):
    """3 steps, stop, --load, 3 more == 6 uninterrupted steps: losses, grad norms, learning rates
    and the validation loss, bit for bit."""
    for first, second in RESUMED.items():
        full = train_records(runs, first.replace("_a", "_full"))
        a, b = train_records(runs, first), train_records(runs, second)
        assert sorted(a) == [1, 2, 3] and sorted(b) == [4, 5, 6] and sorted(full) == list(range(1, 7))
        resumed = {**a, **b}
        for key in ("loss", "grad_norm", "lr"):
            assert [resumed[i][key] for i in full] == [full[i][key] for i in full], (first, key)
        valid = [r["valid_loss"] for r in read_metrics(runs, second) if "valid_loss" in r]
        assert valid == [r["valid_loss"] for r in read_metrics(runs, first.replace("_a", "_full"))
                         if r.get("iteration") == 6 and "valid_loss" in r], first


def test_parallel_layouts_give_the_same_losses(runs):
    """ZeRO-2, ZeRO-3 and TP=2 / PP=2 (DP=1) give the losses and grad norms of DP=2 under ZeRO-1
    (the same global batch and seed)."""
    for reference, layouts in LAYOUTS.items():
        ref = train_records(runs, reference)
        for name in layouts:
            got = train_records(runs, name)
            assert sorted(got) == [1, 2, 3], name
            for it in (1, 2, 3):
                assert got[it]["loss"] == pytest.approx(ref[it]["loss"], abs=LOSS_ATOL, rel=0), (name, it)
                assert got[it]["grad_norm"] == pytest.approx(ref[it]["grad_norm"], rel=1e-5), (name, it)
        assert ref[6]["loss"] < ref[1]["loss"]


def _initial_weights(rank, world_size, load_dir: str) -> dict:
    """The weights a TP=1 model of the checkpoint's config is initialised with (same seed)."""
    from megatron_lev.checkpointing.convert import find_checkpoint
    from megatron_lev.distributed.state import initialize_model_parallel
    from megatron_lev.models.decoder import LeviathanModel

    initialize_model_parallel(1, 1)
    config = find_checkpoint(load_dir).model_config()
    return {n: p.detach()[:config.vocab_size].clone() if n in ("embedding.weight", "output_layer.weight")
            else p.detach().clone() for n, p in LeviathanModel(config).named_parameters()}


def test_frozen_table_in_every_checkpoint_is_its_initialisation(runs):
    """Read back from each layout's last checkpoint (TP shards, pipeline stages and ZeRO-3
    partitions merged): the table is bit-identical to a fresh model's from the same seed, the
    head is not (it trained); the config records the option."""
    from megatron_lev.checkpointing.convert import load_checkpoint_full

    init = run_distributed(_initial_weights, world_size=1, args=(_save_dir(runs, "frozen_full"),))[0]
    for name in ("frozen_full", *LAYOUTS["frozen_full"]):
        full, info = load_checkpoint_full(_save_dir(runs, name))
        assert info.iteration == (6 if name == "frozen_full" else 3), name
        assert info.model_section["freeze_input_embedding"] is True
        assert torch.equal(full["embedding.weight"], init["embedding.weight"]), name
        assert not torch.equal(full["output_layer.weight"], init["output_layer.weight"]), name


def test_factorized_checkpoints_hold_the_trained_table_and_projection(runs):
    """Each layout's checkpoint reads back (the V x r table merged over TP and unpadded, the
    projection identical on both TP ranks, as a replicated parameter must be) as the factorised
    model of the config; both matrices moved from their initialisation."""
    from megatron_lev.checkpointing.convert import load_checkpoint_full

    init = run_distributed(_initial_weights, world_size=1, args=(_save_dir(runs, "fact_full"),))[0]
    assert init["embedding.weight"].shape == (1000, RANK) and init["embedding.projection.weight"].shape == (64, RANK)
    for name in ("fact_full", *LAYOUTS["fact_full"]):
        full, info = load_checkpoint_full(_save_dir(runs, name))
        assert (info.model_section["embedding"], info.model_section["embedding_rank"]) == ("factorized", RANK)
        assert full.keys() == init.keys(), name
        for key in ("embedding.weight", "embedding.projection.weight", "output_layer.weight"):
            assert full[key].shape == init[key].shape and not torch.equal(full[key], init[key]), (name, key)


def test_evaluate_and_hugging_face_export(runs, tmp_path):
    """megatron_lev.evaluate scores each variant's checkpoint with its own validation loss (the same
    first 8 x 64 validation tokens), and its Hugging Face export, an untied LlamaForCausalLM (the
    factorised one materialised: table x projection), with the same perplexity. The factorised
    checkpoint without --materialize-embeddings is refused before anything is written."""
    import json

    from megatron_lev import evaluate
    from megatron_lev.hf.export import export_checkpoint
    from megatron_lev.utils.errors import ExportError

    saves = {v: _save_dir(runs, f"{v}_full") for v in VARIANTS}
    with pytest.raises(ExportError, match=r"^embedding: factorized: no transformers architecture has a factorised "
                                          r"input side .* export with --materialize-embeddings"):
        export_checkpoint(saves["fact"], str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()
    models = []
    for variant, save in saves.items():
        hf = export_checkpoint(save, str(tmp_path / f"hf_{variant}"), dtype="fp32", materialize=variant == "fact")
        with open(os.path.join(hf, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
        section = config["megatron_lev_model"]
        assert (section["embedding"], section["embedding_rank"]) == ("untied", None)
        assert section["freeze_input_embedding"] is (variant == "frozen")
        models += ["--model", f"{variant}={save}", "--model", f"{variant}_hf={hf}"]
    result = evaluate.main([*models, "--eval-tokens", str(8 * 64), "--device", "cpu",
                            "--output-dir", str(tmp_path / "eval")])
    for variant in VARIANTS:
        (valid,) = [r["valid_loss"] for r in read_metrics(runs, f"{variant}_full") if r.get("iteration") == 6
                    and "valid_loss" in r]
        scored = result["models"][variant]
        assert scored["embedding"] == ("untied" if variant == "frozen" else "factorized")
        assert scored["iteration"] == 6 and scored["tokens"] == 8 * 64
        assert scored["loss"] == pytest.approx(valid, abs=1e-5), variant
        assert result["models"][f"{variant}_hf"]["ppl"] == pytest.approx(scored["ppl"], rel=1e-4), variant
