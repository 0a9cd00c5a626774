"""benchmarks/gpu_check.{sh,py} and gpu_check_multi.{sh,py} on CPU: the first line they print
on a machine without the GPUs they need, the offline install (the machine's own pytest kept),
the device-name -> peak table, the rehearsal of the first GPU call (benchmarks/gpu_rehearsal.sh:
the install under a stand-in of the GPU image's Python 3.12, then every stage of gpu_check.py
with --device cpu --tiny) and gpu_check_multi's logic on gloo ranks, with assertions on the JSON
they write. Not a GPU run: the numbers that matter there (MFU, LEV/tied ratio, bf16 reduction)
come from running the scripts on one (docs/performance.md, "The first GPU call")."""
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
    """PATH with an `nvidia-smi` that lists `gpus` H100s (-L) of compute capability 9.0."""
    bin_dir = tmp_path / f"bin{gpus}"
    bin_dir.mkdir()
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(gpus))
    cap = "".join("echo 9.0\n" for _ in range(gpus))
    (bin_dir / "nvidia-smi").write_text(f'#!/bin/sh\ncase "$*" in *compute_cap*)\n{cap};;\n*)\n{lines};;\nesac\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def probe_wheel_folder(folder: Path, requires: list[str]) -> Path:
    """A wheel folder holding one small pure wheel, `gpu-check-probe 1.0` (module
    gpu_check_probe), that requires `requires`: what gpu_wheels.sh's folder is, in miniature."""
    from gpu_rehearsal_image import standin_wheel

    standin_wheel(folder, "gpu-check-probe", "1.0", requires, files={"gpu_check_probe/__init__.py": "VALUE = 42\n"})
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
    seconds = proc.stderr.split(" in ")[-1].split(" s;")[0]
    assert proc.stderr.splitlines() == [f"{script}: installed 1 of 1 wheels offline into {tmp_path / 'env'} in "
                                        f"{seconds} s; kept the machine's own: none", line]
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
    """With a GPU listed but a CPU torch: gpu_check.py's one line, in the JSON too, after the
    settings gpu_check.sh gives it (the image's pytest plugins off, fused Adam built for the listed
    GPU's architecture, the time left of its 470 s)."""
    wheels = probe_wheel_folder(tmp_path / "wheels", [])
    env = {k: v for k, v in _fake_nvidia_smi(tmp_path, 1).items()
           if k not in ("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "TORCH_CUDA_ARCH_LIST")}
    proc, report = _run_script("gpu_check.sh", [wheels], env, tmp_path)
    import torch

    error = (f"SystemExit: gpu_check.py: torch {torch.__version__} sees no GPU (is it a CUDA build?); "
             "--device cpu --tiny runs the logic on the CPU")
    assert proc.returncode == 1 and report["finished"] and not report["ok"]
    assert report["error"] == error and report["failures"] == [error]
    assert f"gpu_check: FAILED: {error}" in proc.stderr.splitlines()
    settings = report["settings"]
    assert (settings["PYTEST_DISABLE_PLUGIN_AUTOLOAD"], settings["TORCH_CUDA_ARCH_LIST"], settings["TRITON_INTERPRET"],
            settings["steps"], settings["allow_optimizer_fallback"]) == ("1", "9.0", "0", 20, False)
    assert (settings["warmup_steps"], settings["max_lev_over_tied"]) == (3, 1.02)
    assert 400 < settings["time_limit_s"] <= 470


@pytest.mark.parametrize("given, expected", [("9.0a", "9.0"), ("8.0 9.0a+PTX", "8.0 9.0+PTX")])
def test_gpu_check_drops_the_arch_suffix_deepspeed_cannot_parse(tmp_path, given, expected):
    """The H200 image sets TORCH_CUDA_ARCH_LIST=9.0a; DeepSpeed 0.19's op builder failed on it
    ("invalid literal for int() with base 10: '0a'") and the first GPU call ran torch's AdamW
    instead of fused Adam. gpu_check.sh hands the check 9.0 (and keeps +PTX)."""
    wheels = probe_wheel_folder(tmp_path / "wheels", [])
    env = {**_fake_nvidia_smi(tmp_path, 1), "TORCH_CUDA_ARCH_LIST": given}
    _, report = _run_script("gpu_check.sh", [wheels], env, tmp_path)
    assert report["settings"]["TORCH_CUDA_ARCH_LIST"] == expected


def test_the_install_keeps_the_machines_pytest(tmp_path):
    """The folder's pytest (here a 99.0 stand-in) does not replace the machine's own: the check's
    environment sees the machine's pytest, and the record says so. Before issue 34 every wheel
    of the folder was installed over the machine's packages."""
    from importlib.metadata import version

    from gpu_rehearsal_image import standin_wheel

    wheels = probe_wheel_folder(tmp_path / "wheels", ["pytest>=7"])
    standin_wheel(wheels, "pytest", "99.0")
    proc, report = _run_script("gpu_check.sh", [wheels], _fake_nvidia_smi(tmp_path, 0), tmp_path)
    assert proc.returncode == 1 and "no CUDA GPU" in report["error"]
    assert proc.stderr.splitlines()[0].endswith(f"kept the machine's own: pytest {version('pytest')}")
    seen = subprocess.run([str(tmp_path / "env" / "bin" / "python"), "-c",
                           "from importlib.metadata import version; print(version('pytest'))"],
                          capture_output=True, text=True, check=True)
    assert seen.stdout.strip() == version("pytest")
    assert json.loads((tmp_path / "env" / "install_record.json").read_text()) == {
        "installed": [{"name": "gpu-check-probe", "version": "1.0"}],
        "kept": [{"name": "pytest", "machine_version": version("pytest"), "wheel_version": "99.0"}]}


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_an_optimizer_fallback_is_recorded_and_warned(monkeypatch):
    """On a GPU, DeepSpeed's fused Adam failing to build (and apex missing) falls back to torch's
    fused AdamW: the reasons are kept in training.optim.optimizer_fallbacks (the GPU check's JSON
    reads them) and the first is warned about. Before issue 34 the fallback was silent."""
    import torch

    from megatron_lev.training import optim

    def no_fused_adam(groups, kwargs):
        raise RuntimeError("Error building extension 'fused_adam'\nninja: build stopped")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(optim, "_deepspeed_fused_adam", no_fused_adam)
    monkeypatch.setattr(optim, "optimizer_fallbacks", [])
    model = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning) as caught:
        optimizer = optim.build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    assert type(optimizer) is torch.optim.AdamW
    apex = optim.optimizer_fallbacks[1]
    assert optim.optimizer_fallbacks == ["DeepSpeed's FusedAdam: RuntimeError: Error building extension 'fused_adam'",
                                         apex] and apex.startswith("apex's FusedAdam: ModuleNotFoundError: ")
    assert [str(w.message) for w in caught if "AdamW:" in str(w.message)] == [
        "AdamW: DeepSpeed's FusedAdam: RuntimeError: Error building extension 'fused_adam'; using torch's fused "
        "AdamW instead (same update, another kernel)"]


def test_a_deepspeed_engine_is_freed_only_after_destroy():
    """ZeRO's gradient hooks sit in the parameters' autograd nodes (C++) and refer back to the
    optimizer: a deleted engine is never collected unless DeepSpeed's destroy() takes them out
    first, so the check before issue 34, which deleted its LEV engine and collected, kept it (and
    its memory) while tied ran. gpu_check_training.release_engine destroys it."""
    import gc
    import weakref

    import torch

    from gpu_check_training import build_trainer_engine, optimizer_step, release_engine, slurm_train_argv
    from bench_train import as_inputs, zipf_batches
    from tests.distributed import one_in_process_rank

    collected = {}
    with one_in_process_rank():
        argv = slurm_train_argv("train_tied_1b.sh", 8, "h100", "tiny-tied")
        for released in (False, True):
            args, config, engine = build_trainer_engine(argv, 1, {"--no-compile-layers": ""})
            optimizer_step(engine, [as_inputs(zipf_batches(config.vocab_size, 1, 64, 1)[0], torch.device("cpu"),
                                              config.vocab_size)])
            ref = weakref.ref(engine)
            if released:
                release_engine(engine)
            del engine
            gc.collect()
            collected[released] = ref() is None
    assert collected == {False: False, True: True}


def test_the_documented_device_call(tmp_path):
    """docs/performance.md gives one call for a machine that receives a copy of the working
    tree: it carries the wheel folder (git ignores runs/, so it travels only when carried), and
    OUTPUT puts the JSON into the folder that comes back."""
    text = (REPO / "docs" / "performance.md").read_text()
    block = text.split("<!-- device call -->")[1].split("```")[1]
    assert block.startswith("text\n")
    call = dict(line.split(": ", 1) for line in block.splitlines()[1:] if ": " in line)
    assert json.loads(call["carry"]) == ["runs/gpu_wheels"]
    assert call["command"] == ("set -o pipefail; OUTPUT=$OUT/gpu_check.json bash benchmarks/gpu_check.sh "
                               "runs/gpu_wheels 2>&1 | tee $OUT/gpu_check.log")
    assert int(call["timeout_s"]) == 600
    ignored = subprocess.run(["git", "check-ignore", "-q", "runs/gpu_wheels/x.whl"], cwd=REPO)
    assert ignored.returncode == 0  # ignored: only `carry` takes it along
    assert 'folder=${1:-$repo/runs/gpu_wheels}' in (REPO / "benchmarks" / "gpu_wheels.sh").read_text()


def assert_training_stage(training: dict, gemm: dict) -> None:
    """What the training stage of `gpu_check.py --device cpu --tiny` must report: both kinds at the
    Slurm scripts' batch, 3 untimed and 20 timed steps each, rounds rotated, the loss falling at a
    constant rate, LEV's generator timed inside lev's steps (its share of each step), LEV/tied from
    the medians with the pairwise spread."""
    import statistics

    import gpu_check_rules as rules

    assert training["order"] == ["lev", "tied", "tied", "lev"] * 11 + ["lev", "tied"]
    assert training["warmup_steps"] == 3 and training["label"] == rules.DP1_LABEL
    assert training["memory"]["engines_collected"] == {"lev": True, "tied": True}
    assert training["micro_batch_plan"] == {"micro_batch_size": 1, "gradient_accumulation_steps": 1,
                                            "estimated_bytes": None, "estimate_fits": None}
    assert "attempts" not in training  # no out-of-memory error on CPU: the Slurm batch ran
    times = {}
    for kind in ("lev", "tied"):
        k = training["kinds"][kind]
        # slurm/train_*_1b.sh on a node of 8: global batch 8 -> 1 sequence per GPU, no accumulation.
        assert (k["micro_batch_size"], k["gradient_accumulation_steps"], k["global_batch_size"]) == (1, 1, 1)
        assert k["lrs"] == [1e-3] * 23  # tiny-*.yaml's lr from the first step: no warm-up
        losses = k["losses"]
        assert len(losses) == 23 and all(0 < loss < 2 * math.log(1000) for loss in losses)
        assert k["loss_falls"] == {"first_mean": sum(losses[:3]) / 3, "last_mean": sum(losses[-3:]) / 3, "falls": True}
        assert k["optimizer"] == {"class": "torch.optim.adamw.AdamW", "fallbacks": []}
        assert k["sdpa_backend"] in ("FLASH_ATTENTION", "MATH")  # on CPU; "auto" keeps torch's order there
        assert k["compile_fallbacks"]["decoder_layers"] == [] and k["learning_rate_problems"] == []
        times[kind] = k["step_times_s"]
        assert len(times[kind]) == 20 and len(k["warmup_step_times_s"]) == 3
        assert k["first_step_s"] == k["warmup_step_times_s"][0]
        assert k["step_time_s_median"] == statistics.median(times[kind])
        assert k["tokens_per_s"] == pytest.approx(64 / k["step_time_s_median"], rel=1e-12)
        assert k["mfu"] is None and k["mfu_of_measured_gemm_ceiling"] == pytest.approx(
            k["model_tflops_per_s_per_gpu"] / gemm["tflops"], rel=1e-12)
    lev, tied = training["kinds"]["lev"], training["kinds"]["tied"]
    assert lev["lev_timing"] == "time.perf_counter" and "lev_timing" not in tied
    forward, backward = lev["lev_forward_s"], lev["lev_backward_s"]
    assert len(forward) == len(backward) == 20
    assert all(0 < f and 0 < b and f + b < t for f, b, t in zip(forward, backward, times["lev"]))
    shares = [(f + b) / t for f, b, t in zip(forward, backward, times["lev"])]
    assert lev["lev_generator"] == {"share": rules.spread(shares), "forward_s_median": statistics.median(forward),
                                    "backward_s_median": statistics.median(backward)}
    ratio = training["lev_over_tied_step_time"]
    assert ratio["comparable"] and ratio["median_ratio"] == statistics.median(times["lev"]) / statistics.median(
        times["tied"])
    assert ratio["pair_ratios"] == rules.spread([a / b for a, b in zip(times["lev"], times["tied"])])


def test_training_stage_on_cpu(tmp_path, monkeypatch):
    """gpu_check.py's training stage alone on CPU (the tiny configs), as the rehearsal runs it:
    the JSON fields assert_training_stage names, and the check passes at a ratio bound the CPU
    can meet (the tiny model's LEV is a large part of its step)."""
    import gpu_check

    from tests.distributed import one_in_process_rank

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with one_in_process_rank():
        report = gpu_check.main(["--device", "cpu", "--tiny", "--stages", "gemm_ceiling", "training",
                                 "--max-lev-over-tied", "100", "--output", str(tmp_path / "out.json")])
    assert report["ok"] and report["failures"] == [] and report["stages_done"] == ["gemm_ceiling", "training"]
    assert (report["settings"]["steps"], report["settings"]["warmup_steps"]) == (20, 3)
    assert_training_stage(report["training"], report["gemm_ceiling"])
    assert _read(tmp_path / "out.json") == report


def test_rehearsal_of_the_first_gpu_call(tmp_path):
    """benchmarks/gpu_rehearsal.sh: the wheels built, installed offline under a stand-in of the GPU
    image's Python 3.12 (its pytest kept, plugins not autoloaded, megatron-core's cp312 wheel
    among the carried ones, nothing of torch or CUDA), the rules under 3.12, then every stage of
    gpu_check.py on CPU with assertions on the numbers its JSON reports."""
    import gpu_check_rules as rules

    out = tmp_path / "rehearsal"
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_rehearsal.sh"), str(out)],
                          env={**os.environ, "LOGIC_PYTHON": sys.executable}, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    rehearsal = _read(out / "rehearsal.json")
    assert rehearsal["ok"] and all(rehearsal["checks"].values())
    assert rehearsal["python_version"] in ("3.12", f"{sys.version_info[0]}.{sys.version_info[1]}")
    files = rehearsal["wheels"]["files"]
    assert any(f.startswith(f"megatron_core-0.16.1-cp{rehearsal['python_version'].replace('.', '')}-") for f in files)
    assert not [f for f in files if f.split("-")[0] in ("torch", "triton") or f.startswith("nvidia")]
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    tree = sum((REPO / f.decode()).stat().st_size for f in tracked if f and (REPO / f.decode()).is_file())
    assert rehearsal["wheels"]["bytes"] < 50 * 2**20 and rehearsal["wheels"]["bytes"] + tree < 64 * 2**20
    record = rehearsal["install_record"]
    assert {"name": "pytest", "machine_version": "8.4.2", "wheel_version": next(
        f.split("-")[1] for f in files if f.startswith("pytest-"))} in record["kept"]
    assert {"deepspeed", "megatron-core", "megatron-lev"} <= {w["name"] for w in record["installed"]}

    report = _read(out / "gpu_check_cpu.json")
    assert report["ok"] and report["finished"] and report["failures"] == []
    assert report["stages_done"] == list(rules.STAGE_ORDER)
    kernels = report["kernel_tests"]
    assert (kernels["tests"], kernels["failures"], kernels["errors"], kernels["skipped"]) == (1, 0, 0, 0)
    assert kernels["plugin_autoload_disabled"] and kernels["pytest"] == report["environment"]["pytest"]
    fused = report["fused_vs_pytorch"]
    assert 0 < max(fused["relative_max_diffs"].values()) <= fused["tolerance"] and fused["fused_failure"] is None
    assert 0 < fused["bf16_matmul_relative_max_diffs"]["output"] < 0.1 and fused["bf16_matmul_ms"] > 0
    gemm = report["gemm_ceiling"]
    assert gemm["size"] == 256 and gemm["tflops"] == 2 * 256 ** 3 / gemm["seconds_median"] / 1e12

    gpt = report["megatron_gpt"]
    local = gpt["local"]
    assert local["logits"] <= 1e-5 and local["loss"] <= 1e-5 and local["grads"] <= 1e-4
    assert gpt["transformer_engine"]["skipped"].startswith("transformer_engine does not import here")
    step = gpt["bf16_step"]
    assert step["dtype"] == "torch.bfloat16" and step["losses_ours_gpt"]["after"][1] < step["losses_ours_gpt"]["before"][1]
    assert max(step["relative_diffs"].values()) <= 2.0 ** -5

    assert_training_stage(report["training"], gemm)

    bf16 = report["bf16_vs_fp32"]
    assert bf16["within"] and len(bf16["fp32_losses"]) == len(bf16["bf16_losses"]) == 12
    assert bf16["bounds"] == rules.bf16_loss_bounds(2, bf16["fp32_losses"], bf16["fp32_max_abs_logits"])
    assert 0 < max(bf16["diffs"]) and bf16["worst_diff_over_bound"] < 1
    resume = report["save_resume"]
    assert resume["bit_exact"] and resume["losses"]["uninterrupted"] == resume["losses"]["resumed"]
    assert resume["lrs"]["resumed"] == resume["lrs"]["uninterrupted"] == pytest.approx(
        [1e-3 - i * 0.9e-3 / 6 for i in range(6)], rel=1e-9)
    assert resume["checkpoint_tag"] == "iter_0000003" and resume["weights_replaced"]


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
    proc = torchrun([script, "--device", "cpu", "--tiny", "--reference", str(reference), "--steps", "10",
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
    assert report["throughput"]["order"] == ["lev", "tied"] * 10
    for kind in ("lev", "tied"):
        # slurm/train_*_1b.sh DRY_RUN with CONFIG=tiny-*, 1 node x 2: global 8 / DP 2 -> micro-batch 4.
        assert (kinds[kind]["global_batch_size"], kinds[kind]["micro_batch_size"],
                kinds[kind]["gradient_accumulation_steps"], kinds[kind]["data_parallel_size"]) == (8, 4, 1, 2)
        assert kinds[kind]["bf16"] and 0 < kinds[kind]["final_loss"] < 2 * math.log(1000)
        assert kinds[kind]["lrs"] == [1e-3] * 10 and kinds[kind]["loss_falls"]["falls"]
    assert report["throughput"]["lev_over_tied_step_time"]["median_ratio"] == pytest.approx(
        kinds["lev"]["step_time_s_median"] / kinds["tied"]["step_time_s_median"], rel=1e-12)
    assert report["throughput"]["memory"]["engines_collected"] == {"lev": True, "tied": True}


def test_gpu_check_multi_on_one_process_runs_its_one_gpu_part(tmp_path):
    """One GPU: the throughput stage (the Slurm scripts' per-GPU work) runs, the TP and DP
    checks say they need two GPUs, and the check passes (exit 0)."""
    out = tmp_path / "multi.json"
    proc = torchrun([str(REPO / "benchmarks" / "gpu_check_multi.py"), "--device", "cpu", "--tiny", "--steps", "10",
                     "--output", str(out)], nproc=1)
    report = json.loads(proc.stdout)
    assert report == _read(out) and report["ok"] and report["processes"] == 1
    assert report["stages_done"] == ["throughput"]
    assert report["tensor_parallel"] == report["data_parallel"] == {"skipped": "needs >= 2 GPUs", "ok": True}
    kinds = report["throughput"]["kinds"]
    assert (kinds["lev"]["data_parallel_size"], kinds["lev"]["global_batch_size"]) == (1, 8)  # all 8 on one rank


def test_the_fused_adam_build_is_waited_for_recorded_and_stopped_when_it_hangs(monkeypatch):
    """gpu_check.py builds DeepSpeed's fused Adam in a child process while the kernel tests run;
    the engines' stages wait for it and the JSON records how it went; a build that hangs is
    stopped (the engines then fall back, which the check reports)."""
    import gpu_check

    assert gpu_check.FusedAdamBuild(None).wait(5) == {"skipped": "not on CUDA: the optimizer there is torch's fused AdamW"}
    done = gpu_check.FusedAdamBuild([sys.executable, "-c", "print('built fused_adam')"]).wait(60)
    assert (done["returncode"], done["log_tail"]) == (0, "built fused_adam\n") and done["seconds"] < 60
    monkeypatch.setattr(gpu_check, "FUSED_ADAM_BUILD_LIMIT_S", 1)
    hung = gpu_check.FusedAdamBuild([sys.executable, "-c", "import time; time.sleep(60)"]).wait(600)
    assert hung["returncode"].startswith("killed after ") and hung["seconds"] < 30


def test_a_stage_that_raises_is_recorded_and_the_next_stages_still_run(tmp_path, monkeypatch):
    """One call must answer every question it can: a stage's exception is that stage's result
    (the check fails, naming it) and the stages after it still run."""
    import gpu_check
    import gpu_check_correctness

    from tests.distributed import one_in_process_rank

    def broken(device):
        raise AttributeError("'GPTModel' object has no attribute 'x'")

    monkeypatch.setattr(gpu_check_correctness, "megatron_gpt", broken)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with one_in_process_rank():
        report = gpu_check.main(["--device", "cpu", "--tiny", "--stages", "gemm_ceiling", "megatron_gpt",
                                 "save_resume", "--output", str(tmp_path / "out.json")])
    assert report["stages_done"] == ["gemm_ceiling", "save_resume"] and not report["ok"]
    assert report["failures"] == ["megatron_gpt failed: AttributeError: 'GPTModel' object has no attribute 'x'"]
    assert report["save_resume"]["bit_exact"] and _read(tmp_path / "out.json") == report


def test_the_tracked_tree_leaves_room_for_the_carried_wheels():
    """A device call carries the working tree and the wheel folder, 64 MiB together. The rehearsal
    above measures the real sum but runs late in the suite; the wheels were 16,267,891 bytes on
    5 Dec 2026, so the tracked tree keeps under 44 MiB (20 MiB for the wheels) and committed
    experiment results that outgrow it fail here, in a second (per-position NLLs of whole-split
    scorings stay uncommitted: .gitignore)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    sizes = {f.decode(): (REPO / f.decode()).stat().st_size for f in tracked if f and (REPO / f.decode()).is_file()}
    largest = sorted(sizes, key=sizes.get)[-3:]
    assert sum(sizes.values()) < 44 * 2**20, f"tracked tree {sum(sizes.values()):,} bytes; largest {largest}"


def test_lev_timer_times_the_generators_forward_and_backward_inside_a_step(monkeypatch):
    """gpu_check_training.LevTimer, on the host clock as the CPU rehearsal runs it, with a clock
    that only the model's own operations advance: the generator's forward adds 1, its backward 10,
    a layer after the LEV embedding 100 in forward and 1000 in backward. Over two micro-batches
    (forward, backward, forward, backward) the timer must read exactly 2 and 20: the intervals
    hold LEV's forward and backward and nothing of the layer around it."""
    import torch

    from gpu_check_training import HostEvent, LevTimer
    from megatron_lev.lev.generator import LEVConfig
    from megatron_lev.lev.parallel import ParallelLEVEmbedding

    clock = [0.0]
    monkeypatch.setattr(HostEvent, "clock", staticmethod(lambda: clock[0]))

    class Tick(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, forward_ticks, backward_ticks):
            clock[0] += forward_ticks
            ctx.backward_ticks = backward_ticks
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            clock[0] += ctx.backward_ticks
            return grad, None, None

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = ParallelLEVEmbedding(LEVConfig(vocab_size=100, hidden_size=16, seed_dim=8, num_heads=2,
                                                            num_knots=4, num_modes=4))
            self.embedding.generator.register_forward_hook(lambda module, args, out: Tick.apply(out, 1, 10))

        def forward(self, ids):
            return Tick.apply(self.embedding(ids), 100, 1000)

    model = Model()
    timer = LevTimer(model, torch.device("cpu"))
    assert timer.source == "time.perf_counter"
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(ids).float().pow(2).sum().backward()
    assert clock[0] == 2 * 1111
    assert timer.take() == (2.0, 20.0)
    with pytest.raises(RuntimeError, match="LevTimer: 0 micro-batches timed"):
        timer.take()
    model(ids)  # a forward without its backward: incomplete
    with pytest.raises(RuntimeError, match=r"incomplete: \[0\]"):
        timer.take()
    timer.remove()
    model(ids).sum().backward()
    assert timer.marks == [] and clock[0] == 3 * 1111 + 101  # removed: nothing recorded
