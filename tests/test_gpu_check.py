"""benchmarks/gpu_check.{sh,py} and gpu_check_multi.{sh,py} on CPU: the first line they print
on a machine without the GPUs they need, the device-name -> peak table, and their whole logic
(--device cpu --tiny, gloo ranks) with assertions on the JSON they write. Not a GPU run: the
numbers that matter on a cluster (MFU, LEV/tied ratio, bf16 reduction) come from running the
scripts there (docs/cluster.md, "First day on a cluster")."""
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


def probe_wheel_folder(folder: Path, requires: list[str]) -> Path:
    """A wheel folder holding one small pure wheel, `gpu-check-probe 1.0` (module
    gpu_check_probe), that requires `requires`: what gpu_wheels.sh's folder is, in miniature."""
    import base64
    import hashlib
    import zipfile

    folder.mkdir(parents=True)
    info = "gpu_check_probe-1.0.dist-info"
    files = {"gpu_check_probe/__init__.py": "VALUE = 42\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 1.0\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()]
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(folder / "gpu_check_probe-1.0-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
    return folder


def _run_script(script: str, args: list, env: dict, tmp_path: Path):
    output = tmp_path / f"{script}.json"
    env = {**env, "PYTHON": sys.executable, "GPU_CHECK_VENV": str(tmp_path / "env"), "OUTPUT": str(output)}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / script), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)
    return proc, json.loads(output.read_text())


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_check_multi.sh"])
def test_scripts_install_the_wheel_folder_offline_then_say_there_is_no_gpu(tmp_path, script):
    """On a CPU machine: the folder's wheels go into a fresh environment over this Python's
    packages (pip --no-index), their requirements are met, then the one-line no-GPU message,
    exit 1, and the JSON says the same."""
    import socket

    wheels = probe_wheel_folder(tmp_path / "wheels", ["torch>=2.6", "numpy"])
    proc, report = _run_script(script, [wheels], _fake_nvidia_smi(tmp_path, 0), tmp_path)
    line = (f"{script}: no CUDA GPU on {socket.gethostname()} (nvidia-smi lists none): run it on a GPU node, "
            f"e.g. srun --gres=gpu:1 --pty bash benchmarks/{script} WHEELS")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"{script}: installed 1 wheels offline into {tmp_path / 'env'} in "
                                        f"{proc.stderr.split(' in ')[-1].splitlines()[0]}", line]
    assert (report["ok"], report["error"], report["exit_status"], report["check"]) == (False, line, 1, script[:-3])
    # The environment has the wheel and, behind it, this interpreter's own packages.
    probe = subprocess.run([str(tmp_path / "env" / "bin" / "python"), "-c",
                            "import gpu_check_probe, torch; print(gpu_check_probe.VALUE, torch.__version__)"],
                           capture_output=True, text=True, check=True)
    import torch

    assert probe.stdout.split() == ["42", torch.__version__]


def test_scripts_refuse_a_missing_or_incomplete_wheel_folder(tmp_path):
    env = _fake_nvidia_smi(tmp_path, 1)
    proc, report = _run_script("gpu_check.sh", [], env, tmp_path)
    usage = "gpu_check.sh: usage: bash benchmarks/gpu_check.sh WHEELS (the folder benchmarks/gpu_wheels.sh builds)"
    assert (proc.returncode, proc.stderr.splitlines(), report["error"]) == (2, [usage], usage)
    wheels = probe_wheel_folder(tmp_path / "wheels", ["torch>=2.6", "no-such-package>=1.0"])
    proc, report = _run_script("gpu_check_multi.sh", [wheels], env, tmp_path)
    missing = (f"gpu_check_multi.sh: no-such-package>=1.0 (needed by gpu-check-probe 1.0; found none): neither "
               f"{wheels} nor {sys.executable} provides it (rebuild the folder with benchmarks/gpu_wheels.sh)")
    assert (proc.returncode, proc.stderr.splitlines()[-1], report["error"]) == (2, missing, missing)


