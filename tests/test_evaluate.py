"""Evaluation and the papers' analyses: frequencies, buckets, tables, plots, curves, lm-eval."""
from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import pytest
import torch

from megatron_lev.evaluation import buckets as bk
from megatron_lev.evaluation import curves, frequency, plots, report


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


@pytest.mark.parametrize("spec", ["log", "log:2", "quantile", "quantile:10"])
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


def test_bucket_nll_weighted_by_counts_equals_overall():
    counts = zipf_counts()
    rng = np.random.default_rng(1)
    labels = rng.integers(0, counts.size, size=3000)
    nll = rng.gamma(2.0, 2.0, size=labels.size)
    for spec in ("log", "quantile:5"):
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
    table = report.ComparisonTable("t", ["rare", "common"], {"tied": [100.0, 10.0], "lev": [19.0, 9.9]},
                                   baseline="tied", info_columns={"eval tokens": [12, 3400]}, metric_name="ppl")
    data = table.to_json()
    assert data["rows"][0]["relative_change_pct"]["lev"] == pytest.approx(-81.0)
    assert data["rows"][1]["relative_change_pct"]["lev"] == pytest.approx(-1.0)
    md = table.to_markdown()
    assert "| rare | 12 | 100.00 | 19.00 | -81.0% |" in md
    assert "| common | 3,400 | 10.00 | 9.9000 | -1.0% |" in md
    with pytest.raises(ValueError, match="baseline 'x'"):
        report.ComparisonTable("t", ["a"], {"m": [1.0]}, baseline="x")


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


# ---------------------------------------------------------------- lm-eval

WORDS = ("the a cat dog sat on mat ran to park sun is hot cold water boil ice melt put in pot "
         "question answer : . , fish swim bird fly").split()


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tiny_hf_exports(tmp_path_factory):
    """Two tiny HF causal LMs (different seeds) with a tokenizer, saved as export dirs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _word_tokenizer()
    paths = {}
    for name, seed in (("base", 0), ("other", 1)):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             bos_token_id=1, eos_token_id=2)
        path = str(tmp_path_factory.mktemp(f"hf_{name}"))
        LlamaForCausalLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = path
    return paths


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


def test_lm_eval_runs_offline_on_local_tasks(tmp_path, tiny_hf_exports, monkeypatch):
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
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for name, rows in (("piqa", piqa), ("lambada_openai", lambada)):
        (data_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    out_dir = tmp_path / "out"
    result = downstream.main(["--model", f"base={tiny_hf_exports['base']}", "--model",
                              f"other={tiny_hf_exports['other']}", "--tasks", "piqa,lambada_openai",
                              "--data-dir", str(data_dir), "--device", "cpu", "--dtype", "float32",
                              "--batch-size", "4", "--log-samples", "--output-dir", str(out_dir)])

    saved = json.load(open(out_dir / "downstream.json"))
    markdown = (out_dir / "downstream.md").read_text()
    for name, path in tiny_hf_exports.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
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
    rel = result["table"]["rows"]
    by_label = {r["label"]: r for r in rel}
    base_acc = by_label["piqa / acc"]["values"]["base"]
    other_acc = by_label["piqa / acc"]["values"]["other"]
    assert by_label["piqa / acc"]["relative_change_pct"]["other"] == report.relative_change(other_acc, base_acc)
    assert "| lambada_openai / perplexity |" in markdown and "| piqa / acc |" in markdown


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
