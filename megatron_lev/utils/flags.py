"""Command lines that read like Megatron-LM's: the parser class of our commands (Megatron's
`allow_abbrev=False`, one-line errors naming the closest flag) and Megatron-LM flags that have
no work to do here (accepted with a warning) or cannot apply (refused, with the reason).

Each command lists its own compatible flags: training/megatron_flags.py for the trainer,
data/preprocess.py for preprocessing; megatron_lev/flag_table.py renders them all as the
"Megatron-LM flag -> here" table of docs/training.md.
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
    """A Megatron-LM flag with nothing to do here: recorded in `ignored_flags`. With `accepted`
    values, only those are (they are what happens here anyway); any other is refused."""

    def __init__(self, *args, accepted=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.accepted = accepted

    def __call__(self, parser, namespace, values, option_string=None):
        value = values[0] if isinstance(values, list) and len(values) == 1 else values
        if self.accepted is not None and value not in self.accepted:
            parser.error(f"{option_string} {value} is not supported: {self.help} (accepted: "
                         f"{', '.join(map(str, self.accepted))})")
        ignored = list(getattr(namespace, "ignored_flags", []))
        ignored.append(option_string)
        setattr(namespace, "ignored_flags", ignored)


class _RefusedFlag(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not supported: {self.help}")


def add_compat_flags(parser: argparse.ArgumentParser, ignored: dict, refused: dict) -> None:
    """Register Megatron-LM flags: `ignored` and `refused` map a flag to (nargs, reason); an
    ignored flag's entry may add the values it accepts, (nargs, reason, accepted): others are refused."""
    g = parser.add_argument_group("Megatron-LM flags accepted with a warning (no effect here)")
    for flag, (nargs, reason, *accepted) in ignored.items():
        g.add_argument(flag, nargs=nargs, action=_IgnoredFlag, help=reason, dest=argparse.SUPPRESS,
                       default=argparse.SUPPRESS, accepted=accepted[0] if accepted else None)
    g = parser.add_argument_group("Megatron-LM flags refused (cannot apply here)")
    for flag, (nargs, reason) in refused.items():
        g.add_argument(flag, nargs=nargs, action=_RefusedFlag, help=reason, dest=argparse.SUPPRESS,
                       default=argparse.SUPPRESS)


def warn_ignored(prog: str, flags, ignored: dict) -> None:
    """One warning line per ignored flag (`ignored`: flag -> (nargs, reason)), rank 0 only."""
    if flags and int(os.environ.get("RANK", "0")) == 0:
        for flag in dict.fromkeys(flags):
            print(f"{prog}: warning: {flag} ignored: {ignored[flag][1]}", file=sys.stderr, flush=True)


def tokenizer_flags_error(tokenizer_type: str, tokenizer_model, vocab_file, merge_file):
    """The one-line problem with a combination of Megatron's tokenizer flags, or None:
    GPT2BPETokenizer reads --vocab-file and --merge-file, every other type --tokenizer-model.
    Shared by preprocessing and training, which raise it as their own error."""
    if tokenizer_type == "GPT2BPETokenizer":
        if tokenizer_model is not None:
            return "--tokenizer-type GPT2BPETokenizer takes --vocab-file and --merge-file, not --tokenizer-model"
    elif tokenizer_model is None:
        return f"--tokenizer-type {tokenizer_type} needs --tokenizer-model"
    elif vocab_file is not None or merge_file is not None:
        return (f"--vocab-file/--merge-file belong to --tokenizer-type GPT2BPETokenizer; "
                f"{tokenizer_type} takes --tokenizer-model only")
    return None
