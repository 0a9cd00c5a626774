"""Issue 43, item 6: data loading off the training process. --num-workers defaults to 2 where
CUDA is (Megatron-LM's default) and 0 on CPU; a negative count is refused in one line; worker
processes hand out the in-process loader's batches, from any resume point, pinned on CUDA and
kept alive across the run (the 2-rank resume with workers: tests/test_train.py)."""
import pytest
import torch

from megatron_lev.data.datasets import build_pretraining_data_loader, build_train_valid_test_datasets
from megatron_lev.utils.errors import ConfigError
from tests.test_data import spm  # noqa: F401  (the SentencePiece tokenizer fixture)
from tests.test_train_setup import args_for


def _train_split(tiny_dataset, spm, tmp_path):  # noqa: F811
    train, _, _ = build_train_valid_test_datasets(
        data_path=[tiny_dataset], split="90,10,0", seq_length=48, seed=5, train_samples=200, valid_samples=20,
        test_samples=None, tokenizer=spm, cache_dir=str(tmp_path / "cache"))
    return train


def test_workers_default_to_two_on_cuda_and_none_on_cpu(tiny_dataset, spm, tmp_path, monkeypatch):  # noqa: F811
    """The default is the loader's, by the device: the flag check at submit imports no torch."""
    assert args_for(world_size=1).num_workers is None
    assert args_for("--num-workers", "3", world_size=1).num_workers == 3
    assert args_for("--num-workers", "0", world_size=1).num_workers == 0
    with pytest.raises(ConfigError, match=r"^--num-workers must be >= 0, got -1$"):
        args_for("--num-workers", "-1", world_size=1)
    train = _train_split(tiny_dataset, spm, tmp_path)
    assert build_pretraining_data_loader(train, 0, 2, 0, 1, num_workers=None).num_workers == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    loader = build_pretraining_data_loader(train, 0, 2, 0, 1, num_workers=None)
    assert (loader.num_workers, loader.persistent_workers, loader.pin_memory) == (2, True, True)


def test_workers_hand_out_the_same_batches_from_any_resume_point(tiny_dataset, spm, tmp_path,  # noqa: F811
                                                                  monkeypatch):
    train = _train_split(tiny_dataset, spm, tmp_path)
    micro, dp = 2, 2

    def batches(consumed, workers, rank):
        loader = build_pretraining_data_loader(train, consumed, micro, rank, dp, num_workers=workers,
                                               lev_vocab_size=spm.vocab_size)
        return [b for b, _ in zip(loader, range(5))]

    for rank in (0, 1):
        for consumed in (0, 6 * micro * dp):  # a fresh start and a resume at global batch 6
            inline, workers = batches(consumed, 0, rank), batches(consumed, 2, rank)
            assert len(inline) == len(workers) == 5
            for a, b in zip(inline, workers):
                assert a.keys() == b.keys() and "lev_ids" in a
                for key in a:
                    assert torch.equal(a[key], b[key]), (rank, consumed, key)
    assert not torch.equal(batches(0, 2, 0)[0]["tokens"], batches(6 * micro * dp, 2, 0)[0]["tokens"])
    # The loader's settings: workers persist across the run; on CUDA their batches come pinned.
    loader = build_pretraining_data_loader(train, 0, micro, 0, dp, num_workers=2)
    assert (loader.num_workers, loader.persistent_workers, loader.pin_memory) == (2, True, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert build_pretraining_data_loader(train, 0, micro, 0, dp, num_workers=2).pin_memory
