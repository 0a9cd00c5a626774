"""Issue 43, item 5: the input embedding watched. The statistics against a hand computation, the
fixed id sample, TP=2 equal to TP=1 on the same weights, and the two families' gradient norms
read from DeepSpeed's optimizer under ZeRO-1/2/3 and bf16 against a plain backward (the
training runs of tests/test_train.py check them over layouts, in metrics.jsonl and the log)."""
import math

import pytest
import torch

from megatron_lev.models.embedding_stats import (SAMPLE_SIZE, effective_rank, matrix_statistics,
                                                 mean_pairwise_cosine, rms, sample_ids, singular_values)
from megatron_lev.training.diagnostics import log_line_fields
from tests.distributed import run_distributed
from tests.test_model import single_rank  # noqa: F401  (module-scoped fixture: one in-process rank)
from tests.test_train_setup import args_for


def test_statistics_by_hand():
    # Rows (1, 0), (0, 1), (1, 1): squares sum to 4 over 6 entries; cosines 0, 1/sqrt2, 1/sqrt2;
    # E^T E = [[2, 1], [1, 2]] has eigenvalues 3 and 1, so the singular values are sqrt3 and 1.
    e = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    s = [math.sqrt(3), 1.0]
    p = [v / sum(s) for v in s]
    stats = matrix_statistics(e)
    assert stats.rms == pytest.approx(math.sqrt(4 / 6), rel=1e-12)
    assert stats.mean_cosine == pytest.approx((0 + 2 / math.sqrt(2)) / 3, rel=1e-12)
    assert stats.effective_rank == pytest.approx(math.exp(-sum(q * math.log(q) for q in p)), rel=1e-12)
    assert stats.record() == {"embedding_rms": stats.rms, "embedding_mean_cosine": stats.mean_cosine,
                              "embedding_effective_rank": stats.effective_rank}
    # The extremes: rows along one direction (rank 1, cosine 1); orthogonal rows of equal norm
    # (every singular value equal: effective rank n, cosine 0).
    one_way = torch.tensor([[1.0, 2.0, 2.0]]) * torch.tensor([[1.0], [2.0], [0.5], [3.0]])
    assert effective_rank(one_way) == pytest.approx(1.0, abs=1e-6)
    assert mean_pairwise_cosine(one_way) == pytest.approx(1.0, rel=1e-12)
    eye = 3 * torch.eye(5)
    assert effective_rank(eye) == pytest.approx(5.0, rel=1e-12)
    assert mean_pairwise_cosine(eye) == pytest.approx(0.0, abs=1e-15) and rms(eye) == pytest.approx(3 / math.sqrt(5))
    # The Gram-matrix route gives an SVD's singular values, both orientations.
    for shape in ((64, 16), (16, 64)):
        m = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        torch.testing.assert_close(singular_values(m).flip(0), torch.linalg.svdvals(m), rtol=1e-9, atol=1e-12)
    # Weights blown up (a non-finite step): numbers, not an exception that would stop the run.
    assert math.isnan(effective_rank(torch.tensor([[1.0, float("nan")], [0.0, 1.0]])))


