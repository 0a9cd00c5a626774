"""Pre-training under DeepSpeed: `python -m megatron_lev.train --config lev-200m ...`.

    torchrun --nproc_per_node 8 -m megatron_lev.train --config lev-1.2b \
        --data-path /data/pile_text_document --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model /data/tok.model --save ckpt --load ckpt --bf16

What a run does, in order:
1. parse flags over the YAML (arguments.py), check the batch arithmetic, build the
   DeepSpeed config (ds_config.py), check the data paths, the tokenizer/dataset
   vocabulary against the model's, and a `--load` checkpoint's config against this
   run's: every mistake here stops the job before any model is built;
2. start torch.distributed and megatron-core's TP/PP/DP groups, seed;
3. build the model: `LeviathanModel` under `deepspeed.initialize(mpu=DeepSpeedMPU())`
   for PP = 1 (ZeRO 1/2/3), or `build_pipeline_model` under DeepSpeed's pipeline
   engine for PP > 1 (ZeRO 1); AdamW with weight-decay groups and the warmup+cosine
   schedule (optim.py); DeepSpeed owns clipping (its grad norm counts replicated
   parameters once over TP and sums shards over TP/PP/DP) and skips steps whose
   gradient norm is not finite;
4. resume from `--load` (megatron_lev/checkpointing/) and train, logging every --log-interval,
   evaluating every --eval-interval, checkpointing every --save-interval, on
   SIGTERM/SIGUSR1, at --exit-interval / --exit-duration-in-mins, and at the end.

Exit codes: 0 done or stopped cleanly (signal, exit interval/duration: a requeued job
resumes with --load); 1 too many non-finite steps in a row (after saving); 2 bad
configuration (nothing was built).
"""
from __future__ import annotations

import datetime
import math
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_lev.arguments import (derive_vocab_size, effective_config, format_config, parse_args, summarize_config,
                                    validate_args)
from megatron_lev.checkpointing.catalog import read_checkpoint_config, select_checkpoint, select_readable_checkpoint
from megatron_lev.checkpointing.load import load_checkpoint
from megatron_lev.checkpointing.safe_load import CheckpointLoadError
from megatron_lev.checkpointing.save import save_checkpoint, write_run_config
from megatron_lev.checkpointing.universal import UNIVERSAL, layout_changes, zero_stage
from megatron_lev.distributed.launch import default_device, detect_launch_env, init_distributed
from megatron_lev.distributed.rng import set_seed
from megatron_lev.distributed.state import (DeepSpeedMPU, destroy_parallel, initialize_model_parallel, is_rank_0,
                                            print_rank_0)
from megatron_lev.ds_config import build_deepspeed_config, offloads_optimizer
from megatron_lev.flops import FlopsModel, peak_flops_per_device, training_flops
from megatron_lev.metrics import MetricsWriter
from megatron_lev.optim import build_lr_scheduler, build_optimizer, schedule_mismatch
from megatron_lev.utils.errors import ConfigError

EXIT_OK, EXIT_SKIPPED_STEPS, EXIT_CONFIG = 0, 1, 2
_PROCESS_START = time.time()  # --exit-duration-in-mins counts start-up too (a job's wall time does)


# --------------------------------------------------------------------------- signals


