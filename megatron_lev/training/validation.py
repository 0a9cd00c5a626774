"""The start-up path of a training run: every check, in one place, before anything is built.

    run = validate_run(argv, world_size, rank)    # ConfigError / ValueError / FileNotFoundError

In order: the flags over the YAML and the job size (arguments.py); the DeepSpeed config and
the installed DeepSpeed's known bugs for it; the datasets (paths, blends, every split has
documents); the tokenizer, the vocabulary it gives the model and the ids the data holds;
that the data was tokenized with this tokenizer; the --save folder; and, when --load names a
checkpoint, that its model, tokenizer, seed, parallel layout and LR schedule agree with this run. The trainer (megatron_lev/train.py)
builds nothing until this returns; the Slurm scripts' dry run calls the same checks at
submit time:

    python -m megatron_lev.training.validation --world-size 16 --config lev-1.2b ...

Nothing here starts torch.distributed or reads more of a checkpoint than its config.json.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

from megatron_lev.checkpointing.catalog import read_checkpoint_config, select_checkpoint
from megatron_lev.checkpointing.universal import layout_changes, zero_stage
from megatron_lev.data.datasets import max_token_id, plan_datasets, preprocessing_stats
from megatron_lev.data.tokenizer import build_tokenizer
from megatron_lev.models.config import FIELD_DEFAULTS, LeviathanConfig, model_config_from_dict
from megatron_lev.training.arguments import effective_config, validate_flags
from megatron_lev.training.tokenizer_args import derive_vocab_size, padded_vocab_line, tokenizer_source
from megatron_lev.training.batches import dataset_arguments
from megatron_lev.training.optim import schedule_mismatch
from megatron_lev.utils.errors import ConfigError
from megatron_lev.utils.versions import untested_versions_warning

DATA_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


@dataclass
class Run:
    """A validated run: what the trainer builds from."""

    args: argparse.Namespace
    ds_config: dict
    tokenizer: object
    model_config: LeviathanConfig
    config: dict  # the effective configuration: printed at start, saved with every checkpoint
    resume_tag: Optional[str] = None  # the --load checkpoint the checks ran against (None: fresh start)
    layout_changes: list[str] = field(default_factory=list)  # how this run's layout differs from it


def validate_run(argv=None, world_size: int = 1, rank: int = 0) -> Run:
    """Every check of a training run, in order (module docstring); the first problem is raised
    as one line naming the flag, file or field. Warnings (rank 0) go to stderr."""
    args, ds_config = validate_flags(argv, world_size)
    check_deepspeed_version(ds_config, args.deepspeed_config_path)
    untested = untested_versions_warning()
    if untested and rank == 0:
        print(untested, file=sys.stderr, flush=True)
    plan = plan_datasets(**dataset_arguments(args))
    prefixes = data_prefixes(args, plan)
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
    # A resumed run keeps its checkpoint's vocabulary (Megatron: "if not already set from a
    # checkpoint"), so runs saved when a packaged vocab_size still pinned it resume unchanged.
    resume_tag = select_checkpoint(args.load, args.ckpt_step) if args.load else None
    saved_model = (read_checkpoint_config(args.load, resume_tag).get("model") or {}) if resume_tag else {}
    padded = derive_vocab_size(args, tokenizer.vocab_size, saved_model.get("vocab_size"))
    if rank == 0:
        print(padded_vocab_line(args.model["vocab_size"], padded), flush=True)
    model_config = build_model_config(args)
    check_vocab(args, tokenizer, prefixes, model_config.vocab_size)
    check_data_tokenizer(args, tokenizer, prefixes)
    check_save_folder(args)
    if args.ckpt_step is not None and not args.load:
        raise ConfigError(f"--ckpt-step {args.ckpt_step}: needs --load (the folder holding that checkpoint)")
    config = effective_config(args, model_config.to_dict())
    config["deepspeed"] = ds_config
    config["tokenizer"] = tokenizer.describe()
    run = Run(args=args, ds_config=ds_config, tokenizer=tokenizer, model_config=model_config, config=config)
    if args.load:
        run.resume_tag = resume_tag
        if run.resume_tag is not None:
            run.layout_changes = check_resume(args, run.resume_tag, config, rank)
    return run


# The first DeepSpeed release whose ZeRO-1/2 gradient buckets wait for every stream that
# filled them (deepspeedai/DeepSpeed PR #8080, fixing #8061: compiled backward hooks on several
# streams, NaN from step 1); it also has the fixes of #7188 (0.17.2-0.18.4: loss goes to 0).
DEEPSPEED_OVERLAP_COMM_FIXED = "0.19.3"


def check_deepspeed_version(ds_config: dict, source: str, installed: Optional[str] = None) -> None:
    """ZeRO stage 1 or 2 with overlap_comm on a DeepSpeed older than DEEPSPEED_OVERLAP_COMM_FIXED
    is refused: its gradient-bucket races silently corrupt gradients. `source`: the DeepSpeed
    JSON's path; `installed`: the version to check (default: the installed distribution's;
    nothing to check without one)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    zero = ds_config.get("zero_optimization") or {}
    if zero.get("stage", 0) not in (1, 2) or not zero.get("overlap_comm", False):
        return
    if installed is None:
        try:
            installed = version("deepspeed")
        except PackageNotFoundError:
            return
    if Version(installed) < Version(DEEPSPEED_OVERLAP_COMM_FIXED):
        raise ConfigError(
            f"DeepSpeed {installed} with ZeRO stage {zero['stage']} and overlap_comm can corrupt gradients (races in "
            f"its gradient buckets, deepspeedai/DeepSpeed#7188 and #8061, fixed in {DEEPSPEED_OVERLAP_COMM_FIXED} by "
            f"PR #8080): install deepspeed>={DEEPSPEED_OVERLAP_COMM_FIXED}, or set \"overlap_comm\": false in "
            f"{source} (--deepspeed-config)")


