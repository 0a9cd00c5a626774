"""The docs name only what exists: every relative link of docs/*.md and README.md reaches a file
of the tree (and a heading of it, for `#anchor`s), every repository path quoted in `code`
exists, and every command of their shell blocks (and inline `python ...` / `bash ...` spans)
names a module, script or entry point that exists, with flags its parser accepts.

Parsers are built in this process (megatron_lev/flag_table.py's `command_parsers`, a script's
`build_parser`, or the parser its `main` builds, taken before it parses): nothing is run.
A shell script's flags must appear in its text (its `case` labels). A flag of Megatron-LM that
the trainer refuses counts as unknown: a doc command must run as written.
"""
from __future__ import annotations

import argparse
import functools
import glob
import importlib.util
import itertools
import json
import os
import re
import shlex
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))) + [os.path.join(REPO, "README.md"),
                                                                os.path.join(REPO, "experiments", "README.md")]
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")
# Top-level folders whose files the docs quote as `path`; outputs of a run (runs/, demo/, ...) are not.
TREE_DIRS = ("megatron_lev", "tools", "slurm", "docs", "tests", "benchmarks", "experiments", "deepspeed_configs",
             ".ci")
PYTHONS = ("python", "python3")
LAUNCHERS = ("sbatch", "srun", "env", "time", "flock", "nohup")
# Flags of other programs that the docs quote (sbatch, torchrun, pip, pytest, ...).
EXTERNAL_FLAGS = frozenset({"--index-url", "--oversubscribe"})
# Megatron-LM's own pretrain_gpt.py flags (docs/megatron-lm.md quotes them), from the namespace its
# parser built at core_v0.16.1 (tests/data/megatron_lm/pretrain_gpt_args.json): --dest, --no-dest,
# and the flags of that parser (some names differ from their dest).
MEGATRON_LM_ARGS = os.path.join(REPO, "tests", "data", "megatron_lm", "pretrain_gpt_args.json")


@functools.lru_cache(maxsize=None)
def _megatron_lm_flags() -> frozenset:
    with open(MEGATRON_LM_ARGS, encoding="utf-8") as f:
        record = json.load(f)
    named = {f"--{prefix}{d.replace('_', '-')}" for d in record["args"] for prefix in ("", "no-")}
    parser = {flag for entry in record.get("parser", {}).values() for flag in entry["flags"]}
    return frozenset(named | parser | {t for t in record["argv"] if t.startswith("--")})


# --------------------------------------------------------------------------- markdown


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^```([\w+-]*)[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*$", _prose(f.read()), flags=re.M)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in headings:
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def link_problems(page: str, text: str) -> list[str]:
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(page), file_part)) if file_part else page
        if not os.path.exists(path):
            problems.append(f"link {target}: no such file {os.path.relpath(path, REPO)}")
        elif anchor and path.endswith(".md") and anchor not in _anchors(path):
            problems.append(f"link {target}: {os.path.relpath(path, REPO)} has no heading #{anchor}")
    return problems


def _expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [p for choice in match.group(1).split(",")
            for p in _expand_braces(path[:match.start()] + choice + path[match.end():])]


def path_problems(text: str) -> list[str]:
    """Repository paths quoted in inline code (`tools/x.py`, `slurm/common.sh`, `docs/a.md`)."""
    problems = []
    pattern = rf"^(?:\./)?((?:{'|'.join(map(re.escape, TREE_DIRS))})/[\w./{{}},*-]*\w)(?::[\w:]+)?$"
    for span in re.findall(r"`([^`\n]+)`", _prose(text)):
        match = re.match(pattern, span.strip())
        if not match:
            continue
        for path in _expand_braces(match.group(1)):
            if not glob.glob(os.path.join(REPO, path)):
                problems.append(f"`{span}`: no such file or folder {path}")
    return problems


# --------------------------------------------------------------------------- commands


@functools.lru_cache(maxsize=None)
def _package_parsers() -> dict:
    from megatron_lev.flag_table import command_parsers

    return command_parsers()


def _entry_points() -> set[str]:
    with open(os.path.join(REPO, "setup.py"), encoding="utf-8") as f:
        return set(re.findall(r'"(megatron-lev-[\w-]+)=', f.read()))


@functools.lru_cache(maxsize=None)
def _file_parsers(script: str) -> tuple:
    """A Python script's parsers: the package's for a tools/ wrapper, else its build_parser or
    the parser its main builds. Loaded as a module: its `if __name__ == "__main__"` does not run."""
    from megatron_lev.flag_table import parser_of_main

    if script in _package_parsers():
        return tuple(_package_parsers()[script])
    name = "_doc_command_" + re.sub(r"\W", "_", script)
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, script))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    sys.path.insert(0, os.path.dirname(spec.origin))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(spec.origin))
    if hasattr(module, "build_parser"):
        return (module.build_parser(),)
    return (parser_of_main(module.main),) if hasattr(module, "main") else ()


