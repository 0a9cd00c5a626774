"""Bounded checkpoint disk (issue 43 item 2): the size of a checkpoint as saved and as estimated, a
save that cannot fit refused in one line on a small filesystem (a tmpfs of a few MB) with `latest`
and every complete checkpoint intact, and what the Slurm scripts say and pass about it."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess

import pytest

from tests.distributed import run_distributed
from tests.test_slurm import run_script


def _flags(dataset, tokenizer, work, save, iters):
    return ["--config", "tiny-lev", "--data-path", dataset, "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", tokenizer, "--split", "90,5,5", "--data-cache-path", os.path.join(work, "cache"),
            "--train-iters", str(iters), "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1",
            "--metrics-file", os.path.join(work, os.path.basename(save) + ".jsonl"), "--save", save,
            "--save-interval", "1", "--no-bf16"]


def _space_runs(rank, world_size, measure_argv, small_argv, small_dir):
    """Rank body: 3 saves into a roomy folder; rank 0 measures one and mounts a tmpfs holding 2.5 of
    them at `small_dir`; then a run saving every iteration there. Returns the exit codes, the
    checkpoint's size and rank 0's stderr of the second run."""
    import torch.distributed as dist

    from megatron_lev.checkpointing.space import folder_bytes
    from megatron_lev.train import main

    measured = main(measure_argv)
    size = folder_bytes(os.path.join(measure_argv[measure_argv.index("--save") + 1], "iter_0000002"))
    if rank == 0:
        os.makedirs(small_dir)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(2.5 * size) + 64 * 1024}", "tmpfs", small_dir],
                       check=True, capture_output=True)
    dist.barrier()
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        small = main(small_argv)
    return measured, small, size, said.getvalue()


@pytest.fixture(scope="module")
def small_disk_run(tiny_dataset, spm_tokenizer, tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("this test mounts a tmpfs of a few MB: run it as root (as .ci/run does)")
    work = str(tmp_path_factory.mktemp("space"))
    small_dir = os.path.join(work, "small")
    try:
        results = run_distributed(_space_runs, world_size=2, args=(
            _flags(tiny_dataset, spm_tokenizer, work, os.path.join(work, "roomy"), 3),
            _flags(tiny_dataset, spm_tokenizer, work, small_dir, 6), small_dir), timeout=900)
        from megatron_lev.checkpointing.catalog import checkpoint_problem, complete_checkpoints

        state = {"results": results, "complete": complete_checkpoints(small_dir),
                 "latest": open(os.path.join(small_dir, "latest")).read(), "folders": sorted(os.listdir(small_dir)),
                 "problems": [checkpoint_problem(small_dir, tag) for _, tag in complete_checkpoints(small_dir)],
                 "small_dir": small_dir, "work": work}
    finally:
        subprocess.run(["umount", small_dir], capture_output=True)
    return state


def test_a_save_that_cannot_fit_stops_the_run_with_latest_intact(small_disk_run):
    """The tmpfs holds two checkpoints and a half: the saves of iterations 1 and 2 are written, the
    third is refused before a byte of it is, on both ranks, with one line naming the folder and the
    sizes; exit status 2; `latest` and both complete checkpoints are as they were."""
    (measured0, small0, size, said0), (measured1, small1, _, said1) = small_disk_run["results"]
    small_dir = small_disk_run["small_dir"]
    assert (measured0, measured1, small0, small1) == (0, 0, 2, 2)
    lines = [l for l in said0.splitlines() if "error" in l]
    assert len(lines) == 1 and said1.count("error") == 0, said0
    assert lines[0].startswith(f"megatron_lev.train: error: --save {small_dir}: not enough disk for checkpoint "
                               f"iter_0000003: it needs about {size / 1e6:.1f} MB (the size of iter_0000002; "), lines
    assert " MB is free; the complete checkpoints and `latest` are untouched: free space (or keep fewer checkpoints: " \
           f"--keep-last-checkpoints, KEEP_CHECKPOINTS in the Slurm scripts), then resume with --load {small_dir}" \
        in lines[0]
    assert small_disk_run["latest"] == "iter_0000002"
    assert [tag for _, tag in small_disk_run["complete"]] == ["iter_0000001", "iter_0000002"]
    assert small_disk_run["problems"] == [None, None]  # every file there, at the size its marker records
    assert "iter_0000003" not in small_disk_run["folders"]


def test_the_estimate_is_the_saved_size(small_disk_run, tiny_dataset):
    """14 bytes a parameter under bf16, 16 in fp32 (weights, fp32 master weights, both Adam moments):
    the fp32 tiny-lev checkpoint saved by 2 ranks is that, within 10% (pickling and RNG files weigh
    more on 180 k parameters than on 1.2 B)."""
    import json

    from megatron_lev.checkpointing.space import estimated_checkpoint_bytes
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.param_count import count_parameters

    size = small_disk_run["results"][0][2]
    with open(os.path.join(small_disk_run["work"], "roomy", "iter_0000002", "config.json")) as f:
        model = json.load(f)["model"]
    estimate = estimated_checkpoint_bytes(count_parameters(model_config_from_dict(model))["total"], bf16=False)
    assert 0.9 * size <= estimate <= size, (estimate, size)


def test_slurm_scripts_keep_the_newest_checkpoints_and_say_the_disk(tmp_path):
    """KEEP_CHECKPOINTS (default 3) is passed as --keep-last-checkpoints (0: not at all, every
    checkpoint kept); the dry run says one checkpoint's size and the disk the run needs."""
    for suffix in (".bin", ".idx"):
        (tmp_path / f"d{suffix}").touch()
    (tmp_path / "t.model").touch()
    inputs = {"DATA_PATH": tmp_path / "d", "TOKENIZER_MODEL": tmp_path / "t.model", "DRY_RUN": 1,
              "CHECKPOINT_DIR": tmp_path / "ckpt"}

    def dry_run(**env):
        proc = run_script("train_lev_1b.sh", **inputs, **env)
        assert proc.returncode == 0, proc.stderr
        (cmd,) = {l for l in proc.stdout.splitlines() if l.startswith("torchrun ")}
        (disk,) = [l for l in proc.stdout.splitlines() if l.startswith("# Disk: ")]
        return shlex.split(cmd), disk.split(f"; ")

    cmd, disk = dry_run()
    assert cmd[cmd.index("--keep-last-checkpoints") + 1] == "3"
    assert disk[:3] == ["# Disk: one checkpoint is about 17.3 GB (1,235,724,160 parameters x 14 bytes: bf16 weights, "
                        "fp32 master weights and Adam moments)",
                        "the newest 3 kept (KEEP_CHECKPOINTS=3): 4 at most, while the next is written",
                        "the run needs about 69.2 GB in CHECKPOINT_DIR, and 17.3 GB more while a resume at another "
                        "layout converts one"]
    assert disk[3].endswith("free there now")
    # Every checkpoint: 2.4e10 tokens / (512 x 512) = 91,553 iterations, a save every 1000 and the last.
    cmd, disk = dry_run(KEEP_CHECKPOINTS=0, BF16=0)
    assert "--keep-last-checkpoints" not in cmd
    assert disk[:3] == ["# Disk: one checkpoint is about 19.8 GB (1,235,724,160 parameters x 16 bytes: fp32 weights, "
                        "fp32 master weights and Adam moments)",
                        "every one kept (KEEP_CHECKPOINTS=0): 92 over the run's 91553 iterations (SAVE_INTERVAL=1000)",
                        "the run needs about 1.8 TB in CHECKPOINT_DIR, and 19.8 GB more while a resume at another "
                        "layout converts one"]
    assert disk[4] == ("step and save times not measured yet (a start of the run records them: metrics.jsonl's "
                       "step_time_s, each checkpoint's complete.json save_seconds)")
    # An earlier start measured both: the median of the last 20 logged step times, the newest save's.
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0002000").mkdir(parents=True)
    (ckpt / "iter_0002000" / "complete.json").write_text(json.dumps({"iteration": 2000, "save_seconds": 42.0,
                                                                     "files": {}}))
    steps = [9.0] * 5 + [2.0, 2.2, 2.1] * 6 + [2.3, 2.1]  # the first 5 fall outside the last 20
    (ckpt / "metrics.jsonl").write_text("".join(json.dumps({"iteration": 10 * i, "step_time_s": t}) + "\n"
                                                for i, t in enumerate(steps, 1)) + '{"iteration": 250, "valid_lo')
    _, disk = dry_run()
    assert disk[-1] == ("a step took 2.1 s and a save 42 s (measured in CHECKPOINT_DIR): SAVE_INTERVAL=1000 spends "
                        "2% of the time saving, and a crash loses up to 35 min of training (SAVE_INTERVAL=1980 would "
                        "spend 1%)")
    cmd, _ = dry_run(EXTRA_ARGS="--keep-last-checkpoints 5")
    assert cmd.count("--keep-last-checkpoints") == 1 and cmd[cmd.index("--keep-last-checkpoints") + 1] == "5"
    proc = run_script("train_lev_1b.sh", **inputs, KEEP_CHECKPOINTS=2, EXTRA_ARGS="--keep-last-checkpoints 5")
    assert (proc.returncode, proc.stderr) == (1, "slurm: error: EXTRA_ARGS passes --keep-last-checkpoints 5, but "
                                                 "KEEP_CHECKPOINTS=2: set one of them (the script passes this flag "
                                                 "from KEEP_CHECKPOINTS)\n")
    proc = run_script("train_lev_1b.sh", **inputs, KEEP_CHECKPOINTS="all")
    assert (proc.returncode, proc.stderr) == (1, "slurm: error: KEEP_CHECKPOINTS=all is not a non-negative integer\n")