def build_model_config(args):
    # --seed seeds the weights too (Megatron's meaning) unless the YAML pins model.init_seed.
    overrides = {} if "init_seed" in args.model else {"init_seed": args.seed}
    return model_config_from_dict(
        args.model, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, bf16=bool(args.bf16),
        sequence_parallel=bool(args.sequence_parallel), recompute=args.recompute, **overrides)


def data_prefixes(args, plan) -> list[tuple[str, str]]:
    """(flag, prefix) of every dataset the run names, from the checked plan."""
    if plan.blend is not None:
        return [("--data-path", prefix) for prefix in plan.blend[0]]
    return [("--" + dest.replace("_", "-"), prefix) for dest, blend in zip(DATA_FLAGS[1:], plan.blend_per_split)
            for prefix in (blend[0] if blend else ())]


def check_vocab(args, tokenizer, prefixes: list[tuple[str, str]], vocab_size: int) -> None:
    """Ids the model's vocabulary cannot hold stop the run here."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"{tokenizer_source(args)} has {tokenizer.vocab_size} tokens but the "
                          f"model's vocab_size is {vocab_size} ({args.config}): raise model.vocab_size")
    for flag, prefix in prefixes:
        highest = max_token_id(prefix, args.data_cache_path)
        if highest >= vocab_size:
            raise ConfigError(f"{flag} {prefix}: holds token id {highest}, outside the model's vocab_size "
                              f"{vocab_size} ({args.config}): was it tokenized with another tokenizer?")


def check_data_tokenizer(args, tokenizer, prefixes: list[tuple[str, str]]) -> None:
    """Data preprocessed with another tokenizer than --tokenizer-model stops the run: the
    preprocessing sidecar (.stats.json) records the tokenizer's content hash."""
    now = tokenizer.describe()
    for flag, prefix in prefixes:
        recorded = ((preprocessing_stats(prefix) or {}).get("tokenizer") or {})
        if recorded.get("sha256") and recorded["sha256"] != now["sha256"]:
            raise ConfigError(
                f"{flag} {prefix}: was tokenized with {recorded.get('model')} (sha256 {recorded['sha256'][:12]}), "
                f"but {tokenizer_source(args)} is another tokenizer (sha256 {now['sha256'][:12]}): "
                "train with the data's tokenizer or preprocess the data again with this one")


