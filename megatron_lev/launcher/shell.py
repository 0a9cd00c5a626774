"""What the launcher shares with the batch shell: bash's quoting (so a printed command can be
pasted into a shell, and the assignments handed back to the shell are `eval`-safe), bash's word
splitting of a variable, its integer checks, and the one-line refusal."""
from __future__ import annotations

import datetime
import re
from typing import Iterable, Mapping, Optional

# Words print_cmd leaves bare (bash: [[ $arg =~ ^[][A-Za-z0-9_@%+=:,./-]+$ ]]).
_BARE = re.compile(r"^[][A-Za-z0-9_@%+=:,./-]+$")
_ANSI_C = {"\a": "\\a", "\b": "\\b", "\x1b": "\\E", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t",
           "\v": "\\v", "\\": "\\\\", "'": "\\'"}


class LaunchError(Exception):
    """A launch that cannot work: the message is the one line after `slurm: error: `."""


def bash_quote(value: str) -> str:
    """`${value@Q}` of bash 5: single quotes ('a'\\''b' for a quote inside), or $'...' with C
    escapes when the value holds a control character."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return "$'" + "".join(_ANSI_C.get(c, f"\\{ord(c):03o}" if ord(c) < 32 or ord(c) == 127 else c)
                              for c in value) + "'"
    if value == "'":
        return "\\'"  # bash's one special case
    return "'" + value.replace("'", "'\\''") + "'"


def print_cmd(words: Iterable[str]) -> str:
    """A command line exactly: each word bare where that is safe, else quoted as bash's @Q."""
    return " ".join(w if w and _BARE.match(w) else bash_quote(w) for w in map(str, words))


def assign(name: str, value) -> str:
    """`name='value'` (a list: a bash array), for the batch shell to evaluate."""
    if isinstance(value, (list, tuple)):
        return f"{name}=({' '.join(bash_quote(str(v)) for v in value)})"
    return f"{name}={bash_quote(str(value))}"


def words(value: Optional[str]) -> list[str]:
    """A variable split as bash splits `read -r -a words <<<"$value"` (spaces, tabs; and newlines)."""
    return [w for w in re.split(r"[ \t\n]+", value or "") if w]


def stamp(now: Optional[datetime.datetime] = None) -> str:
    """The batch shell's log prefix: `[slurm 2026-12-04 10:11:12]`."""
    return f"[slurm {(now or datetime.datetime.now()):%Y-%m-%d %H:%M:%S}]"


def require_int(name: str, value: str, minimum: int = 0) -> int:
    """An integer variable, refused in the batch shell's words."""
    if not re.fullmatch(r"[0-9]+", value or ""):
        raise LaunchError(f"{name}={value} is not a non-negative integer")
    number = int(value)
    if number < minimum:
        raise LaunchError(f"{name}={value} must be >= {minimum}")
    return number


def switch(name: str, value: str) -> bool:
    """A 0/1 variable."""
    if value not in ("0", "1"):
        raise LaunchError(f"{name}={value}: expected 0 or 1")
    return value == "1"


def get(env: Mapping[str, str], name: str, default: str = "") -> str:
    """`${NAME:-default}`: unset and empty both give the default."""
    return env.get(name) or default
