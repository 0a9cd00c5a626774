#!/usr/bin/env python
"""Convert a Megatron-LM checkpoint of a GPTModel with the LEV embedding to a Hugging Face folder.

    python tools/convert_from_mcore.py --load megatron-lm-save-dir --output hf/lev [--iteration N] \
        [--tokenizer-model tok.model | --vocab-file vocab.json --merge-file merges.txt] [--dtype bf16|fp16|fp32]

The model's settings and the tokenizer come from the arguments Megatron-LM saved with the checkpoint.

See docs/megatron-lm.md (or --help).
"""
import sys

from megatron_lev.hf.cli import convert_from_mcore_main

if __name__ == "__main__":
    sys.exit(convert_from_mcore_main())
