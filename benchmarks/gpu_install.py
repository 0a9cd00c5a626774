#!/usr/bin/env python
"""Which wheels of the folder benchmarks/gpu_wheels.sh builds go into the GPU machine's check
environment (benchmarks/gpu_check_env.sh runs this with the machine's own Python):

    python gpu_install.py WHEELS RECORD.json      # prints the wheel files to install, one a line
    python gpu_install.py --kept RECORD.json      # the machine's packages it kept, one line

The machine's own packages win: a wheel is left out when the machine already has that
distribution at a version every requirement of the wheels still to install accepts (its pytest
with its plugins, say, instead of the folder's pytest). This project's own wheel is always
installed. RECORD.json says what was installed and what was kept, with both versions.

No torch and no third-party import: `packaging` comes from the machine or, failing that, from
the folder's own pure-Python wheel (tests/test_gpu_check_rules.py runs `install_plan` on CPU).
"""
from __future__ import annotations

import argparse
import email.parser
import glob
import json
import os
import re
import sys
import zipfile

ALWAYS_INSTALLED = {"megatron-lev"}  # the code under test, whatever the machine holds


def normalize(name: str) -> str:
    """PEP 503's normal form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_metadata(path: str) -> dict:
    """{"name", "version", "requires", "file"} from a wheel's METADATA."""
    with zipfile.ZipFile(path) as wheel:
        (meta,) = [n for n in wheel.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        message = email.parser.Parser().parsestr(wheel.read(meta).decode("utf-8"))
    return {"name": normalize(message["Name"]), "version": message["Version"],
            "requires": message.get_all("Requires-Dist") or [], "file": os.path.basename(path)}


def install_plan(wheels: list[dict], machine: dict[str, str]) -> dict:
    """{"install": [wheel, ...], "kept": [{"name", "machine_version", "wheel_version"}, ...]}.

    `machine`: normalized name -> version of what the machine's Python already has. A wheel is
    kept out when the machine has its distribution at a version that satisfies every requirement
    (markers evaluated, extras off) of the wheels being installed; keeping one drops its own
    requirements, so this repeats until nothing changes.
    """
    from packaging.requirements import Requirement

    install = {w["name"]: w for w in wheels}
    while True:
        wanted: dict[str, list] = {}
        for wheel in install.values():
            for text in wheel["requires"]:
                req = Requirement(text)
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    wanted.setdefault(normalize(req.name), []).append(req.specifier)
        keep = [name for name in install if name not in ALWAYS_INSTALLED and name in machine
                and all(spec.contains(machine[name], prereleases=True) for spec in wanted.get(name, []))]
        if not keep:
            break
        for name in keep:
            del install[name]
    kept = [{"name": w["name"], "machine_version": machine[w["name"]], "wheel_version": w["version"]}
            for w in wheels if w["name"] not in install]
    return {"install": sorted(install.values(), key=lambda w: w["file"]), "kept": kept}


def machine_distributions() -> dict[str, str]:
    from importlib.metadata import distributions

    found = {}
    for dist in distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalize(name), dist.version)  # the first on sys.path wins, as import does
    return found


def kept_line(record: str) -> str:
    """'pytest 8.3.5, ...' (the machine's versions kept), or 'none'."""
    with open(record, encoding="utf-8") as f:
        kept = json.load(f)["kept"]
    return ", ".join(f"{k['name']} {k['machine_version']}" for k in kept) or "none"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="The wheels of a gpu_wheels.sh folder the machine's Python lacks.")
    p.add_argument("wheels", nargs="?", help="the folder benchmarks/gpu_wheels.sh built")
    p.add_argument("record", nargs="?", help="where to write what is installed and what is kept (JSON)")
    p.add_argument("--kept", metavar="RECORD", help="print the machine's packages RECORD kept, on one line")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kept:
        print(kept_line(args.kept))
        return 0
    if not (args.wheels and args.record):
        build_parser().error("WHEELS and RECORD are needed (or --kept RECORD)")
    folder, record = args.wheels, args.record
    paths = sorted(glob.glob(os.path.join(folder, "*.whl")))
    try:
        import packaging.requirements  # noqa: F401
    except ImportError:  # a machine without packaging: the folder's own pure-Python wheel
        sys.path.extend(p for p in paths if os.path.basename(p).startswith("packaging-"))
    plan = install_plan([wheel_metadata(p) for p in paths], machine_distributions())
    with open(record, "w", encoding="utf-8") as f:
        json.dump({"installed": [{"name": w["name"], "version": w["version"]} for w in plan["install"]],
                   "kept": plan["kept"]}, f, indent=1)
    for wheel in plan["install"]:
        print(os.path.join(folder, wheel["file"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
