"""`pip install .` (a wheel, not an editable install) gives a working stack.

One test builds the wheel from a copy of the sources, installs it with --no-deps into a
fresh venv that reuses this venv's packages (torch is not downloaded again), and from a
folder outside the checkout runs every console command's --help, resolves the packaged
YAML configs and DeepSpeed JSONs, and preprocesses a small corpus with the installed
`megatron-lev-preprocess`, comparing its tokens with the tokenizer's.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np

from megatron_lev.cli import CONSOLE_SCRIPTS

REPO = Path(__file__).resolve().parent.parent


def _run(cmd, cwd, env):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{cmd}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_wheel_installs_commands_configs_and_preprocesses(tmp_path, spm_tokenizer):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "megatron_lev", src / "megatron_lev", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
          str(src)], tmp_path, env)
    wheel, = (tmp_path / "dist").glob("megatron_lev-*.whl")

    # A venv whose own site-packages comes first, then this venv's (torch, deepspeed, ...) via
    # a .pth line; `--system-site-packages` would reach the base interpreter's, not this venv's.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env).strip())
    (site / "reuse_outer_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)], tmp_path, env)

    work = tmp_path / "work"  # outside the checkout: nothing can come from the source tree
    work.mkdir()
    found = json.loads(_run([str(py), "-c", (
        "import json, megatron_lev; from megatron_lev.configs import config_path; "
        "from megatron_lev.training.ds_config import resolve_deepspeed_config as r; "
        "print(json.dumps({'package': megatron_lev.__file__, 'config': str(config_path('lev-1.2b')), "
        "'zero3': str(r(None, 3)), 'by_path': str(r('deepspeed_configs/zero2.json', None))}))")], work, env))
    for key, path in found.items():
        assert Path(path).resolve().is_relative_to(site.resolve()), (key, path)
    assert Path(found["zero3"]).name == "zero3.json" and Path(found["by_path"]).name == "zero2.json"
    assert json.loads(Path(found["zero3"]).read_text())["zero_optimization"]["stage"] == 3

    for command in CONSOLE_SCRIPTS:
        usage = _run([str(venv / "bin" / command), "--help"], work, env)
        assert usage.startswith("usage:"), (command, usage[:200])

    docs = ["def f(x):\n    return x", "Second document, ünïcode."]
    corpus = work / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    _run([str(venv / "bin" / "megatron-lev-preprocess"), "--input", str(corpus), "--output-prefix",
          str(work / "docs"), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", spm_tokenizer,
          "--append-eod", "--workers", "1"], work, env)
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron_lev.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("SentencePieceTokenizer", spm_tokenizer)
    dataset = IndexedDataset(str(work / "docs_text_document"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [tokenizer.tokenize(d) + [tokenizer.eod] for d in docs]
