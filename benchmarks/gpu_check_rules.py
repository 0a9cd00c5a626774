"""The pure rules of benchmarks/gpu_check.py: what passes, what is comparable, in what order the
kinds run, the bounds and how they are derived, the time plan. No torch here: the rehearsal
(benchmarks/gpu_rehearsal.sh) runs these under the GPU image's Python 3.12 with a stand-in
torch, and tests/test_gpu_check_rules.py checks them with exact numbers.
"""
from __future__ import annotations

import math
import statistics

KINDS = ("lev", "tied")

# ----------------------------------------------------------------------------- time (one H200)

# Seconds each stage is expected to take on one H200, in the order the check runs them (the
# derivation is in docs/performance.md, "The first GPU call"); gpu_check.sh gives gpu_check.py
# what is left of 470 s after the install, and a stage that no longer fits is skipped
# (recorded, and the check fails). kernel_tests is also the subprocess's time limit.
STAGE_ORDER = ("kernel_tests", "fused_vs_pytorch", "gemm_ceiling", "megatron_gpt", "bf16_vs_fp32", "save_resume",
               "training")
STAGE_ESTIMATE_S = {"kernel_tests": 60, "fused_vs_pytorch": 20, "gemm_ceiling": 5, "megatron_gpt": 20,
                    "bf16_vs_fp32": 20, "save_resume": 30, "training": 200}
KERNEL_TESTS_LIMIT_S = 150


def stage_fits(stage: str, seconds_left: float | None) -> bool:
    """Whether `stage` may start with `seconds_left` of the check's time (None: no limit)."""
    return seconds_left is None or seconds_left >= STAGE_ESTIMATE_S[stage]


# ----------------------------------------------------------------------------- training stage

MIN_TRAIN_STEPS = 10
MAX_WARMUP_STEPS = 2
LOSS_WINDOW = 3  # the loss falls: mean of the first 3 steps > mean of the last 3
# The one-GPU check's training stage: WARMUP_STEPS untimed steps per kind (the first compiles and
# allocates Adam's moments), then at least MIN_TIMED_STEPS timed ones.
WARMUP_STEPS = 3
MIN_TIMED_STEPS = 20
# LEV's step time over tied's: the check fails above this median ratio (docs/performance.md: the
# goal at 1.2B is 1.01; the pairwise ratios' spread is reported beside it).
MAX_LEV_OVER_TIED = 1.02


def interleaved_order(kinds: tuple[str, ...], steps: int, rotate: bool = True) -> list[tuple[int, str]]:
    """(step, kind) in the order the training stage runs them: every kind's step s before any
    kind's step s + 1 (a round), so a drift of the machine's speed falls on both kinds alike; with
    `rotate` round s starts with kinds[s % len(kinds)] (lev, tied, tied, lev, lev, tied, ...), so
    neither kind always runs first (after the other's optimizer step, with its caches warm)."""
    n = len(kinds)
    return [(step, kinds[(i + step * rotate) % n]) for step in range(steps) for i in range(n)]


def loss_falls(losses: list[float]) -> dict:
    """{"first_mean", "last_mean", "falls"}: the mean loss of the first LOSS_WINDOW steps against
    the last LOSS_WINDOW (needs 2 * LOSS_WINDOW steps; a non-finite loss never falls)."""
    if len(losses) < 2 * LOSS_WINDOW:
        return {"first_mean": None, "last_mean": None, "falls": False}
    first = sum(losses[:LOSS_WINDOW]) / LOSS_WINDOW
    last = sum(losses[-LOSS_WINDOW:]) / LOSS_WINDOW
    return {"first_mean": first, "last_mean": last, "falls": math.isfinite(first) and math.isfinite(last)
            and last < first}


