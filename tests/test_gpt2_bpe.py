"""Megatron-LM's GPT2BPETokenizer (--vocab-file/--merge-file): our ids equal Megatron-LM's.

tests/data/gpt2_bpe/megatron_ids.json holds the ids that Megatron-LM core_v0.16.1's own
`_GPT2BPETokenizer` (megatron/training/tokenizer/gpt2_tokenization.py) gave for each text of
corpus.jsonl with vocab.json/merges.txt there (tools/record_megatron_gpt2_ids.py wrote all four).
"""
import json
import os

import pytest

from megatron_lev.data.tokenizer import GPT2BPETokenizer, build_tokenizer, tokenizer_sha256
from tests.test_model import single_rank  # noqa: F401  (module-scoped fixture: one in-process rank)

DATA = os.path.join(os.path.dirname(__file__), "data", "gpt2_bpe")
VOCAB, MERGES = os.path.join(DATA, "vocab.json"), os.path.join(DATA, "merges.txt")
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@pytest.fixture(scope="module")
def recorded():
    with open(os.path.join(DATA, "megatron_ids.json"), encoding="utf-8") as f:
        out = json.load(f)
    with open(os.path.join(DATA, "corpus.jsonl"), encoding="utf-8") as f:
        out["corpus"] = [json.loads(line)["text"] for line in f]
    return out


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)


def _mismatches(tokenizer, recorded) -> int:
    return sum(tokenizer.tokenize(text) != ids for text, ids in zip(recorded["corpus"], recorded["ids"]))


def test_ids_equal_megatron_lm(gpt2, recorded):
    """Every text's ids equal Megatron-LM's, one by one and in a batch; vocab size and EOD too."""
    assert recorded["megatron_lm"].startswith("core_v0.16.1")
    assert (len(recorded["corpus"]), recorded["ids_total"]) == (341, 21097)
    assert (recorded["vocab_sha256"], recorded["merges_sha256"]) == (tokenizer_sha256(VOCAB), tokenizer_sha256(MERGES))
    assert [gpt2.tokenize(text) for text in recorded["corpus"]] == recorded["ids"]
    assert gpt2.tokenize_batch(recorded["corpus"]) == recorded["ids"]
    assert (gpt2.vocab_size, gpt2.eod, gpt2.bos, gpt2.pad) == (recorded["vocab_size"], recorded["eod"], None, -1)
    assert all(gpt2.detokenize(ids) == text for text, ids in zip(recorded["corpus"], recorded["ids"]))


@pytest.mark.parametrize("variant, pattern", [
    ("add_prefix_space", None),
    ("whitespace runs kept whole (no `\\s+(?!\\S)`)", GPT2_PATTERN.replace(r"|\s+(?!\S)", "")),
    ("case-insensitive contractions", "(?i:'s|'t|'re|'ve|'m|'ll|'d)" + GPT2_PATTERN[len("'s|'t|'re|'ve|'m|'ll|'d"):]),
])
def test_the_recorded_ids_tell_pre_tokenizations_apart(gpt2, recorded, variant, pattern):
    """The comparison above has teeth: GPT-2's BPE with another pre-tokenization misses ids."""
    from tokenizers import Regex, pre_tokenizers

    original = gpt2._tok.pre_tokenizer
    try:
        gpt2._tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=True) if pattern is None else
                                   pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"),
                                                            pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                     use_regex=False)]))
        assert _mismatches(gpt2, recorded) > 0
        gpt2._tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(GPT2_PATTERN), "isolated"),
                                                           pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                    use_regex=False)])
        assert _mismatches(gpt2, recorded) == 0  # the same harness with GPT-2's regex spelled out
    finally:
        gpt2._tok.pre_tokenizer = original


def test_merges_are_read_as_megatron_reads_them(tmp_path, recorded):
    """Megatron drops the merges file's first line (the '#version' header) and its last (empty
    after the final newline) whatever they hold; a file without the header loses its first merge."""
    with open(MERGES, encoding="utf-8") as f:
        lines = f.read().split("\n")
    headless = tmp_path / "merges.txt"
    headless.write_text("\n".join(lines[1:]), encoding="utf-8")
    tok = GPT2BPETokenizer(VOCAB, str(headless))
    assert len(tok._merges) == len(lines) - 3 and tok._merges[0] == tuple(lines[2].split())


