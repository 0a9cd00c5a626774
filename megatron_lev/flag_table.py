"""docs/training.md's "Megatron-LM flag -> here" table, generated from every command's parser.

    python -m megatron_lev.flag_table docs/training.md     # after adding a flag

It reads the trainer's and the preprocessor's parsers, so it lives above both (the top of the
package, beside the other entry points); tests/test_megatron_flags.py checks the page holds
exactly this table.
"""
from __future__ import annotations

import argparse
import sys

from megatron_lev.data.preprocess import PREPROCESS_IGNORED, PREPROCESS_OWN_FLAGS, PREPROCESS_REFUSED
from megatron_lev.data.preprocess import build_parser as build_preprocess_parser
from megatron_lev.training.arguments import build_parser
from megatron_lev.training.megatron_flags import SUPPORTED_NOTES, TRAIN_IGNORED, TRAIN_OWN_FLAGS, TRAIN_REFUSED
from megatron_lev.utils.files import atomic_path


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


TABLE_HEADING = "## Megatron-LM flag → here"


def write_flag_table(page: str) -> None:
    """Replace the table under TABLE_HEADING in `page` (docs/training.md) with flag_table():
    `python -m megatron_lev.flag_table docs/training.md` after adding a flag."""
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
