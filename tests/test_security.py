"""Files from other people cannot run code (docs/security.md).

A hostile checkpoint file is a real `torch.save` file whose pickle calls `os.system` to write
a marker file; a hostile Hugging Face folder is a genuine LEV export whose modeling_lev.py
writes a marker when imported. Each test shows the file is hostile (the marker appears when
it is loaded the unsafe way) and that our entry points refuse it in one line naming the
file, with no marker. One 2-rank launch trains the checkpoint (3 steps, DP=2 ZeRO-1) and
tries `--load` of its hostile copy.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.fixtures import assert_release_modes

SEQ = 64


class _Hostile:
    """Unpickling calls os.system(echo > marker)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"echo pwned > {shlex.quote(self.marker)}",)


def write_hostile_checkpoint_file(path: str, marker: str) -> None:
    """A torch.save file shaped like DeepSpeed's (a dict with 'module'), with a hostile pickle.
    In a checkpoint folder, complete.json's size list is updated too (an attacker ships both)."""
    torch.save({"module": _Hostile(marker), "iteration": 1}, path)
    from megatron_lev.checkpointing.catalog import COMPLETE_MARKER

    complete = os.path.join(os.path.dirname(path), COMPLETE_MARKER)
    if os.path.isfile(complete):
        with open(complete, encoding="utf-8") as f:
            record = json.load(f)
        if "files" in record:
            record["files"][os.path.basename(path)] = os.path.getsize(path)
            with open(complete, "w", encoding="utf-8") as f:
                json.dump(record, f)


def _train_flags(dataset: str, tokenizer: str, *extra: str) -> list[str]:
    return ["--config", "tiny-lev", "--zero-stage", "1", "--data-path", dataset, "--split", "90,5,5",
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tokenizer, "--train-iters", "6",
            "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "1", *extra]


def _train_then_load_hostile(rank, world_size, train_argv, load_argv, save, hostile, marker):
    """Rank body: train and save; rank 0 copies the checkpoint and plants the hostile file in
    the share of files rank 1 checks; every rank then runs `--load` of the copy."""
    import torch.distributed as dist

    from megatron_lev.checkpointing.catalog import find_latest
    from megatron_lev.checkpointing.safe_load import checkpoint_files
    from megatron_lev.train import main

    trained = main(train_argv)  # keeps the process group it found (tests/distributed.py's)
    planted = None
    if rank == 0:
        shutil.copytree(save, hostile)
        tag_dir = os.path.join(hostile, find_latest(hostile))
        # rank 1's share in check_checkpoint_files: only rank 1 can see the hostile file,
        # so rank 0 can only report it if the check is collective.
        planted = next(p for p in checkpoint_files(tag_dir)[1::2] if p.endswith("_optim_states.pt"))
        write_hostile_checkpoint_file(planted, marker)
    dist.barrier()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        loaded = main(load_argv)
    return {"trained": trained, "loaded": loaded, "stderr": err.getvalue(), "planted": planted}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dataset, spm_tokenizer) -> dict:
    root = tmp_path_factory.mktemp("security")
    save, hostile, marker = str(root / "run"), str(root / "hostile_run"), str(root / "load_marker")
    train_argv = _train_flags(tiny_dataset, spm_tokenizer, "--save", save, "--exit-interval", "3")
    load_argv = _train_flags(tiny_dataset, spm_tokenizer, "--load", hostile)
    out = run_distributed(_train_then_load_hostile, world_size=2,
                          args=(train_argv, load_argv, save, hostile, marker), timeout=600)
    return {"save": save, "marker": marker, "ranks": out}


# --------------------------------------------------------------------------- checkpoints


