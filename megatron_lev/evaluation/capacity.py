"""Can the LEV generator hold a good input table? A regression fit, no language-model training
(issue 49; docs/experiments.md, "The generator's capacity").

The generator of a model config (its `lev:` fields, vocabulary and width, started from the init
that config's LEV model draws at `--seed`) is fitted to a target table T [V, D] by mean squared
error with Adam until the loss stops falling; then W_out, in which the embedding is linear, is
replaced by its exact least-squares solution for the fitted modes. Beside it, the factorised table
of equal parameters (V x r' times r' x D, r' = parameters / (V + D)) at its optimum, the truncated
SVD (Eckart-Young), and the rank bound of any h * r modes: the truncated SVD at rank h * r.

    relative residual   ||E - T||_F / ||T||_F over all V rows (0: T held exactly; 1: nothing)
    cosine, eff. rank   models/embedding_stats.py's mean pairwise cosine and effective rank of the
                        fitted rows of its fixed 512-id sample (the numbers training logs)

Targets: a checkpoint's input table (`--target-checkpoint DIR`: a tied or untied run), the table a
config's model draws at init (`--target-init CONFIG`: exp-frozen's frozen random table), or an
N(0, std) table (`--target-random STD`, at `--vocab-size`/`--hidden-size`). `--save FILE` keeps
the fitted generator: `model.lev_init_from: FILE` starts a LEV model from it.

    python -m megatron_lev.evaluation.capacity --config experiments/configs/exp-lev.yaml \\
        --target-checkpoint RUN --save fit.pt --out capacity.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from megatron_lev.configs import load_config
from megatron_lev.lev.generator import LEVConfig, LEVGenerator, seed_modes
from megatron_lev.models.config import model_config_from_dict
from megatron_lev.models.embedding_stats import matrix_statistics, sample_ids
from megatron_lev.models.layers import LEV_FIT_FORMAT, derive_seed
from megatron_lev.utils.files import atomic_path, write_json_atomic



@dataclass
class FitSettings:
    """Adam on the mean squared error; stop when `patience` evaluations in a row improved the full
    loss by less than `tolerance` (relative), or at `max_steps`."""

    lr: float = 3e-3
    max_steps: int = 5000
    batch_ids: Optional[int] = None  # ids per step, drawn uniformly (None: all of them, full batch)
    eval_every: int = 50
    patience: int = 4
    tolerance: float = 1e-3
    seed: int = 1


def relative_residual(fitted: torch.Tensor, target: torch.Tensor) -> float:
    return ((fitted.double() - target.double()).norm() / target.double().norm()).item()


@torch.no_grad()
def generator_table(generator: LEVGenerator, vocab_size: int, chunk: int = 8192) -> torch.Tensor:
    """Every id's embedding [V, D] float32, in chunks."""
    return torch.cat([generator(torch.arange(s, min(s + chunk, vocab_size))) for s in range(0, vocab_size, chunk)])


@torch.no_grad()
def generator_modes(generator: LEVGenerator, vocab_size: int, chunk: int = 8192) -> torch.Tensor:
    """Every id's modes, flattened over heads [V, h * r] float32: the embedding is modes @ W_out."""
    out = []
    for s in range(0, vocab_size, chunk):
        ids = torch.arange(s, min(s + chunk, vocab_size))
        z = generator.seed(ids)
        out.append(seed_modes(generator.config, generator.mode_parameters(), z).flatten(1))
    return torch.cat(out)


def fit_generator(generator: LEVGenerator, target: torch.Tensor, settings: FitSettings,
                  log=print) -> dict:
    """Fit `generator` (in place) to `target` [V, D]; the fit's history and stopping reason."""
    vocab_size = target.shape[0]
    optimizer = torch.optim.Adam(generator.parameters(), lr=settings.lr)
    rng = torch.Generator().manual_seed(settings.seed)
    all_ids = torch.arange(vocab_size)
    history, best, stale, reason = [], math.inf, 0, "max_steps"
    start = time.perf_counter()
    target_power = target.pow(2).mean().item()
    for step in range(settings.max_steps + 1):
        if step % settings.eval_every == 0 or step == settings.max_steps:
            full = generator_table(generator, vocab_size)
            loss = (full - target).pow(2).mean().item()
            elapsed = time.perf_counter() - start
            history.append({"step": step, "mse": loss, "relative_residual": math.sqrt(loss / target_power),
                            "elapsed_s": elapsed})
            rate = step / elapsed if elapsed > 0 and step else float("nan")
            log(f"capacity fit: step {step}/{settings.max_steps} | mse {loss:.6e} | relative residual "
                f"{math.sqrt(loss / target_power):.4f} | {rate:.2f} steps/s | elapsed {elapsed:.0f} s")
            if not math.isfinite(loss):
                reason = "non-finite loss"
                break
            stale = stale + 1 if loss > best * (1 - settings.tolerance) else 0
            best = min(best, loss)
            if stale >= settings.patience:
                reason = f"plateau ({settings.patience} evaluations under {settings.tolerance:g} relative gain)"
                break
            if step == settings.max_steps:
                break
        ids = all_ids if settings.batch_ids is None else torch.randint(vocab_size, (settings.batch_ids,), generator=rng)
        loss = (generator(ids) - target[ids]).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return {"steps": history[-1]["step"], "stopped": reason, "history": history,
            "seconds": time.perf_counter() - start}


