"""Megatron's --decoupled-lr / --decoupled-min-lr: the input side (LEV generator or table) and
the output layer get their own peak and floor on the same warmup and decay, in the plain
optimizer, under DeepSpeed's engine (fp32 ZeRO-1 and bf16), and across a resume."""
import pytest
import torch

from megatron_lev.training.optim import DECOUPLED_LR_KEY, build_lr_scheduler, param_groups
from megatron_lev.training.validation import build_model_config, check_resume_schedule
from megatron_lev.training.arguments import effective_config
from megatron_lev.utils.errors import ConfigError
from tests.test_model import single_rank  # noqa: F401  (module-scoped fixture: one in-process rank)
from tests.test_train_setup import args_for

SCHEDULE = ("--lr", "1.0", "--min-lr", "0.1", "--train-iters", "14", "--lr-warmup-iters", "4",
            "--lr-decay-style", "cosine", "--global-batch-size", "8")


def _scheduler(*flags):
    """A scheduler over two plain groups and two --decoupled-lr groups, as param_groups orders them."""
    args = args_for(*flags, world_size=1)
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "weight_decay": 0.1},
              {"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.0},
              {"params": [torch.nn.Parameter(torch.zeros(2, 2))], "weight_decay": 0.1, DECOUPLED_LR_KEY: True},
              {"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.0, DECOUPLED_LR_KEY: True}]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    return args, opt, build_lr_scheduler(opt, args)


def _group_lrs(opt, sched, steps):
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        sched.step()
    return out


@pytest.mark.parametrize("kind", ["lev", "tied", "untied"])
def test_decoupled_groups_hold_the_input_side_and_the_output_layer(single_rank, kind):  # noqa: F811
    from megatron_lev.models.decoder import build_model

    args = args_for("--embedding", kind, "--decoupled-lr", "0.5", world_size=1)
    model = build_model(build_model_config(args))
    groups = param_groups(model, 0.1, decoupled=True)
    special = sorted(n for g in groups if g.get(DECOUPLED_LR_KEY) for n in g["param_names"])
    expected = sorted(n for n, _ in model.named_parameters() if n.startswith(("embedding.", "output_layer.")))
    assert special == expected and special
    assert not groups[0].get(DECOUPLED_LR_KEY) and groups[0]["weight_decay"] == 0.1  # group 0: --lr, logged
    # Weight decay per group is unchanged by the split: the same names decay as without it.
    decayed = sorted(n for g in groups if g["weight_decay"] > 0 for n in g["param_names"])
    plain = param_groups(model, 0.1)
    assert decayed == sorted(n for g in plain if g["weight_decay"] > 0 for n in g["param_names"])
    assert len(plain) == 2 and not any(g.get(DECOUPLED_LR_KEY) for g in plain)


def test_decoupled_schedule_runs_between_its_own_end_points():
    args, opt, sched = _scheduler(*SCHEDULE, "--decoupled-lr", "0.5", "--decoupled-min-lr", "0.05")
    lrs = _group_lrs(opt, sched, 15)
    main, decoupled = [r[0] for r in lrs], [r[2] for r in lrs]
    assert main[:5] == [0.0, 0.25, 0.5, 0.75, 1.0] and main[14] == pytest.approx(0.1)
    assert decoupled[:5] == [0.0, 0.125, 0.25, 0.375, 0.5]  # warmup from --lr-warmup-init to 0.5
    assert decoupled == pytest.approx([m / 2 for m in main], abs=1e-15)  # same shape, ends halved
    assert all(r[0] == r[1] and r[2] == r[3] for r in lrs)
    # --decoupled-min-lr defaults to --min-lr.
    _, opt2, sched2 = _scheduler(*SCHEDULE, "--decoupled-lr", "3.0")
    last = _group_lrs(opt2, sched2, 15)[14]
    assert last[0] == pytest.approx(0.1) and last[2] == pytest.approx(0.1)
    assert _group_lrs(opt2, sched2, 1)[0][2] == pytest.approx(0.1)


def test_decoupled_flags_are_checked():
    from megatron_lev.training.run_summary import summarize_config

    summary = summarize_config(effective_config(args_for(*SCHEDULE, "--decoupled-lr", "0.5")), "x")
    assert "lr 1 cosine -> 0.1, input side and output layer 0.5 -> 0.1, warmup 4 iterations" in summary
    with pytest.raises(ConfigError, match=r"^--decoupled-min-lr 0.01 needs --decoupled-lr$"):
        args_for("--decoupled-min-lr", "0.01")
    with pytest.raises(ConfigError, match=r"^--decoupled-min-lr 0.9 \(default: --min-lr\) must lie in \[0, "
                                          r"--decoupled-lr 0.5\]$"):
        args_for("--decoupled-lr", "0.5", "--decoupled-min-lr", "0.9")
    with pytest.raises(ConfigError, match=r"^--decoupled-lr -1.0 must be > 0"):
        args_for("--decoupled-lr", "-1")


def test_resume_checks_and_restores_the_decoupled_schedule():
    """Changing --decoupled-lr on resume is refused unless told which schedule wins; the winner
    is the one the decoupled groups follow after the load. Turning it on or off is refused
    (other parameter groups) unless the optimizer is not loaded."""
    old_args, _, old_sched = _scheduler(*SCHEDULE, "--decoupled-lr", "0.5")
    for _ in range(4):  # to the end of warmup: the rates are the peaks
        old_sched.step()
    saved = effective_config(old_args)
    assert saved["training"]["decoupled_lr"] == 0.5
    new = args_for(*SCHEDULE, "--decoupled-lr", "0.25", "--load", "/ckpt", world_size=1)
    with pytest.raises(ConfigError, match=r"LR schedule differs.*decoupled_lr 0.5 -> 0.25 \(--decoupled-lr\)"):
        check_resume_schedule(new, saved, effective_config(new))
    for flag, peak in (("--use-checkpoint-opt_param-scheduler", 0.5), ("--override-opt_param-scheduler", 0.25)):
        args, opt, sched = _scheduler(*SCHEDULE, "--decoupled-lr", "0.25", "--load", "/ckpt", flag)
        check_resume_schedule(args, saved, effective_config(args))
        sched.load_state_dict(old_sched.state_dict())
        sched.step(0)  # as DeepSpeed's first step after a load applies the rates
        assert sched.decoupled_lr == peak and opt.param_groups[2]["lr"] == peak
        assert opt.param_groups[0]["lr"] == 1.0
    for on, off in ((("--decoupled-lr", "0.5"), ()), ((), ("--decoupled-lr", "0.5"))):
        then = effective_config(args_for(*SCHEDULE, *on, world_size=1))
        now = args_for(*SCHEDULE, *off, "--load", "/ckpt", "--override-opt_param-scheduler", world_size=1)
        with pytest.raises(ConfigError, match=r"parameter groups differ; keep the checkpoint's setting or add "
                                              r"--no-load-optim$"):
            check_resume_schedule(now, then, effective_config(now))
        check_resume_schedule(args_for(*SCHEDULE, *off, "--load", "/ckpt", "--no-load-optim", world_size=1), then,
                              effective_config(now))


@pytest.mark.parametrize("precision", [(), ("--bf16",)], ids=["fp32_zero1", "bf16"])
def test_deepspeed_engine_applies_the_decoupled_rates(single_rank, precision):  # noqa: F811
    """DeepSpeed wraps the optimizer (ZeRO-1 / BF16_Optimizer): the groups keep their marks and
    each step's rates come from the right schedule."""
    from megatron_lev.distributed.rng import set_seed
    from megatron_lev.training.ds_config import build_deepspeed_config
    from megatron_lev.training.engine import build_engine

    args = args_for(*SCHEDULE, "--decoupled-lr", "0.5", "--decoupled-min-lr", "0.05", "--micro-batch-size", "8",
                    "--seq-length", "8", *precision, world_size=1)
    set_seed(args.seed)
    engine = build_engine(args, build_model_config(args), build_deepspeed_config(args))
    tokens = torch.randint(4, 1000, (8, 9), generator=torch.Generator().manual_seed(0))
    seen = []
    for _ in range(6):
        seen.append([g["lr"] for g in engine.optimizer.param_groups])
        loss = engine(tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(8, 8))
        engine.backward(loss)
        engine.step()
    marks = [bool(g.get(DECOUPLED_LR_KEY)) for g in engine.optimizer.param_groups]
    assert marks == [False, False, True, True]
    _, opt, sched = _scheduler(*SCHEDULE, "--decoupled-lr", "0.5", "--decoupled-min-lr", "0.05")
    assert seen == _group_lrs(opt, sched, 6)  # exactly the plain optimizer's rates, group by group
    assert seen[4] == [1.0, 1.0, 0.5, 0.5]
