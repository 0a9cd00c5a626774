"""Issue 50, item 3: --lev-union-ids, the LEV generator run once per optimizer step on the union of
the step's micro-batches' distinct ids (training/union_ids.py). Against the per-micro-batch path on
the same weights and batches: the same losses, gradient norms and parameters to float32 rounding
(1 rank in-process under ZeRO-1/2, fp32 and bf16; 2 gloo ranks at TP=2 and at DP=2 through
`megatron_lev.train.main`), one generator forward per step instead of G, and its refusals."""
import os

import pytest
import torch

from megatron_lev.utils.errors import ConfigError
from tests.distributed import run_distributed
from tests.test_model import single_rank  # noqa: F401  (module-scoped fixture: one in-process rank)
from tests.test_train_setup import args_for

STEPS = 3
# Micro-batch 2 x 16 tokens over ids 4..150: the micro-batches share ids, so |U| < the sum of their counts.
SMALL = ("--micro-batch-size", "2", "--seq-length", "16", "--lr", "3e-3", "--lr-warmup-iters", "0",
         "--clip-grad", "0", "--train-iters", "10")


def _batches(count, micro=2, seq=16, seed=0):
    from megatron_lev.lev.generator import ids_to_evaluate

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(4, 150, (micro, seq + 1), generator=g)
        b = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(micro, seq),
             "position_ids": torch.arange(seq).expand(micro, seq)}
        b["lev_ids"], b["lev_inverse"] = ids_to_evaluate(b["tokens"], 1000, unique=True)
        out.append(b)
    return out


def _train(flags, steps=STEPS, world_size=1, break_injection=False):
    """Trainer.train_step for `steps` optimizer steps on a fresh engine: per step the mean loss, the
    gradient norm and the generator's forward calls; the final parameters; the union sizes."""
    from megatron_lev.distributed.rng import set_seed
    from megatron_lev.training import union_ids
    from megatron_lev.training.ds_config import build_deepspeed_config
    from megatron_lev.training.engine import build_engine
    from megatron_lev.training.timers import StepTimers
    from megatron_lev.training.trainer import Trainer
    from megatron_lev.training.validation import build_model_config

    args = args_for(*SMALL, *flags, world_size=world_size)
    set_seed(args.seed)
    engine = build_engine(args, build_model_config(args), build_deepspeed_config(args))
    trainer = Trainer.__new__(Trainer)  # the step alone: no datasets, checkpoints or metrics
    trainer.engine, trainer.args, trainer.timers = engine, args, StepTimers(torch.device("cpu"), level=2)
    trainer.is_pipeline, trainer.count_distinct, trainer.union_ids = False, True, bool(args.lev_union_ids)
    calls = []
    engine.module.embedding.generator.register_forward_hook(lambda m, i, o: calls.append(i[0].numel()))
    batches = iter(_batches(steps * args.gradient_accumulation_steps))
    original = union_ids._AddGradient.apply
    if break_injection:  # the negative control: the earlier micro-batches' generator gradient dropped
        union_ids._AddGradient.apply = staticmethod(lambda rows, extra: rows)
    losses, norms, counts, distinct = [], [], [], []
    try:
        for _ in range(steps):
            before = len(calls)
            loss, seen = trainer.train_step(batches)
            losses.append(float(loss))
            norms.append(float(engine.get_global_grad_norm()))
            counts.append(len(calls) - before)
            distinct.append(seen)
    finally:
        union_ids._AddGradient.apply = original
    params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return dict(losses=losses, norms=norms, calls=counts, distinct=distinct, params=params,
                accumulation=args.gradient_accumulation_steps)


def _max_differences(a, b):
    loss = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    norm = max(abs(x - y) / y for x, y in zip(a["norms"], b["norms"]))
    # Adam divides by sqrt(v): a last-bit difference of a tiny gradient moves a parameter by more than
    # float32 rounding of its value, so parameters are held to 1e-5 after updates of up to 3e-3 a step.
    param = max(float((a["params"][n] - b["params"][n]).abs().max()) for n in a["params"])
    return loss, norm, param


@pytest.mark.parametrize("flags, tol", [
    (("--global-batch-size", "6", "--zero-stage", "1"), (1e-6, 1e-5, 1e-5)),
    (("--global-batch-size", "4", "--zero-stage", "2", "--attention-dropout", "0.2"), (1e-6, 1e-5, 1e-5)),
    # bf16: the generator's parameters get one bf16 gradient of the float32 sum over micro-batches, where
    # the per-micro-batch path rounds each micro-batch's to bf16 before DeepSpeed sums them in float32.
    # (8 bits of mantissa: 7.8e-3 is one step of a parameter near 1).
    (("--global-batch-size", "6", "--zero-stage", "2", "--bf16"), (1e-3, 2e-3, 1.6e-2)),
], ids=["G3-zero1", "G2-zero2-dropout", "G3-zero2-bf16"])
def test_union_step_equals_the_per_micro_batch_step(single_rank, flags, tol):  # noqa: F811
    per_micro = _train(flags)
    union = _train((*flags, "--lev-union-ids"))
    g = union["accumulation"]
    assert g in (2, 3)
    assert per_micro["calls"] == [g] * STEPS and union["calls"] == [1] * STEPS  # forwards per step
    assert all(u < p for u, p in zip(union["distinct"], per_micro["distinct"]))  # ids shared by micro-batches
    assert union["losses"][0] == per_micro["losses"][0]  # the same rows: the first step's loss bit for bit
    loss, norm, param = _max_differences(union, per_micro)
    print(f"max differences ({'-'.join(flags)}): loss {loss:.3g}, grad norm (rel.) {norm:.3g}, parameter {param:.3g}")
    assert loss <= tol[0] and norm <= tol[1] and param <= tol[2], (loss, norm, param)
    if "--bf16" in flags:
        return
    # The negative control: without the earlier micro-batches' gradient the test fails by far.
    broken = _train((*flags, "--lev-union-ids"), steps=1, break_injection=True)
    assert abs(broken["norms"][0] - per_micro["norms"][0]) / per_micro["norms"][0] > 100 * tol[1]


