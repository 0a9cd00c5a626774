"""Megatron-LM command lines, understood: the parser class of our commands, and the
Megatron-LM (core_v0.16.1 `pretrain_gpt.py`, `tools/preprocess_data.py`) flags that have
no work to do here (accepted with a warning) or cannot apply (refused, with the reason).

Every flag our parsers define under a Megatron-LM name has Megatron's meaning; the ones
that are ours alone are listed in OWN_FLAGS. `flag_table()` renders the three groups as
the "Megatron-LM flag -> here" table of docs/training.md (tests/test_megatron_flags.py
checks that the page holds exactly this table).
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys


class MegatronArgumentParser(argparse.ArgumentParser):
    """argparse with Megatron's `allow_abbrev=False`, and errors as one line (no usage
    block), printed by rank 0 only: an unknown flag names the closest known one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        flags = [a for a in extras if a.startswith("-")]
        if flags:  # parse_args would print the whole usage first; one line instead
            self.error(self.unknown_flag_message(flags[0]))
        return parsed, extras

    def known_flags(self) -> list[str]:
        return [s for action in self._actions for s in action.option_strings if s.startswith("--")]

    def unknown_flag_message(self, flag: str) -> str:
        name = flag.split("=", 1)[0]
        close = difflib.get_close_matches(name, self.known_flags(), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else " (--help lists the flags)"
        return f"unrecognized argument {name}{hint}"

    def error(self, message):
        if int(os.environ.get("RANK", "0")) == 0:  # torchrun starts every rank with the same argv
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)


class _IgnoredFlag(argparse.Action):
    """A Megatron-LM flag with nothing to do here: recorded in `ignored_flags`."""

    def __call__(self, parser, namespace, values, option_string=None):
        ignored = list(getattr(namespace, "ignored_flags", []))
        ignored.append(option_string)
        setattr(namespace, "ignored_flags", ignored)