def test_hostile_pickle_is_refused_and_our_files_load(runs, tmp_path):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from megatron_lev.checkpointing.safe_load import (UnsafeCheckpointError, check_checkpoint_files, safe_torch_load,
                                                      use_safe_checkpoint_engine)

    path, marker = str(tmp_path / "mp_rank_00_model_states.pt"), str(tmp_path / "marker")
    write_hostile_checkpoint_file(path, marker)
    with pytest.raises(UnsafeCheckpointError) as refused:
        safe_torch_load(path)
    assert str(refused.value).startswith(f"{path}: refused: loading it would call posix.system")
    assert "\n" not in str(refused.value)
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        check_checkpoint_files(str(tmp_path))
    # DeepSpeed's own loader, made safe (its default loads with weights_only=False).
    engine = type("Engine", (), {})()
    engine.checkpoint_engine = TorchCheckpointEngine()
    use_safe_checkpoint_engine(engine)
    with pytest.raises(UnsafeCheckpointError):
        engine.checkpoint_engine.load(path, map_location="cpu")
    assert not os.path.exists(marker)
    torch.load(path, weights_only=False)  # the unsafe way: the file really is hostile
    assert os.path.exists(marker)

    # Our own files load, with the values the unsafe loader gives: the RNG file (numpy's
    # MT19937 key) and DeepSpeed's model and optimizer files.
    tag_dir = os.path.join(runs["save"], "iter_0000003")
    rng_path = os.path.join(tag_dir, "rng", "rank_00001.pt")
    safe, unsafe = safe_torch_load(rng_path), torch.load(rng_path, weights_only=False)
    assert safe["numpy"][0] == "MT19937" and safe["numpy"][1].dtype == np.uint32
    np.testing.assert_array_equal(safe["numpy"][1], unsafe["numpy"][1])
    assert safe["python"] == unsafe["python"] and torch.equal(safe["torch"], unsafe["torch"])
    model = safe_torch_load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    unsafe = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), weights_only=False)
    assert model["module"].keys() == unsafe["module"].keys()
    assert all(torch.equal(model["module"][k], unsafe["module"][k]) for k in model["module"] if model["module"][k] is not None)
    check_checkpoint_files(tag_dir)  # every file of every kind


def test_our_loads_leave_the_process_allow_list_as_they_found_it(tmp_path):
    """megatron-core allows argparse.Namespace, numpy's arrays and more for the whole process when
    imported (its dist_checkpointing.load reads common.pt with torch's default weights_only=True).
    Our safe loads allow their types for the load only, and must not take those away after it."""
    import argparse
    import signal

    import megatron.core  # noqa: F401  registers its safe globals

    from megatron_lev.checkpointing.mcore import read_saved_args
    from megatron_lev.checkpointing.safe_load import safe_torch_load

    before = set(torch.serialization.get_safe_globals())
    assert {argparse.Namespace, np.ndarray, np.dtype, signal.Signals} <= before
    path = tmp_path / "rng.pt"
    torch.save({"numpy": np.random.get_state()}, path)
    assert safe_torch_load(str(path))["numpy"][0] == "MT19937"
    iter_dir = tmp_path / "iter_0000001"
    iter_dir.mkdir()
    torch.save({"args": argparse.Namespace(hidden_size=64, exit_signal=signal.SIGTERM)}, iter_dir / "common.pt")
    (iter_dir / ".metadata").write_bytes(b"")
    (iter_dir / "metadata.json").write_text("{}")
    assert read_saved_args(str(iter_dir)).hidden_size == 64
    assert set(torch.serialization.get_safe_globals()) == before
    # megatron-core's dist_checkpointing reads common.pt so (strategies/common.py): still works after ours.
    assert torch.load(iter_dir / "common.pt", map_location="cpu")["args"].hidden_size == 64


def test_train_load_refuses_hostile_checkpoint(runs):
    rank0, rank1 = runs["ranks"]
    assert (rank0["trained"], rank1["trained"]) == (0, 0)
    assert (rank0["loaded"], rank1["loaded"]) == (2, 2)  # every rank stops, none waits in DeepSpeed
    # (stderr also holds library warnings; the error is one line)
    lines = [line for line in rank0["stderr"].splitlines() if "error" in line]
    assert lines == [f"megatron_lev.train: error: {rank0['planted']}: refused: loading it would call posix.system, "
                     "which is not a type our checkpoints hold (torch.load weights_only); it may be hostile or "
                     "not written by megatron_lev (docs/security.md)"]
    assert "error" not in rank1["stderr"]  # rank 0 speaks for the job
    assert not os.path.exists(runs["marker"])


def _hostile_copy(save: str, dst: str, marker: str) -> str:
    shutil.copytree(save, dst)
    planted = os.path.join(dst, "iter_0000003", "mp_rank_00_model_states.pt")
    write_hostile_checkpoint_file(planted, marker)
    return planted


