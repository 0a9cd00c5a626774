"""Issue 32: the generator's own knobs on the training side: --lev-lr-mult (the LEV generator's
learning rate alone) and --lev-clip-grad (its gradients clipped apart from the body's), in the
plain optimizer and under DeepSpeed's engine, their refusals and their resume checks."""
import math

import pytest
import torch

from megatron_lev.training.arguments import effective_config
from megatron_lev.training.optim import DECOUPLED_LR_KEY, LEV_GROUP_KEY, build_lr_scheduler, param_groups
from megatron_lev.training.validation import build_model_config, check_resume_schedule
from megatron_lev.utils.errors import ConfigError
from tests.test_decoupled_lr import SCHEDULE, _group_lrs
from tests.test_model import single_rank  # noqa: F401  (module-scoped fixture: one in-process rank)
from tests.test_train_setup import args_for


def test_the_generator_gets_groups_of_its_own_only_when_asked(single_rank):  # noqa: F811
    from megatron_lev.models.decoder import build_model

    model = build_model(build_model_config(args_for("--embedding", "lev", world_size=1)))
    plain = param_groups(model, 0.1)
    assert len(plain) == 2 and not any(g.get(LEV_GROUP_KEY) for g in plain)
    groups = param_groups(model, 0.1, lev_separate=True)
    generator = sorted(n for g in groups if g.get(LEV_GROUP_KEY) for n in g["param_names"])
    assert generator == sorted(n for n, _ in model.named_parameters() if n.startswith("embedding.generator."))
    assert not groups[0].get(LEV_GROUP_KEY) and groups[0]["weight_decay"] == 0.1  # group 0 carries --lr
    # Weight decay is decided per parameter, as without the split.
    assert sorted(n for g in groups if g["weight_decay"] > 0 for n in g["param_names"]) == \
        sorted(n for g in plain if g["weight_decay"] > 0 for n in g["param_names"])
    # With --decoupled-lr too: the generator's groups are decoupled and LEV, the output layer's decoupled only.
    both = param_groups(model, 0.1, decoupled=True, lev_separate=True)
    assert [(bool(g.get(DECOUPLED_LR_KEY)), bool(g.get(LEV_GROUP_KEY))) for g in both] == \
        [(False, False), (False, False), (True, False), (True, True), (True, True)]


def _scheduler(*flags):
    args = args_for(*flags, world_size=1)
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "weight_decay": 0.1},
              {"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.0, DECOUPLED_LR_KEY: True},
              {"params": [torch.nn.Parameter(torch.zeros(2, 2))], "weight_decay": 0.1, LEV_GROUP_KEY: True},
              {"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.0, LEV_GROUP_KEY: True,
               DECOUPLED_LR_KEY: True}]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    return args, opt, build_lr_scheduler(opt, args)


def test_the_multiplier_scales_the_generator_schedule_alone():
    _, opt, sched = _scheduler(*SCHEDULE, "--lev-lr-mult", "0.25", "--embedding", "lev")
    lrs = _group_lrs(opt, sched, 15)
    main, lev = [r[0] for r in lrs], [r[2] for r in lrs]
    assert main[:5] == [0.0, 0.25, 0.5, 0.75, 1.0] and main[14] == pytest.approx(0.1)
    assert lev == [0.25 * m for m in main]
    assert [r[1] for r in lrs] == main  # a decoupled group without --decoupled-lr: the main schedule
    assert [r[3] for r in lrs] == lev
    # On top of --decoupled-lr: the generator's decoupled group runs at mult x the decoupled schedule.
    _, opt, sched = _scheduler(*SCHEDULE, "--lev-lr-mult", "2", "--decoupled-lr", "0.5", "--embedding", "lev")
    lrs = _group_lrs(opt, sched, 15)
    assert [r[3] for r in lrs] == pytest.approx([2 * r[1] for r in lrs], abs=1e-15)
    assert lrs[4] == [1.0, 0.5, 2.0, 1.0]


def test_bad_or_pointless_knob_flags_are_refused_in_one_line():
    from megatron_lev.training.run_summary import summarize_config
    from megatron_lev.training.ds_config import build_deepspeed_config

    with pytest.raises(ConfigError, match=r"^--lev-lr-mult must be a finite number > 0, got 0.0$"):
        args_for("--lev-lr-mult", "0", "--embedding", "lev")
    with pytest.raises(ConfigError, match=r"^--lev-clip-grad must be a finite number >= 0, got -1.0$"):
        args_for("--lev-clip-grad", "-1", "--embedding", "lev")
    for kind in ("tied", "untied"):
        with pytest.raises(ConfigError, match=rf"^--lev-lr-mult: the model has no LEV generator \(embedding: {kind}\)$"):
            args_for("--lev-lr-mult", "2", "--embedding", kind)
        with pytest.raises(ConfigError, match=rf"^--lev-clip-grad: the model has no LEV generator"):
            args_for("--lev-clip-grad", "1", "--embedding", kind)
    for flags, reason in ((("--zero-stage", "3"), "ZeRO-3"), (("--zero-stage", "1", "--bf16"), "ZeRO-1 with bf16")):
        with pytest.raises(ConfigError, match=rf"^--lev-clip-grad 1.0: not supported with {reason}"):
            build_deepspeed_config(args_for("--lev-clip-grad", "1", "--embedding", "lev", *flags, world_size=1))
    args = args_for("--lev-clip-grad", "0.5", "--embedding", "lev", world_size=1)
    assert build_deepspeed_config(args)["gradient_clipping"] == 0.0  # the trainer clips, not DeepSpeed
    summary = summarize_config(effective_config(args_for(*SCHEDULE, "--embedding", "lev", "--lev-lr-mult", "0.5",
                                                         "--lev-clip-grad", "0.3")), "x")
    assert "lr 1 cosine -> 0.1, LEV generator x0.5, LEV generator clipped apart at 0.3, warmup 4" in summary