def test_bad_flags_and_files(tmp_path):
    with pytest.raises(ValueError, match=r"^--tokenizer-type GPT2BPETokenizer needs --merge-file \(GPT-2's merges.txt\)$"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB)
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match=f"^--merge-file {missing}: no such file$"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=missing)
    with open(VOCAB, encoding="utf-8") as f:
        vocab = json.load(f)
    no_eod = tmp_path / "no_eod.json"
    no_eod.write_text(json.dumps({t: i for t, i in vocab.items() if t != "<|endoftext|>"}))
    with pytest.raises(ValueError, match=f"^--vocab-file {no_eod}: no <\\|endoftext\\|> entry"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(no_eod), merge_file=MERGES)
    no_bytes = tmp_path / "no_bytes.json"
    no_bytes.write_text(json.dumps({"<|endoftext|>": 0, "a": 1}))
    with pytest.raises(ValueError, match=f"^--vocab-file {no_bytes}: lacks 255 of the 256 byte symbols"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(no_bytes), merge_file=MERGES)


def test_describe_hashes_both_files(gpt2, tmp_path):
    other = tmp_path / "merges.txt"
    with open(MERGES, encoding="utf-8") as f:
        other.write_text(f.read() + "Ġ Ġ\n", encoding="utf-8")
    described = gpt2.describe()
    assert described["type"] == "GPT2BPETokenizer" and described["merge_file"] == os.path.abspath(MERGES)
    assert described["sha256"] == tokenizer_sha256(VOCAB, MERGES) != tokenizer_sha256(VOCAB, str(other))


