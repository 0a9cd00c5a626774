"""The cluster path on CPU: bf16 training under TP/PP/DP, fp32 gradient reduction, exact
bf16 resume, and resume at another scale (universal checkpoints).

Two launches: one 2-rank launch runs every 2-rank job of this file in turn (train.main
in-process, as tests/test_train.py does), one 1-rank launch the references and the
resumes on 1 rank. Every run shares the schedule of a 30-step run.
"""
import os
import shutil

import pytest
import torch

from megatron_lev.checkpointing.catalog import COMPLETE_MARKER, checkpoint_tag
from megatron_lev.checkpointing.safe_load import safe_torch_load
from megatron_lev.checkpointing.universal import UNIVERSAL, UNIVERSAL_INFO_KEY, convert_to_universal
from megatron_lev.utils.errors import ConfigError
from tests.distributed import run_distributed
from tests.test_train import TRAIN_ITERS, _main_error, read_metrics, train_flags, train_records

# bf16 layouts vs 1 rank: TP/PP/DP/ZeRO change the order of sums (TP's row-parallel partial
# outputs are reduced in bf16, as on GPUs), so losses move slightly: measured max |diff| over
# 6 steps and the validation passes is 1.1e-4 (TP=2; loss ~6.8; one bf16 ulp at 6.8 is 0.03).
BF16_LOSS_ATOL = 1e-3
SAVE_AT, LAYOUT_STEPS, RESUME_AT = 3, 6, 15  # checkpoints every 3 steps; layouts run 6 steps
LAYOUTS = {  # name -> flags, on 2 ranks
    "tp2": ("--tensor-model-parallel-size", "2"),
    "pp2": ("--pipeline-model-parallel-size", "2"),
    "dp2_z1": ("--zero-stage", "1"),
    "dp2_z2": ("--zero-stage", "2"),
    "dp2_z3": ("--zero-stage", "3"),
}
SCALE_CHANGES = ("dp2_z1", "dp2_z2", "tp2", "pp2")  # resumed on 1 rank (DP=1, TP=1, PP=1)