def test_convert_and_evaluate_refuse_hostile_checkpoint(runs, tmp_path, capsys):
    from megatron_lev import evaluate
    from megatron_lev.hf.cli import convert_to_hf_main

    marker = str(tmp_path / "marker")
    planted = _hostile_copy(runs["save"], str(tmp_path / "ckpt"), marker)
    assert convert_to_hf_main(["--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]  # after any progress bar
    assert err.startswith(f"convert_to_hf: error: {planted}: refused: loading it would call posix.system")
    assert not os.path.exists(tmp_path / "hf")
    with pytest.raises(SystemExit) as exited:
        evaluate.main(["--model", f"x={tmp_path / 'ckpt'}", "--eval-tokens", "64", "--device", "cpu",
                       "--output-dir", str(tmp_path / "eval")])
    assert str(exited.value.code).startswith(f"megatron_lev.evaluate: error: {planted}: refused")
    assert not os.path.exists(marker)


# --------------------------------------------------------------------------- Hugging Face folders


@pytest.fixture(scope="module")
def lev_export(runs, tmp_path_factory) -> str:
    """tools/convert_to_hf.py's export of the run, written under umask 077."""
    from megatron_lev.hf.cli import convert_to_hf_main

    out = str(tmp_path_factory.mktemp("export") / "lev")
    old = os.umask(0o077)
    try:
        assert convert_to_hf_main(["--load", runs["save"], "--output", out]) == 0
    finally:
        os.umask(old)
    return out


def test_export_is_readable_by_group_and_others(lev_export):
    assert {"model.safetensors", "modeling_lev.py", "tokenizer.json", "config.json"} <= set(os.listdir(lev_export))
    assert_release_modes(lev_export)  # written under umask 077: set explicitly


def test_hf_folder_code_runs_only_when_ours_or_trusted(runs, lev_export, tmp_path):
    """The genuine export evaluates without any flag, with the checkpoint's loss; a copy whose
    modeling_lev.py differs is refused naming the file, and runs only with --trust-remote-code."""
    from megatron_lev import evaluate
    from megatron_lev.hf.trust import hf_trust_remote_code

    common = ["--model", f"ckpt={runs['save']}", "--eval-tokens", str(2 * SEQ), "--device", "cpu"]
    result = evaluate.main(["--model", f"hf={lev_export}", *common, "--output-dir", str(tmp_path / "genuine")])
    losses = {name: m["loss"] for name, m in result["models"].items()}
    assert losses["hf"] == pytest.approx(losses["ckpt"], abs=1e-5), losses  # measured: equal
    assert result["models"]["hf"]["architecture"] == "LevForCausalLM"

    # A unique folder name: transformers caches remote code by the folder's name.
    hostile = str(tmp_path / f"hostile_{os.getpid()}_{os.urandom(4).hex()}")
    shutil.copytree(lev_export, hostile)
    marker = str(tmp_path / "marker")
    with open(os.path.join(hostile, "modeling_lev.py"), "a", encoding="utf-8") as f:
        f.write(f"\nopen({marker!r}, 'w').close()  # runs on import\n")
    with pytest.raises(SystemExit) as exited:
        evaluate.main(["--model", f"hf={hostile}", *common, "--output-dir", str(tmp_path / "refused")])
    message = str(exited.value.code)
    assert message.startswith(f"megatron_lev.evaluate: error: {os.path.join(hostile, 'modeling_lev.py')}: differs "
                              "from the copy this megatron_lev ships") and "--trust-remote-code" in message
    assert "\n" not in message and not os.path.exists(marker)
    trusted = evaluate.main(["--model", f"hf={hostile}", *common, "--trust-remote-code",
                             "--output-dir", str(tmp_path / "trusted")])
    assert os.path.exists(marker)  # the flag runs the folder's code as it is
    assert trusted["models"]["hf"]["loss"] == pytest.approx(losses["hf"], abs=1e-6)

    # A foreign auto_map entry is refused even when the files match.
    config_path = os.path.join(lev_export, "config.json")
    foreign = str(tmp_path / "foreign")
    shutil.copytree(lev_export, foreign)
    with open(config_path, encoding="utf-8") as f:
        text = f.read()
    with open(os.path.join(foreign, "config.json"), "w", encoding="utf-8") as f:
        f.write(text.replace('"modeling_lev.LevForCausalLM"', '"someone/else--modeling.Evil"'))
    with pytest.raises(ValueError, match=r"foreign/config.json: auto_map names 'someone/else--modeling.Evil'"):
        hf_trust_remote_code(foreign)


# --------------------------------------------------------------------------- tokenizers


def test_corrupt_tokenizer_files_are_one_line_naming_the_file(spm_tokenizer, tiny_dataset, tmp_path, monkeypatch,
                                                             capsys):
    from megatron_lev.data.tokenizer import build_tokenizer
    from megatron_lev.train import main

    truncated = str(tmp_path / "truncated.model")
    with open(spm_tokenizer, "rb") as src, open(truncated, "wb") as dst:
        dst.write(src.read()[:3000])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", "1")  # the error comes before torch.distributed
    assert main(_train_flags(tiny_dataset, truncated)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megatron_lev.train: error: --tokenizer-model {truncated}: not a valid SentencePiece model "
                   f"(INTERNAL: could not parse ModelProto from {truncated})"]

    folder = tmp_path / "hf_tokenizer"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": ')
    with pytest.raises(ValueError) as bad:
        build_tokenizer("HuggingFaceTokenizer", str(folder))
    message = str(bad.value)
    assert message.startswith(f"--tokenizer-model {folder / 'tokenizer.json'}: not a valid tokenizer.json (")
    assert "\n" not in message