def test_the_sample_is_fixed_uniform_and_inside_the_vocabulary():
    torch.manual_seed(1)
    ids = sample_ids(32000)
    torch.manual_seed(2)  # the run's seed does not move it
    assert torch.equal(sample_ids(32000), ids)
    assert len(ids) == SAMPLE_SIZE == 512 and len(ids.unique()) == 512
    assert ids.min() >= 0 and ids.max() < 32000 and torch.equal(ids, ids.sort().values)
    # Uniform over the vocabulary, not a stride: every eighth of it holds about 64 ids.
    counts = torch.bincount(ids // 4000, minlength=8)
    assert counts.min() > 40 and counts.max() < 90, counts
    assert torch.equal(sample_ids(300), torch.arange(300))  # a smaller vocabulary: all of it
    assert not torch.equal(sample_ids(32000, seed=1), ids)


def _statistics_at_tp(rank, world_size):
    from megatron_lev.configs import load_config
    from megatron_lev.distributed.state import initialize_model_parallel
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.decoder import build_model
    from megatron_lev.models.embedding_stats import input_embedding_statistics

    out = {}
    for tp in (1, 2):
        initialize_model_parallel(tensor_model_parallel_size=tp)
        for kind in ("lev", "tied", "untied"):
            model = build_model(model_config_from_dict(load_config("tiny-lev")["model"], embedding=kind,
                                                       tensor_model_parallel_size=tp))
            out[tp, kind] = input_embedding_statistics(model, model.config.vocab_size)
    return out


def test_tensor_parallel_statistics_are_the_whole_embeddings():
    """TP=2 (the LEV module's partial sums all-reduced, the table's vocabulary shards) gives the
    TP=1 numbers on both ranks, for every kind; the kinds differ (the numbers are not constant)."""
    results = run_distributed(_statistics_at_tp, world_size=2)
    for result in results:
        for kind in ("lev", "tied", "untied"):
            one, two = result[1, kind], result[2, kind]
            for field in ("rms", "mean_cosine", "effective_rank"):
                assert getattr(two, field) == pytest.approx(getattr(one, field), rel=1e-6, abs=1e-9), (kind, field)
            assert 1 < one.effective_rank <= 512
    assert results[0][1, "lev"].rms != pytest.approx(results[0][1, "tied"].rms, rel=0.1)


# ---------------------------------------------------------------- the two families' gradient norms

def _reference_family_norms(engine, args, batch):
    """The norms from a plain (DeepSpeed-free, float32) backward of the same weights and batch."""
    from megatron_lev.models.decoder import build_model
    from megatron_lev.training.validation import build_model_config

    config = build_model_config(args)
    config.params_dtype = torch.float32
    reference = build_model(config)
    state = {}
    for name, param in engine.module.named_parameters():
        if hasattr(param, "ds_id"):  # ZeRO-3 keeps only a partition: gather it
            from deepspeed.utils import safe_get_full_fp32_param

            state[name] = safe_get_full_fp32_param(param)
        else:
            state[name] = param.detach().float()
    reference.load_state_dict(state, strict=False)
    tokens, labels, mask = batch
    reference(tokens, labels=labels, loss_mask=mask).backward()
    sums = {"embedding": 0.0, "body": 0.0}
    for name, param in reference.named_parameters():
        sums["embedding" if name.startswith("embedding.") else "body"] += param.grad.double().pow(2).sum().item()
    return {k: math.sqrt(v) for k, v in sums.items()}


@pytest.mark.parametrize("kind, flags", [("lev", ("--zero-stage", "1")), ("tied", ("--zero-stage", "1")),
                                         ("untied", ("--zero-stage", "2")), ("lev", ("--zero-stage", "2")),
                                         ("lev", ("--zero-stage", "3")), ("lev", ("--zero-stage", "1", "--bf16")),
                                         ("lev", ("--zero-stage", "2", "--lev-clip-grad", "0.05"))])
def test_family_norms_are_those_of_a_plain_backward(single_rank, kind, flags):  # noqa: F811
    from megatron_lev.distributed.rng import set_seed
    from megatron_lev.training.diagnostics import EmbeddingWatch
    from megatron_lev.training.ds_config import build_deepspeed_config
    from megatron_lev.training.engine import build_engine
    from megatron_lev.training.validation import build_model_config

    args = args_for("--embedding", kind, "--micro-batch-size", "8", "--global-batch-size", "8",
                    "--seq-length", "8", "--clip-grad", "0.5", *flags, world_size=1)
    set_seed(args.seed)
    config = build_model_config(args)
    engine = build_engine(args, config, build_deepspeed_config(args))
    watch = EmbeddingWatch(engine, config.vocab_size, args.clip_grad, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 1000, (8, 9), generator=g)
    batch = tokens[:, :-1], tokens[:, 1:], torch.ones(8, 8)
    expected = _reference_family_norms(engine, args, batch)
    assert expected["embedding"] > 0 and expected["body"] > 0
    for armed in (False, True):
        if armed:
            watch.arm()
        engine.backward(engine(batch[0], labels=batch[1], loss_mask=batch[2]))
        engine.step()
        if not armed:  # an unarmed step records nothing: the other steps pay nothing
            assert watch.family_norms is None
            expected = _reference_family_norms(engine, args, batch)  # the weights moved: again
    got = watch.family_norms
    rel = 2e-2 if "--bf16" in flags else 1e-5
    assert got["embedding"] == pytest.approx(expected["embedding"], rel=rel)
    assert got["body"] == pytest.approx(expected["body"], rel=rel)
    assert math.hypot(got["embedding"], got["body"]) == pytest.approx(float(engine.get_global_grad_norm()), rel=1e-5)
    watch.count_step(float(engine.get_global_grad_norm()), True)
    watch.count_step(0.1, True)
    watch.count_step(float("inf"), False)  # a skipped step does not count
    record = watch.interval_record()
    assert record["clipped_fraction"] == 0.5
    assert record["embedding_grad_norm"] == got["embedding"] and record["body_grad_norm"] == got["body"]
    assert {"embedding_rms", "embedding_mean_cosine", "embedding_effective_rank"} <= set(record)
    assert watch.interval_record()["clipped_fraction"] is None and watch.family_norms is None  # a new interval


def test_log_line_fields():
    record = {"embedding_grad_norm": 2.84, "body_grad_norm": 1.9234, "clipped_fraction": 0.97,
              "embedding_rms": 0.13, "embedding_mean_cosine": 0.7821, "embedding_effective_rank": 123.44}
    assert log_line_fields(record) == (" embedding grad norm: 2.840 | body grad norm: 1.923 | clipped: 97.0% |"
                                       " embedding RMS: 0.1300 | embedding cosine: 0.782 | embedding eff. rank: 123.4 |")
    assert log_line_fields({"clipped_fraction": None}) == ""