def check_save_folder(args) -> None:
    """--save into a folder that already holds files, without --load, would overwrite
    another run (checkpoints, `latest`, metrics.jsonl): refused. Resuming is explicit."""
    if args.save and not args.load and os.path.isdir(args.save) and os.listdir(args.save):
        names = sorted(os.listdir(args.save))
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} entries)" if len(names) > 3 else "")
        raise ConfigError(f"--save {args.save}: the folder is not empty ({shown}); resume that run with --load "
                          f"{args.save}, or choose a new --save folder")


# --------------------------------------------------------------------------- resuming


def check_resume(args, tag: str, config: dict, rank: int) -> list[str]:
    """The --load checkpoint `tag` against this run: model, tokenizer and seed, parallel
    layout, LR schedule (each check below). Returns the layout changes (`layout_changes`)."""
    saved = read_checkpoint_config(args.load, tag)
    check_resume_compatible(args.load, tag, saved, config)
    check_resume_run(args, saved, config, rank)
    changes = layout_changes(saved, config)
    if changes:
        check_layout_change(args.load, tag, saved, config, changes)
    check_resume_schedule(args, saved, config)
    return changes


# Model fields that only matter before the first step (the weights come from the checkpoint).
_INIT_ONLY_KEYS = ("init_seed", "init_method_std")


def check_resume_compatible(ckpt_dir: str, tag: str, saved: dict, config: dict) -> None:
    """Refuse a checkpoint whose model differs from this run's, naming every differing
    field. `saved` is the checkpoint's config, `config` this run's (`effective_config`). A
    different parallel layout is no reason to refuse (`layout_changes`)."""
    # A field a model section predates was built with its default value.
    saved_model, model = {**FIELD_DEFAULTS, **saved.get("model", {})}, {**FIELD_DEFAULTS, **config["model"]}
    diffs = [f"{key}: {saved_model.get(key, '<unset>')!r} in the checkpoint, {model.get(key, '<unset>')!r} now"
             for key in sorted(set(saved_model) | set(model))
             if key not in _INIT_ONLY_KEYS and saved_model.get(key) != model.get(key)]
    if diffs:
        raise ConfigError(f"--load {ckpt_dir}: checkpoint {tag} was saved with a different model config ("
                          + "; ".join(diffs) + "); resume with the checkpoint's settings or use a new --save "
                          "directory")


def check_resume_run(args, saved: dict, config: dict, rank: int) -> None:
    """A resumed run must keep the checkpoint's tokenizer (ids mean other text) and seed
    (it orders the data: another seed replays or skips samples mid-run); both refused
    unless --override-checkpoint-args. Another data path is allowed, with a warning."""
    diffs = []
    then_tok, now_tok = saved.get("tokenizer") or {}, config.get("tokenizer") or {}
    if then_tok.get("sha256") and then_tok["sha256"] != now_tok.get("sha256"):
        diffs.append(f"tokenizer: {then_tok.get('model')} (sha256 {then_tok['sha256'][:12]}) in the checkpoint, "
                     f"{now_tok.get('model')} (sha256 {now_tok.get('sha256', '')[:12]}) now")
    then_seed, now_seed = saved.get("training", {}).get("seed"), config["training"].get("seed")
    if then_seed is not None and then_seed != now_seed:
        diffs.append(f"seed: {then_seed} in the checkpoint, {now_seed} now")
    if diffs and not args.override_checkpoint_args:
        raise ConfigError(f"--load {args.load}: the checkpoint's run used another " + "; ".join(diffs)
                          + ": resume with the checkpoint's values, or add --override-checkpoint-args")
    changed_data = [f"{key}: {saved['training'].get(key)!r} in the checkpoint, {config['training'].get(key)!r} now"
                    for key in DATA_FLAGS if saved.get("training", {}).get(key) != config["training"].get(key)]
    if rank == 0:
        for text in diffs + changed_data:
            print(f"warning: --load {args.load}: resuming with another {text}", file=sys.stderr, flush=True)