def test_gpu_check_says_when_torch_sees_no_gpu(tmp_path):
    wheels = probe_wheel_folder(tmp_path / "wheels", [])
    proc, report = _run_script("gpu_check.sh", [wheels], _fake_nvidia_smi(tmp_path, 1), tmp_path)
    import torch

    error = (f"SystemExit: gpu_check.py: torch {torch.__version__} sees no GPU (is it a CUDA build?); "
             "--device cpu --tiny runs the logic on the CPU")
    assert proc.returncode == 1 and report["finished"] and not report["ok"]
    assert report["error"] == error and report["failures"] == [error]
    assert f"gpu_check: FAILED: {error}" in proc.stderr.splitlines()


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_gpu_check_logic_on_cpu(tmp_path):
    """The 1-GPU check's stages on CPU (tiny configs): the kernel tests under pytest, fused vs
    PyTorch LEV (Triton's interpreter), both kinds trained with the Slurm scripts' per-GPU batch;
    the JSON file written at the end equals the printed report."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny",
                           "--steps", "2", "--max-lev-over-tied", "100", "--output", str(out)],
                          env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                               "TRITON_INTERPRET": "1"},
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report == _read(out) and report["ok"] and report["finished"] and report["failures"] == []
    assert report["stages_done"] == ["kernel_tests", "fused_vs_pytorch", "training"]
    kernels = report["kernel_tests"]
    assert (kernels["tests"], kernels["failures"], kernels["errors"], kernels["skipped"]) == (1, 0, 0, 0)
    fused = report["fused_vs_pytorch"]
    assert 0 < max(fused["relative_max_diffs"].values()) <= fused["tolerance"] and fused["fused_failure"] is None
    assert set(fused["relative_max_diffs"]) == {"output", "codebooks", "w_seed", "ln_gamma", "ln_beta", "delta",
                                                "w_out"}
    kinds = report["training"]["kinds"]
    assert set(kinds) == {"lev", "tied"}
    assert report["training"]["lev_over_tied_step_time"] == pytest.approx(
        kinds["lev"]["step_time_s_median"] / kinds["tied"]["step_time_s_median"], rel=1e-12)
    for k in kinds.values():
        # slurm/train_*_1b.sh on a node of 8: global batch 8 -> 1 sequence per GPU, no accumulation.
        assert (k["micro_batch_size"], k["gradient_accumulation_steps"], k["global_batch_size"]) == (1, 1, 1)
        assert len(k["losses"]) == 3 and all(0 < loss < 2 * math.log(1000) for loss in k["losses"])
        assert k["tokens_per_s"] == pytest.approx(64 / k["step_time_s_median"], rel=1e-12)
        assert k["attempts"] == [{"micro_batch_size": 1, "gradient_accumulation_steps": 1, "result": "ok"}]


def test_gpu_check_fails_on_nan_ratio_or_fused_kernels_not_run():
    import torch

    from gpu_check import failures

    def report(losses=(2.0, 1.9), ratio=1.01, launches=(3, 3), kernels_ok=True):
        return {"kernel_tests": {"ok": kernels_ok}, "fused_vs_pytorch": {"ok": True},
                "training": {"lev_over_tied_step_time": ratio, "kinds": {
                    "lev": {"losses": list(losses), "fused_failure": None,
                            "fused_kernel_launches": dict(zip(("forward", "backward"), launches))},
                    "tied": {"losses": [2.0, 1.9]}}}}

    cuda = torch.device("cuda")
    assert failures(report(), cuda, 1.05) == []
    assert failures(report(losses=(2.0, float("nan"))), cuda, 1.05) == ["lev: non-finite loss [2.0, nan]"]
    assert failures(report(ratio=1.07), cuda, 1.05) == ["lev_over_tied_step_time 1.070 > 1.05"]
    assert failures(report(launches=(3, 0)), cuda, 1.05) == [
        "lev: the fused LEV kernels did not run (launches {'forward': 3, 'backward': 0}, failure None)"]
    assert failures(report(launches=(0, 0)), torch.device("cpu"), 1.05) == []  # CPU: the PyTorch path is right
    assert failures(report(kernels_ok=False), cuda, 1.05) == ["kernel_tests failed"]


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


def test_gpu_check_multi_on_one_process_runs_its_one_gpu_part(tmp_path):
    """One GPU: the throughput stage (the Slurm scripts' per-GPU work) runs, the TP and DP
    checks say they need two GPUs, and the check passes (exit 0)."""
    out = tmp_path / "multi.json"
    proc = torchrun([str(REPO / "benchmarks" / "gpu_check_multi.py"), "--device", "cpu", "--tiny", "--steps", "1",
                     "--output", str(out)], nproc=1)
    report = json.loads(proc.stdout)
    assert report == _read(out) and report["ok"] and report["processes"] == 1
    assert report["stages_done"] == ["throughput"]
    assert report["tensor_parallel"] == report["data_parallel"] == {"skipped": "needs >= 2 GPUs", "ok": True}
    kinds = report["throughput"]["kinds"]
    assert (kinds["lev"]["data_parallel_size"], kinds["lev"]["global_batch_size"]) == (1, 8)  # all 8 on one rank
