"""Training data: megatron-core GPT datasets over preprocessed .bin/.idx, sharded over DP.

    train, valid, test = build_train_valid_test_datasets(
        data_path=["0.3", "/data/pile_A_text_document", "0.7", "/data/pile_B_text_document"],
        split="969,30,1", seq_length=2048, seed=1234, train_samples=..., valid_samples=...,
        test_samples=..., tokenizer=tokenizer, cache_dir="/data/cache")
    loader = build_pretraining_data_loader(train, consumed_samples, micro_batch_size,
                                           data_parallel_rank, data_parallel_size)
    for batch in loader:  # {"tokens", "labels", "loss_mask", "position_ids"}: [micro, seq]
        ...

The datasets are megatron-core's GPTDataset (document shuffling, sample packing across
document boundaries, all fixed by the seed) blended by BlendedDataset, built by
BlendedMegatronDatasetBuilder: rank 0 builds the index files into the cache first, the
other ranks wait at a barrier and then load them. The sample index is built by the
prebuilt `helpers_cpp` extension that ships in the megatron-core wheel (never compiled
at run time).

Sharding is Megatron's MegatronPretrainingSampler: the global sample order is one
sequence 0, 1, 2, ...; global batch g is samples [g*B, (g+1)*B) with B = micro x DP,
and DP rank r takes the slice [r*micro, (r+1)*micro) of it. Ranks see disjoint samples,
their union is the 1-rank order, and a run resumed at `consumed_samples` continues at
exactly that sample.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
from typing import Callable, Sequence

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                    parse_and_normalize_split)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import _IndexReader, get_bin_path, get_idx_path
from megatron.core.datasets.utils import get_blend_from_list

from megatron_lev.utils.files import write_json_atomic

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")

Blend = tuple[list[str], list[float] | None]


def check_dataset_prefix(prefix: str, flag: str = "--data-path") -> None:
    """A clear error, before any heavy work, when a prefix lacks its .bin or .idx."""
    for path in (get_bin_path(prefix), get_idx_path(prefix)):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{flag} {prefix}: {path} does not exist")


def parse_blend(data_path: str | Sequence[str] | None, flag: str = "--data-path") -> Blend | None:
    """Megatron's blend syntax -> (prefixes, weights or None); every prefix checked on disk.

    Accepts one prefix, several prefixes (weighted by size), or "w1 p1 w2 p2 ..." given
    as a list of words or one string.
    """
    if not data_path:
        return None
    words = data_path.split() if isinstance(data_path, str) else [w for item in data_path for w in str(item).split()]

    def is_number(word: str) -> bool:
        try:
            float(word)
            return True
        except ValueError:
            return False

    numbers = [is_number(w) for w in words]
    if any(numbers):
        pairs_ok = len(words) % 2 == 0 and all(numbers[0::2]) and not any(numbers[1::2])
        if not pairs_ok:
            raise ValueError(f"{flag} {' '.join(words)}: expected 'weight prefix weight prefix ...' "
                             "or prefixes only")
        if any(float(w) <= 0 for w in words[0::2]):
            raise ValueError(f"{flag} {' '.join(words)}: blend weights must be positive")
    prefixes, weights = get_blend_from_list(words)
    for prefix in prefixes:
        check_dataset_prefix(prefix, flag)
    return prefixes, weights


def preprocessing_stats(prefix: str) -> dict | None:
    """The `.stats.json` preprocess_data.py wrote beside a dataset (documents, tokens,
    highest id, the tokenizer with its content hash), or None when there is none or it
    does not describe this .bin (another size)."""
    stats_path = prefix + ".stats.json"
    if not os.path.isfile(stats_path):
        return None
    with open(stats_path, encoding="utf-8") as f:
        stats = json.load(f)
    return stats if stats.get("bin_bytes") == os.path.getsize(get_bin_path(prefix)) else None


def max_token_id(prefix: str, cache_dir: str | None = None) -> int:
    """The highest token id in a dataset (-1 if empty), so training can refuse data that
    does not fit its vocabulary.

    Read from the `.stats.json` that preprocess_data.py writes (when it matches the .bin),
    else computed by scanning the .bin: every byte of it, on every rank, so the answer is kept
    in `cache_dir` (the run's --data-cache-path) for the next start (a requeue, a resume) while
    the .bin keeps its path, size and modification time.
    """
    check_dataset_prefix(prefix)
    bin_path = get_bin_path(prefix)
    stats = preprocessing_stats(prefix)
    if stats is not None and "max_token_id" in stats:
        return int(stats["max_token_id"])
    st = os.stat(bin_path)
    key = {"bin": os.path.abspath(bin_path), "bin_bytes": st.st_size, "bin_mtime_ns": st.st_mtime_ns}
    cache = None
    if cache_dir:
        name = hashlib.sha256(key["bin"].encode()).hexdigest()[:16]
        cache = os.path.join(cache_dir, f"max_token_id_{name}.json")
        with contextlib.suppress(OSError, ValueError):
            with open(cache, encoding="utf-8") as f:
                cached = json.load(f)
            if {k: cached.get(k) for k in key} == key:
                return int(cached["max_token_id"])
    dtype = _IndexReader(get_idx_path(prefix), multimodal=False).dtype
    data = np.memmap(bin_path, dtype=dtype, mode="r") if st.st_size else np.empty(0, dtype)
    highest, step = -1, 1 << 26
    for start in range(0, len(data), step):
        highest = max(highest, int(data[start:start + step].max()))
    if cache is not None:
        with contextlib.suppress(OSError):  # a read-only cache folder: scan again next time
            os.makedirs(cache_dir, exist_ok=True)
            write_json_atomic(cache, {**key, "max_token_id": highest})
    return highest


@dataclasses.dataclass
class DatasetPlan:
    """What `plan_datasets` checked: the blend (or per-split blends), the split string,
    and how many samples each split must provide."""

    blend: Blend | None
    blend_per_split: list[Blend | None] | None
    split: str | None
    seq_length: int
    sizes: list[int | None]

    @property
    def prefixes(self) -> list[str]:
        return [p for b in ([self.blend] if self.blend else self.blend_per_split) if b for p in b[0]]


def plan_datasets(
    *,
    data_path: str | Sequence[str] | None = None,
    train_data_path: str | Sequence[str] | None = None,
    valid_data_path: str | Sequence[str] | None = None,
    test_data_path: str | Sequence[str] | None = None,
    split: str | None = "969,30,1",
    seq_length: int,
    train_samples: int | None,
    valid_samples: int | None,
    test_samples: int | None,
) -> DatasetPlan:
    """Every check of the datasets a run names, without building anything (no index files,
    no collective): the paths' form, every .bin/.idx on disk, the blend weights, and that
    each split that must supply samples gets documents. A ValueError / FileNotFoundError
    names the flag. `build_train_valid_test_datasets` runs it first; the trainer's start-up
    validation runs it before any process group exists."""
    per_split = (train_data_path, valid_data_path, test_data_path)
    if data_path and any(per_split):
        raise ValueError("--data-path and --train-data-path/--valid-data-path/--test-data-path are exclusive")
    if not data_path and not train_data_path:
        raise ValueError("--data-path (or --train-data-path) is required")
    if seq_length < 1:
        raise ValueError(f"--seq-length {seq_length}: must be positive")
    if data_path:
        blend, blend_per_split = parse_blend(data_path, "--data-path"), None
    else:
        blend, split = None, None
        blend_per_split = [parse_blend(paths, flag) for paths, flag in zip(
            per_split, ("--train-data-path", "--valid-data-path", "--test-data-path"))]
    split_matrix = (convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
                    if blend is not None else None)
    sizes = [train_samples, valid_samples, test_samples]
    for i, name in enumerate(("train", "valid", "test")):
        blend_i = blend if blend_per_split is None else blend_per_split[i]
        has_data = blend_i is not None and (split_matrix is None or split_matrix[i] is not None)
        if sizes[i] is None and blend_i is not None and blend_i[1] is not None:
            if has_data:  # megatron-core draws weighted blends by count: it needs one
                raise ValueError(f"{name}_samples is required with a weighted blend")
            sizes[i] = 0  # an empty split: its size is never used
    if blend is not None:
        _check_splits_have_documents(blend[0], split_matrix, sizes, split)
    return DatasetPlan(blend=blend, blend_per_split=blend_per_split, split=split, seq_length=seq_length, sizes=sizes)


def build_train_valid_test_datasets(
    *,
    seed: int,
    tokenizer,
    cache_dir: str | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    is_built_on_rank: Callable[[], bool] | None = None,
    num_dataset_builder_threads: int = 1,
    **data,
):
    """(train, valid, test) GPT datasets; a split is None when it gets no data.

    `data` is what `plan_datasets` takes (and checks first): either `data_path` (one blend,
    divided by `split`, e.g. "969,30,1") or per-split paths, `seq_length`, and `*_samples`,
    the numbers of samples each split must provide (None: one epoch). The shuffled index files go to a folder under `cache_dir` keyed on the data
    files (`index_cache_dir`); without `cache_dir`, under `default_cache_root`. With
    `reset_attention_mask` samples also carry a per-document `attention_mask`
    ([1, seq, seq], True = masked); otherwise none is built: the model is causal.

    Must be called on every rank when torch.distributed is initialised: rank 0 builds and
    caches the indices, then the others load them. `is_built_on_rank` (default: every
    rank) says which ranks get datasets; the others get None.
    """
    plan = plan_datasets(**data)
    cache_dir = index_cache_dir(cache_dir or default_cache_root(plan.prefixes), plan.prefixes)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=plan.seq_length,
        blend=plan.blend,
        blend_per_split=plan.blend_per_split,
        split=plan.split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=reset_attention_mask,
        num_dataset_builder_threads=num_dataset_builder_threads,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, plan.sizes, is_built_on_rank or (lambda: True), config)
    with _rank_zero_when_not_distributed():
        train, valid, test = builder.build()
    return train, valid, test


def default_cache_root(prefixes: Sequence[str]) -> str:
    """Where the index cache goes without --data-cache-path (the trainer defaults it to
    `<--save>/data_cache`, a folder every node sees): a `cache/` folder beside the first
    dataset, else, when that folder is read-only, the user's cache folder."""
    data_dir = os.path.dirname(os.path.abspath(prefixes[0]))
    if os.access(data_dir, os.W_OK):
        return os.path.join(data_dir, "cache")
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megatron_lev",
                        "index_cache")