class ExitSignalHandler:
    """SIGTERM/SIGUSR1 (Slurm preemption, the time limit) set a flag; the training loop
    agrees on it across ranks at the next step boundary, checkpoints and exits 0."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: Optional[int] = None

    def install(self) -> "ExitSignalHandler":
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        self.received = signum


# --------------------------------------------------------------------------- set-up checks


def fail(message: str, rank: int) -> int:
    if rank == 0:
        print(f"megatron_lev.train: error: {message}", file=sys.stderr, flush=True)
    return EXIT_CONFIG


def build_model_config(args):
    from megatron_lev.models.config import model_config_from_dict

    # --seed seeds the weights too (Megatron's meaning) unless the YAML pins model.init_seed.
    overrides = {} if "init_seed" in args.model else {"init_seed": args.seed}
    return model_config_from_dict(
        args.model, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, bf16=bool(args.bf16),
        sequence_parallel=bool(args.sequence_parallel), recompute=args.recompute, **overrides)


DATA_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def data_prefixes(args) -> list[tuple[str, str]]:
    """(flag, prefix) of every dataset the run names; a missing .bin/.idx is a
    FileNotFoundError naming the flag and the file."""
    from megatron_lev.data.datasets import parse_blend

    found = []
    for dest in DATA_FLAGS:
        flag = "--" + dest.replace("_", "-")
        blend = parse_blend(getattr(args, dest), flag)
        found += [(flag, prefix) for prefix in (blend[0] if blend else ())]
    return found


def check_vocab(args, tokenizer, prefixes: list[tuple[str, str]], vocab_size: int) -> None:
    """Ids the model's vocabulary cannot hold stop the run here."""
    from megatron_lev.data.datasets import max_token_id

    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"--tokenizer-model {args.tokenizer_model} has {tokenizer.vocab_size} tokens but the "
                          f"model's vocab_size is {vocab_size} ({args.config}): raise model.vocab_size")
    for flag, prefix in prefixes:
        highest = max_token_id(prefix)
        if highest >= vocab_size:
            raise ConfigError(f"{flag} {prefix}: holds token id {highest}, outside the model's vocab_size "
                              f"{vocab_size} ({args.config}): was it tokenized with another tokenizer?")


def check_data_tokenizer(args, tokenizer, prefixes: list[tuple[str, str]]) -> None:
    """Data preprocessed with another tokenizer than --tokenizer-model stops the run: the
    preprocessing sidecar (.stats.json) records the tokenizer's content hash."""
    from megatron_lev.data.datasets import preprocessing_stats

    now = tokenizer.describe()
    for flag, prefix in prefixes:
        recorded = ((preprocessing_stats(prefix) or {}).get("tokenizer") or {})
        if recorded.get("sha256") and recorded["sha256"] != now["sha256"]:
            raise ConfigError(
                f"{flag} {prefix}: was tokenized with {recorded.get('model')} (sha256 {recorded['sha256'][:12]}), "
                f"but --tokenizer-model {args.tokenizer_model} is another tokenizer (sha256 {now['sha256'][:12]}): "
                "train with the data's tokenizer or preprocess the data again with this one")


def check_save_folder(args) -> None:
    """--save into a folder that already holds files, without --load, would overwrite
    another run (checkpoints, `latest`, metrics.jsonl): refused. Resuming is explicit."""
    if args.save and not args.load and os.path.isdir(args.save) and os.listdir(args.save):
        names = sorted(os.listdir(args.save))
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} entries)" if len(names) > 3 else "")
        raise ConfigError(f"--save {args.save}: the folder is not empty ({shown}); resume that run with --load "
                          f"{args.save}, or choose a new --save folder")


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


def flops_model(model_config, seq_length: int) -> FlopsModel:
    lev = model_config.lev_config() if model_config.embedding == "lev" else None
    return FlopsModel(
        num_layers=model_config.num_layers, hidden_size=model_config.hidden_size,
        ffn_hidden_size=model_config.ffn_hidden_size,
        kv_width=model_config.kv_channels * (model_config.num_query_groups or model_config.num_attention_heads),
        padded_vocab_size=model_config.padded_vocab_size, seq_length=seq_length,
        lev_heads=lev.num_heads if lev else None, lev_seed_dim=lev.seed_dim if lev else None,
        lev_knots=lev.num_knots if lev else None, lev_modes=lev.num_modes if lev else None)