def learning_rate_problems(lrs: list[float]) -> list[str]:
    """Why the learning rates the steps ran at do not make a training check (empty: they do): at
    least MIN_TRAIN_STEPS steps, and after at most MAX_WARMUP_STEPS warm-up steps one constant
    rate above zero."""
    if len(lrs) < MIN_TRAIN_STEPS:
        return [f"{len(lrs)} steps, fewer than {MIN_TRAIN_STEPS}"]
    constant = lrs[-1]
    warmup = next((i for i, lr in enumerate(lrs) if all(later == constant for later in lrs[i:])), len(lrs))
    problems = []
    if not constant > 0:
        problems.append(f"learning rate {constant} after warm-up")
    if warmup > MAX_WARMUP_STEPS:
        problems.append(f"the learning rate settles after {warmup} steps, more than {MAX_WARMUP_STEPS} "
                        f"(rates {lrs[:warmup + 1]})")
    return problems


def spread(values: list[float]) -> dict:
    """median, min, max, quartiles and (max - min) / median of `values`."""
    ordered = sorted(values)
    median = statistics.median(ordered)
    q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else (median,) * 3
    return {"median": median, "min": ordered[0], "max": ordered[-1], "q1": q1, "q3": q3,
            "relative_range": (ordered[-1] - ordered[0]) / median if median else None}


BATCH_FIELDS = ("micro_batch_size", "gradient_accumulation_steps", "seq_length", "data_parallel_size")


def step_time_ratio(lev: dict, tied: dict) -> dict:
    """LEV's step time over tied's, when the two ran the same batch (every BATCH_FIELDS equal):
    the ratio of the medians and the spread of the per-step ratios of the interleaved pairs.
    Otherwise `comparable` is False and `why` names the difference (the check then fails)."""
    differ = [f"{f} {lev.get(f)} vs {tied.get(f)}" for f in BATCH_FIELDS if lev.get(f) != tied.get(f)]
    if differ:
        return {"comparable": False, "why": "lev vs tied: " + ", ".join(differ), "median_ratio": None}
    pairs = [a / b for a, b in zip(lev["step_times_s"], tied["step_times_s"])]
    return {"comparable": True, "median_ratio": statistics.median(lev["step_times_s"]) / statistics.median(
        tied["step_times_s"]), "pair_ratios": spread(pairs)}


# Memory (bytes per parameter) of one DeepSpeed bf16 engine at DP = 1 under ZeRO-2: bf16 weights
# and gradients (2 + 2), fp32 master weights (4), Adam's two fp32 moments (8), the fp32 gradient
# partition (4). At DP = 1 the partition is everything; a GPU of an 8-GPU node holds 1/8 of the
# last three.
ENGINE_BYTES_PER_PARAMETER = 20
FP32_STATE_BYTES_PER_PARAMETER = 16
# The Slurm launcher (megatron_lev/launcher/batch.py) sizes the micro-batch at about 5.6 GB of activations per 2048-token sequence.
ACTIVATION_BYTES_PER_TOKEN = 5.6e9 / 2048
MEMORY_HEADROOM = 0.9  # of the GPU's memory: the allocator's fragmentation and the CUDA context

DP1_LABEL = ("DP=1: ZeRO-2 partitions over one rank, so this GPU holds all fp32 master weights, fp32 gradients "
             "and Adam moments (16 bytes per parameter); a GPU of an 8-GPU node holds 1/8 of them. Step time, "
             "tokens/s and MFU are this GPU's at the per-GPU micro-batch and accumulation of an 8-GPU node; "
             "memory figures are not an 8-GPU node's per-GPU figures.")


