"""Megatron-LM command lines through our parsers: a `pretrain_gpt.py` command line (as
Megatron-LM core_v0.16.1's examples write them) and a `tools/preprocess_data.py` one,
with Megatron's meanings; inapplicable flags refused in one line, no-op flags warned
about, an unknown flag answered in one line naming the closest flag; the docs table."""
import json
import os
import re

import pytest

from megatron_lev.flag_table import flag_table
from megatron_lev.training.arguments import parse_args, validate_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Megatron-LM's GPT pre-training flags (examples/gpt3 and examples/llama style), minus the
# model shape, which --config gives here.
PRETRAIN_GPT = """
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1
    --use-mcore-models --transformer-impl local --swiglu --normalization RMSNorm --disable-bias-linear
    --position-embedding-type rope --max-position-embeddings 256 --untie-embeddings-and-output-weights
    --init-method-std 0.006 --make-vocab-size-divisible-by 64 --attention-dropout 0.0 --hidden-dropout 0.0
    --micro-batch-size 2 --global-batch-size 16 --seq-length 64 --train-samples 1600
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 --lr-decay-samples 1440
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --bf16
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --eod-mask-loss --reset-position-ids --split 949,50,1 --tokenizer-type GPTSentencePieceTokenizer
    --log-interval 10 --log-throughput --eval-interval 100 --eval-iters 10 --save-interval 500
    --tensorboard-dir tb --distributed-timeout-minutes 30 --use-distributed-optimizer --overlap-grad-reduce
    --seed 42 --exit-signal-handler --local_rank 0 --deepspeed --deepspeed_config zero2
""".split()


def test_pretrain_gpt_command_line(capsys):
    args = parse_args(["--config", "tiny-lev", "--data-path", "/d/pile_text_document", "--tokenizer-model", "t.model",
                       *PRETRAIN_GPT])
    warnings = capsys.readouterr().err.splitlines()
    assert warnings == [f"megatron_lev.train: warning: {f} ignored: {r}" for f, r in (
        ("--use-mcore-models", "the model is always built from megatron-core layers"),
        ("--transformer-impl", "the model uses its own megatron-core layers (no Transformer Engine)"),
        ("--swiglu", "the MLP is always SwiGLU"), ("--normalization", "always RMSNorm"),
        ("--disable-bias-linear", "linear layers never have biases"),
        ("--position-embedding-type", "always RoPE (--rotary-base sets its base)"),
        ("--max-position-embeddings", "RoPE has no position table; --seq-length sets the length"),
        ("--untie-embeddings-and-output-weights", "the config's model.embedding (lev / tied / untied / factorized) "
                                                  "decides"),
        ("--use-distributed-optimizer", "optimizer state is sharded by DeepSpeed ZeRO (--zero-stage, default 1)"),
        ("--overlap-grad-reduce", "DeepSpeed's JSON (overlap_comm) decides"),
        ("--deepspeed", "training always runs under DeepSpeed"))]
    args = validate_args(args, world_size=4)
    # Megatron's meanings: samples -> iterations and a schedule in samples.
    assert args.data_parallel_size == 2 and args.gradient_accumulation_steps == 4
    assert args.train_iters == 1600 // 16 and args.lr_decay_steps == 1440
    assert args.lr_warmup_steps == pytest.approx(0.01 * 1440) and args.lr_decay_style == "cosine"
    assert args.recompute == {"recompute_granularity": "full", "recompute_method": "uniform",
                              "recompute_num_layers": 1}
    assert args.model["init_method_std"] == 0.006 and args.model["make_vocab_size_divisible_by"] == 64
    assert args.eod_mask_loss and args.reset_position_ids and args.log_throughput and args.bf16
    assert args.deepspeed_config == "zero2" and args.distributed_timeout_minutes == 30 and args.seed == 42
    from megatron_lev.training.validation import build_model_config

    config = build_model_config(args)
    assert config.init_method_std == 0.006 and config.padded_vocab_size == 1024  # 1000 -> multiple of 64 x TP 2
    assert (config.recompute_granularity, config.recompute_method) == ("full", "uniform")
    # Megatron's GPTSentencePieceTokenizer name is accepted by conversion too.
    from megatron_lev.hf.cli import to_hf_parser

    assert to_hf_parser().parse_args(["--load", "c", "--output", "o", "--tokenizer-type",
                                      "GPTSentencePieceTokenizer"]).tokenizer_type == "GPTSentencePieceTokenizer"


