"""Comparison tables: one metric per row, one column per model, relative change vs a baseline.

Relative change of model m on a row is `100 * (value_m / value_baseline - 1)` per
cent: -81 means the model's perplexity is 81% lower than the baseline's.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field


def relative_change(value, baseline) -> float | None:
    """Per-cent change of `value` vs `baseline` (None when either is missing or baseline is 0)."""
    if value is None or baseline is None or baseline == 0 or math.isnan(value) or math.isnan(baseline):
        return None
    return 100.0 * (value / baseline - 1.0)


@dataclass
class ComparisonTable:
    """Rows of one metric each; `values[model][i]` is row i's value for that model."""

    title: str
    row_labels: list[str]
    values: dict[str, list[float | None]]
    baseline: str
    info_columns: dict[str, list] = field(default_factory=dict)  # extra per-row columns shown first
    metric_name: str = "value"
    errors: dict[str, list[float | None]] = field(default_factory=dict)  # standard errors, shown as "value ± error"

    def __post_init__(self):
        if self.baseline not in self.values:
            raise ValueError(f"baseline {self.baseline!r} is not one of the models: {', '.join(self.values)}")
        for name, column in {**self.values, **self.info_columns, **self.errors}.items():
            if len(column) != len(self.row_labels):
                raise ValueError(f"column {name!r} has {len(column)} rows, expected {len(self.row_labels)}")

    def relative(self, model: str) -> list[float | None]:
        return [relative_change(v, b) for v, b in zip(self.values[model], self.values[self.baseline])]

    def to_json(self) -> dict:
        rows = []
        for i, label in enumerate(self.row_labels):
            row = {"label": label}
            row.update({k: col[i] for k, col in self.info_columns.items()})
            row["values"] = {m: col[i] for m, col in self.values.items()}
            if self.errors:
                row["stderr"] = {m: col[i] for m, col in self.errors.items()}
            row["relative_change_pct"] = {m: self.relative(m)[i] for m in self.values if m != self.baseline}
            rows.append(row)
        return {"title": self.title, "metric": self.metric_name, "baseline": self.baseline, "rows": rows}

    def to_markdown(self) -> str:
        others = [m for m in self.values if m != self.baseline]
        header = (["", *self.info_columns, f"{self.baseline} (baseline)"]
                  + [f"{m}" for m in others] + [f"{m} vs baseline" for m in others])
        lines = [f"**{self.title}** ({self.metric_name})", "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        rel = {m: self.relative(m) for m in others}
        for i, label in enumerate(self.row_labels):
            cells = [label, *(_fmt(col[i]) for col in self.info_columns.values()), self._value(self.baseline, i)]
            cells += [self._value(m, i) for m in others]
            cells += ["n/a" if rel[m][i] is None else f"{rel[m][i]:+.1f}%" for m in others]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def _value(self, model: str, i: int) -> str:
        value, error = self.values[model][i], (self.errors.get(model) or [None] * (i + 1))[i]
        return _fmt(value) if value is None or error is None else f"{_fmt(value)} ± {_fmt(error)}"


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.2f}"
        return f"{value:.4f}"
    return str(value)


def parse_named(values: list[str], flag: str, allow_bare: bool = True) -> dict[str, str]:
    """`NAME=PATH` flag values (or a bare PATH, named after its directory); unique names."""
    named = {}
    for item in values:
        name, sep, path = item.partition("=")
        if not sep and allow_bare:
            path = item
            base = path.rstrip("/")
            base = os.path.dirname(base) if base.endswith(".jsonl") else base
            name = os.path.basename(base) or base
        if not name or not path:
            raise ValueError(f"{flag} {item!r}: expected NAME=PATH")
        if name in named:
            raise ValueError(f"{flag}: the name {name!r} is used twice")
        named[name] = path
    return named
