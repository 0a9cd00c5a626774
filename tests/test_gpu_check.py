"""benchmarks/gpu_check.{sh,py} and gpu_check_multi.{sh,py} on CPU: the first line they print
on a machine without the GPUs they need, the device-name -> peak table, and their whole logic
(--device cpu --tiny, gloo ranks) with assertions on the JSON they write. Not a GPU run: the
numbers that matter on a cluster (MFU, LEV/tied ratio, bf16 reduction) come from running the
scripts there (docs/slurm.md, "First day on a cluster")."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import torchrun

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.mark.parametrize("name, variant, peak", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm", 989.0),
    ("NVIDIA H100 PCIe", "h100-pcie", 756.0),
    ("NVIDIA H100 NVL", "h100-nvl", 835.0),
    ("NVIDIA H200", "h200-sxm", 989.0),
    ("NVIDIA H200 NVL", "h200-nvl", 835.0),
    ("NVIDIA GH200 480GB", "gh200", 989.0),
    ("NVIDIA A100-SXM4-80GB", "a100", 312.0),
    ("NVIDIA A100 80GB PCIe", "a100", 312.0),
    ("Tesla V100-SXM2-32GB", None, None),
])
def test_peak_from_device_name(name, variant, peak):
    from gpu_check import gpu_variant

    found = gpu_variant(name)
    assert (found["variant"], found["peak_tflops"]) == (variant, peak)
    assert found["gpu_type"] == (variant.split("-")[0].replace("gh200", "h200") if variant else None)


def _fake_nvidia_smi(tmp_path: Path, gpus: int) -> dict:
    """PATH with an `nvidia-smi -L` that lists `gpus` GPUs."""
    bin_dir = tmp_path / f"bin{gpus}"
    bin_dir.mkdir()
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(gpus))
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{lines}")
    (bin_dir / "nvidia-smi").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.parametrize("script, gpus, first_line", [
    ("gpu_check.sh", 0, "gpu_check.sh: no CUDA GPU on {host} (nvidia-smi lists none): run it on a GPU node, "
                        "e.g. srun --gres=gpu:1 --pty bash benchmarks/gpu_check.sh"),
    ("gpu_check_multi.sh", 0, "gpu_check_multi.sh: no CUDA GPU on {host} (nvidia-smi lists none): run it on a "
                              "GPU node, e.g. srun --gres=gpu:2 --pty bash benchmarks/gpu_check_multi.sh"),
    ("gpu_check_multi.sh", 1, "gpu_check_multi.sh: needs 2 GPUs, {host} has 1 (nvidia-smi -L)"),
    ("gpu_check.sh", 1, "gpu_check.sh: {python}: torch {torch} sees no GPU. Install a CUDA build into it"),
])
def test_scripts_say_first_what_is_missing(tmp_path, script, gpus, first_line):
    import socket

    import torch

    env = {**_fake_nvidia_smi(tmp_path, gpus), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / script)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    expected = first_line.format(host=socket.gethostname(), python=sys.executable, torch=torch.__version__)
    assert proc.stderr.splitlines()[0].startswith(expected), proc.stderr


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_gpu_check_logic_on_cpu(tmp_path):
    """The 1-GPU check's stages on CPU: both engines train, the ratio is the ratio of the
    medians, the JSON file written after the stage equals the final report's stage."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny",
                           "--repeats", "1", "--steps", "1", "--output", str(out)],
                          env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report == _read(out) and report["ok"] and report["stages_done"] == ["training"]
    kinds = report["training"]["kinds"]
    assert set(kinds) == {"lev", "tied"}
    assert report["training"]["lev_over_tied_step_time"] == pytest.approx(
        kinds["lev"]["step_time_s_median"] / kinds["tied"]["step_time_s_median"], rel=1e-12)
    for k in kinds.values():
        assert 0 < k["final_loss"] < 2 * math.log(1000)  # tiny configs: 1000-token vocabulary
        assert k["tokens_per_s"] == pytest.approx(4 * 64 / k["step_time_s_median"], rel=1e-12)


def test_gpu_check_multi_logic_on_two_cpu_ranks(tmp_path):
    """gpu_check_multi's stages with 2 gloo ranks: TP=2 == TP=1 (logits, loss, grads) within
    the stated tolerances (the SP reduce-scatter is CUDA-only: reported skipped); DP=2 bf16
    vs 1 process with accumulation: same losses and gradient norms; both kinds trained as the
    Slurm scripts' dry run sets them up (its micro-batch and accumulation)."""
    reference, out = tmp_path / "reference.json", tmp_path / "multi.json"
    script = str(REPO / "benchmarks" / "gpu_check_multi.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, script, "--device", "cpu", "--tiny", "--stage", "reference",
                           "--dp-size", "2", "--reference", str(reference)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = torchrun([script, "--device", "cpu", "--tiny", "--reference", str(reference), "--steps", "1",
                     "--output", str(out)], nproc=2)
    report = json.loads(proc.stdout)
    assert report == _read(out) and report["ok"], report
    assert report["stages_done"] == ["tensor_parallel", "data_parallel", "throughput"]
    assert report["processes"] == 2 and report["launcher"] == "torchrun"

    tp = report["tensor_parallel"]
    assert tp["dtypes"]["float32"]["logits_relative_max_diff"] <= 1e-4
    assert tp["dtypes"]["float32"]["grads_relative_max_diff"] <= 1e-4
    assert tp["dtypes"]["float32"]["loss_relative_diff"] <= 1e-6
    assert tp["dtypes"]["bfloat16"]["logits_relative_max_diff"] <= 2.0 ** -5
    assert 0 < tp["dtypes"]["float32"]["loss_tp1"] < 2 * math.log(1000)
    assert "needs CUDA" in tp["lev_sequence_parallel"]["skipped"]

    dp = report["data_parallel"]
    assert dp["reference"] == _read(reference)
    assert dp["reference"]["gradient_accumulation_steps"] == 2 and dp["data_parallel"]["gradient_accumulation_steps"] == 1
    assert dp["same_deepspeed_config"] and len(dp["reference"]["grad_norms"]) == 3
    assert all(n > 0 for n in dp["reference"]["grad_norms"])
    assert max(dp["grad_norm_relative_diffs"]) <= 1e-4 and max(dp["loss_relative_diffs"]) <= 1e-3
    assert dp["reference"]["losses"][2] < dp["reference"]["losses"][0]  # the steps really update the weights

    kinds = report["throughput"]["kinds"]
    for kind in ("lev", "tied"):
        # slurm/train_*_1b.sh DRY_RUN with CONFIG=tiny-*, 1 node x 2: global 8 / DP 2 -> micro-batch 4.
        assert (kinds[kind]["global_batch_size"], kinds[kind]["micro_batch_size"],
                kinds[kind]["gradient_accumulation_steps"], kinds[kind]["data_parallel_size"]) == (8, 4, 1, 2)
        assert kinds[kind]["bf16"] and 0 < kinds[kind]["final_loss"] < 2 * math.log(1000)
    assert report["throughput"]["lev_over_tied_step_time"] == pytest.approx(
        kinds["lev"]["step_time_s_median"] / kinds["tied"]["step_time_s_median"], rel=1e-12)
