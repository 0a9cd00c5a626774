"""experiments/cluster_plan.py: GPU-hours from the FLOPs model; issue 43's recipe that tunes
before it spends (a per-kind learning-rate sweep at 125M first, the choice rule, each kind at
its own rate after) and, per planned layout, the checkpoint disk, the data-parallel traffic
and the compute time of a step, with a warning where communication would dominate."""
from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

from megatron_lev.evaluation.lr_sweep import parse_run_name, summarise

spec = importlib.util.spec_from_file_location(
    "cluster_plan", os.path.join(os.path.dirname(__file__), "..", "experiments", "cluster_plan.py"))
plan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan)

# tied-125m-200k by hand: 12 layers x 768, MHA (kv width 768), ffn 2048, padded vocab 200,064,
# sequence 512, 2.5e9 tokens; 6 x matmul parameters + 12 L D s per token.
PER_LAYER = 768 * (768 + 2 * 768) + 768 * 768 + 3 * 768 * 2048
PER_TOKEN = 6 * (12 * PER_LAYER + 768 * 200064) + 12 * 12 * 768 * 512


def test_gpu_hours_from_the_flops_model():
    cost = plan.run_cost("tied-125m-200k", "h100", 0.4)
    assert cost["flops"] == pytest.approx(PER_TOKEN * 2.5e9, rel=1e-12)
    assert cost["gpu_hours"] == pytest.approx(PER_TOKEN * 2.5e9 / (989e12 * 0.4) / 3600, rel=1e-12)
    assert cost["parameters"] == 12 * (PER_LAYER + 2 * 768) + 768 + 768 * 200064
    assert (cost["lr"], cost["train_iters"]) == (6e-4, math.ceil(2.5e9 / (512 * 512)))
    # LEV adds its generator once per token at most: a fraction of a per cent at this size.
    lev = plan.run_cost("lev-125m-200k", "h100", 0.4)
    assert 1 < lev["flops"] / cost["flops"] < 1.01
    rows = plan.plan("a100", 0.5)
    assert [(r["size"], r["run"]) for r in rows][:4] == [("125m", "tied"), ("125m", "lev"), ("125m", "untied"),
                                                       ("125m", "lev-iso")]


def test_the_sweep_comes_first_and_the_ranking_tool_reads_its_runs():
    rows = plan.plan("h100", 0.4)
    sweep = plan.sweep_runs(rows)
    assert [(r["run"], r["lr"]) for r in sweep] == [
        (kind, lr) for kind in ("tied", "lev", "untied", "lev-iso") for lr in (3e-4, 6e-4, 1.2e-3)]
    assert [parse_run_name(r["name"]) for r in sweep] == [(r["run"], r["lr"], 1) for r in sweep]
    assert sweep[2]["name"] == "tied-lr1.2e-3-s1" and sweep[-3]["name"] == "lev-iso-lr3e-4-s1"
    lines = plan.commands(rows, "h100")
    configs = [line for line in lines if line.startswith("CONFIG=")]
    assert len(configs) == 12 + 8 * 3  # the sweep, then 8 runs x 3 seeds
    in_sweep = ["CHECKPOINT_DIR=checkpoints/exp/sweep-125m/" in line for line in configs]
    assert in_sweep == [True] * 12 + [False] * 24
    assert configs[2] == ("CONFIG=tied-125m-200k GPU_TYPE=h100 CHECKPOINT_DIR=checkpoints/exp/sweep-125m/tied-lr1.2e-3-s1 "
                          "EXTRA_ARGS=\"--seed 1 --lr 1.2e-3 --min-lr 1.2e-4 --eval-interval 500\" sbatch --nodes=1 "
                          "slurm/train_tied_1b.sh")
    ranking = lines.index("python -m megatron_lev.evaluation.lr_sweep --sweep-dir checkpoints/exp/sweep-125m "
                          "--steps 9537 --output-dir eval/sweep-125m")
    assert lines.index(configs[11]) < ranking < lines.index(configs[12])
    # Without the sweep's result, each run reads its rate from it when it is submitted.
    assert ("CONFIG=lev-1.2b-200k-iso GPU_TYPE=h100 CHECKPOINT_DIR=checkpoints/exp/lev-1.2b-200k-iso-s3 "
            "EXTRA_ARGS=\"--seed 3 $(python experiments/cluster_plan.py --lr-flags lev-iso --size 1.2b --sweep-json "
            "eval/sweep-125m/sweep.json) --eval-interval 500\" sbatch --nodes=4 slurm/train_lev_1b.sh") in lines


def _sweep_json(tmp_path, losses: dict) -> str:
    """A sweep folder of finished 125M runs (metrics.jsonl: the last validation at 9537) ranked by
    lr_sweep as the plan's command does; returns its sweep.json."""
    for name, loss in losses.items():
        os.makedirs(tmp_path / "sweep" / name)
        with open(tmp_path / "sweep" / name / "metrics.jsonl", "w") as f:
            f.write(json.dumps({"iteration": 9537, "consumed_tokens": 2.5e9, "valid_loss": loss}) + "\n")
    summarise(str(tmp_path / "sweep"), 9537, str(tmp_path / "eval"))
    return str(tmp_path / "eval" / "sweep.json")