@torch.no_grad()
def solve_w_out(generator: LEVGenerator, target: torch.Tensor) -> None:
    """Replace W_out by the least-squares solution of modes @ W = target (the exact optimum of the
    part in which the embedding is linear), in float64."""
    modes = generator_modes(generator, target.shape[0]).double()
    solution = torch.linalg.lstsq(modes, target.double(), driver="gelsd").solution
    h, r, d = generator.w_out.shape
    generator.w_out.copy_(solution.reshape(h, r, d).to(generator.w_out.dtype))


def truncated_svd(target: torch.Tensor, ranks: list[int]) -> dict[int, torch.Tensor]:
    """The best rank-r approximation of `target` for each r (Eckart-Young), from the eigenvectors of
    the D x D Gram matrix (float64)."""
    t = target.double()
    eigenvalues, vectors = torch.linalg.eigh(t.T @ t)
    vectors = vectors.flip(-1)  # descending
    out = {}
    for r in ranks:
        basis = vectors[:, :min(r, t.shape[1])]
        out[r] = ((t @ basis) @ basis.T).float()
    return out


def describe(fitted: torch.Tensor, target: torch.Tensor, ids: torch.Tensor) -> dict:
    stats = matrix_statistics(fitted[ids])
    return {"relative_residual": relative_residual(fitted, target), "rms": stats.rms,
            "mean_cosine": stats.mean_cosine, "effective_rank": stats.effective_rank}


