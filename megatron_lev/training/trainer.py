"""The training loop: one optimizer step after another, logging, evaluation, checkpoints and
clean exits, on a DeepSpeed engine built from a validated run (validation.py).

Every --log-interval a Megatron-LM iteration line (its fields and number formats, then tokens
per second, memory and the ETA); every --eval-interval the validation loss; a checkpoint every
--save-interval, on SIGTERM/SIGUSR1, at --exit-interval / --exit-duration-in-mins, and at the
end. A non-finite step is skipped (DeepSpeed) and counted; too many in a row stop the run.
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
from megatron.core import parallel_state

from megatron_lev.checkpointing.catalog import select_readable_checkpoint
from megatron_lev.checkpointing.load import load_checkpoint
from megatron_lev.checkpointing.save import save_checkpoint
from megatron_lev.checkpointing.universal import UNIVERSAL
from megatron_lev.distributed.launch import default_device
from megatron_lev.distributed.state import print_rank_0
from megatron_lev.training.batches import PipelineBatches, distinct_count, micro_batches, model_inputs
from megatron_lev.training.diagnostics import EmbeddingWatch, log_line_fields, start_line
from megatron_lev.training.engine import build_engine, poison_nonfinite
from megatron_lev.training.flops import flops_model, peak_flops_per_device, training_flops
from megatron_lev.training.metrics import MetricsWriter
from megatron_lev.training.timers import STEP, StepTimers, straggler_line_fields
from megatron_lev.training.union_ids import UnionIds
from megatron_lev.training.validation import Run, check_resume

EXIT_OK, EXIT_SKIPPED_STEPS, EXIT_CONFIG = 0, 1, 2
_PROCESS_START = time.time()  # --exit-duration-in-mins counts start-up too (a job's wall time does)


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


def fail(message: str, rank: int) -> int:
    if rank == 0:
        print(f"megatron_lev.train: error: {message}", file=sys.stderr, flush=True)
    return EXIT_CONFIG


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
    """Builds the engine for a validated `Run` (resuming its checkpoint) and trains: `run()`."""

    def __init__(self, run: Run, datasets):
        args, model_config, ds_config, config = run.args, run.model_config, run.ds_config, run.config
        self.args, self.model_config, self.config = args, model_config, config
        self.train_ds, self.valid_ds, self.test_ds = datasets
        self.exit_handler: Optional[ExitSignalHandler] = None
        self.device = default_device()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # Collective: a checkpoint with an unreadable file falls back to the previous one, which
        # is then checked against this run as the validated one was.
        resume_tag = select_readable_checkpoint(args.load, args.ckpt_step) if run.resume_tag else None
        self.layout_changes = run.layout_changes
        if resume_tag not in (None, run.resume_tag):
            self.layout_changes = check_resume(args, resume_tag, config, self.rank)
        # A checkpoint of another TP/PP/DP size or ZeRO stage loads through DeepSpeed's universal form.
        if resume_tag is not None and self.layout_changes:
            ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
        self.engine = build_engine(args, model_config, ds_config, fresh_start=resume_tag is None)
        self.watch = EmbeddingWatch(self.engine, model_config.vocab_size, args.clip_grad, self.device)
        self.timers = StepTimers(self.device, args.timing_log_level, args.timing_log_option)
        self.timers.install(self.engine)
        self.is_pipeline = args.pipeline_model_parallel_size > 1
        self.dp_group = parallel_state.get_data_parallel_group()
        # Only one rank per DP replica contributes to sums over the world.
        self.reports = (parallel_state.get_tensor_model_parallel_rank() == 0
                        and parallel_state.get_pipeline_model_parallel_rank() == 0)
        self.state = TrainState()
        self.flops_model = flops_model(model_config, args.seq_length)
        self.peak_flops = peak_flops_per_device(args.gpu_type, args.peak_tflops)
        self.count_distinct = model_config.embedding == "lev"
        self.union_ids = bool(getattr(args, "lev_union_ids", False))  # start-up validation refused the rest
        self.lev_vocab_size = model_config.vocab_size if self.count_distinct else None
        self.last_saved: Optional[int] = None
        self.startup = None  # the StartupTimer of train.py: the first log line's time to first step
        self.time_to_first_step: Optional[float] = None  # seconds from the start-up timer's start

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

        Returns (this rank's mean micro-batch loss, distinct ids seen by this rank: with
        --lev-union-ids those of the step's union, which the generator evaluates)."""
        engine, timers = self.engine, self.timers
        if self.is_pipeline:  # the schedule's instructions are timed inside (timers.install)
            pipe_batches = PipelineBatches(batches)
            with timers("forward-backward").timing():
                loss = engine.train_batch(data_iter=pipe_batches)
            return loss.detach().float(), pipe_batches.distinct
        engine.train()
        count, union = self.args.gradient_accumulation_steps, None
        if self.union_ids and count > 1:  # --lev-union-ids: the generator once, on the step's union
            with timers("forward-backward").timing():
                with timers("batch-generator").timing():
                    micro = [next(batches) for _ in range(count)]
                with timers("forward-compute").timing():
                    union = UnionIds(engine.module.embedding, micro)
            batches = iter(micro)
        losses, distinct = [], 0
        for i in range(count):
            with timers("forward-backward").timing():
                with timers("batch-generator").timing():
                    b = next(batches)
                if self.count_distinct and union is None:
                    distinct += distinct_count(b)
                inputs = model_inputs(b) if union is None else {**model_inputs(b), **union.inputs(i)}
                with timers("forward-compute").timing():
                    loss = engine(b["tokens"], **inputs)
                with timers("backward-compute").timing():
                    engine.backward(poison_nonfinite(loss))
            with timers("optimizer").timing():
                engine.step()
            losses.append(loss.detach().float())
        return torch.stack(losses).mean(), distinct if union is None else union.distinct

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

    def report_compilation(self, first_step_s: float, compile_s: Optional[float]) -> None:
        """torch.compile works in the first step (forward, then backward): --compile-layers' decoder
        layers, and on CPU LEV's mode product. Say how long it took, by torch's own count
        (`compile_s`; None: this torch keeps none, and the first step's time bounds it)."""
        layers = sum(getattr(m, "compiled_forward", None) is not None for m in self.engine.module.modules())
        compile_s = first_step_s if compile_s is None else compile_s
        if not layers and compile_s < 0.05:
            return
        what = [f"{layers} decoder layers"] if layers else []
        if self.device.type == "cpu" and self.model_config.embedding == "lev" and compile_s >= 0.05:
            what.append("LEV's CPU mode product")
        print_rank_0(f" > compiled {' and '.join(what) or 'the model'} in {compile_s:.1f} s (torch.compile, during "
                     f"the first step: {first_step_s:.1f} s)")

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
        record.update(self.watch.interval_record())  # collective: the embedding's statistics
        stragglers, timers_block = self.timers.report(stats.iterations)  # collective: every rank's times
        record.update(stragglers.record())
        self.metrics.write(record, st.iteration)
        if self.rank == 0:
            line = megatron_log_line(record, args, stats)
            if self.time_to_first_step is not None:  # the run's first log line
                line += f" time to first step (s): {self.time_to_first_step:.1f} |"
            print(line + (f"\n{timers_block}" if timers_block else ""), flush=True)
        self.time_to_first_step = None

    # ------------------------------------------------------------------ the loop

    def logs_after(self, iteration: int) -> bool:
        """Whether a log line follows this iteration."""
        return iteration % self.args.log_interval == 0 or iteration == self.args.train_iters

    def log_embedding_at_start(self) -> None:
        """The input embedding's statistics before the first step: the initial weights (iteration
        0) or those the run resumed with."""
        st = self.state
        record = {"iteration": st.iteration, "consumed_samples": st.consumed_samples,
                  "consumed_tokens": st.consumed_tokens, **self.watch.embedding_record(eager=True)}
        if "embedding_rms" in record:  # this rank holds the embedding (global rank 0 does)
            self.metrics.write(record, st.iteration)
            print_rank_0(start_line(record, self.model_config.embedding, self.model_config.vocab_size))

    def run(self) -> int:
        args, st = self.args, self.state
        if st.iteration >= args.train_iters:  # a finished run started again (e.g. requeued): nothing to do
            print_rank_0(f"training done: already at iteration {st.iteration} (--train-iters "
                         f"{args.train_iters}), nothing to do")
            return EXIT_OK
        self.log_embedding_at_start()
        batches = micro_batches(self.train_ds, st.consumed_samples, args, self.device, self.lev_vocab_size)
        stats = IntervalStats()
        grad_norm = None
        last_eval = None
        first_step = True
        while st.iteration < args.train_iters:
            lr = self.engine.get_lr()[0]  # the rate this step uses
            if first_step:
                step_start, compiling_before = time.perf_counter(), _compile_seconds()
            if self.logs_after(st.iteration + 1):
                self.watch.arm()  # this step's optimizer records the two families' gradient norms
            with self.timers(STEP).timing():
                loss, distinct = self.train_step(batches)
            if first_step:
                first_step = False
                if self.startup is not None:
                    self.time_to_first_step = self.startup.since_start()
                compiling_after = _compile_seconds()
                self.report_compilation(time.perf_counter() - step_start, None if compiling_before is None
                                        else compiling_after - compiling_before)
            applied = self.engine.was_step_applied()
            grad_norm = self.engine.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None else None
            self.watch.count_step(grad_norm, applied)
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

            if self.logs_after(st.iteration):
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
    line += log_line_fields(record) + straggler_line_fields(record)
    nan = stats.skipped  # a skipped step is one whose loss or gradient norm was not finite
    return line + (f" number of skipped iterations: {stats.skipped:3d} | number of nan iterations: {nan:3d} |"
                   f" tokens per second: {record['tokens_per_s']:.1f} | mem: {record['memory_gb']:.2f} GB |"
                   f" ETA: {eta} |")


def _compile_seconds() -> Optional[float]:
    """Seconds torch.compile has spent in this process (dynamo's frame and backward compiles)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return calculate_time_spent()["total_wall_time"]
    except (ImportError, KeyError):
        return None


def _memory_gb() -> float:
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
