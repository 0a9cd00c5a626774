"""Evaluation and the papers' analyses.

  frequency.py   token-type counts of a training corpus (vectorised, cached)
  buckets.py     frequency buckets (log / quantile / types) and per-bucket NLL / perplexity
  report.py      comparison tables (relative change vs a baseline; markdown + JSON)
  plots.py       PNG bar charts and loss curves (matplotlib Agg)
  curves.py      training-curve comparison, tokens to reach the baseline's final loss
  downstream.py  lm-eval wrapper for the six downstream tasks, offline-capable
  seeds.py       mean +- std over seeds of the changes (overall, per bucket, tokens to target)

`python -m megatron_lev.evaluate` (perplexity of checkpoints / HF exports) ties them together.
"""
from megatron_lev.evaluation.buckets import (BucketNLL, Bucketing, build_bucketing, log_buckets,
                                             quantile_buckets, stratified_report, type_buckets)
from megatron_lev.evaluation.curves import Curve, compare_curves, read_curve, tokens_to_target
from megatron_lev.evaluation.frequency import count_blend_frequencies, count_token_frequencies
from megatron_lev.evaluation.report import ComparisonTable, relative_change

__all__ = [
    "BucketNLL", "Bucketing", "build_bucketing", "log_buckets", "quantile_buckets", "stratified_report",
    "type_buckets",
    "Curve", "compare_curves", "read_curve", "tokens_to_target",
    "count_blend_frequencies", "count_token_frequencies",
    "ComparisonTable", "relative_change",
]
