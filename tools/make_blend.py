"""Print a Megatron data blend ("W1 PREFIX1 W2 PREFIX2 ...") for indexed datasets.

    export DATA_PATH="$(python tools/make_blend.py /data/pile_tok/train)"
    export VALID_DATA_PATH="$(python tools/make_blend.py /data/pile_tok/val)"

Arguments are dataset prefixes (PREFIX.bin + PREFIX.idx) or folders, which stand for
every dataset directly inside them (sorted by name). By default each weight is the
dataset's share of all the tokens, so the blend samples every token with the same
probability, as one concatenated dataset would; that is the right blend for The Pile's
30 training shards, which are random splits of one mixture. `--weighting equal` gives
every dataset the same share instead. `--exclude REGEX` drops datasets whose prefix
matches.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def find_prefixes(paths: list[str], exclude: str | None = None) -> list[str]:
    """Dataset prefixes named by `paths` (prefixes or folders), in order, without duplicates."""
    prefixes: list[str] = []
    for path in paths:
        p = Path(path)
        if p.is_dir():
            found = sorted(str(idx.with_suffix("")) for idx in p.glob("*.idx"))
            if not found:
                raise SystemExit(f"make_blend: {path}: no *.idx files in this folder")
        else:
            prefix = str(p.with_suffix("")) if p.suffix in (".bin", ".idx") else str(p)
            found = [prefix]
        prefixes.extend(f for f in found if f not in prefixes)
    if exclude:
        pattern = re.compile(exclude)
        prefixes = [p for p in prefixes if not pattern.search(p)]
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).is_file():
                raise SystemExit(f"make_blend: {prefix}{suffix}: no such file (is '{prefix}' a dataset prefix?)")
    if not prefixes:
        raise SystemExit(f"make_blend: --exclude {exclude!r} left no datasets")
    return prefixes


def token_count(prefix: str) -> int:
    """Tokens in one indexed dataset: the sum of its sequence lengths (read from the .idx)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    # Keep the dataset referenced while summing: its lengths are a view of an mmap that
    # the dataset closes when it is collected.
    dataset = IndexedDataset(prefix)
    return int(dataset.sequence_lengths.sum(dtype="int64"))


def make_blend(prefixes: list[str], weighting: str = "tokens") -> str:
    if weighting == "equal":
        counts = [1] * len(prefixes)
    else:
        counts = [token_count(p) for p in prefixes]
        empty = [p for p, n in zip(prefixes, counts) if n == 0]
        if empty:
            raise SystemExit(f"make_blend: {empty[0]}: the dataset holds no tokens")
    total = sum(counts)
    # Megatron normalises the weights; 8 significant digits keep them exact enough.
    return " ".join(f"{n / total:.8g} {p}" for n, p in zip(counts, prefixes))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="dataset prefixes or folders of datasets")
    parser.add_argument("--weighting", choices=("tokens", "equal"), default="tokens",
                        help="weight each dataset by its token count (default) or equally")
    parser.add_argument("--exclude", metavar="REGEX", help="drop datasets whose prefix matches")
    args = parser.parse_args(argv)
    print(make_blend(find_prefixes(args.paths, args.exclude), args.weighting))


if __name__ == "__main__":
    sys.exit(main())