def micro_batch_plan(micro: int, accumulation: int, parameters: int, capacity_bytes: float | None,
                     seq_length: int) -> dict:
    """The micro-batch both kinds start at: the Slurm scripts' `micro` and `accumulation` as they
    are, with the estimate of what two resident engines (interleaved timing keeps both) and one
    micro-batch's activations need, and whether that fits MEMORY_HEADROOM of the GPU: recorded,
    not acted on (the estimate is the launcher's, not a measurement; only an out-of-memory error
    halves the micro-batch, gpu_check_training.training_stage). `capacity_bytes` None (CPU): no
    estimate."""
    if capacity_bytes is None:
        return {"micro_batch_size": micro, "gradient_accumulation_steps": accumulation, "estimated_bytes": None,
                "estimate_fits": None}
    need = 2 * ENGINE_BYTES_PER_PARAMETER * parameters + ACTIVATION_BYTES_PER_TOKEN * micro * seq_length
    return {"micro_batch_size": micro, "gradient_accumulation_steps": accumulation, "estimated_bytes": need,
            "estimate_fits": need <= MEMORY_HEADROOM * capacity_bytes}


def halved(micro: int, accumulation: int) -> tuple[int, int] | None:
    """The batch after an out-of-memory error: half the micro-batch, twice the accumulation (the
    same tokens per optimizer step); None when the micro-batch cannot be halved (1, or odd)."""
    if micro == 1 or micro % 2:
        return None
    return micro // 2, accumulation * 2


def lev_share(step_times_s: list[float], forward_s: list[float], backward_s: list[float]) -> dict:
    """LEV's generator inside the training steps: per timed step its forward and backward time
    (summed over the step's micro-batches) over the step's time; the spread of those shares and
    the medians of the two parts."""
    if not (len(step_times_s) == len(forward_s) == len(backward_s)) or not step_times_s:
        return {"share": None, "why": f"{len(step_times_s)} steps, {len(forward_s)} forward and "
                                      f"{len(backward_s)} backward timings"}
    shares = [(f + b) / t for t, f, b in zip(step_times_s, forward_s, backward_s)]
    return {"share": spread(shares), "forward_s_median": statistics.median(forward_s),
            "backward_s_median": statistics.median(backward_s)}


# Memory left allocated after both engines are deleted, above what was allocated before the
# stage, that still counts as freed (the allocator keeps small blocks for its own bookkeeping).
FREED_TOLERANCE_BYTES = 64 * 2**20


def memory_not_freed(memory: dict) -> str | None:
    """Why the training stage's engines were not freed (None: they were): an engine object still
    alive after its deletion, or allocated memory above the stage's start."""
    alive = [kind for kind, freed in memory.get("engines_collected", {}).items() if not freed]
    if alive:
        return f"engines still alive after deletion: {', '.join(alive)}"
    left = memory.get("left_allocated_bytes")
    if left is not None and left > FREED_TOLERANCE_BYTES:
        return f"{left / 2**30:.2f} GiB still allocated after both engines were deleted"
    return None


EXPECTED_OPTIMIZER = {"cuda": "deepspeed.ops.adam.fused_adam.FusedAdam", "cpu": "torch.optim.adamw.AdamW"}


def optimizer_problem(optimizer: dict, device_type: str, allow_fallback: bool) -> str | None:
    """A fallback from the optimizer the device should run (DeepSpeed's fused Adam on CUDA) fails
    the check unless --allow-optimizer-fallback."""
    expected = EXPECTED_OPTIMIZER[device_type]
    if optimizer["class"] == expected and not optimizer["fallbacks"]:
        return None
    line = f"optimizer {optimizer['class']} ran, not {expected} (fallbacks: {optimizer['fallbacks']})"
    return None if allow_fallback else line


# ----------------------------------------------------------------------------- bf16 vs fp32

BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bf16 keeps 8 significant bits: round to nearest is within 2^-8


def bf16_rounding_stages(num_layers: int) -> int:
    """bf16 roundings on the way from the weights to the logits (matmuls accumulate in fp32, the
    loss is fp32): per sublayer (attention, MLP) its normalised input, its two weight matrices,
    the two matmul outputs, the one tensor between them (attention's output, SwiGLU's product)
    and the residual sum: 7, so 14 per layer; then the embedding's output, the final norm's
    output and the output layer's weights."""
    return 14 * num_layers + 3