@functools.lru_cache(maxsize=None)
def _module_parsers(module: str) -> tuple:
    from megatron_lev.flag_table import parser_of_main

    if module in _package_parsers():
        return tuple(_package_parsers()[module])
    imported = importlib.import_module(module)
    return (parser_of_main(imported.main),) if hasattr(imported, "main") else ()


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string of a parser and of its sub-commands."""
    options = dict(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options.update(_options(sub))
    return options


def _flag_problems(command: str, parsers, flags: list[str]) -> list[str]:
    if flags and not parsers:
        return [f"{command}: has no argument parser to check {flags[0]} against"]
    known = {}
    for parser in parsers:
        known.update(_options(parser))
    problems = []
    for flag in flags:
        action = known.get(flag)
        if action is None:
            problems.append(f"{command}: no flag {flag}")
        elif type(action).__name__ == "_RefusedFlag":
            problems.append(f"{command}: {flag} is refused ({action.help})")
    return problems


def _flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2]


def command_problems(tokens: list[str]) -> list[str]:
    """Problems of one simple command (shlex tokens, environment assignments first)."""
    problems = []
    while tokens and re.match(r"^[A-Za-z_]\w*=", tokens[0]):
        name, _, value = tokens.pop(0).partition("=")
        if name == "EXTRA_ARGS":  # the Slurm scripts pass it to the trainer
            problems += _flag_problems("EXTRA_ARGS", _module_parsers("megatron_lev.train"), _flags(shlex.split(value)))
    if tokens and tokens[0] == "export":
        return problems + command_problems(tokens[1:])
    if not tokens:
        return problems
    head, args = tokens[0], tokens[1:]
    if head in LAUNCHERS:  # the launcher's own options, then the command it starts
        start = next((i for i, t in enumerate(args) if not t.startswith("-") and (
            t in PYTHONS + ("bash", "sh", "torchrun") or t.endswith((".sh", "/python")) or
            t.startswith("megatron-lev-"))), None)
        if start is None:
            return problems
        if args[start].endswith(".sh"):
            return problems + command_problems(["bash", *args[start:]])
        return problems + command_problems(args[start:])
    if head in ("bash", "sh"):
        if not args or args[0].startswith("-"):
            return problems
        script, rest = args[0], args[1:]
        if not os.path.isfile(os.path.join(REPO, script)):
            return problems + [f"{head} {script}: no such script"]
        with open(os.path.join(REPO, script), encoding="utf-8") as f:
            text = f.read()
        return problems + [f"{head} {script}: no flag {flag} in the script" for flag in _flags(rest)
                           if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)]
    if head in PYTHONS or head.endswith("/python") or head == "torchrun":
        if head == "torchrun":  # torchrun's options, then -m MODULE or a script
            rest = list(itertools.dropwhile(lambda t: t != "-m" and not t.endswith(".py"), args))
        else:
            rest = args
        if not rest or rest[0] == "-c":
            return problems
        if rest[0] == "-m" and len(rest) > 1:
            module, rest = rest[1], rest[2:]
            if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
                return problems + [f"python -m {module}: no such module"]
            if not module.startswith("megatron_lev"):
                return problems
            return problems + _flag_problems(f"python -m {module}", _module_parsers(module), _flags(rest))
        if rest[0].endswith(".py"):
            script = os.path.normpath(rest[0])
            copied = os.path.join("tools", "megatron_lm", os.path.basename(script))
            if not os.path.isfile(os.path.join(REPO, script)) and os.path.isfile(os.path.join(REPO, copied)):
                # a script of ours copied into a Megatron-LM checkout: Megatron-LM's flags and ours
                flags = [f for f in _flags(rest[1:]) if f not in _megatron_lm_flags()]
                return problems + _flag_problems(f"python {script}", _file_parsers(copied), flags)
            if not os.path.isfile(os.path.join(REPO, script)):
                return problems + [f"python {script}: no such script"]
            return problems + _flag_problems(f"python {script}", _file_parsers(script), _flags(rest[1:]))
        return problems
    if head.startswith("megatron-lev-") and "*" not in head:
        if head not in _entry_points():
            return problems + [f"{head}: no such entry point in setup.py"]
        return problems + _flag_problems(head, _package_parsers()[head], _flags(args))
    return problems


def _simple_commands(line: str) -> list[list[str]]:
    """shlex's tokens of a shell line, cut at `;`, `&&`, `||`, `|`, `&`, redirections dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current, tokens = [], [], list(lexer)
    skip_next = False
    for token in tokens:
        if skip_next:
            skip_next = False
        elif token in (";", "&&", "||", "|", "&", ";;"):
            commands.append(current)
            current = []
        elif token in (">", ">>", "<", ">&", "2>", "&>"):
            skip_next = True
        else:
            current.append(token)
    return [c for c in commands + [current] if c]


