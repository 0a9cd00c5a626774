"""The megatron-core and DeepSpeed versions the test suite has run on, and a one-line warning at
start for any other.

setup.py accepts a range (megatron-core 0.16.1 to 0.19, DeepSpeed 0.19.3 to 0.19.x) rather than
these versions alone: a cluster's image or a Python 3.12 environment may come with a newer
megatron-core (0.17 onwards needs Python 3.12), and an environment that must keep its own
copy should still install and run, told once what was not tested, rather than be refused by pip.
Where the suite runs (.ci/run on CPU; benchmarks/gpu_check.sh on the GPU machines):
megatron-core 0.16.1 and DeepSpeed 0.19.8 (docs/cluster.md, "1. The environment (login node, once)").
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Optional

TESTED = {"megatron-core": ("0.16.1",), "deepspeed": ("0.19.8",)}


def installed_versions() -> dict[str, Optional[str]]:
    """The installed version of each package of TESTED (None: not installed)."""
    found = {}
    for name in TESTED:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def untested_versions_warning(installed: Optional[dict] = None) -> Optional[str]:
    """One line naming every installed version of TESTED's packages the suite has not run on,
    or None when all are tested ones. `installed`: name -> version (default: the installed)."""
    installed = installed_versions() if installed is None else installed
    untested = [f"{name} {v} (tested: {', '.join(TESTED[name])})" for name, v in installed.items()
                if v is not None and v not in TESTED[name]]
    if not untested:
        return None
    return (f"megatron_lev: warning: untested {' and '.join(untested)}; the test suite ran on these tested "
            f"versions only (docs/cluster.md, \"1. The environment (login node, once)\")")