def capacity_report(lev_config: LEVConfig, target: torch.Tensor, init_seed: int, settings: FitSettings,
                    log=print) -> tuple[dict, LEVGenerator]:
    """Fit the generator and the controls to `target`; the report and the fitted generator."""
    vocab_size, width = target.shape
    generator = LEVGenerator(lev_config, init_seed=init_seed)
    ids = sample_ids(vocab_size)
    parameters = lev_config.num_parameters()
    report = {"vocab_size": vocab_size, "hidden_size": width, "lev_config": lev_config.to_dict(),
              "lev_parameters": parameters, "table_parameters": vocab_size * width, "fit": asdict(settings),
              "target": describe(target, target, ids)}
    report["lev_init"] = describe(generator_table(generator, vocab_size), target, ids)
    report["training"] = fit_generator(generator, target, settings, log)
    report["lev_adam"] = describe(generator_table(generator, vocab_size), target, ids)
    solve_w_out(generator, target)
    report["lev"] = describe(generator_table(generator, vocab_size), target, ids)
    factor_rank = max(1, parameters // (vocab_size + width))
    mode_rank = lev_config.num_heads * lev_config.num_modes
    approximations = truncated_svd(target, [factor_rank, mode_rank])
    report["factorized"] = {"rank": factor_rank, "parameters": factor_rank * (vocab_size + width),
                            **describe(approximations[factor_rank], target, ids)}
    report["rank_bound"] = {"rank": mode_rank, **describe(approximations[mode_rank], target, ids)}
    return report, generator


def save_fit(path: str, generator: LEVGenerator, report: dict) -> None:
    """The fitted generator's full parameters and config (what `lev_init_from` loads), atomically."""
    state = {name: p.detach().clone() for name, p in generator.named_parameters()}
    with atomic_path(path) as tmp:
        torch.save({"format": LEV_FIT_FORMAT, "lev": generator.config.to_dict(), "parameters": state,
                    "relative_residual": report["lev"]["relative_residual"]}, tmp)


# --------------------------------------------------------------------------- targets


def checkpoint_table(load_dir: str) -> torch.Tensor:
    """The input table [V, D] of a tied or untied checkpoint (padding rows dropped)."""
    from megatron_lev.checkpointing.convert import load_checkpoint_full

    full, info = load_checkpoint_full(load_dir)
    config = info.model_config()
    if config.embedding not in ("tied", "untied"):
        raise ValueError(f"--target-checkpoint {load_dir}: its input side is {config.embedding}, not a table")
    return full["embedding.weight"][: config.vocab_size].float()


def init_table(config_path: str, seed: int) -> torch.Tensor:
    """The input table that a config's tied/untied model draws at init with --seed `seed`."""
    import tempfile

    import torch.distributed as dist

    from megatron_lev.distributed.state import destroy_parallel, initialize_model_parallel
    from megatron_lev.models.layers import VocabEmbedding

    model = model_config_from_dict(load_config(config_path)["model"], init_seed=seed)
    if model.embedding not in ("tied", "untied"):
        raise ValueError(f"--target-init {config_path}: its input side is {model.embedding}, not a table")
    # The model's own table module, so the draw is the trainer's: it needs megatron-core's groups,
    # here of one process (a file rendezvous: no port).
    started = not dist.is_initialized()
    with tempfile.TemporaryDirectory() as folder:
        if started:
            dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=0, world_size=1)
        try:
            initialize_model_parallel(1, 1)
            return VocabEmbedding(model).weight.detach()[: model.vocab_size].float().clone()
        finally:
            if started:
                destroy_parallel()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_lev.evaluation.capacity", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the LEV model config whose generator is fitted")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--target-checkpoint", help="a tied/untied run's --save folder: its input table")
    target.add_argument("--target-init", help="a tied/untied config: the table its model draws at --seed")
    target.add_argument("--target-random", type=float, metavar="STD", help="an N(0, STD) table")
    p.add_argument("--vocab-size", type=int, help="override the config's vocabulary (with --target-random)")
    p.add_argument("--hidden-size", type=int, help="override the config's width (with --target-random)")
    p.add_argument("--seed", type=int, default=1, help="the LEV model's --seed (its generator init) and the targets'")
    for name, default in (("lr", 3e-3), ("max-steps", 5000), ("eval-every", 50), ("patience", 4), ("tolerance", 1e-3)):
        p.add_argument(f"--{name}", type=type(default), default=default)
    p.add_argument("--batch-ids", type=int, help="ids per Adam step (default: all)")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--save", help="write the fitted generator here (for model.lev_init_from)")
    p.add_argument("--out", help="write the report (JSON) here")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {k: v for k, v in (("vocab_size", args.vocab_size), ("hidden_size", args.hidden_size)) if v}
    if overrides and args.target_random is None:
        sys.exit("capacity: --vocab-size/--hidden-size only with --target-random (a real target has its own)")
    model = model_config_from_dict(load_config(args.config)["model"], init_seed=args.seed, **overrides)
    if model.embedding != "lev":
        sys.exit(f"capacity: --config {args.config}: embedding is {model.embedding}, not lev")
    if args.target_checkpoint:
        target, source = checkpoint_table(args.target_checkpoint), f"checkpoint {args.target_checkpoint}"
    elif args.target_init:
        target, source = init_table(args.target_init, args.seed), f"init of {args.target_init} at seed {args.seed}"
    else:
        g = torch.Generator().manual_seed(args.seed)
        target = torch.randn(model.vocab_size, model.hidden_size, generator=g) * args.target_random
        source = f"N(0, {args.target_random:g}) at seed {args.seed}"
    if tuple(target.shape) != (model.vocab_size, model.hidden_size):
        sys.exit(f"capacity: the target is {tuple(target.shape)}, the config's generator makes "
                 f"({model.vocab_size}, {model.hidden_size})")
    settings = FitSettings(lr=args.lr, max_steps=args.max_steps, batch_ids=args.batch_ids, eval_every=args.eval_every,
                           patience=args.patience, tolerance=args.tolerance, seed=args.seed)
    report, generator = capacity_report(model.lev_config(), target, derive_seed(args.seed, "embedding"), settings,
                                        log=lambda line: print(line, file=sys.stderr, flush=True))
    report.update(config=args.config, target_source=source, seed=args.seed)
    if args.save:
        save_fit(args.save, generator, report)
    if args.out:
        write_json_atomic(args.out, report)
    summary = {k: report[k] for k in ("target", "lev_init", "lev_adam", "lev", "factorized", "rank_bound")}
    print(json.dumps({"target_source": source, "steps": report["training"]["steps"],
                      "stopped": report["training"]["stopped"], **summary}, indent=1))
    return report


if __name__ == "__main__":
    main()
