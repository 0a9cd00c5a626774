#!/usr/bin/env python
"""Parameter breakdown of a model config, and the isoparametric planner.

    python tools/param_count.py --config lev-1.2b [--tensor-model-parallel-size N] [--json]
    python tools/param_count.py --match-baseline untied-400m [--config lev-400m] [--vary depth|width]
    python tools/param_count.py --config FACTORIZED.yaml --match-params TARGET.yaml   # embedding_rank

The logic lives in megatron_lev/models/param_count.py.
"""
import sys

from megatron_lev.models.param_count import main

if __name__ == "__main__":
    sys.exit(main())
