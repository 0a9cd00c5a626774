"""Nothing lost (issue 14): checkpoints fsynced before their completeness marker, a
damaged newest checkpoint skipped for the previous complete one, metrics.jsonl appended,
--save guarded, resume refusing another tokenizer or seed, data checked against
--tokenizer-model.

One 2-rank launch (tests/distributed.py) runs three trainings of tiny-tied in one
checkpoint folder: A (6 steps, checkpoints 2, 4 and 6), B (after rank 0 truncated a file
of checkpoint 6 and overwrote the end of one of checkpoint 4, keeping its size: resumes
from 2), C (another --seed with --override-checkpoint-args, one
step). The refusals are start-up errors, checked in-process like tests/test_train.py's.
"""
import contextlib
import io
import json
import os
import re
import shutil

import pytest

from megatron_lev.checkpointing.catalog import COMPLETE_MARKER, find_latest, read_checkpoint_config
from tests.distributed import run_distributed
from tests.test_train import _main_error, read_metrics, train_flags, train_records

RUN = ("--config", "tiny-tied", "--save-interval", "2", "--eval-interval", "100")


def _record_fsyncs_and_renames():
    """Log of ("fsync", path) / ("replace", destination) events, in order, in this process."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        events.append(("replace", os.path.abspath(dst)))
        return real_replace(src, dst, *args, **kwargs)

    os.fsync, os.replace = fsync, replace
    return events, lambda: (setattr(os, "fsync", real_fsync), setattr(os, "replace", real_replace))


def _safety_runs(rank, world_size, work, dataset, tokenizer):
    import torch.distributed as dist

    from megatron_lev.train import main

    save = os.path.join(work, "ckpt")

    def flags(*extra):
        return train_flags(dataset, tokenizer, work, "run", *RUN, "--save", save, *extra)

    events, restore = _record_fsyncs_and_renames()
    try:
        code_a = main(flags("--exit-interval", "6"))
    finally:
        restore()
    files = {tag: sorted(os.path.join(root, name) for root, _, names in os.walk(os.path.join(save, tag))
                         for name in names) for tag in ("iter_0000002", "iter_0000004")}
    dist.barrier()
    if rank == 0:
        # A node crash or a full disk left checkpoint 6's model file short...
        model_file = os.path.join(save, "iter_0000006", "mp_rank_00_model_states.pt")
        with open(model_file, "r+b") as f:
            f.truncate(os.path.getsize(model_file) // 2)
        # ...and a bad copy zeroed the end (the zip directory) of checkpoint 4's: same size, unreadable.
        model_file = os.path.join(save, "iter_0000004", "mp_rank_00_model_states.pt")
        with open(model_file, "r+b") as f:
            f.seek(-512, os.SEEK_END)
            f.write(bytes(512))
    dist.barrier()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code_b = main(flags("--load", save, "--exit-interval", "4"))
    code_c = main(flags("--load", save, "--seed", "99", "--override-checkpoint-args", "--exit-interval", "5"))
    return {"codes": [code_a, code_b, code_c], "events": events, "files": files, "stderr_b": err.getvalue()}


@pytest.fixture(scope="module")
def safety_runs(tiny_dataset, spm_tokenizer, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("safety"))
    results = run_distributed(_safety_runs, world_size=2, args=(work, tiny_dataset, spm_tokenizer), timeout=900)
    assert [r["codes"] for r in results] == [[0, 0, 0]] * 2
    return work, results


def _final_name(path: str) -> str:
    """The name an atomic write's temporary file (`.NAME.tmp-PID`) is renamed to."""
    return re.sub(r"/\.([^/]+)\.tmp-\d+$", r"/\1", path)


def test_checkpoint_files_fsynced_before_marker(safety_runs):
    """Every file of a checkpoint (DeepSpeed's shards from both ranks, RNG files, config)
    and its folder are fsynced before rank 0 renames complete.json into place; the marker
    and `latest` are fsynced too."""
    work, results = safety_runs
    fsynced = {_final_name(path) for r in results for kind, path in r["events"] if kind == "fsync"}
    events0 = results[0]["events"]
    for tag, files in results[0]["files"].items():
        tag_dir = os.path.join(work, "ckpt", tag)
        marker = os.path.join(tag_dir, COMPLETE_MARKER)
        assert marker in files and any(f.endswith("_model_states.pt") for f in files)
        assert set(files) <= fsynced, sorted(set(files) - fsynced)
        marker_at = events0.index(("replace", marker))
        before = [path for kind, path in events0[:marker_at] if kind == "fsync"]
        assert tag_dir in before and os.path.join(tag_dir, "rng") in before
        assert {f for f in files if f != marker} & {_final_name(p) for p in before}  # rank 0's own files first
        assert _final_name(events0[marker_at - 1][1]) == marker  # the marker's data, right before its rename
    assert os.path.join(work, "ckpt", "latest") in fsynced
    with open(os.path.join(work, "ckpt", "iter_0000002", COMPLETE_MARKER)) as f:
        sizes = json.load(f)["files"]
    assert sizes["mp_rank_00_model_states.pt"] == os.path.getsize(
        os.path.join(work, "ckpt", "iter_0000002", "mp_rank_00_model_states.pt"))