def check_resume_schedule(args, saved: dict, config: dict) -> None:
    """Megatron's rule: resuming with another LR/WD schedule (a longer --train-iters, a new
    --lr, ...) is refused unless --override-opt_param-scheduler (use the flags) or
    --use-checkpoint-opt_param-scheduler (keep the checkpoint's) says which one wins.
    Weights-only loads (--no-load-optim) follow the flags' schedule (the trainer re-steps it)."""
    if args.no_load_optim or args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    changed = schedule_mismatch(saved.get("training", {}), config["training"])
    if changed:
        raise ConfigError(f"--load {args.load}: the LR schedule differs from the checkpoint's ({'; '.join(changed)}; "
                          f"in samples): add --override-opt_param-scheduler to use the new one or "
                          f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's")


# Model fields that only matter before the first step (the weights come from the checkpoint).
_INIT_ONLY_KEYS = ("init_seed", "init_method_std")


def check_resume_compatible(ckpt_dir: str, tag: str, config: dict) -> None:
    """Refuse a checkpoint whose model differs from this run's, naming every differing
    field. `config` is `arguments.effective_config(...)`. A different parallel layout is
    no reason to refuse (`layout_changes`)."""
    saved = read_checkpoint_config(ckpt_dir, tag)
    saved_model, model = saved.get("model", {}), config["model"]
    diffs = [f"{key}: {saved_model.get(key, '<unset>')!r} in the checkpoint, {model.get(key, '<unset>')!r} now"
             for key in sorted(set(saved_model) | set(model))
             if key not in _INIT_ONLY_KEYS and saved_model.get(key) != model.get(key)]
    if diffs:
        raise ConfigError(f"--load {ckpt_dir}: checkpoint {tag} was saved with a different model config ("
                          + "; ".join(diffs) + "); resume with the checkpoint's settings or use a new --save "
                          "directory")


def check_layout_change(ckpt_dir: str, tag: str, config: dict, changes: list[str]) -> None:
    """Refuse the layout changes a universal checkpoint cannot make, saying what to do."""
    then, now = zero_stage(read_checkpoint_config(ckpt_dir, tag)), zero_stage(config)
    if (then == 3) != (now == 3):
        # DeepSpeed names ZeRO-3 model files per data-parallel rank (zero_pp_rank_*), the
        # others per model-parallel rank; its universal loader only finds its own kind.
        raise ConfigError(f"--load {ckpt_dir}: checkpoint {tag} was saved under ZeRO stage {then} and this run "
                          f"uses stage {now} ({'; '.join(changes)}): DeepSpeed's universal checkpoint does not "
                          f"convert between ZeRO-3 and stages 1/2; resume with --zero-stage {then}")


# --------------------------------------------------------------------------- model and engine


def poison_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """A non-finite loss must skip the step; DeepSpeed skips on a non-finite gradient
    norm, so make sure one follows: multiply by NaN when the loss is not finite (no
    host sync; a finite loss is multiplied by exactly 1)."""
    scale = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan")).to(loss.dtype)
    return loss * scale


def _poisoned(loss_fn):
    def wrapped(*args, **kwargs):
        return poison_nonfinite(loss_fn(*args, **kwargs))

    return wrapped


def build_engine(args, model_config, ds_config: dict):
    """DeepSpeed engine over the plain model (PP = 1) or the pipeline module (PP > 1)."""
    import deepspeed

    if args.pipeline_model_parallel_size > 1:
        from megatron_lev.models.pipeline import build_pipeline_model

        module = build_pipeline_model(model_config)  # recompute interval from the config
        module.loss_fn = _poisoned(module.loss_fn)
        mpu = None  # the PipelineModule carries its topology
    else:
        from megatron_lev.models.decoder import LeviathanModel

        module = LeviathanModel(model_config)
        mpu = DeepSpeedMPU()
    if torch.cuda.is_available():
        module = module.cuda()
    if getattr(args, "compile_layers", False):
        from megatron_lev.models.transformer import compile_decoder_layers

        compile_decoder_layers(module)
    offload = offloads_optimizer(ds_config)
    optimizer = build_optimizer(module, lr=args.lr, weight_decay=args.weight_decay,
                                betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, offload=offload)
    if offload and type(optimizer).__name__ != "DeepSpeedCPUAdam":
        ds_config["zero_force_ds_cpu_optimizer"] = False  # the CPU Adam op could not be built here

    def scheduler(opt):
        return build_lr_scheduler(opt, args)

    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, mpu=mpu)
    return engine


# --------------------------------------------------------------------------- data


