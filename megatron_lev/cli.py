"""Console commands installed by `pip install .` (setup.py's entry points).

    megatron-lev-train           python -m megatron_lev.train
    megatron-lev-preprocess      python tools/preprocess_data.py
    megatron-lev-convert-to-hf   python tools/convert_to_hf.py
    megatron-lev-convert-from-hf python tools/convert_from_hf.py
    megatron-lev-convert-from-mcore python tools/convert_from_mcore.py (Megatron-LM checkpoints)
    megatron-lev-evaluate        python -m megatron_lev.evaluate

Each returns an exit code (some of the wrapped mains return their results, which a
console script would otherwise print and turn into exit status 1).
"""
from __future__ import annotations


def train() -> int:
    import sys

    from megatron_lev.training.arguments import build_parser

    # --help and a mistyped flag answer before torch and DeepSpeed are imported.
    build_parser().parse_known_args(sys.argv[1:])
    from megatron_lev.train import main

    return main()


def preprocess() -> int:
    from megatron_lev.data.preprocess import main

    main()
    return 0


def convert_to_hf() -> int:
    from megatron_lev.hf.cli import convert_to_hf_main

    return convert_to_hf_main()


def convert_from_hf() -> int:
    from megatron_lev.hf.cli import convert_from_hf_main

    return convert_from_hf_main()


def convert_from_mcore() -> int:
    from megatron_lev.hf.cli import convert_from_mcore_main

    return convert_from_mcore_main()


def evaluate() -> int:
    from megatron_lev.evaluate import main

    main()
    return 0


# name -> function, as setup.py installs them (and tests/test_packaging.py runs them).
CONSOLE_SCRIPTS = {
    "megatron-lev-train": "train",
    "megatron-lev-preprocess": "preprocess",
    "megatron-lev-convert-to-hf": "convert_to_hf",
    "megatron-lev-convert-from-hf": "convert_from_hf",
    "megatron-lev-convert-from-mcore": "convert_from_mcore",
    "megatron-lev-evaluate": "evaluate",
}