def bf16_loss_bounds(num_layers: int, fp32_losses: list[float], max_abs_logits: list[float]) -> list[float]:
    """Per step t, how far the bf16 run's loss may lie from the fp32 run's (same initial weights,
    same batches, same optimizer), to first order in the rounding error:

        bound_t = eps * (2 * Z_t + V_t),   eps = bf16_rounding_stages(L) * 2^-8

    - forward at the same weights: each rounding moves what it rounds by at most 2^-8 of it, and
      to first order the errors add along the path: the logits are off by at most eps of their
      size, eps * Z_t (Z_t: the largest |logit| of the fp32 model on step t's batch; a rounded
      sum's error is taken at the sum's size, as independent roundings give, not at the sum of
      its terms' sizes); cross entropy moves by at most twice the largest logit error
      (|d logsumexp| and |d z_label| are each <= max |dz|);
    - the trajectory: every update carries a relative error of at most eps, so what the loss
      gained or lost each step (the fp32 curve) is off by at most eps of it; V_t = the sum of
      |L_s - L_(s-1)| over s <= t, the fp32 curve's total variation so far.
    """
    eps = bf16_rounding_stages(num_layers) * BF16_UNIT_ROUNDOFF
    bounds, variation = [], 0.0
    for t, (loss, logit) in enumerate(zip(fp32_losses, max_abs_logits)):
        if t:
            variation += abs(loss - fp32_losses[t - 1])
        bounds.append(eps * (2 * logit + variation))
    return bounds


def compare_curves(reference: list[float], other: list[float], bounds: list[float]) -> dict:
    """Step by step |other - reference| against `bounds`."""
    diffs = [abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf for a, b in zip(other, reference)]
    worst = max(range(len(diffs)), key=lambda i: diffs[i] / bounds[i] if bounds[i] else math.inf)
    return {"diffs": diffs, "bounds": bounds, "worst_step": worst, "worst_diff_over_bound": diffs[worst] / bounds[worst],
            "within": len(diffs) == len(bounds) == len(reference) and all(d <= b for d, b in zip(diffs, bounds))}


# ----------------------------------------------------------------------------- save and resume

# Resumed vs uninterrupted, per step: |dL| <= RESUME_TOLERANCE * |L|. A correct resume on a GPU
# differs only by the order of float32 atomic sums (index_add, attention backward), about 1e-6
# of the loss or less after a few steps; the defects it guards against (Adam's moments or the LR
# schedule not restored, weights not loaded) move the loss by 1e-3 or more of it at the check's
# learning rate (docs/performance.md gives the CPU measurements).
RESUME_TOLERANCE = 1e-4


def compare_resume(uninterrupted: list[float], resumed: list[float], first_resumed_step: int) -> dict:
    """The resumed run's losses from `first_resumed_step` on against the uninterrupted run's
    same steps: bit-exact, or within RESUME_TOLERANCE of the loss; and the steps before the save
    (the same computation twice, no checkpoint involved), whose difference is the GPU's own
    run-to-run noise."""
    after = [(u, r) for u, r in zip(uninterrupted[first_resumed_step:], resumed[first_resumed_step:])]
    before = [abs(u - r) for u, r in zip(uninterrupted[:first_resumed_step], resumed[:first_resumed_step])]
    relative = [abs(u - r) / abs(u) if math.isfinite(r) else math.inf for u, r in after]
    return {"bit_exact": all(u == r for u, r in after) and not any(before),
            "relative_diffs": relative, "before_save_abs_diffs": before, "tolerance": RESUME_TOLERANCE,
            "within": len(after) == len(uninterrupted) - first_resumed_step > 0
            and all(d <= RESUME_TOLERANCE for d in relative)}


# ----------------------------------------------------------------------------- GPTModel + LEV