def build_datasets(args, tokenizer):
    from megatron_lev.data.datasets import build_train_valid_test_datasets

    samples = args.eval_iters * args.global_batch_size
    return build_train_valid_test_datasets(
        data_path=args.data_path, train_data_path=args.train_data_path, valid_data_path=args.valid_data_path,
        test_data_path=args.test_data_path, split=args.split, seq_length=args.seq_length, seed=args.seed,
        train_samples=args.train_iters * args.global_batch_size, valid_samples=samples, test_samples=samples,
        tokenizer=tokenizer, cache_dir=args.data_cache_path,
        # Older checkpoints' configs (demo/evaluate rebuild datasets from them) lack these keys.
        eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
        reset_position_ids=bool(getattr(args, "reset_position_ids", False)))


def micro_batches(dataset, consumed_samples: int, args, device,
                  lev_vocab_size: Optional[int] = None) -> Iterator[dict]:
    """This DP rank's micro-batches from `consumed_samples` on, on `device` (with LEV's
    distinct ids when `lev_vocab_size` is given: see collate_pretraining_batch)."""
    from megatron.core import parallel_state

    from megatron_lev.data.datasets import build_pretraining_data_loader

    loader = build_pretraining_data_loader(
        dataset, consumed_samples, args.micro_batch_size, parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(), num_workers=args.num_workers, lev_vocab_size=lev_vocab_size)
    for batch in loader:
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class PipelineBatches:
    """Micro-batch dicts -> the pipeline module's ((input_ids, position_ids), (labels,
    loss_mask)) tuples; counts distinct ids of what it hands out (for LEV FLOPs)."""

    def __init__(self, batches: Iterator[dict]):
        self.batches = batches
        self.distinct = 0

    def __iter__(self):
        return self

    def __next__(self):
        b = next(self.batches)
        self.distinct += distinct_count(b)
        lev = (b["lev_ids"], b["lev_inverse"]) if "lev_ids" in b else ()  # LEV's ids from the loader
        return (b["tokens"], b["position_ids"], *lev), (b["labels"], b["loss_mask"])


def distinct_count(batch: dict) -> int:
    """Distinct token ids of a micro-batch: the loader's count (a shape, no sync) for LEV."""
    if "lev_ids" in batch:
        return batch["lev_ids"].numel()
    return int(torch.unique(batch["tokens"]).numel())


def model_inputs(batch: dict) -> dict:
    """The keyword inputs of LeviathanModel.forward a micro-batch carries."""
    return {k: batch[k] for k in ("position_ids", "labels", "loss_mask", "lev_ids", "lev_inverse") if k in batch}


# --------------------------------------------------------------------------- training


@dataclass
class TrainState:
    """Everything besides DeepSpeed's own state that a checkpoint must restore."""

    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    skipped_steps: int = 0  # total non-finite steps
    consecutive_skipped: int = 0

    def client_state(self, config: dict) -> dict:
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                "consumed_tokens": self.consumed_tokens, "skipped_steps": self.skipped_steps,
                "consecutive_skipped": self.consecutive_skipped, "config": config}

    @classmethod
    def from_client_state(cls, state: dict) -> "TrainState":
        return cls(**{k: state[k] for k in ("iteration", "consumed_samples", "consumed_tokens", "skipped_steps",
                                             "consecutive_skipped") if k in state})


@dataclass
class IntervalStats:
    """Accumulates what one log line reports."""

    iterations: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    tokens: int = 0
    distinct_tokens: int = 0
    skipped: int = 0
    start: float = field(default_factory=time.perf_counter)