def index_cache_dir(cache_root: str, prefixes: Sequence[str]) -> str:
    """The folder under `cache_root` for these datasets' shuffled indices, named after a
    hash of each prefix's .idx and .bin (path, size, modification time): megatron-core's
    own file names hash only paths and settings, so a prefix preprocessed again in place
    would silently reuse indices of the old data; here it gets a new folder. The name is
    rank 0's, broadcast, so nodes that read their own copies of the data (other
    modification times) share the cache rank 0 builds."""
    digest = hashlib.sha256()
    for prefix in sorted(set(prefixes)):
        for path in (get_idx_path(prefix), get_bin_path(prefix)):
            stat = os.stat(path)
            digest.update(f"{os.path.abspath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    name = [f"indices-{digest.hexdigest()[:16]}"]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(name, src=0)
    return os.path.join(cache_root, name[0])


def _check_splits_have_documents(prefixes, split_matrix, sizes, split: str) -> None:
    """Refuse a split that must supply samples but gets no document of some dataset:
    megatron-core would add 0-token epochs forever (a tiny dataset's 1/1000 test share
    under "969,30,1" hangs). Same rounding as BlendedMegatronDatasetBuilder; runs on
    every rank before any barrier, so all ranks fail alike."""
    for prefix in prefixes:
        documents = len(_IndexReader(get_idx_path(prefix), multimodal=False).sequence_lengths)
        for i, name in enumerate(("train", "valid", "test")):
            bounds = split_matrix[i]
            if bounds is None or not sizes[i]:
                continue
            count = int(round(bounds[1] * float(documents))) - int(round(bounds[0] * float(documents)))
            if count <= 0:
                raise ValueError(f"--split {split}: the {name} split of {prefix} ({documents} documents) gets "
                                 f"no document but {sizes[i]} samples are needed; give it a larger share or "
                                 f"its own --{name}-data-path")


@contextlib.contextmanager
def _rank_zero_when_not_distributed():
    """megatron-core 0.16's BlendedDataset calls torch.distributed.get_rank() to decide who
    writes its cache even when torch.distributed is not initialised, which raises; a lone
    process is rank 0, so answer that for the duration of the build."""
    if torch.distributed.is_initialized():
        yield
        return
    get_rank = torch.distributed.get_rank
    torch.distributed.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        torch.distributed.get_rank = get_rank


class PretrainingSampler:
    """Megatron's MegatronPretrainingSampler: this DP rank's micro-batches of sample ids.

    Global batch g is samples [g*B, (g+1)*B), B = micro_batch_size x data_parallel_size;
    rank r takes [r*micro, (r+1)*micro) of it. Starts at `consumed_samples`.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"the dataset has no samples ({total_samples})")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} is outside the dataset's {total_samples} samples")
        if micro_batch_size < 1 or data_parallel_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"bad sharding: micro_batch_size {micro_batch_size}, data-parallel rank "
                             f"{data_parallel_rank} of {data_parallel_size}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_batch = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self.global_batch)
        mine = rest > self.data_parallel_rank * self.micro_batch_size
        return full + (not self.drop_last and mine)

    def __iter__(self):
        start = self.data_parallel_rank * self.micro_batch_size
        end = start + self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples, self.global_batch):
            batch = range(first, min(first + self.global_batch, self.total_samples))
            if len(batch) < self.global_batch and (self.drop_last or len(batch) <= start):
                return
            yield list(batch[start:end])


def collate_pretraining_batch(samples: list[dict], lev_vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Stack samples into [micro, seq] tensors: tokens, labels, loss_mask, position_ids
    (and attention_mask when the datasets build one). Blend bookkeeping is dropped.

    With `lev_vocab_size` (LEV models) also `lev_ids` [n], the distinct token ids sorted,
    and `lev_inverse` [micro, seq] with tokens == lev_ids[lev_inverse], range-checked
    here on CPU so the training step needs no `unique` and no host synchronisation
    (lev.parallel.ParallelLEVEmbedding). n = lev_ids.numel() is the distinct-id count.
    """
    keys = BATCH_KEYS + (("attention_mask",) if "attention_mask" in samples[0] else ())
    batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in keys}
    if lev_vocab_size is not None:
        from megatron_lev.lev.generator import ids_to_evaluate

        try:
            batch["lev_ids"], batch["lev_inverse"] = ids_to_evaluate(batch["tokens"], lev_vocab_size, unique=True)
        except ValueError as exc:
            raise ValueError(f"training data: {exc}: the data was tokenised with a larger vocabulary "
                             "than the model's") from None
    return batch


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                                  data_parallel_size: int, num_workers: int | None = 0, drop_last: bool = True,
                                  lev_vocab_size: int | None = None):
    """A DataLoader over this DP rank's share of `dataset`, from `consumed_samples` on.

    Batches are dicts of [micro_batch_size, seq] tensors (see collate_pretraining_batch;
    `lev_vocab_size` adds LEV's distinct ids). `num_workers` None: 2 worker processes where
    CUDA is (Megatron-LM's default), none on CPU, where they would take the cores the
    training computes on.
    Returns None for a None dataset (a split with no data).
    """
    if dataset is None:
        return None
    if num_workers is None:
        num_workers = 2 if torch.cuda.is_available() else 0
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, data_parallel_rank,
                                 data_parallel_size, drop_last)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers,
        collate_fn=functools.partial(collate_pretraining_batch, lev_vocab_size=lev_vocab_size),
        pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0)