def check_layout_change(ckpt_dir: str, tag: str, saved: dict, config: dict, changes: list[str]) -> None:
    """Refuse the layout changes a universal checkpoint cannot make, saying what to do."""
    then, now = zero_stage(saved), zero_stage(config)
    if (then == 3) != (now == 3):
        # DeepSpeed names ZeRO-3 model files per data-parallel rank (zero_pp_rank_*), the
        # others per model-parallel rank; its universal loader only finds its own kind.
        raise ConfigError(f"--load {ckpt_dir}: checkpoint {tag} was saved under ZeRO stage {then} and this run "
                          f"uses stage {now} ({'; '.join(changes)}): DeepSpeed's universal checkpoint does not "
                          f"convert between ZeRO-3 and stages 1/2; resume with --zero-stage {then}")


def check_resume_schedule(args, saved: dict, config: dict) -> None:
    """Megatron's rule: resuming with another LR/WD schedule (a longer --train-iters, a new
    --lr, ...) is refused unless --override-opt_param-scheduler (use the flags) or
    --use-checkpoint-opt_param-scheduler (keep the checkpoint's) says which one wins.
    Weights-only loads (--no-load-optim) follow the flags' schedule (the trainer re-steps it).
    Turning --decoupled-lr (or the LEV generator's own groups) on or off changes the optimizer's
    parameter groups, which no flag can reconcile with the saved moments: that needs --no-load-optim."""
    then, now = saved.get("training", {}).get("decoupled_lr"), config["training"].get("decoupled_lr")
    if not args.no_load_optim and (then is None) != (now is None):
        raise ConfigError(f"--load {args.load}: the checkpoint's optimizer was saved "
                          f"{'with --decoupled-lr ' + str(then) if then is not None else 'without --decoupled-lr'} "
                          f"and this run {'sets --decoupled-lr ' + str(now) if now is not None else 'does not'}: "
                          f"its parameter groups differ; keep the checkpoint's setting or add --no-load-optim")
    def generator_apart(training: dict) -> bool:  # engine.lev_groups_apart on a saved config
        return training.get("lev_lr_mult", 1.0) != 1.0 or training.get("lev_clip_grad") is not None

    then, now = generator_apart(saved.get("training", {})), generator_apart(config["training"])
    if not args.no_load_optim and then != now:
        raise ConfigError(f"--load {args.load}: the checkpoint's optimizer was saved {'with' if then else 'without'} "
                          f"the LEV generator in groups of its own (--lev-lr-mult / --lev-clip-grad) and this run "
                          f"{'puts it there' if now else 'does not'}: its parameter groups differ; keep the "
                          "checkpoint's setting or add --no-load-optim")
    then, now = (bool(t.get("lev_no_weight_decay")) for t in (saved.get("training", {}), config["training"]))
    if not args.no_load_optim and then != now:
        raise ConfigError(f"--load {args.load}: the checkpoint's optimizer was saved {'with' if then else 'without'} "
                          f"--lev-no-weight-decay and this run {'sets it' if now else 'does not'}: its parameter "
                          "groups differ; keep the checkpoint's setting or add --no-load-optim")
    if args.no_load_optim or args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    changed = schedule_mismatch(saved.get("training", {}), config["training"])
    if changed:
        raise ConfigError(f"--load {args.load}: the LR schedule differs from the checkpoint's ({'; '.join(changed)}; "
                          f"in samples): add --override-opt_param-scheduler to use the new one or "
                          f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's")


# --------------------------------------------------------------------------- the dry run


def main(argv=None) -> int:
    """`python -m megatron_lev.training.validation --world-size N <training flags>`: run every
    check for a job of N processes; print a summary and exit 0, or the one-line error and 2."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--world-size", type=int, default=1)
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        run = validate_run(rest, known.world_size)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"megatron_lev.train: error: {exc}", file=sys.stderr, flush=True)
        return 2
    from megatron_lev.training.run_summary import summarize_config

    print(summarize_config(run.config, os.path.join(run.args.save, "config.yaml") if run.args.save else "(no --save)"))
    if run.resume_tag:
        print(f"resumes from {os.path.join(run.args.load, run.resume_tag)}"
              + (f" through a universal checkpoint ({'; '.join(run.layout_changes)})" if run.layout_changes else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