class Trainer:
    def __init__(self, args, model_config, ds_config: dict, config: dict, datasets):
        from megatron.core import parallel_state

        self.args, self.model_config, self.config = args, model_config, config
        self.train_ds, self.valid_ds, self.test_ds = datasets
        self.exit_handler: Optional[ExitSignalHandler] = None
        self.device = default_device()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # Collective: a checkpoint with an unreadable file falls back to the previous one.
        resume_tag = select_readable_checkpoint(args.load, args.ckpt_step) if args.load else None
        # A checkpoint of another TP/PP/DP size or ZeRO stage loads through DeepSpeed's universal form.
        self.layout_changes = layout_changes(args.load, resume_tag, config) if resume_tag else []
        if self.layout_changes:
            ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
        self.engine = build_engine(args, model_config, ds_config)
        self.is_pipeline = args.pipeline_model_parallel_size > 1
        self.dp_group = parallel_state.get_data_parallel_group()
        # Only one rank per DP replica contributes to sums over the world.
        self.reports = (parallel_state.get_tensor_model_parallel_rank() == 0
                        and parallel_state.get_pipeline_model_parallel_rank() == 0)
        self.state = TrainState()
        self.flops_model = flops_model(model_config, args.seq_length)
        self.peak_flops = peak_flops_per_device(args.gpu_type, args.peak_tflops)
        self.count_distinct = model_config.embedding == "lev"
        self.lev_vocab_size = model_config.vocab_size if self.count_distinct else None
        self.last_saved: Optional[int] = None

        if args.load:
            tag = resume_tag
            if tag is not None:
                universal = None
                if self.layout_changes:
                    universal_dir = os.path.join(args.load, tag, UNIVERSAL)
                    print_rank_0(f"--load {args.load}: checkpoint {tag} was saved under another layout ("
                                 f"{'; '.join(self.layout_changes)}); loading it through DeepSpeed's "
                                 f"universal checkpoint in {universal_dir}")
                    universal = dict(pipeline=self.is_pipeline, num_layers=model_config.num_layers,
                                     tied=model_config.embedding == "tied")
                client = load_checkpoint(self.engine, args.load, tag, load_optimizer=not args.no_load_optim,
                                         universal=universal, files_checked=True)
                # Counters always continue (Megatron resets them only for --finetune).
                self.state = TrainState.from_client_state(client)
                self.last_saved = self.state.iteration
                if args.no_load_optim:
                    # Fresh optimizer moments, but the LR schedule continues where it was: DeepSpeed
                    # stepped it once per applied step.
                    if universal is not None:  # DeepSpeed's universal loader restores the moments regardless
                        self.engine.optimizer.optimizer.state.clear()
                    for _ in range(self.state.iteration - self.state.skipped_steps):
                        self.engine.lr_scheduler.step()
                print_rank_0(f"resumed from {os.path.join(args.load, tag)} at iteration "
                             f"{self.state.iteration} ({self.state.consumed_samples} samples)")
            else:
                print_rank_0(f"--load {args.load}: no complete checkpoint, starting fresh")

        self.metrics = MetricsWriter(
            active=self.rank == 0, jsonl_path=args.metrics_file, tensorboard_dir=args.tensorboard_dir,
            wandb_project=args.wandb_project, wandb_name=args.wandb_exp_name,
            wandb_dir=args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None),
            config=config, resume_iteration=self.state.iteration)

    # ------------------------------------------------------------------ one step

    def train_step(self, batches: Iterator[dict]) -> tuple[torch.Tensor, int]:
        """One optimizer step over gradient_accumulation_steps micro-batches.

        Returns (this rank's mean micro-batch loss, distinct ids seen by this rank)."""
        engine = self.engine
        if self.is_pipeline:
            pipe_batches = PipelineBatches(batches)
            loss = engine.train_batch(data_iter=pipe_batches)
            return loss.detach().float(), pipe_batches.distinct
        engine.train()
        losses, distinct = [], 0
        for _ in range(self.args.gradient_accumulation_steps):
            b = next(batches)
            if self.count_distinct:
                distinct += distinct_count(b)
            loss = engine(b["tokens"], **model_inputs(b))
            engine.backward(poison_nonfinite(loss))
            engine.step()
            losses.append(loss.detach().float())
        return torch.stack(losses).mean(), distinct

    def _stop_requested_locally(self) -> tuple[float, float]:
        signalled = float(self.exit_handler is not None and self.exit_handler.received is not None)
        limit = self.args.exit_duration_in_mins
        timed_out = float(limit is not None and (time.time() - _PROCESS_START) / 60.0 > limit)
        return signalled, timed_out

    def reduce_step(self, loss: torch.Tensor, distinct: int) -> tuple[float, int, Optional[str]]:
        """One all-reduce per step: the DP-mean loss, the distinct-id count over all
        replicas, and whether any rank was signalled / ran out of time."""
        signalled, timed_out = self._stop_requested_locally()
        t = torch.tensor([float(loss) if self.reports else 0.0, float(distinct) if self.reports else 0.0,
                          signalled, timed_out], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        loss_sum, distinct_sum, signalled, timed_out = t.tolist()
        stop = "signal" if signalled > 0 else "exit duration" if timed_out > 0 else None
        return loss_sum / self.args.data_parallel_size, int(distinct_sum), stop

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, dataset, name: str) -> Optional[float]:
        """Mean loss over the first --eval-iters global batches of `dataset` (the same
        batches every time, so evaluations are comparable and resume-safe)."""
        if dataset is None or len(dataset) == 0:
            return None
        args, engine = self.args, self.engine
        batches = micro_batches(dataset, 0, args, self.device, self.lev_vocab_size)
        total, count = 0.0, 0
        for _ in range(args.eval_iters):
            if self.is_pipeline:
                loss = engine.eval_batch(PipelineBatches(batches))
                total += float(loss)
                count += 1
            else:
                engine.eval()
                for _ in range(args.gradient_accumulation_steps):
                    b = next(batches)
                    total += float(engine(b["tokens"], **model_inputs(b)))
                    count += 1
        # Average over data-parallel replicas (every rank of a replica holds the same value).
        t = torch.tensor([total / count], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        loss = t.item() / args.data_parallel_size
        record = {"iteration": self.state.iteration, "consumed_samples": self.state.consumed_samples,
                  "consumed_tokens": self.state.consumed_tokens, f"{name}_loss": loss,
                  f"{name}_ppl": math.exp(min(loss, 50.0))}
        self.metrics.write(record, self.state.iteration)
        # Megatron's validation block.
        line = (f" {'validation' if name == 'valid' else name} loss at iteration {self.state.iteration} | "
                f"lm loss value: {loss:.6E} | lm loss PPL: {math.exp(min(20.0, loss)):.6E} | ")
        print_rank_0("-" * (len(line) + 1) + "\n" + line + "\n" + "-" * (len(line) + 1))
        return loss

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        if not self.args.save or self.last_saved == self.state.iteration:
            return
        t0 = time.perf_counter()
        tag = save_checkpoint(self.engine, self.args.save, self.state.iteration,
                              self.state.client_state(self.config), self.config,
                              keep_last=self.args.keep_last_checkpoints)
        self.last_saved = self.state.iteration
        print_rank_0(f"saved checkpoint {os.path.join(self.args.save, tag)} "
                     f"in {time.perf_counter() - t0:.1f}s")

    # ------------------------------------------------------------------ logging

    def log(self, stats: IntervalStats, lr: float, grad_norm: Optional[float]) -> None:
        """One log line: the interval's mean loss (over applied steps), the last step's lr
        and grad norm (pre-clipping; inf for a skipped step), speed and memory."""
        args, st = self.args, self.state
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - stats.start
        flops = training_flops(self.flops_model, stats.tokens, stats.distinct_tokens)
        tflops_per_device = flops / elapsed / self.world_size / 1e12
        record = {
            "iteration": st.iteration,
            "consumed_samples": st.consumed_samples,
            "consumed_tokens": st.consumed_tokens,
            "global_batch_size": args.global_batch_size,
            "loss": stats.loss_sum / stats.loss_count if stats.loss_count else float("nan"),
            "lr": lr,
            "grad_norm": grad_norm,
            "step_time_s": elapsed / stats.iterations,
            "tokens_per_s": stats.tokens / elapsed,
            "tflops_per_device": tflops_per_device,
            "mfu": tflops_per_device * 1e12 / self.peak_flops if self.peak_flops else None,
            "memory_gb": _memory_gb(),
            "skipped_steps": st.skipped_steps,
            "skipped_in_interval": stats.skipped,
        }
        self.metrics.write(record, st.iteration)
        if self.rank == 0:
            print(megatron_log_line(record, args, stats), flush=True)

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        args, st = self.args, self.state
        if st.iteration >= args.train_iters:  # a finished run started again (e.g. requeued): nothing to do
            print_rank_0(f"training done: already at iteration {st.iteration} (--train-iters "
                         f"{args.train_iters}), nothing to do")
            return EXIT_OK
        batches = micro_batches(self.train_ds, st.consumed_samples, args, self.device, self.lev_vocab_size)
        stats = IntervalStats()
        grad_norm = None
        last_eval = None
        while st.iteration < args.train_iters:
            lr = self.engine.get_lr()[0]  # the rate this step uses
            loss, distinct = self.train_step(batches)
            applied = self.engine.was_step_applied()
            grad_norm = self.engine.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None else None
            loss_value, distinct_sum, stop = self.reduce_step(loss, distinct)
            st.iteration += 1
            st.consumed_samples += args.global_batch_size
            st.consumed_tokens += args.tokens_per_step
            stats.iterations += 1
            stats.tokens += args.tokens_per_step
            stats.distinct_tokens += distinct_sum
            if applied and math.isfinite(loss_value):
                st.consecutive_skipped = 0
                stats.loss_sum += loss_value
                stats.loss_count += 1
            else:
                st.skipped_steps += 1
                st.consecutive_skipped += 1
                stats.skipped += 1
                print_rank_0(f"iteration {st.iteration}: non-finite loss ({loss_value}) or gradient "
                             f"norm ({grad_norm}); step skipped ({st.consecutive_skipped} in a row)")

            if st.iteration % args.log_interval == 0 or st.iteration == args.train_iters:
                self.log(stats, lr, grad_norm)
                stats = IntervalStats()

            if args.max_skipped_steps and st.consecutive_skipped >= args.max_skipped_steps:
                # Skipped steps never touched the weights: this saves the last good state.
                self.save()
                fail(f"{st.consecutive_skipped} non-finite steps in a row (iterations "
                     f"{st.iteration - st.consecutive_skipped + 1}-{st.iteration}, --max-skipped-steps "
                     f"{args.max_skipped_steps}); weights are those of iteration "
                     f"{st.iteration - st.consecutive_skipped}" + (f", saved in {args.save}" if args.save else ""),
                     self.rank)
                return EXIT_SKIPPED_STEPS

            paused = time.perf_counter()  # evaluation and saving do not count as step time
            if args.eval_interval and st.iteration % args.eval_interval == 0:
                self.evaluate(self.valid_ds, "valid")
                last_eval = st.iteration
            if args.save_interval and st.iteration % args.save_interval == 0:
                self.save()
            stats.start += time.perf_counter() - paused
            if stop is None and args.exit_interval and st.iteration % args.exit_interval == 0:
                stop = "exit interval"
            if stop is not None and st.iteration < args.train_iters:
                self.save()
                print_rank_0(f"exiting at iteration {st.iteration} ({stop})"
                             + (f"; resume with --load {args.save}" if args.save else ""))
                return EXIT_OK

        if last_eval != st.iteration:
            self.evaluate(self.valid_ds, "valid")
        self.evaluate(self.test_ds, "test")
        self.save()
        print_rank_0(f"training done: {st.iteration} iterations, {st.consumed_tokens} tokens, "
                     f"{st.skipped_steps} skipped steps")
        return EXIT_OK


def megatron_log_line(record: dict, args, stats: IntervalStats) -> str:
    """Megatron-LM's iteration line (its fields, words and number formats), then ours:
    tokens per second, peak memory, and the ETA of the run at this interval's speed."""
    eta = datetime.timedelta(seconds=round((args.train_iters - record["iteration"]) * record["step_time_s"]))
    line = (f" [{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}] iteration {record['iteration']:8d}/"
            f"{args.train_iters:8d} | consumed samples: {record['consumed_samples']:12d} | "
            f"elapsed time per iteration (ms): {1000 * record['step_time_s']:.1f} |")
    if args.log_throughput:
        line += f" throughput per GPU (TFLOP/s/GPU): {record['tflops_per_device']:.1f} |"
        if record["mfu"] is not None:
            line += f" MFU: {100 * record['mfu']:.1f}% |"
    line += (f" learning rate: {record['lr']:.6E} | global batch size: {args.global_batch_size:5d} |"
             f" lm loss: {record['loss']:.6E} |")
    if record["grad_norm"] is not None:
        line += f" grad norm: {record['grad_norm']:.3f} |"
    nan = stats.skipped  # a skipped step is one whose loss or gradient norm was not finite
    return line + (f" number of skipped iterations: {stats.skipped:3d} | number of nan iterations: {nan:3d} |"
                   f" tokens per second: {record['tokens_per_s']:.1f} | mem: {record['memory_gb']:.2f} GB |"
                   f" ETA: {eta} |")


def _memory_gb() -> float:
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# --------------------------------------------------------------------------- entry point


def main(argv=None) -> int:
    """Train; returns the exit code. Callable in-process: it initialises torch.distributed
    only if nobody did, and tears down only what it set up."""
    launch = detect_launch_env()
    try:
        args = parse_args(argv)
        validate_args(args, launch.world_size)
        ds_config = build_deepspeed_config(args)
        prefixes = data_prefixes(args)
        if not os.path.exists(args.tokenizer_model):
            raise ConfigError(f"--tokenizer-model {args.tokenizer_model}: no such file")
        from megatron_lev.data.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
        derive_vocab_size(args, tokenizer.vocab_size)
        model_config = build_model_config(args)
        check_vocab(args, tokenizer, prefixes, model_config.vocab_size)
        check_data_tokenizer(args, tokenizer, prefixes)
        check_save_folder(args)
        if args.ckpt_step is not None and not args.load:
            raise ConfigError(f"--ckpt-step {args.ckpt_step}: needs --load (the folder holding that checkpoint)")
        config = effective_config(args, model_config.to_dict())
        config["deepspeed"] = ds_config
        config["tokenizer"] = tokenizer.describe()
        if args.load:
            tag = select_checkpoint(args.load, args.ckpt_step)
            if tag is not None:
                check_resume_compatible(args.load, tag, config)
                saved = read_checkpoint_config(args.load, tag)
                check_resume_run(args, saved, config, launch.rank)
                changes = layout_changes(args.load, tag, config)
                if changes:
                    check_layout_change(args.load, tag, config, changes)
                check_resume_schedule(args, saved, config)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        return fail(str(exc), launch.rank)

    owns_process_group = not dist.is_initialized()
    init_distributed(timeout_minutes=args.distributed_timeout_minutes)
    initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    exit_handler = None
    try:
        set_seed(args.seed)
        if is_rank_0():
            if args.save:  # the full configuration goes to the run folder, a summary to stdout
                write_run_config(args.save, config)
                print(summarize_config(config, os.path.join(args.save, "config.yaml")), flush=True)
            else:
                print("effective configuration:\n" + format_config(config), flush=True)
        try:  # before the model: a split without documents is a configuration error too
            datasets = build_datasets(args, tokenizer)
        except (ValueError, FileNotFoundError) as exc:
            return fail(str(exc), launch.rank)
        try:
            trainer = Trainer(args, model_config, ds_config, config, datasets)
        except CheckpointLoadError as exc:  # raised on every rank alike (safe_load.check_checkpoint_files)
            return fail(str(exc), launch.rank)
        # Only now: a signal during start-up kills the job as usual (nothing new to save, and
        # a hung start-up must stay killable); from here on it means "checkpoint, exit 0".
        if args.exit_signal_handler:
            exit_handler = trainer.exit_handler = ExitSignalHandler().install()
        try:
            return trainer.run()
        finally:
            trainer.metrics.close()
    finally:
        if exit_handler is not None:
            exit_handler.uninstall()
        if owns_process_group:
            destroy_parallel()
        else:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    sys.exit(main())
