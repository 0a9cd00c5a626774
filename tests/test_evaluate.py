"""Evaluation and the papers' analyses: frequencies, buckets, tables, plots, curves, lm-eval,
and `python -m megatron_lev.evaluate` on a LEV model trained 4 steps at TP=2 by the real trainer."""
from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import pytest
import torch

from megatron_lev.evaluation import buckets as bk
from megatron_lev.evaluation import bins, curves, frequency, plots
from megatron_lev.evaluation.report import ComparisonTable, relative_change
from tests.distributed import torchrun

EVAL_ITERS, GLOBAL_BATCH, SEQ = 2, 8, 64  # tiny-lev: global batch 8, sequence 64
SPLIT = "90,5,5"


# ---------------------------------------------------------------- helpers

def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails unless the file is a PNG."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def write_indexed_dataset(prefix, docs, dtype=np.uint16):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_document(torch.tensor(doc, dtype=torch.int64), [len(doc)])
    builder.finalize(f"{prefix}.idx")


# ---------------------------------------------------------------- frequencies

def test_frequency_counts_match_numpy_and_are_cached(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    vocab = 500
    # Zipf-ish ids so that many types are rare or absent; some documents empty-ish.
    docs = [np.minimum(rng.zipf(1.3, size=int(n)) - 1, vocab - 1) for n in rng.integers(1, 300, size=40)]
    prefix = str(tmp_path / "corpus_text_document")
    write_indexed_dataset(prefix, docs)

    from megatron.core.datasets.indexed_dataset import IndexedDataset
    dataset = IndexedDataset(prefix)
    expected = np.bincount(np.concatenate([dataset[i] for i in range(len(dataset))]).astype(np.int64),
                           minlength=vocab)
    cache = str(tmp_path / "cache")
    # A chunk size that does not divide the corpus exercises the chunk loop's tail.
    counts = frequency.count_token_frequencies(prefix, vocab, cache_dir=cache, chunk_tokens=997)
    assert counts.dtype == np.int64 and counts.shape == (vocab,)
    np.testing.assert_array_equal(counts, expected)
    assert (counts == 0).any(), "the test corpus should leave some types unseen"

    cache_file = frequency.frequency_cache_path(prefix, vocab, cache)
    assert os.path.isfile(cache_file)
    monkeypatch.setattr(frequency, "_count", lambda *a: pytest.fail("cache not used"))
    np.testing.assert_array_equal(frequency.count_token_frequencies(prefix, vocab, cache_dir=cache), expected)
    # A rewritten dataset changes the key: never a stale count.
    os.utime(f"{prefix}.bin", ns=(1, 1))
    assert frequency.frequency_cache_path(prefix, vocab, cache) != cache_file
    monkeypatch.undo()

    # A blend sums its parts.
    np.testing.assert_array_equal(frequency.count_blend_frequencies([prefix, prefix], vocab, cache_dir=cache),
                                  2 * expected)
    with pytest.raises(ValueError, match=r"corpus_text_document\.bin: token id \d+ is outside"):
        frequency.count_token_frequencies(prefix, int(expected.nonzero()[0].max()), use_cache=False)


# ---------------------------------------------------------------- buckets

def zipf_counts(vocab=2000, seed=0):
    rng = np.random.default_rng(seed)
    counts = np.bincount(np.minimum(rng.zipf(1.2, size=50_000) - 1, vocab - 1), minlength=vocab)
    return counts.astype(np.int64)


def test_log_buckets_exact_edges():
    counts = np.array([0, 1, 9, 10, 99, 100, 5, 0, 1000, 12345])
    b = bk.log_buckets(counts)
    assert b.labels == ("0", "1-9", "10-99", "100-999", "1000-9999", "10000-99999")
    np.testing.assert_array_equal(b.assignment, [0, 1, 1, 2, 2, 3, 1, 0, 4, 5])
    b2 = bk.log_buckets(np.array([0, 1, 2, 3, 4, 7, 8]), base=2)
    np.testing.assert_array_equal(b2.assignment, [0, 1, 2, 2, 3, 3, 4])
    assert b2.labels == ("0", "1", "2-3", "4-7", "8-15")


def test_quantile_buckets_exact_small_case():
    # 42 tokens, 4 buckets. Mass of rarer levels: count 0 -> 0, 1 -> 0, 2 -> 3, 5 -> 7, 10 -> 12,
    # 20 -> 22; bucket = floor(4 * below / 42): 0, 0, 0, 0, 1, 2 -- Q4 stays empty because
    # the single type of count 20 holds 48% of the mass.
    counts = np.array([0, 1, 1, 1, 2, 2, 5, 10, 20, 0, 0])
    b = bk.quantile_buckets(counts, num_buckets=4)
    np.testing.assert_array_equal(b.assignment, [0, 0, 0, 0, 0, 0, 0, 1, 2, 0, 0])
    assert b.labels == ("Q1 (0-5)", "Q2 (10-10)", "Q3 (20-20)", "Q4 (empty)")
    assert [r["train_tokens"] for r in b.summary(counts)] == [12, 10, 20, 0]


def test_type_buckets_exact_small_case():
    # 11 types, 4 buckets by type count. Types rarer than each count level: 0 -> 0, 1 -> 3,
    # 2 -> 6, 5 -> 8, 10 -> 9, 20 -> 10; bucket = floor(4 * below / 11): 0, 1, 2, 2, 3, 3.
    counts = np.array([0, 1, 1, 1, 2, 2, 5, 10, 20, 0, 0])
    b = bk.type_buckets(counts, num_buckets=4)
    np.testing.assert_array_equal(b.assignment, [0, 1, 1, 1, 2, 2, 2, 3, 3, 0, 0])
    assert b.labels == ("T1 (0-0)", "T2 (1-1)", "T3 (2-5)", "T4 (10-20)")
    assert [r["num_types"] for r in b.summary(counts)] == [3, 3, 3, 2]
    assert bk.build_bucketing("types:4", counts).labels == b.labels
    # Unlike quantile buckets, a corpus with no tokens still has types to divide.
    np.testing.assert_array_equal(bk.type_buckets(np.zeros(4, dtype=np.int64), 2).assignment, [0, 0, 0, 0])


@pytest.mark.parametrize("spec", ["log", "log:2", "quantile", "quantile:10", "types", "types:10"])
def test_every_type_in_exactly_one_bucket(spec):
    counts = zipf_counts()
    b = bk.build_bucketing(spec, counts)
    assert b.assignment.shape == counts.shape  # one bucket per type: zero-count ones included
    assert b.assignment.min() >= 0 and b.assignment.max() < b.num_buckets
    types = np.bincount(b.assignment, minlength=b.num_buckets)
    assert types.sum() == counts.size
    summary = b.summary(counts)
    assert sum(r["num_types"] for r in summary) == counts.size
    assert sum(r["train_tokens"] for r in summary) == counts.sum()
    # Buckets are ordered rarest first and equal counts share a bucket.
    order = np.argsort(counts, kind="stable")
    assert (np.diff(b.assignment[order]) >= 0).all()
    for c in np.unique(counts):
        assert np.unique(b.assignment[counts == c]).size == 1
    assert b.assignment[counts == 0].max() == 0
    if b.kind == "quantile":
        n = b.num_buckets
        heaviest_level = max(int(c) * int((counts == c).sum()) for c in np.unique(counts))
        for r in summary:  # each bucket's mass is 1/n of the corpus, up to one count level
            assert r["train_tokens"] <= counts.sum() / n + heaviest_level
    if b.kind == "types":
        n = b.num_buckets
        largest_level = max(int((counts == c).sum()) for c in np.unique(counts))
        for r in summary:  # each bucket holds 1/n of the types, up to one count level
            assert r["num_types"] <= counts.size / n + largest_level


def test_bucket_nll_weighted_by_counts_equals_overall():
    counts = zipf_counts()
    rng = np.random.default_rng(1)
    labels = rng.integers(0, counts.size, size=3000)
    nll = rng.gamma(2.0, 2.0, size=labels.size)
    for spec in ("log", "quantile:5", "types:5"):
        b = bk.build_bucketing(spec, counts)
        acc = bk.BucketNLL.zeros(b.num_buckets)
        acc.add(b, labels[:1000], nll[:1000])  # accumulates across batches
        acc.add(b, labels[1000:], nll[1000:])
        assert acc.tokens.sum() == labels.size
        seen = acc.tokens > 0
        weighted = (acc.tokens[seen] * acc.mean_nll[seen]).sum() / acc.tokens.sum()
        assert weighted == pytest.approx(nll.mean(), rel=1e-12)
        assert acc.overall_nll == pytest.approx(nll.mean(), rel=1e-12)
        for q in range(b.num_buckets):  # each bucket's mean is the mean over its tokens
            mask = b.assignment[labels] == q
            if mask.any():
                assert acc.mean_nll[q] == pytest.approx(nll[mask].mean(), rel=1e-12)
        rep = bk.stratified_report(b, counts, acc)
        assert rep["overall"]["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-12)
        assert sum(r["eval_tokens"] for r in rep["buckets"]) == labels.size


# ---------------------------------------------------------------- tables and plots

def test_comparison_table_relative_change():
    table = ComparisonTable("t", ["rare", "common"], {"tied": [100.0, 10.0], "lev": [19.0, 9.9]},
                            baseline="tied", info_columns={"eval tokens": [12, 3400]}, metric_name="ppl")
    data = table.to_json()
    assert data["rows"][0]["relative_change_pct"]["lev"] == pytest.approx(-81.0)
    assert data["rows"][1]["relative_change_pct"]["lev"] == pytest.approx(-1.0)
    md = table.to_markdown()
    assert "| rare | 12 | 100.00 | 19.00 | -81.0% |" in md
    assert "| common | 3,400 | 10.00 | 9.9000 | -1.0% |" in md
    with pytest.raises(ValueError, match="baseline 'x'"):
        ComparisonTable("t", ["a"], {"m": [1.0]}, baseline="x")


def test_plots_are_pngs_of_the_requested_size(tmp_path):
    path = plots.plot_bucket_comparison(["Q1", "Q2", "Q3"], {"tied": [300.0, 40.0, 8.0], "lev": [60.0, 38.0, None]},
                                        str(tmp_path / "buckets.png"), baseline="tied", size_px=(900, 600), dpi=100)
    assert png_size(path) == (900, 600)
    path = plots.plot_loss_curves({"a": ([1, 2, 3], [4.0, 3.0, 2.5]), "b": ([1, 2, 3], [4.0, 2.8, 2.2])},
                                  str(tmp_path / "sub" / "curves.png"), target=2.5, crossings={"a": 3.0, "b": 2.4},
                                  size_px=(640, 480), dpi=80)
    assert png_size(path) == (640, 480)
    assert not [p for p in os.listdir(tmp_path / "sub") if ".tmp" in p]


# ---------------------------------------------------------------- training curves

def test_tokens_to_target_on_synthetic_curves(tmp_path):
    # Piecewise-linear curves, so interpolation between logged points is exact.
    assert curves.tokens_to_target([0, 300, 600, 900], [5.0, 3.8, 2.6, 1.4], 3.0) == pytest.approx(500.0)
    assert curves.tokens_to_target([10, 20], [2.0, 1.0], 3.0) == 10.0  # already below at the first point
    assert curves.tokens_to_target([10, 20], [5.0, 4.0], 3.0) is None
    # First crossing wins even if the curve goes back up.
    assert curves.tokens_to_target([0, 100, 200, 300], [4.0, 2.0, 4.0, 1.0], 3.0) == pytest.approx(50.0)

    def write(run, rows):
        os.makedirs(tmp_path / run)
        with open(tmp_path / run / "metrics.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

    # Baseline: valid loss falls linearly to 3.0 at 1050 tokens (its end). LEV: 5 - t/250,
    # logged every 300 tokens, crosses 3.0 at 500 tokens -> 1050/500 = 2.1x.
    base = [{"iteration": i, "consumed_tokens": 150 * i, "loss": 9.0, "valid_loss": 5.0 - 2.0 * i / 7}
            for i in range(8)]
    base.insert(3, {"iteration": 2, "consumed_tokens": 300, "loss": 9.0})  # a train-only line
    base.insert(4, {"iteration": 3, "consumed_tokens": 450, "valid_loss": 99.0})  # overwritten below (resume)
    lev = [{"iteration": 10 * i, "consumed_tokens": 300 * i, "valid_loss": 5.0 - 300 * i / 250} for i in range(4)]
    write("tied", base)
    write("lev", lev)
    write("short", [{"iteration": 1, "consumed_tokens": 100, "valid_loss": 4.0}])
    out = curves.main(["--run", f"tied={tmp_path / 'tied'}", "--run", str(tmp_path / "lev" / "metrics.jsonl"),
                       "--run", f"short={tmp_path / 'short'}", "--baseline", "tied",
                       "--output-dir", str(tmp_path / "out"), "--plot-width", "800", "--plot-height", "500"])
    assert out["target_loss"] == pytest.approx(3.0)
    assert out["runs"]["tied"]["tokens_to_target"] == 1050
    assert out["runs"]["lev"]["tokens_to_target"] == pytest.approx(500.0)
    assert out["runs"]["lev"]["speedup_vs_baseline"] == pytest.approx(2.1)
    assert out["runs"]["short"]["tokens_to_target"] is None
    saved = json.load(open(tmp_path / "out" / "curves.json"))
    assert saved["runs"]["lev"]["speedup_vs_baseline"] == pytest.approx(2.1)
    assert "| lev | 1.4000 | 900 | 500 | 2.10x |" in open(tmp_path / "out" / "curves.md").read()
    assert png_size(tmp_path / "out" / "loss_vs_tokens.png") == (800, 500)

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"iteration": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad/metrics.jsonl:2: not a JSON line"):
        curves.read_curve(str(tmp_path / "bad"))


# ---------------------------------------------------------------- megatron_lev.evaluate


@pytest.fixture(scope="module")
def lev_run(tmp_path_factory, tiny_dataset, spm_tokenizer) -> str:
    """--save dir of tiny-lev trained 4 steps at TP=2 (checkpoints and valid_loss at 2 and 4)."""
    save = tmp_path_factory.mktemp("eval_runs") / "lev_tp2"
    torchrun(["-m", "megatron_lev.train", "--config", "tiny-lev", "--data-path", tiny_dataset, "--split", SPLIT,
              "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", spm_tokenizer, "--save", save,
              "--train-iters", "4", "--save-interval", "2", "--eval-interval", "2", "--eval-iters", str(EVAL_ITERS),
              "--log-interval", "1", "--metrics-file", save / "metrics.jsonl", "--tensor-model-parallel-size", "2"])
    return str(save)


@pytest.fixture(scope="module")
def lev_exports(lev_run, tmp_path_factory) -> dict[str, str]:
    """HF folders (LevForCausalLM, remote code) of the iteration-2 and iteration-4 checkpoints."""
    from megatron_lev.hf.export import export_checkpoint

    root = tmp_path_factory.mktemp("eval_hf")
    return {f"iter{i}": export_checkpoint(lev_run, str(root / f"iter{i}"), iteration=i, dtype="fp32") for i in (2, 4)}


def _valid_samples(tiny_dataset, spm_tokenizer, count: int) -> dict:
    """The first `count` valid-split samples, built independently of megatron_lev.evaluate."""
    from megatron_lev.data.datasets import build_train_valid_test_datasets
    from megatron_lev.data.tokenizer import build_tokenizer

    _, valid, _ = build_train_valid_test_datasets(
        data_path=[tiny_dataset], split=SPLIT, seq_length=SEQ, seed=1234, train_samples=None, valid_samples=None,
        test_samples=None, tokenizer=build_tokenizer("SentencePieceTokenizer", spm_tokenizer))
    samples = [valid[i] for i in range(count)]
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in ("tokens", "labels", "loss_mask")}


def _direct_loss(rank, world_size, load_dir: str, batch: dict) -> float:
    """Our model's own masked-mean loss (forward with labels) on `batch`, TP=1, merged checkpoint."""
    from megatron_lev.checkpointing.convert import load_checkpoint_full
    from megatron_lev.checkpointing.layout import load_full_state_dict
    from megatron_lev.distributed.state import initialize_model_parallel
    from megatron_lev.models.decoder import LeviathanModel

    initialize_model_parallel(1, 1)
    full, info = load_checkpoint_full(load_dir)
    config = info.model_config()
    model = LeviathanModel(config).eval()
    load_full_state_dict(model, full, config, tp_rank=0)
    with torch.no_grad():
        return float(model(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"]))


def test_evaluate_perplexity_frequency_tables_and_plots(lev_run, lev_exports, tiny_dataset, spm_tokenizer, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_lev import evaluate
    from tests.distributed import run_distributed

    n_tokens = 1000  # 15 full samples and 40 tokens of the 16th: exercises the cut
    out = tmp_path / "eval"
    env_before = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = evaluate.main([
        "--model", f"lev={lev_run}", "--model", f"hf={lev_exports['iter4']}", "--model", f"early={lev_exports['iter2']}",
        "--baseline", "early", "--eval-tokens", str(n_tokens), "--micro-batch-size", "3",
        "--freq-dataset", "1.0", tiny_dataset, "--buckets", "quantile:4", "--buckets", "log", "--buckets", "types:4",
        "--device", "cpu", "--save-token-nll",
        "--output-dir", str(out), "--plot-width", "1000", "--plot-height", "700"])
    assert {k: os.environ.get(k) for k in env_before} == env_before  # no rendezvous variables left behind
    saved = json.load(open(out / "evaluation.json"))
    assert saved["models"]["lev"]["ppl"] == result["models"]["lev"]["ppl"]
    lev = result["models"]["lev"]
    assert lev["tokens"] == n_tokens and lev["iteration"] == 4 and lev["embedding"] == "lev"
    assert lev["trained_with"]["tensor_model_parallel_size"] == 2

    # Perplexity = exp(our model's own mean token loss on the same tokens), float32 forward.
    batch = _valid_samples(tiny_dataset, spm_tokenizer, -(-n_tokens // SEQ))
    batch["loss_mask"].view(-1)[n_tokens:] = 0
    direct = run_distributed(_direct_loss, world_size=1, args=(lev_run, batch))[0]
    assert lev["loss"] == pytest.approx(direct, abs=2e-6)
    assert lev["ppl"] == pytest.approx(math.exp(direct), rel=2e-6)
    # The HF export of the same checkpoint scores the same tokens alike; the earlier one worse.
    assert result["models"]["hf"]["ppl"] == pytest.approx(lev["ppl"], rel=1e-4)
    assert result["models"]["early"]["loss"] > lev["loss"]
    overall = {r["label"]: r for r in result["table"]["rows"]}
    assert overall["perplexity"]["relative_change_pct"]["lev"] == pytest.approx(
        100 * (lev["ppl"] / result["models"]["early"]["ppl"] - 1))

    # Frequencies: the train share of the dataset (GPTDataset's own split), counted by plain numpy.
    freq = result["frequency"]
    dataset = IndexedDataset(tiny_dataset)
    begin, end = frequency.train_sequence_range(tiny_dataset, SPLIT)
    assert (begin, end) == (0, int(round(0.9 * len(dataset))))
    expected = np.bincount(np.concatenate([dataset[i] for i in range(begin, end)]).astype(np.int64), minlength=1000)
    np.testing.assert_array_equal(np.load(freq["counts_cache"][0]), expected)
    assert freq["train_split_of"] == SPLIT and freq["train_tokens"] == expected.sum()
    # Both stratifications: each position's NLL in the bucket of its predicted token (label)
    # or of its input token; bucket token counts are those of the evaluated positions' ids.
    mask = batch["loss_mask"] > 0
    ids = {"bucketings": batch["labels"][mask].numpy(), "input_bucketings": batch["tokens"][mask].numpy()}
    for spec in ("quantile:4", "log", "types:4"):
        bucketing = bk.build_bucketing(spec, expected)
        per_stratum = {}
        for key, stratum in (("bucketings", "predicted"), ("input_bucketings", "input")):
            section = freq[key][spec]
            assert section["stratified_by"] == stratum
            assert sum(b["num_types"] for b in section["buckets"]) == 1000  # every type, once
            for name, model in result["models"].items():
                rows = section["models"][name]
                np.testing.assert_array_equal([r["eval_tokens"] for r in rows],
                                              np.bincount(bucketing.assignment[ids[key]],
                                                          minlength=bucketing.num_buckets))
                weighted = sum(r["eval_tokens"] * r["nll"] for r in rows if r["eval_tokens"]) / n_tokens
                assert weighted == pytest.approx(model["loss"], rel=1e-9)
            assert png_size(section["plot"]) == (1000, 700)
            per_stratum[stratum] = [r["nll"] for r in section["models"]["lev"]]
        assert per_stratum["input"] != per_stratum["predicted"]
    assert os.path.basename(freq["input_bucketings"]["types:4"]["plot"]) == "freq_input_types_4.png"
    # --save-token-nll: every scored position's ids, each model's NLL (float16) and the counts;
    # the run's seed and non-embedding count for effective-parameter fits (evaluation.scaling).
    with np.load(out / "token_nll.npz") as saved_nll:
        np.testing.assert_array_equal(saved_nll["input_ids"], ids["input_bucketings"])
        np.testing.assert_array_equal(saved_nll["label_ids"], ids["bucketings"])
        np.testing.assert_array_equal(saved_nll["train_counts"], expected)
        for name, model in result["models"].items():
            assert saved_nll[f"nll/{name}"].dtype == np.float16
            assert float(saved_nll[f"nll/{name}"].astype(np.float64).mean()) == pytest.approx(model["loss"], rel=1e-3)
        seed_data = {"path": str(out), **{k: saved_nll[k] for k in saved_nll.files}}
    assert result["token_nll"]["positions"] == n_tokens and result["token_nll"]["models"] == ["lev", "hf", "early"]
    assert lev["seed"] == 1234
    counts_of = lev["parameter_counts"]
    assert counts_of["total"] == lev["parameters"]
    assert counts_of["nonembedding"] == lev["parameters"] - counts_of["embedding"] - counts_of["output_layer"]
    binned = bins.compare({"1234": seed_data}, [("lev", "early")], edges=(1, 10), draws=200)["pairs"]["lev:early"]
    everything = binned["predicted"][-1]
    assert everything["bin"] == "all" and everything["eval_tokens"] == n_tokens
    assert everything["difference"] == pytest.approx(lev["loss"] - result["models"]["early"]["loss"], abs=2e-3)
    assert sum(r["eval_tokens"] for r in binned["input"][:-1]) == n_tokens

    text = (out / "evaluation.md").read_text()
    assert "Perplexity by training-frequency bucket of the predicted token" in text
    assert "Perplexity by training-frequency bucket of the input token" in text

    # Training's own valid_loss (TP=2 engine, first 2 global batches of the valid split) is
    # what evaluate gives for the same 1,024 tokens of its iteration-4 checkpoint.
    logged = curves.read_curve(lev_run, metric="valid_loss")
    assert logged.iterations.tolist() == [2, 4]
    check = evaluate.main(["--model", f"it4={lev_run}/iter_0000004", "--eval-tokens",
                           str(EVAL_ITERS * GLOBAL_BATCH * SEQ), "--output-dir", str(tmp_path / "eval2")])
    assert check["models"]["it4"]["loss"] == pytest.approx(logged.loss[-1], abs=1e-5)

    with pytest.raises(SystemExit, match="--eval-tokens 99999999: the valid split has only"):
        evaluate.main(["--model", f"lev={lev_run}", "--eval-tokens", "99999999", "--output-dir", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--model bad=.*neither"):
        evaluate.main(["--model", f"bad={tmp_path}", "--output-dir", str(tmp_path / "x")])


# ---------------------------------------------------------------- lm-eval

def loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | context) and whether it is the greedy continuation, tokenised the
    way lm-eval's HF class does (encode the whole string, split off the context's tokens)."""
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    cont = whole[len(ctx):]
    with torch.no_grad():
        logp = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
    rows = logp[len(ctx) - 1: len(whole) - 1]
    ll = rows[torch.arange(len(cont)), torch.tensor(cont)].sum().item()
    return ll, bool((rows.argmax(-1) == torch.tensor(cont)).all())


def test_lm_eval_runs_offline_on_local_tasks(tmp_path, lev_exports, monkeypatch):
    """lm-eval on two real LEV exports (remote code) with local PIQA / LAMBADA files; its
    accuracies and LAMBADA perplexity equal those computed by hand from the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_lev.evaluation import downstream

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    piqa = [{"goal": "boil water", "sol1": "put water in pot", "sol2": "put ice in pot", "label": 0},
            {"goal": "cold", "sol1": "ice", "sol2": "sun", "label": 0},
            {"goal": "the cat sat", "sol1": "on the mat", "sol2": "to the park", "label": 1},
            {"goal": "fish", "sol1": "swim", "sol2": "fly", "label": 0},
            {"goal": "bird", "sol1": "swim", "sol2": "fly", "label": 1}]
    lambada = [{"text": t} for t in ("the cat sat on the mat", "the dog ran to the park", "the sun is hot",
                                     "ice melt in the sun")]
    # One document each for the other paper tasks: their lm-eval YAMLs (process_docs,
    # !function hooks) must run on local files too.
    others = {
        "hellaswag": [{"ind": 1, "activity_label": "Cooking", "ctx_a": "A man puts water in a pot.", "ctx_b": "he",
                       "ctx": "A man puts water in a pot. he", "endings": ["boils it.", "eats the pot.", "sings."],
                       "source_id": "x", "split": "val", "split_type": "indomain", "label": "0"}],
        "arc_easy": [{"id": "q1", "question": "Which is a liquid?", "answerKey": "A",
                      "choices": {"text": ["water", "rock", "wood"], "label": ["A", "B", "C"]}}],
        "arc_challenge": [{"id": "q2", "question": "What melts ice?", "answerKey": "1",
                           "choices": {"text": ["heat", "cold"], "label": ["1", "2"]}}],
        "winogrande": [{"sentence": "The trophy did not fit in the suitcase because _ was too big.",
                        "option1": "trophy", "option2": "suitcase", "answer": "1"}],
    }
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for name, rows in (("piqa", piqa), ("lambada_openai", lambada), *others.items()):
        (data_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    out_dir = tmp_path / "out"
    result = downstream.main(["--model", f"base={lev_exports['iter2']}", "--model",
                              f"other={lev_exports['iter4']}", "--tasks", ",".join(downstream.PAPER_TASKS),
                              "--data-dir", str(data_dir), "--device", "cpu", "--dtype", "float32",
                              "--batch-size", "4", "--log-samples", "--output-dir", str(out_dir)])

    saved = json.load(open(out_dir / "downstream.json"))
    markdown = (out_dir / "downstream.md").read_text()
    for name, path in (("base", lev_exports["iter2"]), ("other", lev_exports["iter4"])):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        # PIQA: the prompt lm-eval's piqa.yaml builds; acc = argmax over the two solutions.
        lls = [[loglikelihood(model, tokenizer, f"Question: {d['goal']}\nAnswer:", " " + d[s])[0]
                for s in ("sol1", "sol2")] for d in piqa]
        acc = np.mean([int(np.argmax(ll) == d["label"]) for ll, d in zip(lls, piqa)])
        # LAMBADA: last word given the rest; acc = greedy, perplexity = exp(-mean loglik).
        lam = [loglikelihood(model, tokenizer, d["text"].rsplit(" ", 1)[0], " " + d["text"].rsplit(" ", 1)[1])
               for d in lambada]
        tasks = result["models"][name]["tasks"]
        assert tasks["piqa"]["num_examples"] == len(piqa)
        assert tasks["piqa"]["acc"] == pytest.approx(acc, abs=1e-9)
        assert tasks["lambada_openai"]["acc"] == pytest.approx(np.mean([g for _, g in lam]), abs=1e-9)
        assert tasks["lambada_openai"]["perplexity"] == pytest.approx(math.exp(-np.mean([ll for ll, _ in lam])),
                                                                      rel=1e-4)
        # lm-eval's own per-example log-likelihoods are the model's (float32, atol 1e-4).
        samples = result["models"][name]["samples"]["piqa"]
        for sample in samples:
            got = [r[0][0] for r in sample["resps"]]
            np.testing.assert_allclose(got, lls[sample["doc_id"]], atol=1e-4)
        assert saved["models"][name]["tasks"]["piqa"]["acc"] == pytest.approx(acc, abs=1e-9)
        for task in others:
            assert tasks[task]["num_examples"] == 1 and tasks[task]["acc"] in (0.0, 1.0)
    rel = result["table"]["rows"]
    by_label = {r["label"]: r for r in rel}
    base_acc = by_label["piqa / acc"]["values"]["base"]
    other_acc = by_label["piqa / acc"]["values"]["other"]
    assert by_label["piqa / acc"]["relative_change_pct"]["other"] == relative_change(other_acc, base_acc)
    assert "| lambada_openai / perplexity |" in markdown and "| piqa / acc |" in markdown


def test_lm_eval_on_a_tied_and_a_materialised_export(tmp_path, lev_run, lev_exports, tiny_dataset, spm_tokenizer,
                                                     monkeypatch):
    """The two exports without remote code go through lm-eval too: a tied run's (a plain
    LlamaForCausalLM, tied weights) scores what its model computes by hand, and LEV's materialised
    export (the generated table as a Llama embedding) scores what the LEV export scores, example
    by example."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_lev.evaluation import downstream
    from megatron_lev.hf.export import export_checkpoint

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    save = tmp_path / "tied"
    torchrun(["-m", "megatron_lev.train", "--config", "tiny-tied", "--data-path", tiny_dataset, "--split", SPLIT,
              "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", spm_tokenizer, "--save", save,
              "--train-iters", "4", "--save-interval", "4", "--eval-interval", "100", "--eval-iters", "1",
              "--log-interval", "1"], nproc=1)
    tied = export_checkpoint(str(save), str(tmp_path / "hf_tied"), dtype="fp32")
    materialised = export_checkpoint(lev_run, str(tmp_path / "hf_lev_table"), iteration=4, dtype="fp32",
                                     materialize=True)
    for folder in (tied, materialised):
        assert json.load(open(os.path.join(folder, "config.json")))["architectures"] == ["LlamaForCausalLM"]
    piqa = [{"goal": "def f", "sol1": "return x", "sol2": "import y", "label": 0},
            {"goal": "for i in", "sol1": "range(3):", "sol2": "the mat", "label": 0},
            {"goal": "class A", "sol1": "(object):", "sol2": "print", "label": 1}]
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "piqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in piqa))
    result = downstream.main(["--model", f"lev={lev_exports['iter4']}", "--model", f"table={materialised}",
                              "--model", f"tied={tied}", "--baseline", "tied", "--tasks", "piqa", "--data-dir",
                              str(data_dir), "--device", "cpu", "--dtype", "float32", "--batch-size", "2",
                              "--log-samples", "--output-dir", str(tmp_path / "out")])
    models = result["models"]
    lls = {name: {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in models[name]["samples"]["piqa"]}
           for name in models}
    for doc in range(len(piqa)):
        np.testing.assert_allclose(lls["table"][doc], lls["lev"][doc], atol=1e-5)
    assert models["table"]["tasks"]["piqa"]["acc"] == models["lev"]["tasks"]["piqa"]["acc"]
    model = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == \
        model.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(tied)
    by_hand = [[loglikelihood(model, tokenizer, f"Question: {d['goal']}\nAnswer:", " " + d[s])[0]
                for s in ("sol1", "sol2")] for d in piqa]
    for doc, expected in enumerate(by_hand):
        np.testing.assert_allclose(lls["tied"][doc], expected, atol=1e-4)
    assert models["tied"]["tasks"]["piqa"]["acc"] == pytest.approx(
        np.mean([int(np.argmax(ll) == d["label"]) for ll, d in zip(by_hand, piqa)]), abs=1e-9)
    assert models["tied"]["tasks"]["piqa"]["acc_stderr"] >= 0


def test_export_task_data_round_trips(tmp_path):
    """--export-data writes the scored split's raw rows; here from a local task, so offline."""
    from lm_eval.tasks import TaskManager

    from megatron_lev.evaluation import downstream

    rows = [{"goal": "g1", "sol1": "a", "sol2": "b", "label": 1}, {"goal": "g2", "sol1": "c", "sol2": "d", "label": 0}]
    src = tmp_path / "piqa.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    downstream.write_local_task_yaml("piqa", str(src), str(tmp_path / "tasks"))
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    written = downstream.export_task_data(["piqa_local"], str(tmp_path / "export"), task_manager=manager)
    assert [json.loads(line) for line in open(written["piqa_local"])] == rows
