#!/usr/bin/env python
"""Convert a Hugging Face folder into a checkpoint `python -m megatron_lev.train` can --load.

    python tools/convert_from_hf.py --load hf/lev-1.2b --save runs/lev-1.2b-ft \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 [--config lev-1.2b]

See megatron_lev/hf/import_hf.py (or --help) for what it writes and how to resume from it.
"""
import sys

from megatron_lev.hf.cli import convert_from_hf_main

if __name__ == "__main__":
    sys.exit(convert_from_hf_main())
