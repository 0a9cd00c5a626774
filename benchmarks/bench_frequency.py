"""Token-frequency counting speed (megatron_lev.evaluation.frequency), printed as JSON.

    python benchmarks/bench_frequency.py --tokens 100_000_000 --vocab-size 50304

Writes a synthetic indexed dataset (Zipf-distributed ids, documents of 2k tokens on
average, uint16 or int32 as preprocess_data.py would choose) into a temporary
directory, then times, in this process:

  baseline    the whole `.bin` read into memory and one `np.bincount` (the simplest
              correct count; its memory grows with the corpus)
  per_doc     a Python loop over documents (`IndexedDataset[i]`, bincount each): what a
              straightforward implementation does
  chunked     count_token_frequencies without cache: chunked bincount over the memory-
              mapped buffer (memory bounded by the chunk)
  cached      count_token_frequencies when the .npy cache exists

Each reports seconds, tokens/s, CPU seconds (independent of other load on the machine)
and its ratio to the baseline's time. Results must agree exactly; the script fails if not.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lev.evaluation.frequency import count_token_frequencies  # noqa: E402


def write_dataset(prefix: str, tokens: int, vocab_size: int, seed: int) -> int:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    import torch

    rng = np.random.default_rng(seed)
    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    written = 0
    while written < tokens:
        n = min(int(rng.integers(500, 3500)), tokens - written)
        ids = np.minimum(rng.zipf(1.1, size=n) - 1, vocab_size - 1)
        builder.add_document(torch.from_numpy(ids.astype(np.int64)), [n])
        written += n
    builder.finalize(f"{prefix}.idx")
    return written


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=lambda s: int(s.replace("_", "")), default=20_000_000)
    parser.add_argument("--vocab-size", type=int, default=50304)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-per-doc", action="store_true", help="skip the slow per-document loop")
    args = parser.parse_args(argv)

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    with tempfile.TemporaryDirectory(prefix="bench_frequency_") as tmp:
        prefix = os.path.join(tmp, "synthetic_text_document")
        tokens = write_dataset(prefix, args.tokens, args.vocab_size, args.seed)
        dtype = IndexedDataset(prefix).index.dtype
        cache = os.path.join(tmp, "cache")

        runs = {}
        base, *t = timed(lambda: np.bincount(np.fromfile(f"{prefix}.bin", dtype=dtype), minlength=args.vocab_size))
        runs["baseline"] = t
        if not args.skip_per_doc:
            def per_doc():
                ds, counts = IndexedDataset(prefix), np.zeros(args.vocab_size, dtype=np.int64)
                for i in range(len(ds)):
                    counts += np.bincount(ds[i], minlength=args.vocab_size)
                return counts
            got, *t = timed(per_doc)
            assert np.array_equal(got, base), "per-document count differs"
            runs["per_doc"] = t
        got, *t = timed(lambda: count_token_frequencies(prefix, args.vocab_size, cache_dir=cache))
        assert np.array_equal(got, base), "chunked count differs"
        runs["chunked"] = t
        got, *t = timed(lambda: count_token_frequencies(prefix, args.vocab_size, cache_dir=cache))
        assert np.array_equal(got, base), "cached count differs"
        runs["cached"] = t

    base_wall = runs["baseline"][0]
    result = {
        "tokens": tokens, "vocab_size": args.vocab_size, "dtype": np.dtype(dtype).name,
        "runs": {name: {"seconds": round(wall, 4), "cpu_seconds": round(cpu, 4),
                        "tokens_per_s": round(tokens / wall), "time_vs_baseline": round(wall / base_wall, 3)}
                 for name, (wall, cpu) in runs.items()},
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
