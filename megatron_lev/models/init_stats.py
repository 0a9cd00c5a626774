"""The input embedding at initialisation, as every run logs it before training starts: the RMS
of the embeddings of a fixed sample of ids (lev.generator.calibration_ids) and their mean
pairwise cosine. An N(0, 0.02) table gives RMS 0.02 and cosine about 0; the spec's LEV init
gives a larger RMS and a shared direction (docs/lev.md, "Initialisation")."""
from __future__ import annotations

from typing import Optional

import torch

from megatron_lev.lev.generator import calibration_ids
from megatron_lev.models.embedding_stats import embed_ids, input_embedding_module, mean_pairwise_cosine, rms


def embedding_statistics(embeddings: torch.Tensor) -> tuple[float, float]:
    """embeddings [n, D] -> (RMS over all entries, mean cosine over the n(n-1) ordered pairs of distinct rows)."""
    return rms(embeddings), mean_pairwise_cosine(embeddings)


def input_embedding_statistics(embedding: torch.nn.Module, vocab_size: int) -> tuple[int, float, float]:
    """(ids, RMS, mean pairwise cosine) of `embedding` over the calibration ids. Collective over
    the tensor-parallel group (the embedding's own all-reduce / gather)."""
    out = embed_ids(embedding, calibration_ids(vocab_size))
    rms_value, cosine = embedding_statistics(out)
    return len(out), rms_value, cosine


def init_statistics_line(module: torch.nn.Module, vocab_size: int, kind: str) -> Optional[str]:
    """The start-of-run log line, or None where this rank holds no input embedding."""
    embedding = input_embedding_module(module)
    if embedding is None:
        return None
    n, rms_value, cosine = input_embedding_statistics(embedding, vocab_size)
    return f" > {kind} input embedding at init ({n} fixed ids): RMS {rms_value:.4f}, mean pairwise cosine {cosine:.3f}"


# The variants the measurement compares (docs/lev.md's table): the spec's init and each option.
LEV_INIT_VARIANTS = {
    "spec": {},
    "init_embedding_rms 0.02": {"init_embedding_rms": 0.02},
    "init_remove_shared": {"init_remove_shared": True},
    "both": {"init_remove_shared": True, "init_embedding_rms": 0.02},
}


def main(argv=None) -> int:
    """`python tools/init_stats.py demo-lev demo-tied ...`: the init statistics of each config's
    input embedding (LEV: the spec's init and each option), as a markdown table."""
    import argparse

    from megatron_lev.configs import load_config
    from megatron_lev.distributed.launch import init_distributed
    from megatron_lev.distributed.state import initialize_model_parallel
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.layers import build_embedding

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("configs", nargs="+", help="packaged config names or YAML paths")
    args = parser.parse_args(argv)
    init_distributed(backend="gloo")
    initialize_model_parallel(1, 1)
    print("| config | kind | init | RMS | mean pairwise cosine |\n| --- | --- | --- | --- | --- |")
    for name in args.configs:
        model = load_config(name)["model"]
        variants = LEV_INIT_VARIANTS if model["embedding"] == "lev" else {"N(0, init_method_std) table": None}
        for label, options in variants.items():
            lev = {**model.get("lev", {}), **(options or {})}
            config = model_config_from_dict({**model, "lev": lev})
            n, rms, cosine = input_embedding_statistics(build_embedding(config), config.vocab_size)
            print(f"| {name} | {model['embedding']} | {label} | {rms:.4f} | {cosine:.3f} |", flush=True)
    return 0