@pytest.mark.parametrize("flags, line", [
    (["--fp16"], "--fp16 is not supported: fp16 needs loss scaling, which is not wired here; use --bf16 (or fp32)"),
    (["--rampup-batch-size", "16", "16", "5859375"],
     "--rampup-batch-size is not supported: batch-size ramp-up is not implemented (the global batch is fixed)"),
    (["--lr-warmup-iter", "3"], "unrecognized argument --lr-warmup-iter (did you mean --lr-warmup-iters?)"),
    (["--recompute-activation"], "unrecognized argument --recompute-activation (did you mean "
                                 "--recompute-activations?)"),
    (["--lr-decay-style", "exp"], "argument --lr-decay-style: invalid choice: 'exp' (choose from 'constant', "
                                  "'linear', 'cosine', 'inverse-square-root', 'WSD')"),
])
def test_refused_and_unknown_flags_are_one_line(flags, line, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", "tiny-lev", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == f"python -m megatron_lev.train: error: {line}\n"


def test_preprocess_data_command_line(tmp_path, spm_tokenizer, capsys):
    """Megatron-LM's tools/preprocess_data.py flags (with its --partitions/--keep-newlines)
    produce the dataset; --split-sentences is refused in one line."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_lev.data.preprocess import main
    from megatron_lev.data.tokenizer import build_tokenizer

    docs = ["first line\nsecond line\n", "x = 1"]
    corpus = tmp_path / "in.json"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    main(["--input", str(corpus), "--output-prefix", str(tmp_path / "out"), "--json-keys", "text",
          "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", spm_tokenizer, "--append-eod",
          "--workers", "1", "--partitions", "2", "--keep-newlines", "--log-interval", "1000"])
    err = capsys.readouterr().err
    assert "preprocess_data.py: warning: --partitions ignored:" in err
    assert "preprocess_data.py: warning: --keep-newlines ignored:" in err
    tok = build_tokenizer("GPTSentencePieceTokenizer", spm_tokenizer)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize(d) + [tok.eod] for d in docs]
    # Llama2Tokenizer: every document starts with BOS, as Megatron-LM's.
    main(["--input", str(corpus), "--output-prefix", str(tmp_path / "llama"), "--tokenizer-type", "Llama2Tokenizer",
          "--tokenizer-model", spm_tokenizer, "--append-eod", "--workers", "1"])
    llama = IndexedDataset(str(tmp_path / "llama_text_document"))
    assert [llama[i].tolist() for i in range(len(llama))] == [[tok.bos] + tok.tokenize(d) + [tok.eod] for d in docs]
    assert tok.bos == 1
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--input", str(corpus), "--output-prefix", str(tmp_path / "o2"), "--tokenizer-type",
              "GPTSentencePieceTokenizer", "--tokenizer-model", spm_tokenizer, "--workers", "1", "--split-sentences"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("preprocess_data.py: error: --split-sentences is not supported:")


def test_docs_table_is_the_parsers():
    """docs/training.md holds exactly the table the parsers define (counts included)."""
    with open(os.path.join(REPO, "docs", "training.md"), encoding="utf-8") as f:
        page = f.read()
    table = flag_table()
    assert table in page, "regenerate it: python -m megatron_lev.flag_table docs/training.md"
    counts = [int(n) for n in re.match(r"(\d+) supported, (\d+) ignored with a warning, (\d+) refused", table).groups()]
    rows = [line for line in table.splitlines() if line.startswith("| pretrain_gpt.py") or
            line.startswith("| preprocess_data.py")]
    assert sum(counts) == len(rows) and counts[1] >= 20 and counts[2] >= 15
