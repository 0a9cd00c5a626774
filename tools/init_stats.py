#!/usr/bin/env python
"""The input embedding's RMS and mean pairwise cosine at initialisation, per config and LEV init option.

    python tools/init_stats.py demo-lev demo-tied experiments/configs/exp-lev.yaml lev-1.2b

See megatron_lev/models/init_stats.py; docs/lev.md ("Initialisation") quotes its table.
"""
import sys

from megatron_lev.models.init_stats import main

if __name__ == "__main__":
    sys.exit(main())
