"""Model/training configs shipped inside the package, found by name or by path.

`load_config("lev-1.2b")` reads `megatron_lev/configs/lev-1.2b.yaml`; any path to a
YAML file works too. A config file has a `model:` section and optionally a
`training:` section (defaults that command-line flags override).
"""
from __future__ import annotations

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
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict) or "model" not in data:
        raise ValueError(f"{path}: a config must be a mapping with a 'model:' section")
    return data