class _RefusedFlag(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not supported: {self.help}")


def add_compat_flags(parser: argparse.ArgumentParser, ignored: dict, refused: dict) -> None:
    """Register Megatron-LM flags: `ignored` and `refused` map a flag to (nargs, reason)."""
    g = parser.add_argument_group("Megatron-LM flags accepted with a warning (no effect here)")
    for flag, (nargs, reason) in ignored.items():
        g.add_argument(flag, nargs=nargs, action=_IgnoredFlag, help=reason, dest=argparse.SUPPRESS,
                       default=argparse.SUPPRESS)
    g = parser.add_argument_group("Megatron-LM flags refused (cannot apply here)")
    for flag, (nargs, reason) in refused.items():
        g.add_argument(flag, nargs=nargs, action=_RefusedFlag, help=reason, dest=argparse.SUPPRESS,
                       default=argparse.SUPPRESS)


def warn_ignored(prog: str, flags) -> None:
    """One warning line per ignored flag, rank 0 only."""
    if flags and int(os.environ.get("RANK", "0")) == 0:
        for flag in dict.fromkeys(flags):
            reason = (TRAIN_IGNORED.get(flag) or PREPROCESS_IGNORED.get(flag))[1]
            print(f"{prog}: warning: {flag} ignored: {reason}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------- pretrain_gpt.py

TRAIN_IGNORED = {
    "--use-mcore-models": (0, "the model is always built from megatron-core layers"),
    "--deepspeed": (0, "training always runs under DeepSpeed"),
    "--swiglu": (0, "the MLP is always SwiGLU"),
    "--disable-bias-linear": (0, "linear layers never have biases"),
    "--normalization": (1, "always RMSNorm"),
    "--position-embedding-type": (1, "always RoPE (--rotary-base sets its base)"),
    "--no-position-embedding": (0, "RoPE needs no position table"),
    "--max-position-embeddings": (1, "RoPE has no position table; --seq-length sets the length"),
    "--untie-embeddings-and-output-weights": (0, "the config's model.embedding (lev / tied / untied) decides"),
    "--group-query-attention": (0, "--num-query-groups decides"),
    "--use-flash-attn": (0, "attention runs through torch SDPA, which picks flash attention on GPUs"),
    "--attention-backend": (1, "attention runs through torch SDPA"),
    "--transformer-impl": (1, "the model uses its own megatron-core layers (no Transformer Engine)"),
    "--no-masked-softmax-fusion": (0, "no fused softmax kernel is used"),
    "--no-bias-gelu-fusion": (0, "no fused bias-GeLU kernel is used"),
    "--no-bias-swiglu-fusion": (0, "no fused bias-SwiGLU kernel is used"),
    "--no-bias-dropout-fusion": (0, "no fused bias-dropout kernel is used"),
    "--no-rope-fusion": (0, "no fused RoPE kernel is used"),
    "--no-gradient-accumulation-fusion": (0, "gradients accumulate in DeepSpeed's fp32 buffers"),
    "--use-distributed-optimizer": (0, "optimizer state is sharded by DeepSpeed ZeRO (--zero-stage, default 1)"),
    "--overlap-grad-reduce": (0, "DeepSpeed's JSON (overlap_comm) decides"),
    "--overlap-param-gather": (0, "DeepSpeed's JSON (overlap_comm) decides"),
    "--log-validation-ppl-to-tensorboard": (0, "validation perplexity is always logged"),
    "--log-timers-to-tensorboard": (0, "iteration-time is always logged"),
    "--log-memory-to-tensorboard": (0, "memory is always logged"),
    "--timing-log-level": (1, "only the iteration time is measured"),
    "--num-dataset-builder-threads": (1, "rank 0 builds the dataset indices once, cached"),
    "--no-create-attention-mask-in-dataloader": (0, "no mask is built (the model is causal)"),
    "--dataloader-type": (1, "the sampler is always Megatron's 'single' pretraining sampler"),
}

TRAIN_REFUSED = {
    "--fp16": (0, "fp16 needs loss scaling, which is not wired here; use --bf16 (or fp32)"),
    "--fp8-format": (1, "fp8 needs Transformer Engine, which the model does not use"),
    "--checkpoint-activations": (0, "gone from Megatron-LM too; use --recompute-activations or "
                                    "--recompute-granularity"),
    "--recompute-modules": (None, "selective recompute covers core attention only (--recompute-granularity "
                                  "selective)"),
    "--distribute-saved-activations": (0, "recomputed activations are not sharded over TP here"),
    "--reset-attention-mask": (0, "the model's attention is causal over the whole sequence (SDPA without a "
                                  "per-document mask); --reset-position-ids and --eod-mask-loss apply"),
    "--rampup-batch-size": (3, "batch-size ramp-up is not implemented (the global batch is fixed)"),
    "--context-parallel-size": (1, "context parallelism is not implemented"),
    "--virtual-pipeline-model-parallel-size": (1, "DeepSpeed's pipeline engine has no interleaved schedule"),
    "--num-layers-per-virtual-pipeline-stage": (1, "DeepSpeed's pipeline engine has no interleaved schedule"),
    "--num-experts": (1, "mixture-of-experts models are not implemented"),
    "--expert-model-parallel-size": (1, "mixture-of-experts models are not implemented"),
    "--finetune": (0, "a weights-only start at iteration 0 is not implemented; --no-load-optim loads the weights "
                      "without the optimizer state"),
    "--use-checkpoint-args": (0, "--config defines the model; a checkpoint of another model is refused"),
    "--ckpt-format": (1, "checkpoints are DeepSpeed's (tools/convert_to_hf.py / convert_from_hf.py convert)"),
    "--vocab-file": (1, "training takes --tokenizer-model (SentencePiece .model or a Hugging Face folder)"),
    "--merge-file": (1, "training takes --tokenizer-model (SentencePiece .model or a Hugging Face folder)"),
}

# Supported, with Megatron's meaning; what is worth knowing about a few of them here.
SUPPORTED_NOTES = {
    "--sequence-parallel": "parsed; the decoder refuses it for now (only the LEV embedding implements it)",
    "--deepspeed-config": "Megatron-DeepSpeed's flag; a path or a packaged name (zero1/2/3, zero3_offload)",
    "--recompute-activations": "selective recompute (core attention), as in Megatron",
    "--lr-decay-style": "default cosine here (Megatron: linear); the packaged configs set it",
    "--exit-signal-handler": "on by default here (SIGTERM and SIGUSR1)",
    "--log-throughput": "adds TFLOP/s per GPU (and MFU with --gpu-type) to the log line",
    "--local-rank": "the deepspeed launcher's; the rank is read from the environment",
    "--tokenizer-type": "SentencePieceTokenizer, GPTSentencePieceTokenizer, HuggingFaceTokenizer; preprocessing "
                        "also Llama2Tokenizer (BOS first); GPT2BPETokenizer: not implemented",
}

# Flags of megatron_lev.train that Megatron-LM does not have.
TRAIN_OWN_FLAGS = ("--config", "--zero-stage", "--train-tokens", "--keep-last-checkpoints", "--metrics-file",
                   "--gpu-type", "--peak-tflops", "--max-skipped-steps", "--embedding", "--compile-layers",
                   "--override-checkpoint-args", "--trust-remote-code")

# ------------------------------------------------------------------------- preprocess_data.py

PREPROCESS_IGNORED = {
    "--partitions": (1, "input files are split into blocks for --workers already; outputs are merged once"),
    "--keep-newlines": (0, "newlines are always kept (it matters only with --split-sentences)"),
    "--keep-sequential-samples": (0, "documents are always written in input order"),
    "--lang": (1, "only used by --split-sentences"),
}

PREPROCESS_REFUSED = {
    "--split-sentences": (0, "sentence splitting (nltk punkt) is for BERT-style sentence datasets; GPT "
                             "pre-training uses whole documents"),
    "--vocab-file": (1, "GPT2BPETokenizer is not implemented: save the GPT-2 vocab/merges as a Hugging Face "
                        "tokenizer.json and use --tokenizer-type HuggingFaceTokenizer"),
    "--merge-file": (1, "GPT2BPETokenizer is not implemented: save the GPT-2 vocab/merges as a Hugging Face "
                        "tokenizer.json and use --tokenizer-type HuggingFaceTokenizer"),
}


def flag_table() -> str:
    """docs/training.md's "Megatron-LM flag -> here" table (markdown)."""
    from megatron_lev.arguments import build_parser
    from megatron_lev.data.preprocess import build_parser as build_preprocess_parser

    rows = []
    for tool, parser, own, ignored, refused in (
            ("pretrain_gpt.py", build_parser(), TRAIN_OWN_FLAGS, TRAIN_IGNORED, TRAIN_REFUSED),
            ("preprocess_data.py", build_preprocess_parser(), PREPROCESS_OWN_FLAGS, PREPROCESS_IGNORED,
             PREPROCESS_REFUSED)):
        compat = set(ignored) | set(refused)
        for action in parser._actions:
            names = [s for s in action.option_strings if s.startswith("--") and not (
                isinstance(action, argparse.BooleanOptionalAction) and s.startswith("--no-"))]
            if names and names[0] not in compat and names[0] not in own and names[0] != "--help":
                rows.append((tool, ", ".join(f"`{n}`" for n in names)[1:-1], "supported",
                             SUPPORTED_NOTES.get(names[0], "")))
        rows += [(tool, f, "ignored (warning)", reason) for f, (_, reason) in ignored.items()]
        rows += [(tool, f, "refused", reason) for f, (_, reason) in refused.items()]
    counts = {s: sum(r[2] == s for r in rows) for s in ("supported", "ignored (warning)", "refused")}
    lines = [f"{counts['supported']} supported, {counts['ignored (warning)']} ignored with a warning, "
             f"{counts['refused']} refused with the reason. Flags of ours alone: "
             + ", ".join(f"`{f}`" for f in TRAIN_OWN_FLAGS) + "; in preprocessing "
             + ", ".join(f"`{f}`" for f in PREPROCESS_OWN_FLAGS) + ".", "",
             "| Megatron-LM | flag | here | why |", "| --- | --- | --- | --- |"]
    lines += [f"| {tool} | `{flag}` | {status} | {why} |" for tool, flag, status, why in rows]
    return "\n".join(lines) + "\n"


PREPROCESS_OWN_FLAGS = ("--split-by-key", "--chunk-size-mb", "--strict", "--max-bad-reports", "--allow-truncated")

TABLE_HEADING = "## Megatron-LM flag → here"


def write_flag_table(page: str) -> None:
    """Replace the table under TABLE_HEADING in `page` (docs/training.md) with flag_table():
    `python -m megatron_lev.megatron_flags docs/training.md` after adding a flag."""
    from megatron_lev.utils.files import atomic_path

    with open(page, encoding="utf-8") as f:
        text = f.read()
    counts_line = text.index(" supported, ", text.index(TABLE_HEADING))  # the table starts with its counts
    first = text.rindex("\n", 0, counts_line) + 1
    end = text.find("\n## ", first)
    end = len(text) if end == -1 else end + 1
    with atomic_path(page) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text[:first] + flag_table() + text[end:])


if __name__ == "__main__":
    write_flag_table(sys.argv[1])