def test_damaged_checkpoints_skipped_for_previous_and_metrics_appended(safety_runs):
    """B found checkpoint 6 short (the marker's sizes) and checkpoint 4 unreadable at its
    intact size (the weights_only load of every file): one warning naming each file,
    resumed from 2, and re-ran steps 3 and 4 with A's exact losses. metrics.jsonl kept A's
    lines and got B's and C's after them."""
    work, results = safety_runs
    warnings = [line for line in results[0]["stderr_b"].splitlines() if line.startswith("warning:")]
    short_file = os.path.join(work, "ckpt", "iter_0000006", "mp_rank_00_model_states.pt")
    unreadable_file = os.path.join(work, "ckpt", "iter_0000004", "mp_rank_00_model_states.pt")
    assert len(warnings) == 2, warnings
    assert f"skipping checkpoint iter_0000006: {short_file}: " in warnings[0]
    assert "(truncated or damaged); trying the previous complete one" in warnings[0]
    assert f"skipping checkpoint iter_0000004: {unreadable_file}: cannot be read" in warnings[1]
    assert warnings[1].endswith("; trying the previous complete one")
    assert not any(line.startswith("warning:") for line in results[1]["stderr_b"].splitlines())  # rank 0 says it
    lines = [r for r in read_metrics(work, "run") if "loss" in r]
    assert [r["iteration"] for r in lines] == [1, 2, 3, 4, 5, 6, 3, 4, 5]
    assert [r["loss"] for r in lines[6:8]] == [r["loss"] for r in lines[2:4]]  # bit-exact resume from 2
    assert [r["grad_norm"] for r in lines[6:8]] == [r["grad_norm"] for r in lines[2:4]]
    assert lines[-1]["consumed_samples"] == 5 * 8  # C continued from B's checkpoint 4
    assert find_latest(os.path.join(work, "ckpt")) == "iter_0000005"


def test_start_up_refusals(safety_runs, tiny_dataset, spm_tokenizer, tmp_path, monkeypatch, capsys):
    work, _ = safety_runs
    save = os.path.join(work, "ckpt")

    def error(*extra, tokenizer=spm_tokenizer):
        return _main_error(monkeypatch, capsys, *train_flags(tiny_dataset, tokenizer, str(tmp_path), "x", *RUN,
                                                             *extra))

    # --save of an existing run without --load: refused, nothing overwritten.
    before = sorted(os.listdir(save))
    err = error("--save", save)
    assert err.startswith(f"megatron_lev.train: error: --save {save}: the folder is not empty (")
    assert err.endswith(f"); resume that run with --load {save}, or choose a new --save folder")
    assert sorted(os.listdir(save)) == before
    # Another seed on resume reorders the data: refused without --override-checkpoint-args.
    err = error("--save", save, "--load", save, "--seed", "7")
    assert err == (f"megatron_lev.train: error: --load {save}: the checkpoint's run used another seed: 99 in the "
                   "checkpoint, 7 now: resume with the checkpoint's values, or add --override-checkpoint-args")
    # --ckpt-step of a damaged checkpoint: refused, naming the file.
    rng_file = os.path.join(save, "iter_0000002", "rng", "rank_00001.pt")
    with open(rng_file, "ab") as f:
        f.write(b"\0")
    err = error("--save", save, "--load", save, "--ckpt-step", "2", "--seed", "99")
    size = os.path.getsize(rng_file)
    assert err == (f"megatron_lev.train: error: --ckpt-step 2: checkpoint iter_0000002 is damaged: {rng_file}: "
                   f"{size} bytes, {size - 1} when saved (truncated or damaged)")
    err = error("--save", save, "--load", save, "--ckpt-step", "3", "--seed", "99")
    assert err == f"megatron_lev.train: error: --ckpt-step 3: no checkpoint iter_0000003 in --load {save}"
    # Data made with another tokenizer (same vocabulary size, other content): refused, both named.
    other = str(tmp_path / "other.model")
    shutil.copy(spm_tokenizer, other)
    with open(other, "ab") as f:
        f.write(bytes([0xA0, 0x06, 0x01]))  # an unknown protobuf field: loads, but other bytes
    err = error("--tokenizer-model", other)
    assert err.startswith(f"megatron_lev.train: error: --data-path {tiny_dataset}: was tokenized with "
                          f"{os.path.abspath(spm_tokenizer)} (sha256 ")
    assert f"but --tokenizer-model {other} is another tokenizer (sha256 " in err


def test_resume_tokenizer_refused_and_data_path_warned(safety_runs, capsys):
    """check_resume_run on the saved config: another tokenizer is refused (naming it), a
    changed data path only warns; --override-checkpoint-args lets the tokenizer through."""
    import argparse
    import copy

    from megatron_lev.training.validation import check_resume_run
    from megatron_lev.utils.errors import ConfigError

    work, _ = safety_runs
    save = os.path.join(work, "ckpt")
    saved = read_checkpoint_config(save, "iter_0000005")
    assert len(saved["tokenizer"]["sha256"]) == 64
    now = copy.deepcopy(saved)
    now["training"]["data_path"] = ["/elsewhere/other_text_document"]
    args = argparse.Namespace(load=save, override_checkpoint_args=False)
    check_resume_run(args, saved, now, rank=0)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: --load {save}: resuming with another data_path: {saved['training']['data_path']!r} "
                   "in the checkpoint, ['/elsewhere/other_text_document'] now"]
    now["tokenizer"] = dict(saved["tokenizer"], model="/tok/b.model", sha256="b" * 64)
    with pytest.raises(ConfigError) as refused:
        check_resume_run(args, saved, now, rank=0)
    assert f"another tokenizer: {saved['tokenizer']['model']} (sha256 {saved['tokenizer']['sha256'][:12]}) in the " \
           f"checkpoint, /tok/b.model (sha256 bbbbbbbbbbbb) now" in str(refused.value)
    check_resume_run(argparse.Namespace(load=save, override_checkpoint_args=True), saved, now, rank=0)
    assert "resuming with another tokenizer" in capsys.readouterr().err