def test_resume_refuses_other_groups_and_checks_the_multiplier():
    base = (*SCHEDULE, "--embedding", "lev")
    saved = effective_config(args_for(*base, "--lev-lr-mult", "0.5", world_size=1))
    now = args_for(*base, "--lev-lr-mult", "0.25", "--load", "/ckpt", world_size=1)
    with pytest.raises(ConfigError, match=r"LR schedule differs.*lev_lr_mult 0.5 -> 0.25 \(--lev-lr-mult\)"):
        check_resume_schedule(now, saved, effective_config(now))
    for then_flags, now_flags in ((("--lev-clip-grad", "1"), ()), ((), ("--lev-lr-mult", "2"))):
        then = effective_config(args_for(*base, *then_flags, world_size=1))
        now = args_for(*base, *now_flags, "--load", "/ckpt", "--override-opt_param-scheduler", world_size=1)
        with pytest.raises(ConfigError, match=r"in groups of its own .* add --no-load-optim$"):
            check_resume_schedule(now, then, effective_config(now))
    # Clipping apart with another threshold keeps the groups: no refusal.
    then = effective_config(args_for(*base, "--lev-clip-grad", "1", world_size=1))
    now = args_for(*base, "--lev-clip-grad", "2", "--load", "/ckpt", world_size=1)
    check_resume_schedule(now, then, effective_config(now))


# ---------------------------------------------------------------- under DeepSpeed's engine

ENGINE = (*SCHEDULE, "--embedding", "lev", "--micro-batch-size", "8", "--seq-length", "8")


def _engine(*flags):
    from megatron_lev.distributed.rng import set_seed
    from megatron_lev.training.ds_config import build_deepspeed_config
    from megatron_lev.training.engine import build_engine

    args = args_for(*ENGINE, *flags, world_size=1)
    set_seed(args.seed)
    return args, build_engine(args, build_model_config(args), build_deepspeed_config(args))


def _batch():
    tokens = torch.randint(4, 1000, (8, 9), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:], torch.ones(8, 8)


def _run(engine, steps):
    tokens, labels, mask = _batch()
    losses, norms, lrs = [], [], []
    for _ in range(steps):
        lrs.append([g["lr"] for g in engine.optimizer.param_groups])
        loss = engine(tokens, labels=labels, loss_mask=mask)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms, lrs


@pytest.mark.parametrize("zero", ["1", "2"])
def test_the_engine_clips_each_family_by_its_own_norm(single_rank, zero):  # noqa: F811
    """After backward, the generator's reduced gradients are scaled by min(1, C / norm_lev) and the
    rest by min(1, clip / norm_body), each norm over its own family, exactly as computed from a
    plain backward of the same model on the same batch."""
    from megatron_lev.models.decoder import build_model

    args, engine = _engine("--zero-stage", zero, "--lev-clip-grad", "0.05", "--clip-grad", "0.5")
    reference = build_model(build_model_config(args))
    reference.load_state_dict(engine.module.state_dict())
    tokens, labels, mask = _batch()
    reference(tokens, labels=labels, loss_mask=mask).backward()
    grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    lev_norm = math.sqrt(sum(g.double().pow(2).sum() for n, g in grads.items() if n.startswith("embedding.")))
    body_norm = math.sqrt(sum(g.double().pow(2).sum() for n, g in grads.items() if not n.startswith("embedding.")))
    assert lev_norm > 0.05 and body_norm > 0.5  # both families are clipped at these thresholds

    engine.backward(engine(tokens, labels=labels, loss_mask=mask))
    zero_opt = engine.optimizer
    total = float(zero_opt.scaled_global_norm())
    assert total == pytest.approx(math.hypot(lev_norm, body_norm), rel=1e-5)
    assert float(zero_opt.family_grad_norms["lev"]) == pytest.approx(lev_norm, rel=1e-5)
    assert float(zero_opt.family_grad_norms["body"]) == pytest.approx(body_norm, rel=1e-5)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    checked = 0
    for i, params in enumerate(zero_opt.params_in_partition):
        for param, grad in zip(params, zero_opt.averaged_gradients[i]):
            name = names[id(param)]
            factor = 0.05 / (lev_norm + 1e-6) if name.startswith("embedding.") else 0.5 / (body_norm + 1e-6)
            torch.testing.assert_close(grad.view_as(param), grads[name] * factor, rtol=1e-5, atol=1e-9)
            checked += 1
    assert checked == len(grads)
    zero_opt.zero_grad(set_to_none=True)


def test_groups_apart_change_nothing_until_they_clip_or_scale(single_rank):  # noqa: F811
    """The generator's own groups with no clipping and a multiplier of 1 train exactly as one group:
    the same losses and the same (unclipped) global norm; a multiplier reaches DeepSpeed's groups."""
    _, plain = _engine("--clip-grad", "0")
    base_losses, base_norms, _ = _run(plain, 5)
    _, apart = _engine("--clip-grad", "0", "--lev-clip-grad", "0")
    losses, norms, _ = _run(apart, 5)
    assert losses == base_losses and norms == pytest.approx(base_norms, rel=1e-6)
    _, scaled = _engine("--lev-lr-mult", "0.5")
    _, _, lrs = _run(scaled, 5)
    marks = [bool(g.get(LEV_GROUP_KEY)) for g in scaled.optimizer.param_groups]
    assert marks == [False, False, True, True]
    assert lrs[4] == [1.0, 1.0, 0.5, 0.5]
