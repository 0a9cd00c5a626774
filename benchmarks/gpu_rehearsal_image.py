#!/usr/bin/env python
"""Stand-ins for the GPU image's own packages, for benchmarks/gpu_rehearsal.sh: small wheels
that carry a distribution's name, version and (for torch) a module that refuses to be used,
so that a Python 3.12 virtual environment holding them looks to pip, importlib.metadata and
the wheels' requirement check like the image (docs/performance.md, "The first GPU call").

    python gpu_rehearsal_image.py FOLDER     # writes the stand-in wheels into FOLDER

Versions: those a session read on the image (the device library's KINDS.md, 2026-11: torch
2.11.0+cu130, triton 3.6.0, numpy 2.5.2, transformers 5.17.0, tokenizers 0.23.2, sentencepiece
0.2.2, safetensors 0.8.0); the others are on the image at versions nobody read, so recent
releases stand in for them (ASSUMED). The image's pytest itself is real (the rehearsal installs
pytest 8.4.2 from the package index) with a stand-in plugin that breaks pytest if autoloaded.
"""
from __future__ import annotations

import base64
import hashlib
import os
import re
import sys
import zipfile

READ_ON_THE_IMAGE = {"torch": "2.11.0+cu130", "triton": "3.6.0", "numpy": "2.5.2", "transformers": "5.17.0",
                     "tokenizers": "0.23.2", "sentencepiece": "0.2.2", "safetensors": "0.8.0"}
ASSUMED = {"pyyaml": "6.0.2", "tqdm": "4.67.1", "tensorboard": "2.20.0", "ninja": "1.13.0", "psutil": "7.0.0",
           "msgpack": "1.1.1", "einops": "0.8.1", "py-cpuinfo": "9.0.0", "typing-extensions": "4.15.0",
           "nvidia-ml-py": "13.580.82", "protobuf": "6.32.1"}
IMAGE_PYTEST = "8.4.2"
STANDIN_TORCH = ('raise ImportError("the rehearsal\'s stand-in torch (the GPU image\'s is 2.11.0+cu130): '
                 'what needs torch runs on the GPU, or with a real torch")\n')
AUTOLOADED_PLUGIN = ('raise ImportError("an image pytest plugin was autoloaded: PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 '
                     'keeps it out")\n')


def standin_wheel(folder, name: str, version: str, requires=(), files: dict | None = None,
                  entry_points: str | None = None) -> str:
    """A pure wheel of distribution `name` `version` requiring `requires` and holding `files`
    ({path: text}; default none, metadata only). Returns its path."""
    os.makedirs(folder, exist_ok=True)
    stem = re.sub(r"[-_.]+", "_", name).lower()
    info = f"{stem}-{version}.dist-info"
    files = dict(files or {})
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires))
    files[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: gpu_rehearsal_image\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    if entry_points:
        files[f"{info}/entry_points.txt"] = entry_points
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    path = os.path.join(folder, f"{stem}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as wheel:
        for name_in_wheel, text in files.items():
            wheel.writestr(name_in_wheel, text)
    return path


def image_standins(folder: str) -> list[str]:
    """The stand-in wheels of the image's packages the check's wheels rely on."""
    paths = [standin_wheel(folder, "torch", READ_ON_THE_IMAGE["torch"], files={"torch/__init__.py": STANDIN_TORCH})]
    paths += [standin_wheel(folder, name, version) for name, version in
              {**READ_ON_THE_IMAGE, **ASSUMED}.items() if name != "torch"]
    paths.append(standin_wheel(folder, "pytest-image-plugin", "1.0", [f"pytest=={IMAGE_PYTEST}"],
                               files={"pytest_image_plugin.py": AUTOLOADED_PLUGIN},
                               entry_points="[pytest11]\nimage_plugin = pytest_image_plugin\n"))
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python gpu_rehearsal_image.py FOLDER")
    for p in image_standins(sys.argv[1]):
        print(p)
