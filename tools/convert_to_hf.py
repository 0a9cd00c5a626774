#!/usr/bin/env python
"""Convert a megatron_lev training checkpoint (any TP / PP / ZeRO) to a Hugging Face folder.

    python tools/convert_to_hf.py --load runs/lev-1.2b --output hf/lev-1.2b [--iteration N]
        [--dtype bf16|fp16|fp32] [--tokenizer-model tok.model] [--materialize-embeddings]

See megatron_lev/hf/export.py (or --help) for what it writes.
"""
import sys

from megatron_lev.hf.cli import convert_to_hf_main

if __name__ == "__main__":
    sys.exit(convert_to_hf_main())
