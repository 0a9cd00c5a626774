"""tqdm progress bars (with ETA) for the tools that run for minutes: evaluation scoring,
token counting, checkpoint conversion."""
from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(iterable, desc: str, total: int | None = None, unit: str = "it"):
    """`iterable` wrapped in a tqdm bar on stderr. Outside a terminal (a log file, Slurm's
    output) it writes a line every 30 s rather than redrawing on every step."""
    tty = sys.stderr.isatty()
    return tqdm(iterable, desc=desc, total=total, unit=unit, mininterval=0.5 if tty else 30.0, dynamic_ncols=tty,
                file=sys.stderr)