GRID = {"tied": (3.40, 3.30, 3.35), "untied": (3.30, 3.20, 3.25), "lev-iso": (3.30, 3.25, 3.28),
        "lev": (3.20, 3.30, 3.40)}  # lev's best, 3e-4, is at the bottom edge of its grid


def _losses(extra: dict | None = None) -> dict:
    out = {f"{kind}-lr{lr}-s1": loss for kind, row in GRID.items() for lr, loss in zip(("3e-4", "6e-4", "1.2e-3"), row)}
    return {**out, **(extra or {})}


def test_the_choice_rule_and_each_kind_at_its_own_rate(tmp_path, capsys):
    rows = plan.plan("h100", 0.4)
    edge = _sweep_json(tmp_path / "a", _losses())
    with pytest.raises(ValueError, match=r"^no rate chosen yet: lev: best 3e-4 at the edge of \['3e-4', '6e-4', "
                                         r"'1.2e-3'\]; run lev-lr1.5e-4-s1 and rank again$"):
        plan.choose_rates(json.load(open(edge)), rows)
    assert plan.main(["--sweep-json", edge]) == 2
    assert capsys.readouterr().err.startswith(f"cluster_plan.py: error: --sweep-json {edge}: no rate chosen yet: lev")
    # The next point out is run: lev's best is now inside its grid.
    chosen = _sweep_json(tmp_path / "b", _losses({"lev-lr1.5e-4-s1": 3.25}))
    rates = plan.choose_rates(json.load(open(chosen)), rows)
    assert rates["tied"] == {"125m": 6e-4, "1.2b": pytest.approx(2e-4, rel=1e-12)}
    assert rates["lev"] == {"125m": 3e-4, "1.2b": pytest.approx(1e-4, rel=1e-12)}  # x (2e-4 / 6e-4): the configs' ratio
    assert rates["untied"]["125m"] == 6e-4 and rates["lev-iso"]["125m"] == 6e-4
    assert plan.main(["--lr-flags", "lev", "--size", "1.2b", "--sweep-json", chosen]) == 0
    assert capsys.readouterr().out == "--lr 1e-4 --min-lr 1e-5\n"
    lines = plan.commands(rows, "h100", rates, chosen)
    assert ("CONFIG=lev-1.2b-200k GPU_TYPE=h100 CHECKPOINT_DIR=checkpoints/exp/lev-1.2b-200k-s2 EXTRA_ARGS=\"--seed 2 "
            "--lr 1e-4 --min-lr 1e-5 --eval-interval 500\" sbatch --nodes=4 slurm/train_lev_1b.sh") in lines
    table = plan.markdown(rows, "h100", 0.4, rates)
    assert "| 1.2b | lev | `lev-1.2b-200k` | 1,542.4M | 24B | 2.29e+20 | 1e-4 | 161 | 482 |" in table


def test_layout_disk_traffic_and_compute_by_hand():
    rows = {r["config"]: r for r in plan.plan("h100", 0.4)}
    tied = rows["tied-1.2b-200k"]
    lay = plan.layout(tied, "h100", 0.4, plan.LINKS_GBPS["h100"], keep=3)
    p = tied["parameters"]
    assert (lay["nodes"], lay["gpus"], lay["data_parallel"]) == (4, 32, 32)
    assert lay["checkpoint_bytes"] == 14 * p  # bf16 weights, fp32 master weights, Adam's two moments
    assert lay["saves"] == math.ceil(math.ceil(24e9 / (512 * 512)) / 1000) == 92
    assert (lay["checkpoints_held"], lay["checkpoint_disk_bytes"]) == (4, 4 * 14 * p)  # 3 kept + the one written
    assert lay["traffic_bytes_per_gpu_per_step"] == pytest.approx(31 / 32 * p * (4 + 2), rel=1e-12)
    assert lay["communication_s_per_step"] == pytest.approx(31 / 32 * p * 6 / (400e9 / 8), rel=1e-12)
    step_flops = tied["flops"] / 24e9 * 512 * 512
    assert lay["compute_s_per_step"] == pytest.approx(step_flops / (32 * 989e12 * 0.4), rel=1e-9)
    assert plan.layout(tied, "h100", 0.4, plan.LINKS_GBPS["h100"], keep=0)["checkpoints_held"] == 92
    small = plan.layout(rows["tied-125m-200k"], "h100", 0.4, plan.LINKS_GBPS["h100"])
    assert (small["nodes"], small["link"], small["link_gbps"]) == (1, "NVLink", 3600.0)


