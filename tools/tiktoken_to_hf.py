#!/usr/bin/env python
"""Convert a tiktoken encoding (a .tiktoken file, or a name such as o200k_base) to a Hugging Face
tokenizer.json with tiktoken's ids, which tools/preprocess_data.py --tokenizer-type
HuggingFaceTokenizer, the trainer and the exports read.

    python tools/tiktoken_to_hf.py --encoding /data/tok/o200k_base.tiktoken --like o200k_base \
        --output /data/tok/o200k --check /data/pile/val.jsonl.zst

See megatron_lev/hf/tiktoken_convert.py (or --help); where o200k_base's file comes from:
docs/cluster.md "3. The tokenizer".
"""
import sys

from megatron_lev.hf.tiktoken_convert import main

if __name__ == "__main__":
    sys.exit(main())