COMMAND_START = re.compile(r"^\s*(?:[A-Za-z_]\w*=\S*\s+)*(?:export\s+|\$\s+)?(?:python3?|bash|sh|sbatch|srun|torchrun|"
                           r"megatron-lev-|\S*/python\b|[A-Za-z_]\w*=)")


def shell_problems(line: str) -> list[str]:
    """Every command of a shell line: `$(...)` substitutions, then each simple command."""
    problems = []
    for inner in re.findall(r"\$\(([^()]*)\)", line):
        problems += shell_problems(inner)
    line = re.sub(r"\$\(([^()]*)\)", "SUBSTITUTED", line)
    try:
        commands = _simple_commands(line)
    except ValueError as exc:  # unbalanced quotes: an error only in what reads as a command
        return problems + ([f"{exc}"] if COMMAND_START.match(line) else [])
    for tokens in commands:
        problems += command_problems(tokens)
    return problems


def command_lines(text: str) -> list[str]:
    lines = []
    for lang, body in _fenced_blocks(text):
        if lang in SHELL_BLOCKS:
            lines += [ln for ln in re.sub(r"\\\n", " ", body).splitlines() if ln.strip()]
    lines += [span for span in re.findall(r"`([^`\n]+)`", _prose(text))
              if re.match(r"(python3? |bash |sbatch |torchrun |megatron-lev-)", span)]
    return lines


@functools.lru_cache(maxsize=None)
def _all_flags() -> frozenset:
    """Every flag of every command of the tree: the package's and its scripts' parsers, and
    the flags the shell scripts and the Slurm launcher (the commands it builds: srun, torchrun) name."""
    flags = set()
    parsers = [p for ps in _package_parsers().values() for p in ps]
    for script in glob.glob(os.path.join(REPO, "*", "*.py")):
        script = os.path.relpath(script, REPO)
        if script.startswith(("tools/", "benchmarks/", "experiments/")):
            parsers += _file_parsers(script)
    for parser in parsers:
        flags.update(_options(parser))
    for script in glob.glob(os.path.join(REPO, "*", "*.sh")) + glob.glob(os.path.join(REPO, "megatron_lev", "launcher",
                                                                                       "*.py")):
        with open(script, encoding="utf-8") as f:
            flags.update(re.findall(r"--[A-Za-z][\w-]*", f.read()))
    return frozenset(flags)


def prose_flag_problems(text: str) -> list[str]:
    """`--flag`s quoted in the text (tables, sentences) belong to some command of the tree."""
    problems = []
    for span in re.findall(r"`([^`\n]+)`", _prose(text)):
        if COMMAND_START.match(span):
            continue  # a command: its own parser checks it (command_lines)
        for flag, family in re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)(/|\*|)", span):
            if family == "*" and any(f.startswith(flag) for f in _all_flags()):
                continue  # a family such as `--lev-*`
            if family == "/" and flag not in _all_flags():
                continue  # an abbreviated family such as `--train/valid/test-data-path`
            if flag not in _all_flags() and flag not in EXTERNAL_FLAGS and flag not in _megatron_lm_flags():
                problems.append(f"`{span}`: no command of the tree has {flag}")
    return problems


def page_problems(page: str, text: str) -> list[str]:
    problems = link_problems(page, text) + path_problems(text) + prose_flag_problems(text)
    for line in command_lines(text):
        problems += [f"{line.strip()[:80]}: {p}" for p in shell_problems(line)]
    return problems


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, REPO))
def test_docs_name_only_what_exists(page):
    with open(page, encoding="utf-8") as f:
        problems = page_problems(page, f.read())
    assert not problems, "\n".join(problems)


def _has_section(page: str, section: str) -> bool:
    """A heading of the page starts with `section`, or a bold paragraph lead-in (`**Sizing ...`)."""
    with open(page, encoding="utf-8") as f:
        text = _prose(f.read())
    return any(h.startswith(section) for h in re.findall(r"^#{1,6}\s+(.*?)\s*$", text, flags=re.M)) or \
        f"**{section}" in text


