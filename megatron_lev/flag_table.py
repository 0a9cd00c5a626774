"""docs/training.md's "Megatron-LM flag -> here" table, generated from every command's parser,
and `command_parsers`: the parser of every command of the package, by the names the docs call
it with (tests/test_docs_links.py checks every flag of the docs' commands against them).

    python -m megatron_lev.flag_table docs/training.md     # after adding a flag

It reads the commands' parsers, so it lives above them all (the top of the package, beside
the other entry points); tests/test_megatron_flags.py checks the page holds exactly this table.
"""
from __future__ import annotations

import argparse
import sys

from megatron_lev.data.preprocess import PREPROCESS_IGNORED, PREPROCESS_OWN_FLAGS, PREPROCESS_REFUSED
from megatron_lev.data.preprocess import build_parser as build_preprocess_parser
from megatron_lev.training.arguments import build_parser
from megatron_lev.training.megatron_flags import SUPPORTED_NOTES, TRAIN_IGNORED, TRAIN_OWN_FLAGS, TRAIN_REFUSED
from megatron_lev.utils.files import replace_generated_table


def flag_table() -> str:
    """docs/training.md's "Megatron-LM flag -> here" table (markdown)."""
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
        rows += [(tool, f, "ignored (warning)", reason + (f" (only {', '.join(accepted[0])}: another value is refused)"
                                                         if accepted else ""))
                 for f, (_, reason, *accepted) in ignored.items()]
        rows += [(tool, f, "refused", reason) for f, (_, reason) in refused.items()]
    counts = {s: sum(r[2] == s for r in rows) for s in ("supported", "ignored (warning)", "refused")}
    lines = [f"{counts['supported']} supported, {counts['ignored (warning)']} ignored with a warning, "
             f"{counts['refused']} refused with the reason. Flags of ours alone: "
             + ", ".join(f"`{f}`" for f in TRAIN_OWN_FLAGS) + "; in preprocessing "
             + ", ".join(f"`{f}`" for f in PREPROCESS_OWN_FLAGS) + ".", "",
             "| Megatron-LM | flag | here | why |", "| --- | --- | --- | --- |"]
    lines += [f"| {tool} | `{flag}` | {status} | {why} |" for tool, flag, status, why in rows]
    return "\n".join(lines) + "\n"


class _ParserBuilt(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def parser_of_main(main) -> argparse.ArgumentParser:
    """The parser a command's `main(argv)` builds, taken when it first parses: main runs up to
    there (building the parser, which is all our mains do before it) and no further."""
    def stop(parser, *args, **kwargs):
        raise _ParserBuilt(parser)

    parse_known_args = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = stop  # parse_args and our subclasses go through it
    try:
        main([])
    except _ParserBuilt as built:
        return built.parser
    finally:
        argparse.ArgumentParser.parse_known_args = parse_known_args
    raise RuntimeError(f"{main.__module__}.main returned without parsing its arguments")


def command_parsers() -> dict[str, list[argparse.ArgumentParser]]:
    """Command -> the parsers its flags go to (a flag is the command's when one of them has
    it), for every name the docs use: `python -m MODULE`, `python tools/X.py`, `megatron-lev-*`."""
    from megatron_lev import demo, evaluate
    from megatron_lev.data import corpus
    from megatron_lev.evaluation import curves, downstream, seeds
    from megatron_lev.hf.cli import from_hf_parser, from_mcore_parser, to_hf_parser
    from megatron_lev.megatron_lm.arguments import add_lev_args
    from megatron_lev.models import param_count
    from megatron_lev.training import validation

    train, preprocess = [build_parser()], [build_preprocess_parser()]
    commands = {
        "megatron_lev.train": train, "megatron-lev-train": train,
        # --world-size, then the trainer's flags
        "megatron_lev.training.validation": [parser_of_main(validation.main), *train],
        "megatron_lev.data.preprocess": preprocess, "tools/preprocess_data.py": preprocess,
        "megatron-lev-preprocess": preprocess,
        "megatron_lev.evaluate": [evaluate.build_parser()], "megatron_lev.demo": [demo.build_parser()],
        "tools/convert_to_hf.py": [to_hf_parser()], "tools/convert_from_hf.py": [from_hf_parser()],
        "tools/param_count.py": [parser_of_main(param_count.main)],
        "megatron_lev.data.corpus": [parser_of_main(corpus.main)],
        "tools/convert_from_mcore.py": [from_mcore_parser()],
        # the --lev-* flags a Megatron-LM checkout's pretrain_lev_gpt.py adds to Megatron-LM's own
        "tools/megatron_lm/pretrain_lev_gpt.py": [add_lev_args(argparse.ArgumentParser(add_help=False))],
    }
    commands["tools/megatron_lm/check_lev_gpt.py"] = commands["tools/megatron_lm/pretrain_lev_gpt.py"]
    commands["megatron-lev-evaluate"] = commands["megatron_lev.evaluate"]
    commands["megatron-lev-convert-to-hf"] = commands["tools/convert_to_hf.py"]
    commands["megatron-lev-convert-from-hf"] = commands["tools/convert_from_hf.py"]
    commands["megatron-lev-convert-from-mcore"] = commands["tools/convert_from_mcore.py"]
    for module in (curves, downstream, seeds):
        commands[module.__name__] = [parser_of_main(module.main)]
    return commands


TABLE_HEADING = "## Megatron-LM flag → here"


def write_flag_table(page: str) -> None:
    """Replace the table under TABLE_HEADING in `page` (docs/training.md) with flag_table():
    `python -m megatron_lev.flag_table docs/training.md` after adding a flag."""
    replace_generated_table(page, TABLE_HEADING, " supported, ", flag_table())


if __name__ == "__main__":
    write_flag_table(sys.argv[1])
