"""Frequency buckets over the vocabulary, and per-bucket NLL / perplexity.

A bucketing assigns every token type `t in [0, V)` to exactly one bucket, from
its training-corpus count `counts[t]`. Bucket 0 is always the rarest. Three schemes:

* `log_buckets(counts, base=10)` -- by order of magnitude of the count. Bucket 0
  holds the types never seen in training (count 0); bucket j >= 1 holds the types
  with `base**(j-1) <= count < base**j`, so with base 10: 0 | 1-9 | 10-99 | ...
  Edges are integers (`ceil(base**j)`), so the assignment is exact. Buckets run up
  to the one holding the most frequent type; empty decades in between are kept so
  the axis is regular.

* `quantile_buckets(counts, num_buckets=5)` -- by share of training-token mass.
  Types are ordered by count, rarest first. For each distinct count `c` let
  `below(c)` be the training tokens of all types rarer than `c` (count < c); a
  type with count `c` goes to bucket `min(n-1, floor(n * below(c) / total))`.
  Bucket q therefore starts where the cumulative mass of rarer types reaches q/n:
  each bucket holds about 1/n of the training tokens, ties (types of equal count)
  never straddle two buckets, and the never-seen types fall in bucket 0 with the
  rarest seen ones. A single count level heavier than 1/n of the corpus can leave
  the bucket after it empty; empty buckets are reported, not dropped.

* `type_buckets(counts, num_buckets=5)` -- by number of types: the same rule with
  every type weighing 1 instead of its count. `below(c)` is the number of types
  rarer than `c`, a type goes to bucket `min(n-1, floor(n * below(c) / V))`, so
  each bucket holds about V/n types (ties never straddle; a count level holding
  more than V/n types, such as the never-seen ones, makes its bucket larger).

Per-bucket NLL is stratified by a token id chosen per position: the *predicted*
token (the NLL of predicting `labels[i]` counts towards the bucket of
`labels[i]`) or the *input* token at that position (`tokens[i]`, the one whose
embedding LEV generates). Either way every position lands in exactly one
bucket, so summing bucket NLL sums gives the overall NLL sum and the
token-weighted mean of bucket NLLs is the overall mean NLL exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BUCKET_KINDS = ("log", "quantile", "types")
STRATA = ("predicted", "input")  # which token of a position picks its bucket


@dataclass(frozen=True)
class Bucketing:
    """Bucket of every token type; bucket 0 is the rarest."""

    kind: str
    assignment: np.ndarray  # int64 [V]: bucket index of each token type
    labels: tuple[str, ...]
    description: str

    @property
    def num_buckets(self) -> int:
        return len(self.labels)

    @property
    def vocab_size(self) -> int:
        return int(self.assignment.shape[0])

    def bucket_of(self, token_ids) -> np.ndarray:
        return self.assignment[np.asarray(token_ids, dtype=np.int64)]

    def summary(self, counts: np.ndarray) -> list[dict]:
        """Per bucket: its label, number of types, count range and training-token share."""
        counts = np.asarray(counts, dtype=np.int64)
        n = self.num_buckets
        types = np.bincount(self.assignment, minlength=n)
        mass = np.bincount(self.assignment, weights=counts, minlength=n)
        total = max(int(counts.sum()), 1)
        rows = []
        for b in range(n):
            members = counts[self.assignment == b]
            rows.append({
                "bucket": b,
                "label": self.labels[b],
                "num_types": int(types[b]),
                "min_count": int(members.min()) if members.size else None,
                "max_count": int(members.max()) if members.size else None,
                "train_tokens": int(mass[b]),
                "train_token_share": float(mass[b]) / total,
            })
        return rows


def _check_counts(counts) -> np.ndarray:
    counts = np.asarray(counts)
    if counts.ndim != 1 or counts.size == 0 or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError("counts must be a non-empty 1-D integer array (one entry per token type)")
    if counts.min() < 0:
        raise ValueError("counts must be non-negative")
    return counts.astype(np.int64, copy=False)


def log_buckets(counts, base: float = 10) -> Bucketing:
    """Order-of-magnitude buckets: {0}, [1, base), [base, base^2), ... (see module doc)."""
    counts = _check_counts(counts)
    if not base > 1:
        raise ValueError(f"log bucket base must be > 1, got {base}")
    top = int(counts.max())
    edges = [1]  # edges[j] = lower count of bucket j+1
    while edges[-1] <= top:
        nxt = math.ceil(base ** len(edges))
        edges.append(max(nxt, edges[-1] + 1))
    # searchsorted(..., "right"): 0 -> bucket 0, [edges[j-1], edges[j]) -> bucket j.
    assignment = np.searchsorted(np.asarray(edges, dtype=np.int64), counts, side="right").astype(np.int64)
    num = len(edges)  # bucket 0 plus one per [edges[j-1], edges[j])
    labels = ["0"] + [f"{lo}-{hi - 1}" if hi - 1 > lo else f"{lo}" for lo, hi in zip(edges[:-1], edges[1:])]
    assert len(labels) == num
    return Bucketing("log", assignment, tuple(labels),
                     f"log buckets (base {base:g}): count 0, then [base^(j-1), base^j)")


def _level_buckets(counts: np.ndarray, num_buckets: int, by_mass: bool) -> np.ndarray:
    """Bucket of each type when each count level `c` goes to `floor(n * below(c) / total)`,
    `below` and `total` in training tokens (by_mass) or in types."""
    levels, inverse = np.unique(counts, return_inverse=True)  # distinct counts, ascending
    types_at = np.bincount(inverse, minlength=levels.size)
    weight_at = levels * types_at if by_mass else types_at
    below = np.concatenate([[0], np.cumsum(weight_at)[:-1]])  # weight of all rarer levels
    # Integer arithmetic: floor(n * below / total) without float rounding at the edges.
    level_bucket = np.minimum(num_buckets - 1, (num_buckets * below) // int(weight_at.sum()))
    return level_bucket[inverse].astype(np.int64)


def _span_labels(counts: np.ndarray, assignment: np.ndarray, num_buckets: int, prefix: str) -> tuple[str, ...]:
    labels = []
    for q in range(num_buckets):
        members = counts[assignment == q]
        span = f"{members.min()}-{members.max()}" if members.size else "empty"
        labels.append(f"{prefix}{q + 1} ({span})")
    return tuple(labels)


def quantile_buckets(counts, num_buckets: int = 5) -> Bucketing:
    """Buckets of about equal training-token mass, rarest first (see module doc)."""
    counts = _check_counts(counts)
    if num_buckets < 1:
        raise ValueError(f"number of quantile buckets must be >= 1, got {num_buckets}")
    if int(counts.sum()) == 0:
        raise ValueError("quantile buckets need a corpus with at least one token (all counts are 0)")
    assignment = _level_buckets(counts, num_buckets, by_mass=True)
    return Bucketing("quantile", assignment, _span_labels(counts, assignment, num_buckets, "Q"),
                     f"{num_buckets} quantile buckets of ~equal training-token mass, rarest first")


def type_buckets(counts, num_buckets: int = 5) -> Bucketing:
    """Buckets of about equal numbers of token types, rarest first (see module doc)."""
    counts = _check_counts(counts)
    if num_buckets < 1:
        raise ValueError(f"number of type buckets must be >= 1, got {num_buckets}")
    assignment = _level_buckets(counts, num_buckets, by_mass=False)
    return Bucketing("types", assignment, _span_labels(counts, assignment, num_buckets, "T"),
                     f"{num_buckets} buckets of ~equal numbers of token types, rarest first")


def build_bucketing(spec: str, counts) -> Bucketing:
    """From a flag value: 'log', 'log:2' (base), 'quantile', 'quantile:10', 'types', 'types:10' (number)."""
    kind, _, arg = spec.partition(":")
    try:
        if kind == "log":
            return log_buckets(counts, base=float(arg) if arg else 10)
        if kind == "quantile":
            return quantile_buckets(counts, num_buckets=int(arg) if arg else 5)
        if kind == "types":
            return type_buckets(counts, num_buckets=int(arg) if arg else 5)
    except ValueError as exc:
        if "could not convert" in str(exc) or "invalid literal" in str(exc):
            raise ValueError(f"--buckets {spec!r}: bad number after ':'") from exc
        raise
    raise ValueError(f"--buckets {spec!r}: kind must be one of {', '.join(BUCKET_KINDS)} "
                     f"(optionally with ':N')")


@dataclass
class BucketNLL:
    """Summed NLL and token count per bucket for one model on a set of predicted tokens."""

    tokens: np.ndarray  # int64 [B]
    nll_sum: np.ndarray  # float64 [B]

    @classmethod
    def zeros(cls, num_buckets: int) -> "BucketNLL":
        return cls(np.zeros(num_buckets, dtype=np.int64), np.zeros(num_buckets, dtype=np.float64))

    def add(self, bucketing: Bucketing, labels, nll) -> None:
        """Accumulate the NLLs `nll[i]` into the buckets of the token ids `labels[i]` (the
        predicted or the input token of each position; same shapes, masked out already)."""
        labels = np.asarray(labels, dtype=np.int64).ravel()
        nll = np.asarray(nll, dtype=np.float64).ravel()
        if labels.shape != nll.shape:
            raise ValueError(f"labels {labels.shape} and nll {nll.shape} differ in shape")
        if labels.size and (labels.min() < 0 or labels.max() >= bucketing.vocab_size):
            raise ValueError(f"token id outside the bucketed vocabulary [0, {bucketing.vocab_size})")
        b = bucketing.assignment[labels]
        self.tokens += np.bincount(b, minlength=bucketing.num_buckets)
        self.nll_sum += np.bincount(b, weights=nll, minlength=bucketing.num_buckets)

    @property
    def mean_nll(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.tokens > 0, self.nll_sum / np.maximum(self.tokens, 1), np.nan)

    @property
    def perplexity(self) -> np.ndarray:
        return np.exp(self.mean_nll)

    @property
    def overall_nll(self) -> float:
        return float(self.nll_sum.sum() / max(int(self.tokens.sum()), 1))


def stratified_report(bucketing: Bucketing, counts, result: BucketNLL) -> dict:
    """JSON-ready table: bucket summary plus eval tokens, mean NLL and perplexity per bucket."""
    rows = bucketing.summary(counts)
    for row, tokens, nll in zip(rows, result.tokens, result.mean_nll):
        row["eval_tokens"] = int(tokens)
        row["nll"] = None if np.isnan(nll) else float(nll)
        row["ppl"] = None if np.isnan(nll) else float(math.exp(nll))
    return {
        "kind": bucketing.kind,
        "description": bucketing.description,
        "buckets": rows,
        "overall": {"eval_tokens": int(result.tokens.sum()), "nll": result.overall_nll,
                    "ppl": math.exp(result.overall_nll)},
    }