def test_a_warning_where_communication_would_dominate(capsys):
    assert plan.main([]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    # H100 at nominal rates: only the untied 1.2B model's gradients outweigh its step.
    assert [w.split(" on ")[0] for w in warnings] == ["warning: untied-1.2b-200k"]
    assert "communication would dominate unless overlap_comm hides it" in warnings[0]
    assert "| `tied-1.2b-200k` | 4 x 8 | 21.6 GB | 4 (of 92) | 86 GB | 8.95 GB |" in out
    assert plan.main(["--inter-node-gbps", "100"]) == 0
    warned = [line.split(" on ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert warned == [f"warning: {kind}-1.2b-200k" for kind in ("tied", "lev", "untied")] + \
        ["warning: lev-1.2b-200k-iso"]
    assert plan.main(["--inter-node-gbps", "800", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == []


@pytest.mark.parametrize("argv, message", [
    (["--keep-checkpoints", "-1"], "--keep-checkpoints -1: must be >= 0"),
    (["--inter-node-gbps", "0"], "--inter-node-gbps 0.0: must be a number > 0"),
    (["--lr-flags", "lev"], "--lr-flags: needs --sweep-json (the sweep's ranking)"),
])
def test_bad_flags_name_themselves(argv, message, capsys):
    with pytest.raises(SystemExit):
        plan.main(argv)
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")


# --------------------------------------------------------------------------- without torch

PLAN = os.path.join(os.path.dirname(__file__), "..", "experiments", "cluster_plan.py")
NO_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = [sys.argv[1], *sys.argv[2:]]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")


def _plan_without_torch(*argv):
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", NO_TORCH, PLAN, *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": repo}, cwd=repo)


def test_the_shim_makes_import_torch_fail():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; import torch"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "ModuleNotFoundError: import of torch halted" in proc.stderr


def test_the_planner_runs_where_import_torch_fails():
    """experiments/cluster_plan.py imports no torch (models/shape.py, not models/config.py): its
    numbers where torch cannot be imported are the hand count's."""
    proc = _plan_without_torch("--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    tied = next(r for r in out["runs"] if r["config"] == "tied-125m-200k")
    assert tied["parameters"] == 12 * (PER_LAYER + 2 * 768) + 768 + 768 * 200064
    assert tied["flops"] == pytest.approx(PER_TOKEN * 2.5e9, rel=1e-12)
    assert tied["train_iters"] == math.ceil(2.5e9 / (512 * 512))
    table = _plan_without_torch()
    assert table.returncode == 0, table.stderr[-2000:]
    assert "| 125m | tied | `tied-125m-200k` | 238.6M | 2.5B | 3.72e+18 | the sweep's | 3 | 8 |" in table.stdout


def test_shapes_agree_with_the_model_configs():
    """models/shape.py's torch-free sizes equal LeviathanConfig's on every packaged config:
    parameter counts (LEV's generator included), the FLOPs model's inputs and the LEVConfig."""
    from megatron_lev.configs import available_configs, load_config
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.param_count import count_parameters
    from megatron_lev.models.shape import count_parameters as shape_count
    from megatron_lev.models.shape import model_shape
    from megatron_lev.training.flops import flops_model

    names = available_configs()
    assert "lev-1.2b-200k" in names and len(names) > 30
    for name in names:
        section = load_config(name)["model"]
        for tp in (1, 2):
            try:
                config = model_config_from_dict(section, tensor_model_parallel_size=tp)
            except ValueError:
                continue
            shape = model_shape(section, tensor_model_parallel_size=tp)
            assert shape_count(shape) == count_parameters(config), (name, tp)
            assert flops_model(shape, 512) == flops_model(config, 512), (name, tp)
            if config.embedding == "lev":  # one LEVConfig, built the same way by both
                assert shape.lev_config() == config.lev_config(), (name, tp)
    lev = model_shape(load_config("lev-1.2b-200k")["model"]).lev_config()
    assert (lev.base, lev.num_parameters()) == (59, 2_252_928)  # LEV_SPEC.md section 6


def test_the_torch_free_shape_refuses_a_bad_lev_field_in_one_line():
    """ModelShape builds LeviathanConfig's LEVConfig, so a planner or the launcher's disk check
    meets the same one-line error as the trainer, not a count of an impossible generator."""
    from megatron_lev.configs import load_config
    from megatron_lev.models.shape import count_parameters, model_shape

    section = load_config("lev-1.2b-200k")["model"]
    for lev, message in (({"num_knots": 1}, "lev: LEVConfig.num_knots=1 must be an integer >= 2"),
                         ({"hidden_size": 64}, "lev.hidden_size: set the model's hidden_size, not the generator's"),
                         ({"num_kntos": 16}, "lev: LEVConfig: unknown field(s) ['num_kntos']")):
        with pytest.raises(ValueError) as raised:
            count_parameters(model_shape({**section, "lev": {**section["lev"], **lev}}))
        assert str(raised.value).startswith(message), str(raised.value)
