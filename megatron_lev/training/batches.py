"""From datasets to the model's inputs: the run's GPT datasets, this data-parallel rank's
micro-batches on the device, and the tuples DeepSpeed's pipeline engine reads.

The path of a batch: `.bin`/`.idx` (data/datasets.py: megatron-core's GPTDataset, Megatron's
sampler, `collate_pretraining_batch` with LEV's distinct ids) -> `micro_batches` here ->
`Trainer.train_step` (trainer.py) -> `LeviathanModel.forward` (models/decoder.py) -> the loss
(models/cross_entropy.py).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from megatron.core import parallel_state

from megatron_lev.data.datasets import build_pretraining_data_loader, build_train_valid_test_datasets


def dataset_arguments(args) -> dict:
    """The data flags as `plan_datasets` / `build_train_valid_test_datasets` take them."""
    samples = args.eval_iters * args.global_batch_size
    return dict(data_path=args.data_path, train_data_path=args.train_data_path,
                valid_data_path=args.valid_data_path, test_data_path=args.test_data_path, split=args.split,
                seq_length=args.seq_length, train_samples=args.train_iters * args.global_batch_size,
                valid_samples=samples, test_samples=samples)


def build_datasets(args, tokenizer):
    return build_train_valid_test_datasets(
        **dataset_arguments(args), seed=args.seed, tokenizer=tokenizer, cache_dir=args.data_cache_path,
        # Older checkpoints' configs (demo/evaluate rebuild datasets from them) lack these keys.
        eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
        reset_position_ids=bool(getattr(args, "reset_position_ids", False)))


def micro_batches(dataset, consumed_samples: int, args, device,
                  lev_vocab_size: Optional[int] = None) -> Iterator[dict]:
    """This DP rank's micro-batches from `consumed_samples` on, on `device` (with LEV's
    distinct ids when `lev_vocab_size` is given: see collate_pretraining_batch)."""
    loader = build_pretraining_data_loader(
        dataset, consumed_samples, args.micro_batch_size, parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(), num_workers=args.num_workers, lev_vocab_size=lev_vocab_size)
    for batch in loader:
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class PipelineBatches:
    """Micro-batch dicts -> the pipeline module's ((input_ids, position_ids), (labels,
    loss_mask)) tuples; counts distinct ids of what it hands out (for LEV FLOPs)."""

    def __init__(self, batches: Iterator[dict]):
        self.batches = batches
        self.distinct = 0

    def __iter__(self):
        return self

    def __next__(self):
        b = next(self.batches)
        self.distinct += distinct_count(b)
        lev = (b["lev_ids"], b["lev_inverse"]) if "lev_ids" in b else ()  # LEV's ids from the loader
        return (b["tokens"], b["position_ids"], *lev), (b["labels"], b["loss_mask"])


def distinct_count(batch: dict) -> int:
    """Distinct token ids of a micro-batch: the loader's count (a shape, no sync) for LEV."""
    if "lev_ids" in batch:
        return batch["lev_ids"].numel()
    return int(torch.unique(batch["tokens"]).numel())


def model_inputs(batch: dict) -> dict:
    """The keyword inputs of LeviathanModel.forward a micro-batch carries."""
    return {k: batch[k] for k in ("position_ids", "labels", "loss_mask", "lev_ids", "lev_inverse") if k in batch}
