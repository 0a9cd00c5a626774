#!/usr/bin/env python
"""Tokenize JSON-lines corpora (The Pile) into megatron-core indexed datasets.

    python tools/preprocess_data.py --input /data/pile/train/00.jsonl.zst \
        --output-prefix /data/pile/pile_00 --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model tok.model --append-eod --workers 32

See megatron_lev/data/preprocess.py (or --help) for everything it does.
"""
from megatron_lev.data.preprocess import main

if __name__ == "__main__":
    main()