def test_megatron_pile_recipe_preprocesses_and_sizes_the_model(tmp_path, recorded, capsys, single_rank):  # noqa: F811
    """Megatron's flags end to end: preprocess_data.py with GPT2BPETokenizer (two workers) writes
    Megatron's ids + EOD; a tiny-lev run (packaged vocab_size 1000) on that data takes the
    tokenizer's 3000 tokens, padded to 3072 as Megatron logs it, and the model has 3072 rows."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_lev.data.preprocess import main as preprocess_main
    from megatron_lev.models.decoder import build_model
    from megatron_lev.training.validation import validate_run

    tokenizer_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES]
    prefix = str(tmp_path / "pile")
    preprocess_main(["--input", os.path.join(DATA, "corpus.jsonl"), "--output-prefix", prefix, *tokenizer_flags,
                     "--append-eod", "--workers", "2", "--chunk-size-mb", "0.01"])
    dataset = IndexedDataset(prefix + "_text_document")
    eod = recorded["eod"]
    kept = [ids + [eod] for text, ids in zip(recorded["corpus"], recorded["ids"]) if text.strip()]  # 3 blank ones
    assert len(kept) == 338 and [dataset[i].tolist() for i in range(len(dataset))] == kept  # are skipped
    capsys.readouterr()

    run = validate_run(["--config", "tiny-lev", "--data-path", prefix + "_text_document", "--split", "90,5,5",
                        *tokenizer_flags, "--train-iters", "4"], world_size=1)
    assert capsys.readouterr().out == " > padded vocab (size: 3000) with 72 dummy tokens (new size: 3072)\n"
    assert (run.model_config.vocab_size, run.model_config.padded_vocab_size) == (3000, 3072)
    assert run.config["tokenizer"]["type"] == "GPT2BPETokenizer"
    model = build_model(run.model_config)
    rows = {name: tuple(p.shape) for name, p in model.named_parameters() if p.shape[0] == 3072}
    assert rows and all(shape[-1] == 64 for shape in rows.values()), rows  # the output layer: 3072 x hidden 64
    with pytest.raises(ValueError, match="^--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file$"):
        validate_run(["--config", "tiny-lev", "--data-path", prefix + "_text_document", "--tokenizer-type",
                      "GPT2BPETokenizer", "--vocab-file", VOCAB, "--train-iters", "4"], world_size=1)


def test_huggingface_tokenizer_takes_a_hub_name_from_the_cache(gpt2, recorded, tmp_path, monkeypatch):
    """--tokenizer-type HuggingFaceTokenizer --tokenizer-model org/name (Megatron's AutoTokenizer
    form) reads the Hub cache's tokenizer.json and config; never the network."""
    import huggingface_hub.constants

    from megatron_lev.data.tokenizer import HuggingFaceTokenizer

    snapshot = tmp_path / "models--example-org--gpt2-test" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (tmp_path / "models--example-org--gpt2-test" / "refs").mkdir()
    (tmp_path / "models--example-org--gpt2-test" / "refs" / "main").write_text("a" * 40)
    gpt2._tok.save(str(snapshot / "tokenizer.json"))
    (snapshot / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    hub = build_tokenizer("HuggingFaceTokenizer", "example-org/gpt2-test")
    assert isinstance(hub, HuggingFaceTokenizer) and hub.path == str(snapshot)
    assert hub.tokenize_batch(recorded["corpus"]) == recorded["ids"] and hub.eod == recorded["eod"]
    with pytest.raises(FileNotFoundError, match=r"^--tokenizer-model example-org/other: no such file, nor a Hugging "
                                                r"Face Hub tokenizer in this machine's cache \(fetch it once: hf "
                                                r"download example-org/other tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", "example-org/other")


def test_hf_export_of_the_tokenizer_keeps_megatrons_ids(recorded, tmp_path):
    """A GPT2BPETokenizer run's HF release: the exported tokenizer.json, loaded by transformers'
    AutoTokenizer, gives Megatron-LM's ids for every text, the text "<|endoftext|>" included (ordinary
    text there, unlike the Hub's gpt2 tokenizer), and EOS is <|endoftext|>."""
    from transformers import AutoTokenizer

    from megatron_lev.hf.export import ExportError, load_tokenizer, write_tokenizer

    tokenizer = load_tokenizer("GPT2BPETokenizer", None, 3072, "the checkpoint's tokenizer", VOCAB, MERGES)
    write_tokenizer(tokenizer, str(tmp_path), model_max_length=4096)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert sum("<|endoftext|>" in text for text in recorded["corpus"]) == 1
    assert [hf(text, add_special_tokens=False).input_ids for text in recorded["corpus"]] == recorded["ids"]
    assert hf("a<|endoftext|>b").input_ids == tokenizer.tokenize("a<|endoftext|>b") != [
        *hf("a").input_ids, recorded["eod"], *hf("b").input_ids]
    assert (hf.eos_token, hf.eos_token_id, hf.bos_token, hf.pad_token) == ("<|endoftext|>", recorded["eod"], None, None)
    with pytest.raises(ExportError, match=r"^the checkpoint's tokenizer --vocab-file .*merges.txt has 3000 tokens "
                                          r"but the model's vocab_size is 2000"):
        load_tokenizer("GPT2BPETokenizer", None, 2000, "the checkpoint's tokenizer", VOCAB, MERGES)


def test_evaluation_takes_the_checkpoints_gpt2_files(tmp_path):
    """evaluate.py without tokenizer flags uses the GPT-2 files the checkpoint's run trained with."""
    from megatron_lev.evaluate import LoadedModel, build_parser, data_settings

    trained = {"training": {"data_path": ["/data/pile_text_document"], "split": "969,30,1", "seq_length": 128,
                            "tokenizer_type": "GPT2BPETokenizer", "tokenizer_model": None, "vocab_file": VOCAB,
                            "merge_file": MERGES}}
    model = LoadedModel("run", "checkpoint", str(tmp_path), None, 3072, training_config=trained)
    args = build_parser().parse_args(["--model", str(tmp_path), "--output-dir", str(tmp_path)])
    settings = data_settings(args, [model])
    assert (settings["tokenizer_type"], settings["tokenizer_model"], settings["vocab_file"], settings["merge_file"]) \
        == ("GPT2BPETokenizer", None, VOCAB, MERGES)
    args = build_parser().parse_args(["--model", str(tmp_path), "--output-dir", str(tmp_path), "--tokenizer-type",
                                      "SentencePieceTokenizer", "--tokenizer-model", "/other/tok.model"])
    settings = data_settings(args, [model])
    assert (settings["tokenizer_type"], settings["tokenizer_model"], settings["vocab_file"]) == (
        "SentencePieceTokenizer", "/other/tok.model", None)


def test_preprocess_refuses_mixed_tokenizer_flags(tmp_path, capsys):
    from megatron_lev.data.preprocess import main as preprocess_main

    common = ["--input", os.path.join(DATA, "corpus.jsonl"), "--output-prefix", str(tmp_path / "p"), "--workers", "1"]
    for flags, message in (
            (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES,
              "--tokenizer-model", VOCAB],
             "--tokenizer-type GPT2BPETokenizer takes --vocab-file and --merge-file, not --tokenizer-model"),
            (["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", MERGES],
             "--tokenizer-type GPT2BPETokenizer needs --vocab-file (GPT-2's vocab.json)"),
            (["--tokenizer-type", "SentencePieceTokenizer"], "--tokenizer-type SentencePieceTokenizer needs "
                                                             "--tokenizer-model")):
        with pytest.raises(SystemExit):
            preprocess_main(common + flags)
        assert capsys.readouterr().err == f"error: {message}\n"
    assert not os.listdir(tmp_path)