def test_one_micro_batch_per_step_changes_nothing(single_rank):  # noqa: F811
    flags = ("--global-batch-size", "2")
    per_micro, union = _train(flags, steps=2), _train((*flags, "--lev-union-ids"), steps=2)
    assert union["accumulation"] == 1 and union["calls"] == per_micro["calls"] == [1, 1]
    assert union["losses"] == per_micro["losses"] and union["norms"] == per_micro["norms"]
    assert all(torch.equal(union["params"][n], per_micro["params"][n]) for n in union["params"])


def test_refusals_name_the_flag_in_one_line(tmp_path):
    import yaml

    from megatron_lev.configs import load_config
    from megatron_lev.training.ds_config import build_deepspeed_config

    def refused(*flags, world_size=2):
        with pytest.raises(ConfigError) as err:
            build_deepspeed_config(args_for("--lev-union-ids", *flags, world_size=world_size))
        message = str(err.value)
        assert message.startswith("--lev-union-ids") and "\n" not in message
        return message

    for kind in ("tied", "untied", "factorized"):
        assert refused("--embedding", kind) == f"--lev-union-ids: the model has no LEV generator (embedding: {kind})"
    assert refused("--pipeline-model-parallel-size", "2").startswith(
        "--lev-union-ids: not supported with --pipeline-model-parallel-size 2")
    assert refused("--zero-stage", "3").startswith("--lev-union-ids: not supported with ZeRO-3")
    assert refused("--tensor-model-parallel-size", "2", "--sequence-parallel").startswith(
        "--lev-union-ids: not supported with --sequence-parallel")
    per_position = load_config("tiny-lev")
    per_position["model"]["lev"]["unique_ids"] = False
    (tmp_path / "per-position.yaml").write_text(yaml.safe_dump(per_position))
    assert refused("--config", str(tmp_path / "per-position.yaml")) == (
        "--lev-union-ids: not supported with model.lev.unique_ids false (the generator evaluated per position)")
    # The default is off; the YAML's training: section sets it as the flag does.
    assert args_for(world_size=1).lev_union_ids is False
    per_position["model"]["lev"]["unique_ids"] = True
    per_position["training"]["lev_union_ids"] = True
    (tmp_path / "union.yaml").write_text(yaml.safe_dump(per_position))
    assert args_for("--config", str(tmp_path / "union.yaml"), world_size=1).lev_union_ids is True
    build_deepspeed_config(args_for("--lev-union-ids", "--tensor-model-parallel-size", "2"))  # TP=2: accepted


# ---------------------------------------------------------------- 2 gloo ranks, through train.main

def _main_runs(rank, world_size, runs):
    """Each run's exit code and how many steps built a UnionIds (the flag reached the trainer)."""
    from megatron_lev.train import main
    from megatron_lev.training import trainer

    built = []

    class Counted(trainer.UnionIds):
        def __init__(self, *args):
            built.append(1)
            super().__init__(*args)

    trainer.UnionIds = Counted
    out = []
    for argv in runs:
        before = len(built)
        out.append((main(argv), len(built) - before))
    return out


def test_tp2_and_dp2_through_the_trainer(tiny_dataset, spm_tokenizer, tmp_path):
    """TP=2 (DP=1, G=2) and DP=2 under ZeRO-2 (micro 2, G=2): the metrics' losses and grad norms
    of 3 steps with and without --lev-union-ids."""
    from tests.test_train import read_metrics, train_flags

    work = str(tmp_path)
    layouts = {"tp2": ("--tensor-model-parallel-size", "2"), "dp2": ("--zero-stage", "2", "--micro-batch-size", "2")}
    runs = {}
    for layout, flags in layouts.items():
        for union in (False, True):
            name = f"{layout}_{'union' if union else 'per_micro'}"
            runs[name] = train_flags(tiny_dataset, spm_tokenizer, work, name, "--config", "tiny-lev", *flags,
                                     "--exit-interval", "3", "--eval-interval", "100",
                                     *(("--lev-union-ids",) if union else ()))
    codes = run_distributed(_main_runs, world_size=2, args=(list(runs.values()),), timeout=900)
    assert codes[0] == [(0, 3 if name.endswith("_union") else 0) for name in runs], dict(zip(runs, codes[0]))
    for layout in layouts:
        per_micro, union = ([r for r in read_metrics(work, f"{layout}_{kind}") if "loss" in r]
                            for kind in ("per_micro", "union"))
        assert [r["iteration"] for r in union] == [1, 2, 3] == [r["iteration"] for r in per_micro]
        loss = max(abs(u["loss"] - p["loss"]) for u, p in zip(union, per_micro))
        norm = max(abs(u["grad_norm"] - p["grad_norm"]) / p["grad_norm"] for u, p in zip(union, per_micro))
        print(f"max differences ({layout}): loss {loss:.3g}, grad norm (rel.) {norm:.3g}")
        assert union[0]["loss"] == per_micro[0]["loss"]
        assert loss <= 1e-6 and norm <= 1e-5, (layout, loss, norm)
        assert os.path.exists(os.path.join(work, f"{layout}_union", "metrics.jsonl"))
