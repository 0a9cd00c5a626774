"""--keep-checkpoints-every N (KEEP_EVERY in the Slurm scripts): besides the newest
--keep-last-checkpoints K, the checkpoints of every N-th iteration stay."""
from __future__ import annotations

import contextlib
import io
import os
import shlex

import pytest

from megatron_lev.checkpointing.catalog import check_retention, retained
from megatron_lev.utils.errors import ConfigError


def test_retained_keeps_the_newest_and_the_multiples():
    saved = list(range(10, 101, 10)) + [105]
    assert retained(saved, 2) == [100, 105]
    assert retained(saved, 2, 30) == [30, 60, 90, 100, 105]
    assert retained(saved, 3, 50) == [50, 90, 100, 105]
    assert retained([], 2, 30) == []


class _FakeEngine:
    """What save_checkpoint asks of DeepSpeed's engine: write the tag's files."""

    checkpoint_engine = None

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        with open(os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"), "wb") as f:
            f.write(b"x" * 64)


def test_save_checkpoint_keeps_every_nth_iteration_besides_the_newest(tmp_path):
    """The trainer's save path (save_checkpoint with keep_last, the effective config's
    keep_checkpoints_every): exactly which iter_ folders remain."""
    from megatron_lev.checkpointing.save import save_checkpoint
    from megatron_lev.configs import load_config

    model = load_config("tiny-lev")["model"]
    save = str(tmp_path / "ckpt")
    for every, expected in ((30, ["iter_0000030", "iter_0000060", "iter_0000090", "iter_0000100"]),
                            (None, ["iter_0000090", "iter_0000100"])):
        folder = os.path.join(save, str(every))
        config = {"model": model, "training": {"keep_checkpoints_every": every, "bf16": False}}
        for iteration in range(10, 101, 10):
            save_checkpoint(_FakeEngine(), folder, iteration, {"consumed_samples": iteration}, config, keep_last=2)
        assert sorted(n for n in os.listdir(folder) if n.startswith("iter_")) == expected
        assert open(os.path.join(folder, "latest")).read() == "iter_0000100"


@pytest.mark.parametrize("keep_last, every, interval, message", [
    (2, 0, 10, "--keep-checkpoints-every must be >= 1, got 0"),
    (None, 30, 10, "--keep-checkpoints-every 30: needs --keep-last-checkpoints K (without it every checkpoint is "
                   "kept already)"),
    (2, 15, 10, "--keep-checkpoints-every 15 is not a multiple of --save-interval 10: checkpoints are saved every "
                "10 iterations, so only those of every 30-th would be kept"),
])
def test_check_retention_refuses_in_one_line(keep_last, every, interval, message):
    with pytest.raises(ConfigError) as exc:
        check_retention(keep_last, every, interval)
    assert str(exc.value) == message
    check_retention(2, 30, 10)
    check_retention(None, None, 10)


def test_the_trainers_flag_check_refuses_a_bad_keep_every():
    """python -m megatron_lev.training.arguments (the submit-time check, and the trainer's first)."""
    from megatron_lev.training.arguments import main

    base = ["--config", "tiny-lev", "--data-path", "unread_text_document", "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", "unread.model", "--save-interval", "10",
            "--keep-last-checkpoints", "2"]
    assert main([*base, "--keep-checkpoints-every", "30"]) == 0
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([*base, "--keep-checkpoints-every", "25"]) == 2
    assert err.getvalue() == ("megatron_lev.train: error: --keep-checkpoints-every 25 is not a multiple of "
                              "--save-interval 10: checkpoints are saved every 10 iterations, so only those of "
                              "every 50-th would be kept\n")


def test_slurm_keep_every(tmp_path):
    """KEEP_EVERY=N passes --keep-checkpoints-every N and the disk line counts them; without
    KEEP_CHECKPOINTS it is refused."""
    from tests.test_slurm import run_script

    for suffix in (".bin", ".idx"):
        (tmp_path / f"d{suffix}").touch()
    (tmp_path / "t.model").touch()
    inputs = {"DATA_PATH": tmp_path / "d", "TOKENIZER_MODEL": tmp_path / "t.model", "DRY_RUN": 1,
              "CHECKPOINT_DIR": tmp_path / "ckpt"}
    proc = run_script("train_lev_1b.sh", **inputs, KEEP_EVERY=20000)
    assert proc.returncode == 0, proc.stderr
    (cmd,) = {shlex.join(shlex.split(l)) for l in proc.stdout.splitlines() if l.startswith("torchrun ")}
    words = shlex.split(cmd)
    assert words[words.index("--keep-last-checkpoints"):words.index("--keep-last-checkpoints") + 4] == [
        "--keep-last-checkpoints", "3", "--keep-checkpoints-every", "20000"]
    (disk,) = [l for l in proc.stdout.splitlines() if l.startswith("# Disk: ")]
    assert ("the newest 3 and every 20000-th iteration's (KEEP_EVERY=20000, 4 over the run) kept (KEEP_CHECKPOINTS=3): "
            "8 at most, while the next is written") in disk
    proc = run_script("train_lev_1b.sh", **inputs, KEEP_CHECKPOINTS=0, KEEP_EVERY=5000)
    assert (proc.returncode, proc.stderr) == (1, "slurm: error: KEEP_EVERY=5000 keeps checkpoints besides the newest "
                                                 "KEEP_CHECKPOINTS, but KEEP_CHECKPOINTS=0 keeps every one already: "
                                                 "set KEEP_CHECKPOINTS, or unset KEEP_EVERY\n")
    proc = run_script("train_lev_1b.sh", **inputs, KEEP_EVERY=1500)
    assert proc.returncode == 1 and proc.stderr.strip().endswith(
        "--keep-checkpoints-every 1500 is not a multiple of --save-interval 1000: checkpoints are saved every 1000 "
        "iterations, so only those of every 3000-th would be kept"), proc.stderr