def _grad_micro_batches(n: int, args):
    """n micro-batches of random tokens (fixed seed): the same data on every layout."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(4, 1000, (n, args.micro_batch_size, args.seq_length + 1), generator=gen)
    position_ids = torch.arange(args.seq_length).expand(args.micro_batch_size, -1)
    return [dict(tokens=t[:, :-1], labels=t[:, 1:], position_ids=position_ids,
                 loss_mask=torch.ones(args.micro_batch_size, args.seq_length)) for t in tokens]


def bf16_gradients(rank, world_size, argv, communication_data_type):
    """The fp32 gradient DeepSpeed hands to the optimizer after one global batch of 2
    micro-batches (2 ranks x 1 or 1 rank x 2 accumulated), for every parameter, under
    `communication_data_type`. Collective; returns {name: full fp32 gradient}."""
    from deepspeed.utils import safe_get_full_grad

    from megatron_lev.distributed.rng import set_seed
    from megatron_lev.distributed.state import initialize_model_parallel
    from megatron_lev.training.arguments import parse_args, validate_args
    from megatron_lev.training.ds_config import build_deepspeed_config
    from megatron_lev.training.engine import build_engine
    from megatron_lev.training.validation import build_model_config

    args = validate_args(parse_args(argv), world_size)
    ds_config = build_deepspeed_config(args)
    ds_config["communication_data_type"] = communication_data_type
    initialize_model_parallel(1, 1)
    try:
        set_seed(args.seed)
        engine = build_engine(args, build_model_config(args), ds_config)
        batches = _grad_micro_batches(2, args)
        mine = batches[rank::world_size]
        for i, b in enumerate(mine):
            loss = engine(b["tokens"], position_ids=b["position_ids"], labels=b["labels"], loss_mask=b["loss_mask"])
            engine.backward(loss)  # the last one is the accumulation boundary: gradients are reduced
            if i < len(mine) - 1:
                engine.step()  # not a boundary: only counts the micro-step
        return {name: safe_get_full_grad(p).float().clone() for name, p in engine.module.named_parameters()}
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


def _jobs(rank, world_size, jobs):
    """Rank body: run each job in order, return what each returned. Jobs: ("train", argv),
    ("grads", argv, communication dtype), ("copy", src, dst) (rank 0 copies a folder)."""
    import torch.distributed as dist

    from megatron_lev.train import main

    out = []
    for kind, *job in jobs:
        if kind == "copy":
            if rank == 0:
                shutil.copytree(*job)
            dist.barrier()
            out.append(None)
        else:
            out.append(_logged_main(main, job[0], rank) if kind == "train" else bf16_gradients(rank, world_size, *job))
    return out


def _logged_main(main, argv, rank):
    """main(argv) with this rank's stdout and stderr (prints, warnings) in log.rank<N>.txt next to
    the run's metrics.jsonl: what a user's log file would hold."""
    import contextlib

    log_path = os.path.join(os.path.dirname(argv[argv.index("--metrics-file") + 1]), f"log.rank{rank}.txt")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        return main(argv)


@pytest.fixture(scope="module")
def bf16_work(tiny_dataset, spm_tokenizer, tmp_path_factory):
    """Every run of this file: the 2-rank launch, then the 1-rank launch. Returns
    (work directory, gradients {name: {param: tensor}})."""
    work = str(tmp_path_factory.mktemp("bf16"))

    def flags(name, *extra):
        return train_flags(tiny_dataset, spm_tokenizer, work, name, "--config", "tiny-lev", "--bf16", *extra)

    def ckpt(name):
        return os.path.join(work, "ckpt_" + name)

    resume_dir, resume_tag = ckpt("resume"), checkpoint_tag(RESUME_AT)
    # Layouts: 6 steps, checkpoints every 3 steps; DP=2 ZeRO-1 (DeepSpeed's BF16_Optimizer) runs
    # all 30 steps: the uninterrupted run of the exact-resume test.
    two = {f"bf16_{name}": ("train", flags(f"bf16_{name}", *layout, "--save", ckpt(name), "--save-interval",
                                           str(SAVE_AT), "--eval-interval", str(SAVE_AT),
                                           *(() if name == "dp2_z1" else ("--exit-interval", str(LAYOUT_STEPS)))))
           for name, layout in LAYOUTS.items()}
    two.update({
        # Exact bf16 resume: steps 16-30 from its step-15 checkpoint (a copy: the run went on).
        "copy_resume": ("copy", os.path.join(ckpt("dp2_z1"), resume_tag), os.path.join(resume_dir, resume_tag)),
        "bf16_resume": ("train", flags("bf16_resume", "--save", resume_dir, "--load", resume_dir, "--eval-interval",
                                       str(SAVE_AT))),
        "grads_fp32": ("grads", flags("grads"), "fp32"),
        "grads_bf16": ("grads", flags("grads"), "bf16"),
        "grads_z2_fp32": ("grads", flags("grads", "--zero-stage", "2"), "fp32"),
        "grads_z2_bf16": ("grads", flags("grads", "--zero-stage", "2"), "bf16"),
    })
    one = {
        "bf16_ref": ("train", flags("bf16_ref", "--exit-interval", str(LAYOUT_STEPS), "--eval-interval",
                                    str(SAVE_AT))),
        "grads_ref": ("grads", flags("grads"), "fp32"),
    }
    results = {}
    per_rank = run_distributed(_jobs, world_size=2, args=(list(two.values()),), timeout=900)
    results.update(zip(two, per_rank[0]))
    # Resume on 1 rank from each 2-rank layout's step-3 checkpoint (a copy: the runs went on to 6).
    for name in SCALE_CHANGES:
        src = os.path.join(ckpt(name), checkpoint_tag(SAVE_AT))
        shutil.copytree(src, os.path.join(ckpt("from_" + name), os.path.basename(src)))
        one[f"scale_{name}"] = ("train", flags(f"scale_{name}", "--load", ckpt("from_" + name),
                                               "--exit-interval", str(LAYOUT_STEPS), "--eval-interval", str(SAVE_AT)))
    one["scale_dp2_z1_no_optim"] = ("train", flags("scale_dp2_z1_no_optim", "--load", ckpt("from_dp2_z1"),
                                                   "--no-load-optim", "--exit-interval", str(LAYOUT_STEPS)))
    per_rank = run_distributed(_jobs, world_size=1, args=(list(one.values()),), timeout=900)
    results.update(zip(one, per_rank[0]))
    codes = {name: code for name, code in results.items() if not isinstance(code, dict) and code is not None}
    assert all(code == 0 for code in codes.values()), codes
    return work, {name: r for name, r in results.items() if isinstance(r, dict)}


def test_bf16_log_is_megatron_lines(bf16_work):
    """The log of a tiny bf16 TP=2 run (the first of its process, as a job's is): Megatron-style
    lines and the start-up breakdown; none of DeepSpeed's bf16 memory dumps (print()ed six times
    by its BF16_Optimizer) or megatron-core's warnings that do not apply (CUDA_DEVICE_MAX_CONNECTIONS
    on CPU, its own deprecated default cuda_graph_scope): those are debug output (--logging-level 10)."""
    import re

    work, _ = bf16_work
    logs = [open(os.path.join(work, "bf16_tp2", f"log.rank{r}.txt")).read() for r in (0, 1)]
    for log in logs:
        assert not [l for l in log.splitlines() if re.match(r"MA [\d.]+ GB|CPU Virtual Memory|(begin|end) bf16_", l)], log
        assert "UserWarning" not in log and "CUDA_DEVICE_MAX_CONNECTIONS" not in log and "deprecated" not in log, log
        assert "built successfully" not in log, log
    assert logs[1] == ""  # rank 1 says nothing
    lines = logs[0].splitlines()
    (startup,) = [l for l in lines if l.startswith(" > start-up")]
    assert re.fullmatch(r" > start-up \(seconds\): validation [\d.]+, distributed [\d.]+, data [\d.]+, model and "
                        r"engine [\d.]+; [\d.]+ in all before the first step", startup.replace("imports 0.00, ", "")), startup
    # The first iteration line adds the time from the start to the end of step 1; the others do not.
    iterations = [l for l in lines if "] iteration " in l]
    assert len(iterations) == LAYOUT_STEPS and re.search(r"\| time to first step \(s\): [\d.]+ \|$", iterations[0])
    assert all("time to first step" not in l for l in iterations[1:])
    # On CPU the first step compiles LEV's mode product (torch.compile), and says so before its line.
    (compiled,) = [i for i, l in enumerate(lines) if l.startswith(" > compiled ")]
    assert re.fullmatch(r" > compiled LEV's CPU mode product in [\d.]+ s \(torch.compile, during the first step: "
                        r"[\d.]+ s\)", lines[compiled]) and lines[compiled + 1] == iterations[0], lines[compiled:]
    # Everything else: the config summary, evaluation, checkpoints.
    others = [l for l in lines if l not in iterations and l not in (startup, lines[compiled])]
    assert len(others) <= 25, others


def test_bf16_layouts_match_one_rank(bf16_work):
    """TP=2, PP=2, DP=2 under ZeRO-1/2/3 in bf16: the 1-rank bf16 losses and grad norms,
    step by step, and the same validation loss."""
    work, _ = bf16_work
    ref = train_records(work, "bf16_ref")
    assert sorted(ref) == list(range(1, LAYOUT_STEPS + 1))
    ref_valid = {r["iteration"]: r["valid_loss"] for r in read_metrics(work, "bf16_ref") if "valid_loss" in r}
    diffs = {}
    for name in LAYOUTS:
        got = train_records(work, f"bf16_{name}")
        assert sorted(got) == list(range(1, (TRAIN_ITERS if name == "dp2_z1" else LAYOUT_STEPS) + 1)), name
        got = {i: got[i] for i in ref}
        diffs[name] = max(abs(got[i]["loss"] - ref[i]["loss"]) for i in got)
        for i in got:
            assert got[i]["grad_norm"] == pytest.approx(ref[i]["grad_norm"], rel=2e-2), (name, i)
            assert got[i]["lr"] == ref[i]["lr"] and got[i]["consumed_tokens"] == ref[i]["consumed_tokens"]
        valid = {r["iteration"]: r["valid_loss"] for r in read_metrics(work, f"bf16_{name}")
                 if "valid_loss" in r and r["iteration"] <= LAYOUT_STEPS}
        assert sorted(valid) == sorted(ref_valid) == [SAVE_AT, LAYOUT_STEPS]
        diffs[name + " valid"] = max(abs(valid[i] - ref_valid[i]) for i in valid)
    print("bf16 layouts, max |loss - 1 rank| over 6 steps:", diffs)
    assert max(diffs.values()) < BF16_LOSS_ATOL, diffs
    # The runs really were bf16: the saved module weights are bf16.
    module = safe_torch_load(os.path.join(work, "ckpt_dp2_z1", checkpoint_tag(SAVE_AT),
                                          "mp_rank_00_model_states.pt"))["module"]
    assert {v.dtype for v in module.values() if v is not None} == {torch.bfloat16}


def test_bf16_exact_resume(bf16_work):
    """bf16, DP=2 ZeRO-1: 15 steps, --load, 15 more == 30 uninterrupted steps, bit for bit
    (losses, grad norms, learning rates, samples, validation losses)."""
    work, _ = bf16_work
    full, resumed = train_records(work, "bf16_dp2_z1"), train_records(work, "bf16_resume")
    assert sorted(resumed) == list(range(RESUME_AT + 1, TRAIN_ITERS + 1))
    for key in ("loss", "grad_norm", "lr", "consumed_samples"):
        assert [resumed[i][key] for i in resumed] == [full[i][key] for i in resumed], key
    valid = [(r["iteration"], r["valid_loss"]) for r in read_metrics(work, "bf16_resume") if "valid_loss" in r]
    assert len(valid) == 5 and valid == [(r["iteration"], r["valid_loss"]) for r in read_metrics(work, "bf16_dp2_z1")
                                         if "valid_loss" in r and r["iteration"] > RESUME_AT]


@pytest.mark.parametrize("stage", ["", "z2_"], ids=["zero1", "zero2"])
def test_dp_gradients_reduced_in_fp32(bf16_work, stage):
    """bf16 model, DP=2 (ZeRO-1: BF16_Optimizer's all-reduce; ZeRO-2: bucketed reduce-scatter):
    the reduced fp32 gradients equal 1 rank's (2 micro-batches accumulated in fp32) to fp32
    precision, while a bf16 reduction (DeepSpeed's default for a bf16 model) is off by bf16
    rounding."""
    _, grads = bf16_work
    ref, fp32, bf16 = grads["grads_ref"], grads[f"grads_{stage}fp32"], grads[f"grads_{stage}bf16"]
    assert sorted(ref) == sorted(fp32) == sorted(bf16) and len(ref) > 10

    def max_rel(got):
        return max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max()) for n in ref if ref[n].abs().max() > 0)

    fp32_err, bf16_err = max_rel(fp32), max_rel(bf16)
    print(f"DP=2 {'ZeRO-2' if stage else 'ZeRO-1'} vs 1 rank, max |grad diff| / max |grad| per tensor: fp32 "
          f"reduction {fp32_err:.3g}, bf16 reduction {bf16_err:.3g}")
    assert fp32_err < 1e-6  # fp32 rounding of one sum (2**-24 = 6e-8)
    assert bf16_err > 1e-4  # bf16 rounding (2**-9 = 2e-3)


def test_resume_at_another_scale(bf16_work):
    """Checkpoints of DP=2 (ZeRO-1, ZeRO-2), TP=2 and PP=2 resumed on 1 rank (DeepSpeed's
    universal checkpoint, converted by the trainer): steps 4-6 continue the uninterrupted
    2-rank run (same data, LR, optimizer state) within the bf16 layout tolerance."""
    work, _ = bf16_work
    diffs = {}
    for name in SCALE_CHANGES:
        full, resumed = train_records(work, f"bf16_{name}"), train_records(work, f"scale_{name}")
        assert sorted(resumed) == list(range(SAVE_AT + 1, LAYOUT_STEPS + 1)), name
        for i in resumed:
            for key in ("lr", "consumed_samples", "consumed_tokens"):
                assert resumed[i][key] == full[i][key], (name, i, key)
            assert resumed[i]["grad_norm"] == pytest.approx(full[i]["grad_norm"], rel=2e-2), (name, i)
        diffs[name] = max(abs(resumed[i]["loss"] - full[i]["loss"]) for i in resumed)
        valid = [r for r in read_metrics(work, f"scale_{name}") if "valid_loss" in r]
        full_valid = [r for r in read_metrics(work, f"bf16_{name}") if r.get("iteration") == LAYOUT_STEPS
                      and "valid_loss" in r]
        diffs[name + " valid"] = abs(valid[0]["valid_loss"] - full_valid[0]["valid_loss"])
        universal = os.path.join(work, f"ckpt_from_{name}", checkpoint_tag(SAVE_AT),
                                 UNIVERSAL)
        assert os.path.isfile(os.path.join(universal, COMPLETE_MARKER)), name
    print("resumed on 1 rank vs uninterrupted 2-rank run, max |loss diff| steps 4-6:", diffs)
    assert max(diffs.values()) < BF16_LOSS_ATOL, diffs

    # --no-load-optim: weights only, but iteration, samples and the LR schedule continue; fresh
    # AdamW moments make a visibly different run (so the full resume above did load them).
    no_optim, full = train_records(work, "scale_dp2_z1_no_optim"), train_records(work, "bf16_dp2_z1")
    assert sorted(no_optim) == list(range(SAVE_AT + 1, LAYOUT_STEPS + 1))
    assert [no_optim[i]["lr"] for i in no_optim] == [full[i]["lr"] for i in no_optim]
    assert [no_optim[i]["consumed_samples"] for i in no_optim] == [full[i]["consumed_samples"] for i in no_optim]
    fresh_moments = max(abs(no_optim[i]["loss"] - full[i]["loss"]) for i in no_optim)
    print(f"--no-load-optim vs uninterrupted: max |loss diff| {fresh_moments:.3g}")
    assert fresh_moments > 3 * diffs["dp2_z1"]


def test_impossible_layout_changes_say_what_to_do(bf16_work, tiny_dataset, spm_tokenizer, tmp_path, monkeypatch,
                                                  capsys):
    """ZeRO-1/2 <-> ZeRO-3 is refused before anything is built; a checkpoint without
    universal_checkpoint_info (saved before this support) gets a ConfigError naming the way out."""
    work, _ = bf16_work
    ckpt = os.path.join(work, "ckpt_dp2_z1")
    flags = train_flags(tiny_dataset, spm_tokenizer, str(tmp_path), "err", "--config", "tiny-lev", "--bf16")
    err = _main_error(monkeypatch, capsys, *flags, "--load", ckpt, "--zero-stage", "3")
    latest = checkpoint_tag(TRAIN_ITERS)
    assert err.startswith(f"megatron_lev.train: error: --load {ckpt}: checkpoint {latest} was saved under ZeRO "
                          "stage 1 and this run uses stage 3 (zero stage: 1 -> 3)")
    assert err.endswith("DeepSpeed's universal checkpoint does not convert between ZeRO-3 and stages 1/2; resume "
                        "with --zero-stage 1")

    old = str(tmp_path / "old")
    tag = checkpoint_tag(SAVE_AT)
    shutil.copytree(os.path.join(ckpt, tag), os.path.join(old, tag))
    for name in os.listdir(os.path.join(old, tag)):
        if name.startswith("mp_rank_"):
            path = os.path.join(old, tag, name)
            state = safe_torch_load(path)
            del state[UNIVERSAL_INFO_KEY]
            torch.save(state, path)
    with pytest.raises(ConfigError, match=f"checkpoint {tag} predates universal checkpoint support .*resume it with "
                                          "the layout it was saved with, let it save once, then change the layout"):
        convert_to_universal(old, tag, pipeline=False, num_layers=2, tied=False)
    assert not os.path.exists(os.path.join(old, tag, UNIVERSAL))
