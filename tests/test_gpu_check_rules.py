"""The pure rules of the GPU check (benchmarks/gpu_check_rules.py) and the wheel-install plan
(benchmarks/gpu_install.py), with exact numbers. No torch: benchmarks/gpu_rehearsal.sh runs this
file under the GPU image's Python 3.12 with a stand-in torch (pytest --noconftest).

Each defect the first review of the check found (issue 34) has a case here that the code before
it could not pass: a learning rate warming up over 900 iterations (rates of almost 0), kinds at
different micro-batches compared anyway, LEV always timed first, a fused-Adam fallback nobody
saw, engines never freed, the image's pytest replaced by the folder's.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check_rules as rules  # noqa: E402
import gpu_install  # noqa: E402
from gpu_rehearsal_image import standin_wheel  # noqa: E402


def test_interleaved_order_alternates_the_kinds_and_rotates_which_starts_a_round():
    # Issue 50: before, lev always ran first in every round (right after tied's optimizer step).
    assert rules.interleaved_order(("lev", "tied"), 3) == [(0, "lev"), (0, "tied"), (1, "tied"), (1, "lev"),
                                                            (2, "lev"), (2, "tied")]
    assert rules.interleaved_order(("a", "b", "c"), 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a")]
    assert rules.interleaved_order(("lev", "tied"), 2, rotate=False) == [(0, "lev"), (0, "tied"), (1, "lev"),
                                                                          (1, "tied")]
    order = [kind for _, kind in rules.interleaved_order(("lev", "tied"), 23)]
    assert order[0::2].count("lev") == 12 and order[1::2].count("lev") == 11


@pytest.mark.parametrize("losses, expected", [
    ([3.0, 3.0, 3.0, 2.5, 2.0, 2.0, 2.0], {"first_mean": 3.0, "last_mean": 2.0, "falls": True}),
    ([2.0, 2.0, 2.0, 2.0, 2.0, 2.0], {"first_mean": 2.0, "last_mean": 2.0, "falls": False}),
    ([1.0, 1.5, 2.0, 2.5, 3.0, 3.5], {"first_mean": 1.5, "last_mean": 3.0, "falls": False}),
    ([1.0, 2.0, 3.0, 4.0, 5.0], {"first_mean": None, "last_mean": None, "falls": False}),
])
def test_loss_falls_compares_the_first_three_steps_with_the_last_three(losses, expected):
    assert rules.loss_falls(losses) == expected


def test_a_non_finite_loss_never_falls():
    assert rules.loss_falls([9.0, 9.0, 9.0, 1.0, 1.0, math.nan])["falls"] is False


def test_learning_rates_constant_after_at_most_two_warmup_steps():
    assert rules.learning_rate_problems([2e-4] * 12) == []
    assert rules.learning_rate_problems([0.0, 1e-4] + [2e-4] * 10) == []
    # The check before issue 34: lev-1.2b's 900-iteration warm-up, 4 steps at almost 0.
    old = [2e-4 * i / 900 for i in range(4)]
    assert rules.learning_rate_problems(old) == ["4 steps, fewer than 10"]
    rising = [2e-4 * i / 900 for i in range(12)]
    assert rules.learning_rate_problems(rising) == [
        f"the learning rate settles after 11 steps, more than 2 (rates {rising})"]
    assert rules.learning_rate_problems([0.0] * 10) == ["learning rate 0.0 after warm-up"]


def test_spread_of_step_times():
    assert rules.spread([5.0, 1.0, 3.0, 2.0, 4.0]) == {"median": 3.0, "min": 1.0, "max": 5.0, "q1": 2.0, "q3": 4.0,
                                                      "relative_range": 4.0 / 3.0}


def _kind(micro=32, acc=2, times=(1.0, 1.2, 1.1)):
    return {"micro_batch_size": micro, "gradient_accumulation_steps": acc, "seq_length": 512,
            "data_parallel_size": 1, "step_times_s": list(times)}


def test_step_time_ratio_only_at_the_same_batch():
    ratio = rules.step_time_ratio(_kind(times=(1.1, 1.3, 1.2)), _kind(times=(1.0, 1.0, 1.0)))
    assert ratio["comparable"] and ratio["median_ratio"] == 1.2 / 1.0
    assert ratio["pair_ratios"]["median"] == 1.2 and ratio["pair_ratios"]["max"] == 1.3
    # The check before issue 34 let each kind fall back to its own micro-batch on OOM.
    ratio = rules.step_time_ratio(_kind(micro=32, acc=2), _kind(micro=64, acc=1))
    assert ratio == {"comparable": False, "median_ratio": None,
                     "why": "lev vs tied: micro_batch_size 32 vs 64, gradient_accumulation_steps 2 vs 1"}


def test_micro_batch_plan_keeps_the_slurm_batch_and_only_reports_the_estimate():
    parameters, capacity = 1_233_000_000, 150_000_000_000
    # 2 x 20 B x 1.233e9 = 49.32 GB of engines; 32768 tokens x 5.6e9 / 2048 = 89.6 GB > 0.9 x 150 GB - 49.32.
    # Before issue 50 this estimate halved the H200's 64 x 512 to 32 x 2 before anything ran.
    plan = rules.micro_batch_plan(64, 1, parameters, capacity, 512)
    assert plan == {"micro_batch_size": 64, "gradient_accumulation_steps": 1,
                    "estimated_bytes": 49.32e9 + 5.6e9 / 2048 * 64 * 512, "estimate_fits": False}
    assert rules.micro_batch_plan(32, 2, parameters, capacity, 512)["estimate_fits"] is True
    assert rules.micro_batch_plan(64, 1, parameters, None, 512) == {
        "micro_batch_size": 64, "gradient_accumulation_steps": 1, "estimated_bytes": None, "estimate_fits": None}


def test_an_out_of_memory_error_halves_the_micro_batch_and_doubles_the_accumulation():
    assert rules.halved(64, 1) == (32, 2) and rules.halved(2, 16) == (1, 32)
    assert rules.halved(1, 64) is None and rules.halved(3, 1) is None


def test_lev_share_of_each_timed_step():
    share = rules.lev_share([1.0, 2.0, 0.5], [0.01, 0.02, 0.01], [0.03, 0.02, 0.04])
    assert share["share"]["median"] == pytest.approx(0.04, rel=1e-12)
    assert share["share"]["min"] == pytest.approx(0.02, rel=1e-12) and share["share"]["max"] == pytest.approx(0.1)
    assert (share["forward_s_median"], share["backward_s_median"]) == (0.01, 0.03)
    assert rules.lev_share([1.0, 2.0], [0.01], [0.03, 0.02]) == {
        "share": None, "why": "2 steps, 1 forward and 2 backward timings"}


def test_memory_not_freed():
    assert rules.memory_not_freed({"engines_collected": {"lev": True, "tied": True}, "left_allocated_bytes": 0}) is None
    # The check before issue 34 deleted its engines without DeepSpeed's destroy(): never collected.
    assert (rules.memory_not_freed({"engines_collected": {"lev": False, "tied": True}})
            == "engines still alive after deletion: lev")
    assert (rules.memory_not_freed({"engines_collected": {"lev": True}, "left_allocated_bytes": 2**30})
            == "1.00 GiB still allocated after both engines were deleted")


def test_an_optimizer_fallback_fails_unless_allowed():
    fused = {"class": "deepspeed.ops.adam.fused_adam.FusedAdam", "fallbacks": []}
    torch_adamw = {"class": "torch.optim.adamw.AdamW",
                   "fallbacks": ["DeepSpeed's FusedAdam: RuntimeError: Error building extension 'fused_adam'",
                                 "apex's FusedAdam: ModuleNotFoundError: No module named 'apex'"]}
    assert rules.optimizer_problem(fused, "cuda", False) is None
    assert rules.optimizer_problem(torch_adamw, "cuda", False) == (
        f"optimizer torch.optim.adamw.AdamW ran, not deepspeed.ops.adam.fused_adam.FusedAdam (fallbacks: "
        f"{torch_adamw['fallbacks']})")
    assert rules.optimizer_problem(torch_adamw, "cuda", True) is None
    assert rules.optimizer_problem({"class": "torch.optim.adamw.AdamW", "fallbacks": []}, "cpu", False) is None


def test_bf16_bound_derivation():
    assert rules.bf16_rounding_stages(2) == 31
    eps = 31 * 2.0 ** -8
    assert rules.bf16_loss_bounds(2, [10.0, 9.0, 9.5], [1.0, 2.0, 3.0]) == [eps * 2.0, eps * (4.0 + 1.0),
                                                                            eps * (6.0 + 1.5)]
    within = rules.compare_curves([10.0, 9.0], [10.1, 9.0], [0.2, 0.2])
    assert within["within"] and within["worst_step"] == 0 and within["diffs"][1] == 0.0
    assert within["worst_diff_over_bound"] == pytest.approx(0.5, rel=1e-12)
    # A bf16 run that does not learn: its loss stays while fp32's falls by 1 nat.
    assert not rules.compare_curves([10.0, 9.0], [10.0, 10.0], [0.1, 0.2])["within"]
    assert not rules.compare_curves([10.0, 9.0], [10.0, math.nan], [0.1, 0.2])["within"]


def test_compare_resume():
    uninterrupted = [7.0, 6.9, 6.8, 6.7, 6.6, 6.5]
    exact = rules.compare_resume(uninterrupted, list(uninterrupted), 3)
    assert exact["bit_exact"] and exact["within"] and exact["relative_diffs"] == [0.0, 0.0, 0.0]
    noisy = rules.compare_resume(uninterrupted, uninterrupted[:3] + [6.7, 6.6 * (1 + 1e-6), 6.5], 3)
    assert not noisy["bit_exact"] and noisy["within"]
    # Adam's moments not restored moved the loss by 1.7e-3 of it on CPU (docs/performance.md).
    lost = rules.compare_resume(uninterrupted, uninterrupted[:3] + [6.7, 6.6 * (1 + 1.7e-3), 6.5], 3)
    assert not lost["within"] and lost["relative_diffs"][1] == pytest.approx(1.7e-3, rel=1e-9)
    assert not rules.compare_resume(uninterrupted, uninterrupted[:3], 3)["within"]  # the resumed steps missing


def _training(micro=(32, 32), falls=(True, True), optimizer=None, collected=True, lrs=None):
    kinds = {}
    for kind, m, f in zip(("lev", "tied"), micro, falls):
        kinds[kind] = {**_kind(micro=m), "losses": [7.0, 6.0], "lrs": lrs or [2e-4] * 12,
                       "loss_falls": {"first_mean": 7.0, "last_mean": 6.0 if f else 7.5, "falls": f},
                       "optimizer": optimizer or {"class": "deepspeed.ops.adam.fused_adam.FusedAdam", "fallbacks": []},
                       "compile_fallbacks": {"decoder_layers": []}}
    kinds["lev"].update(fused_kernel_launches={"forward": 12, "backward": 12}, fused_failure=None)
    return {"kinds": kinds, "lev_over_tied_step_time": rules.step_time_ratio(kinds["lev"], kinds["tied"]),
            "memory": {"engines_collected": {"lev": collected, "tied": True}, "left_allocated_bytes": 0}}


def test_failures_name_every_rule_broken():
    assert rules.failures({"training": _training()}, "cuda", 1.05) == []
    assert rules.failures({"training": _training(micro=(32, 64))}, "cuda", 1.05) == [
        "lev_over_tied_step_time not comparable: lev vs tied: micro_batch_size 32 vs 64"]
    assert rules.failures({"training": _training(falls=(True, False))}, "cuda", 1.05) == [
        "tied: the loss did not fall (mean of the first 3 steps 7.0, of the last 3 7.5)"]
    adamw = {"class": "torch.optim.adamw.AdamW", "fallbacks": ["DeepSpeed's FusedAdam: RuntimeError: nvcc failed"]}
    found = rules.failures({"training": _training(optimizer=adamw)}, "cuda", 1.05)
    assert found == [f"{kind}: optimizer torch.optim.adamw.AdamW ran, not deepspeed.ops.adam.fused_adam.FusedAdam "
                     f"(fallbacks: {adamw['fallbacks']}) (--allow-optimizer-fallback accepts it)" for kind in ("lev", "tied")]
    assert rules.failures({"training": _training(optimizer=adamw)}, "cuda", 1.05, allow_optimizer_fallback=True) == []
    assert rules.failures({"training": _training(collected=False)}, "cuda", 1.05) == [
        "training: engines still alive after deletion: lev"]
    assert rules.failures({"training": _training(lrs=[0.0] * 12)}, "cuda", 1.05) == [
        "lev: learning rate 0.0 after warm-up", "tied: learning rate 0.0 after warm-up"]
    assert rules.failures({"skipped_stages": {"save_resume": "12 s left, the stage needs about 20 s"},
                           "bf16_vs_fp32": {"ok": False, "why": "step 3: |bf16 - fp32| 0.5 > bound 0.1"}}, "cuda", 1.05) == [
        "bf16_vs_fp32 failed: step 3: |bf16 - fp32| 0.5 > bound 0.1",
        "save_resume skipped: 12 s left, the stage needs about 20 s"]


def test_failures_on_a_non_finite_loss_a_slow_lev_or_fused_kernels_not_run():
    training = _training()
    training["kinds"]["lev"]["losses"] = [7.0, math.nan]
    assert rules.failures({"training": training}, "cuda", 1.05) == ["lev: non-finite loss [7.0, nan]"]
    training = _training()
    training["kinds"]["lev"]["step_times_s"] = [1.07, 1.07, 1.07]
    training["kinds"]["tied"]["step_times_s"] = [1.0, 1.0, 1.0]
    training["lev_over_tied_step_time"] = rules.step_time_ratio(training["kinds"]["lev"], training["kinds"]["tied"])
    assert rules.failures({"training": training}, "cuda", 1.05) == [
        "lev_over_tied_step_time 1.070 > 1.05 (pairwise median 1.070, quartiles 1.070-1.070, range 1.070-1.070)"]
    training["kinds"]["lev"]["step_times_s"] = [1.01, 1.03, 1.02]
    training["lev_over_tied_step_time"] = rules.step_time_ratio(training["kinds"]["lev"], training["kinds"]["tied"])
    assert rules.failures({"training": training}, "cuda", rules.MAX_LEV_OVER_TIED) == []
    training["kinds"]["lev"]["step_times_s"] = [1.00, 1.05, 1.03]
    training["lev_over_tied_step_time"] = rules.step_time_ratio(training["kinds"]["lev"], training["kinds"]["tied"])
    assert rules.failures({"training": training}, "cuda", rules.MAX_LEV_OVER_TIED) == [
        "lev_over_tied_step_time 1.030 > 1.02 (pairwise median 1.030, quartiles 1.015-1.040, range 1.000-1.050)"]
    training = _training()
    training["kinds"]["lev"]["lev_generator"] = rules.lev_share([1.0], [], [])
    assert rules.failures({"training": training}, "cuda", 1.05) == [
        "lev: the generator's timing inside the steps: 1 steps, 0 forward and 0 backward timings"]
    training = _training()
    training["kinds"]["lev"]["fused_kernel_launches"] = {"forward": 12, "backward": 0}
    assert rules.failures({"training": training}, "cuda", 1.05) == [
        "lev: the fused LEV kernels did not run (launches {'forward': 12, 'backward': 0}, failure None)"]
    assert rules.failures({"training": training}, "cpu", 1.05) == [  # CPU: the PyTorch path is right; torch AdamW
        "lev: optimizer deepspeed.ops.adam.fused_adam.FusedAdam ran, not torch.optim.adamw.AdamW (fallbacks: []) "
        "(--allow-optimizer-fallback accepts it)",
        "tied: optimizer deepspeed.ops.adam.fused_adam.FusedAdam ran, not torch.optim.adamw.AdamW (fallbacks: []) "
        "(--allow-optimizer-fallback accepts it)"]
    training = _training()
    training["kinds"]["tied"]["compile_fallbacks"]["decoder_layers"] = [0, 1]
    assert rules.failures({"training": training}, "cuda", 1.05) == [
        "tied: decoder layers ran eagerly after torch.compile failed: {'decoder_layers': [0, 1]}"]
    assert rules.failures({"kernel_tests": {"ok": False}}, "cuda", 1.05) == ["kernel_tests failed"]


def test_the_stage_estimates_fit_the_time_gpu_check_sh_gives():
    # gpu_check.sh: 470 s, of which the install takes about 30 (docs/performance.md).
    assert sum(rules.STAGE_ESTIMATE_S.values()) == 355 <= 440
    assert rules.stage_fits("training", 200) and not rules.stage_fits("training", 199) and rules.stage_fits("training", None)
    assert set(rules.STAGE_ESTIMATE_S) == set(rules.STAGE_ORDER)


# ----------------------------------------------------------------------------- the install plan


def _wheel(name, version, requires=()):
    return {"name": name, "version": version, "requires": list(requires), "file": f"{name}-{version}.whl"}


def test_install_plan_keeps_the_machines_packages_that_meet_the_requirements():
    wheels = [_wheel("pytest", "9.2.0", ["pluggy>=1.5,<2", "iniconfig>=1", "packaging>=20"]),
              _wheel("pluggy", "1.6.0"), _wheel("iniconfig", "2.1.0"), _wheel("packaging", "25.0"),
              _wheel("deepspeed", "0.19.8", ["packaging>=24.2", "pydantic>=2"]), _wheel("pydantic", "2.11.0"),
              _wheel("megatron-lev", "0.1.0", ["deepspeed>=0.19.3,<0.20"])]
    # The image's pytest with its plugins, an older packaging, and (odd, but possible) our project.
    machine = {"pytest": "8.3.5", "pluggy": "1.5.0", "iniconfig": "2.0.0", "packaging": "24.0",
               "megatron-lev": "0.0.9", "torch": "2.11.0+cu130"}
    plan = gpu_install.install_plan(wheels, machine)
    assert [w["name"] for w in plan["install"]] == ["deepspeed", "megatron-lev", "packaging", "pydantic"]
    assert plan["kept"] == [{"name": "pytest", "machine_version": "8.3.5", "wheel_version": "9.2.0"},
                            {"name": "pluggy", "machine_version": "1.5.0", "wheel_version": "1.6.0"},
                            {"name": "iniconfig", "machine_version": "2.0.0", "wheel_version": "2.1.0"}]
    # Nothing on the machine: everything is installed.
    assert len(gpu_install.install_plan(wheels, {})["install"]) == len(wheels)


def test_install_plan_reads_wheels_and_writes_its_record(tmp_path):
    folder = tmp_path / "wheels"
    standin_wheel(folder, "Gpu_Check.Probe", "1.0", ["pytest>=7", 'colorama; sys_platform == "win32"'])
    standin_wheel(folder, "pytest", "99.0")
    record = tmp_path / "record.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_install.py"), str(folder), str(record)],
                          capture_output=True, text=True, check=True)
    from importlib.metadata import version

    assert proc.stdout.splitlines() == [str(folder / "gpu_check_probe-1.0-py3-none-any.whl")]
    assert json.loads(record.read_text()) == {
        "installed": [{"name": "gpu-check-probe", "version": "1.0"}],
        "kept": [{"name": "pytest", "machine_version": version("pytest"), "wheel_version": "99.0"}]}
    kept = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_install.py"), "--kept", str(record)],
                          capture_output=True, text=True, check=True)
    assert kept.stdout == f"pytest {version('pytest')}\n"