def section_reference_problems(source: str, text: str) -> list[str]:
    """`docs/x.md "Section"` references in code comments (where to read more)."""
    problems = []
    for page, section in re.findall(r"\b((?:docs/)?[\w.-]+\.md),?\s+\"([^\"\n]+)\"", text):
        path = os.path.join(REPO, page)
        if not os.path.isfile(path):
            problems.append(f"{source}: {page}: no such page")
        elif not _has_section(path, section):
            problems.append(f"{source}: {page} has no section \"{section}\"")
    for page in re.findall(r"\b(docs/[\w-]+\.md)\b", text):
        if not os.path.isfile(os.path.join(REPO, page)):
            problems.append(f"{source}: {page}: no such page")
    return problems


def test_code_comments_point_to_sections_that_exist():
    """Scripts and modules that send the reader to a page (`docs/slurm.md "Sizing"`) name a page
    and a heading (or bold lead-in) it has."""
    problems = []
    for path in sorted(glob.glob(os.path.join(REPO, "**", "*.*"), recursive=True)):
        rel = os.path.relpath(path, REPO)
        if (path.endswith((".py", ".sh")) and rel.split(os.sep)[0] in TREE_DIRS and rel != "tests/test_docs_links.py"):
            with open(path, encoding="utf-8") as f:
                problems += section_reference_problems(rel, f.read())
    assert not problems, "\n".join(problems)
    assert section_reference_problems("x.sh", '# README.md, "Running on a Slurm cluster"; docs/gone.md') == [
        'x.sh: README.md has no section "Running on a Slurm cluster"', "x.sh: docs/gone.md: no such page"]


def test_the_checker_catches_what_does_not_exist():
    """Each kind of mistake in a page is reported, naming it; the correct forms are not."""
    page = os.path.join(REPO, "docs", "training.md")
    bad = "\n".join([
        "[gone](nowhere.md) [wrong anchor](slurm.md#no-such-heading) [fine](slurm.md) [site](https://x.org/a)",
        "`tools/no_such_tool.py` `slurm/common.sh` `deepspeed_configs/zero{1,2}.json`",
        "```bash",
        "python -m megatron_lev.train --config tiny-lev --no-such-flag 3 --lr 1e-3",
        "python -m megatron_lev.no_such_module --x",
        "torchrun --nproc_per_node 2 -m megatron_lev.train --finetune",
        "python tools/convert_to_hf.py --load a --output b --outptu c",
        "python tools/no_such_script.py",
        "torchrun --nproc-per-node 2 pretrain_lev_gpt.py --swiglu --lev-num-head 4",
        'export DATA_PATH="$(python tools/make_blend.py --no-blend-flag /data)"',
        'EXTRA_ARGS="--seed 1 --sed 2" sbatch --nodes=2 slurm/train_lev_1b.sh',
        "bash tools/quickstart.sh --publish --no-such-option",
        "megatron-lev-nope --x",
        "sbatch --nodes 2 --time 01:00:00 slurm/no_such_job.sh && megatron-lev-train --config tiny-lev",
        "python -m megatron_lev.training.validation --world-size 16 --config lev-1.2b --data-path x",
        "```",
        "Run `python benchmarks/bench_train.py --sizes demo --no-such-bench-flag`; set `--lr-warmup-iters`,",
        "`--eval-iters/-interval`, `--train/valid/test-data-path`, not `--no-flag-anywhere`.",
    ])
    problems = page_problems(page, bad)
    expected = [
        "link nowhere.md: no such file docs/nowhere.md",
        "link slurm.md#no-such-heading: docs/slurm.md has no heading #no-such-heading",
        "`tools/no_such_tool.py`: no such file or folder tools/no_such_tool.py",
        "python -m megatron_lev.train: no flag --no-such-flag",
        "python -m megatron_lev.no_such_module: no such module",
        "python -m megatron_lev.train: --finetune is refused",
        "python tools/convert_to_hf.py: no flag --outptu",
        "python tools/no_such_script.py: no such script",
        "python pretrain_lev_gpt.py: no flag --lev-num-head",
        "python tools/make_blend.py: no flag --no-blend-flag",
        "EXTRA_ARGS: no flag --sed",
        "bash tools/quickstart.sh: no flag --no-such-option in the script",
        "megatron-lev-nope: no such entry point in setup.py",
        "bash slurm/no_such_job.sh: no such script",
        "python benchmarks/bench_train.py: no flag --no-such-bench-flag",
        "`--no-flag-anywhere`: no command of the tree has --no-flag-anywhere",
    ]
    for message in expected:
        assert sum(message in p for p in problems) == 1, (message, problems)
    assert len(problems) == len(expected), problems