# GPTModel+LEV vs LeviathanModel on the same weights, float32 (TF32 off): max |diff| / max |value|
# per tensor. The two run the same matmuls (cuBLAS, the same shapes) and differ in the attention
# kernel and the norm's implementation: sums in another order, about sqrt(K) * 2^-24 (K <= 5632:
# 4.5e-6) of a tensor's scale per layer; tests/test_megatron_gpt.py holds the CPU to the same.
GPT_FP32_TOLERANCE = {"logits": 1e-5, "loss": 1e-5, "grads": 1e-4}
# bf16: the two models round different intermediate tensors (2^-8 each, a handful of roundings
# per layer at 2 layers): 2^-5 of the loss, as gpu_check_multi's TP bf16 comparison allows.
GPT_BF16_TOLERANCE = 2.0 ** -5


# ----------------------------------------------------------------------------- the verdict


def failures(report: dict, device_type: str, max_ratio: float, allow_optimizer_fallback: bool = False) -> list[str]:
    """Why the check fails (empty: it passes)."""
    found = []
    for stage in ("kernel_tests", "fused_vs_pytorch", "gemm_ceiling", "megatron_gpt", "bf16_vs_fp32", "save_resume"):
        result = report.get(stage)
        if result is not None and not result.get("ok"):
            found.append(f"{stage} failed" + (f": {result['why']}" if result.get("why") else ""))
    found += [f"{stage} skipped: {why}" for stage, why in report.get("skipped_stages", {}).items()]
    training = report.get("training")
    if training is None:
        return found
    kinds = training.get("kinds", {})
    for kind, result in kinds.items():
        if "error" in result:
            found.append(f"{kind}: {result['error']}")
            continue
        if "loss_falls" not in result:  # interrupted before its steps were summarised
            found.append(f"{kind}: unfinished after {len(result.get('losses', []))} steps")
            continue
        if not all(math.isfinite(loss) for loss in result["losses"]):
            found.append(f"{kind}: non-finite loss {result['losses']}")
        elif not result["loss_falls"]["falls"]:
            falls = result["loss_falls"]
            found.append(f"{kind}: the loss did not fall (mean of the first {LOSS_WINDOW} steps "
                         f"{falls['first_mean']}, of the last {LOSS_WINDOW} {falls['last_mean']})")
        found += [f"{kind}: {problem}" for problem in learning_rate_problems(result["lrs"])]
        problem = optimizer_problem(result["optimizer"], device_type, allow_optimizer_fallback)
        if problem:
            found.append(f"{kind}: {problem} (--allow-optimizer-fallback accepts it)")
        if device_type == "cuda" and result["compile_fallbacks"]["decoder_layers"]:
            found.append(f"{kind}: decoder layers ran eagerly after torch.compile failed: "
                         f"{result['compile_fallbacks']}")
    lev = kinds.get("lev", {})
    if device_type == "cuda" and "fused_kernel_launches" in lev and (
            lev.get("fused_failure") or not all(lev["fused_kernel_launches"].values())):
        found.append(f"lev: the fused LEV kernels did not run (launches {lev['fused_kernel_launches']}, "
                     f"failure {lev.get('fused_failure')})")
    timing = lev.get("lev_generator")
    if timing is not None and timing["share"] is None:
        found.append(f"lev: the generator's timing inside the steps: {timing['why']}")
    ratio = training.get("lev_over_tied_step_time")
    if ratio is not None and not ratio["comparable"]:
        found.append(f"lev_over_tied_step_time not comparable: {ratio['why']}")
    elif ratio is not None and ratio["median_ratio"] > max_ratio:
        pairs = ratio["pair_ratios"]
        found.append(f"lev_over_tied_step_time {ratio['median_ratio']:.3f} > {max_ratio} (pairwise median "
                     f"{pairs['median']:.3f}, quartiles {pairs['q1']:.3f}-{pairs['q3']:.3f}, range "
                     f"{pairs['min']:.3f}-{pairs['max']:.3f})")
    problem = memory_not_freed(training.get("memory", {}))
    if problem:
        found.append(f"training: {problem}")
    if "error" in training:
        found.append(f"training: {training['error']}")
    return found
