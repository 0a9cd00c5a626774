"""Model/training configs shipped inside the package, found by name or by path.

`load_config("lev-1.2b")` reads `megatron_lev/configs/lev-1.2b.yaml`; any path to a
YAML file works too. A config file has a `model:` section and optionally a
`training:` section (defaults that command-line flags override).

A config may start from another: `base: lev-400m` (a packaged name, or a path relative to
the file) loads that config first and merges this file over it, mappings key by key
(`model: {embedding: tied}` changes only that field).
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

CONFIG_DIR = Path(__file__).resolve().parent


def available_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def config_path(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    packaged = CONFIG_DIR / f"{name_or_path}.yaml"
    if packaged.is_file():
        return packaged
    raise FileNotFoundError(
        f"--config {name_or_path}: no such file, and not a packaged config "
        f"(available: {', '.join(available_configs())})")


def load_config(name_or_path: str | Path) -> dict:
    path = config_path(name_or_path)
    data = _load_with_bases(path.resolve(), ())
    if "model" not in data:
        raise ValueError(f"{path}: a config must be a mapping with a 'model:' section")
    return data


def _load_with_bases(path: Path, chain: tuple) -> dict:
    if path in chain:
        raise ValueError(f"{path}: 'base:' cycle ({' -> '.join(str(p) for p in (*chain, path))})")
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config must be a mapping with a 'model:' section")
    _resolve_file_fields(path, data)
    base = data.pop("base", None)
    if base is None:
        return data
    return _merge(_load_with_bases(_base_path(path, base), (*chain, path)), data)


# Model fields naming a file: a relative path in a YAML file is relative to that file's folder (as
# `base:` is), so a config finds its file from any working folder.
FILE_FIELDS = ("lev_init_from",)


def _resolve_file_fields(path: Path, data: dict) -> None:
    model = data.get("model")
    if not isinstance(model, dict):
        return
    for name in FILE_FIELDS:
        value = model.get(name)
        if isinstance(value, str) and value and not os.path.isabs(value):
            model[name] = str((path.parent / value).resolve())


def _base_path(path: Path, base) -> Path:
    relative = path.parent / str(base)
    try:
        base_path = relative if relative.suffix in (".yaml", ".yml") and relative.is_file() else config_path(base)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{path}: base: {exc}") from None
    return base_path.resolve()


def model_field_source(name_or_path: str | Path, field: str) -> str | None:
    """The user's file that sets the loaded config's `model.<field>` (the last word along the
    `base:` chain), or None when a packaged config sets it, or nothing does, or it is null.
    Tells a packaged default (e.g. vocab_size, which the tokenizer replaces) from a choice."""
    path = config_path(name_or_path).resolve()
    while True:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        model = data.get("model") or {}
        if isinstance(model, dict) and field in model:
            return None if model[field] is None or path.parent == CONFIG_DIR else str(path)
        if data.get("base") is None:
            return None
        path = _base_path(path, data["base"])


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
