"""megatron-lev-convert-from-mcore on what a Megatron-LM user has: a checkpoint trained with
pretrain_gpt.py's default tokenizer, GPT2BPETokenizer, exports with a Hugging Face tokenizer that
encodes exactly as Megatron-LM's `_GPT2BPETokenizer` did (ids recorded from Megatron-LM core_v0.16.1,
tests/data/gpt2_bpe) and the GPTModel's logits, with no flag but --load and --output; the packages
the export needs are checked before any checkpoint file is read; the whole route (builder,
converter) runs in an environment without DeepSpeed, with tools/megatron_lm/requirements.txt."""
import argparse
import ast
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_lev.configs import load_config
from megatron_lev.models.config import model_config_from_dict
from tests.distributed import one_in_process_rank
from tests.mcore_cpu import causal_mask, patch_mcore_for_cpu
from tests.megatron_lm_record import recorded_namespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2 = os.path.join(REPO, "tests", "data", "gpt2_bpe")
VOCAB, PADDED, ITERATION = 3000, 3072, 12  # the recorded GPT-2 BPE files' vocabulary, padded to 128


def _save(gpt, load: str, args: argparse.Namespace) -> None:
    """What Megatron-LM's save_checkpoint writes for the model: torch_dist with the saved args."""
    from megatron.core import dist_checkpointing

    tag = os.path.join(load, f"iter_{ITERATION:07d}")
    os.makedirs(tag)
    dist_checkpointing.save({"model": gpt.sharded_state_dict(), "iteration": ITERATION, "checkpoint_version": 3.0,
                             "args": args}, tag)
    with open(os.path.join(load, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITERATION))


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """A GPTModel+LEV trained (here: initialised) with --tokenizer-type GPT2BPETokenizer, saved as
    Megatron-LM saves it; its logits on a batch."""
    from megatron_lev.models.gpt_lev import build_lev_gpt_model_from_config

    load = str(tmp_path_factory.mktemp("gpt2") / "save")
    args = recorded_namespace(tokenizer_type="GPT2BPETokenizer", vocab_size=None, lev_vocab_size=VOCAB,
                              padded_vocab_size=PADDED, vocab_file=os.path.join(GPT2, "vocab.json"),
                              merge_file=os.path.join(GPT2, "merges.txt"), consumed_train_samples=ITERATION * 8)
    config = model_config_from_dict({**load_config("tiny-lev")["model"], "vocab_size": VOCAB})
    with pytest.MonkeyPatch.context() as monkeypatch, one_in_process_rank():
        patch_mcore_for_cpu(monkeypatch)
        gpt = build_lev_gpt_model_from_config(config).eval()
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            logits = gpt(ids, torch.arange(16).expand(2, 16), causal_mask(16))[..., :VOCAB]
        _save(gpt, load, args)
    return {"load": load, "ids": ids, "logits": logits}


def _convert(*argv: str, capsys) -> tuple[int, str]:
    from megatron_lev.hf.cli import convert_from_mcore_main

    capsys.readouterr()
    code = convert_from_mcore_main(list(argv))
    return code, capsys.readouterr().err.strip()


def test_gpt2_bpe_checkpoint_exports_megatrons_tokenization(gpt2_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = str(tmp_path / "hf")
    code, err = _convert("--load", gpt2_run["load"], "--output", out, capsys=capsys)
    assert code == 0, err
    with open(os.path.join(GPT2, "megatron_ids.json"), encoding="utf-8") as f:
        recorded = json.load(f)
    with open(os.path.join(GPT2, "corpus.jsonl"), encoding="utf-8") as f:
        corpus = [json.loads(line)["text"] for line in f]
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    encoded = [tokenizer.encode(text) for text in corpus]
    mismatches = sum(ids != want for ids, want in zip(encoded, recorded["ids"]))
    with capsys.disabled():
        print(f"GPT-2 BPE export: {len(corpus) - mismatches}/{len(corpus)} texts encode to Megatron-LM's ids "
              f"({recorded['ids_total']} ids)")
    assert mismatches == 0 and len(corpus) == 341
    assert tokenizer.eos_token_id == recorded["eod"] and tokenizer.bos_token_id is None
    assert all(tokenizer.decode(ids) == text for ids, text in zip(encoded, corpus))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(gpt2_run["ids"]).logits
    assert ((logits - gpt2_run["logits"]).abs().max() / gpt2_run["logits"].abs().max()).item() < 1e-5


def test_saved_tokenizer_files_moved(gpt2_run, tmp_path, capsys):
    """The saved --vocab-file is the cluster's path: where it is not here, one line says what to pass."""
    import shutil

    from megatron_lev.checkpointing.mcore import read_saved_args

    load = str(tmp_path / "save")
    shutil.copytree(gpt2_run["load"], load)
    common = os.path.join(load, f"iter_{ITERATION:07d}", "common.pt")
    state = torch.load(common, weights_only=False)
    state["args"].vocab_file, state["args"].merge_file = "/cluster/gpt2-vocab.json", "/cluster/gpt2-merges.txt"
    torch.save(state, common)
    assert read_saved_args(os.path.dirname(common)).vocab_file == "/cluster/gpt2-vocab.json"
    code, err = _convert("--load", load, "--output", str(tmp_path / "a"), capsys=capsys)
    assert code == 2 and err == ("convert_from_mcore: error: the tokenizer the checkpoint was trained with (pass "
                                 "--tokenizer-model, or --vocab-file/--merge-file, where it lies here): --vocab-file "
                                 "/cluster/gpt2-vocab.json: no such file")
    code, err = _convert("--load", load, "--output", str(tmp_path / "b"), "--vocab-file",
                         os.path.join(GPT2, "vocab.json"), "--merge-file", os.path.join(GPT2, "merges.txt"),
                         capsys=capsys)
    assert code == 0, err


def test_converter_checks_its_imports_before_reading(gpt2_run, tmp_path, capsys, monkeypatch):
    from megatron_lev.checkpointing import mcore

    def read(*args, **kwargs):
        raise AssertionError("a checkpoint file was read")

    monkeypatch.setattr(mcore, "read_saved_args", read)
    monkeypatch.setattr(mcore, "find_iteration_dir", read)
    for name in ("transformers", "safetensors"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    code, err = _convert("--load", gpt2_run["load"], "--output", str(tmp_path / "hf"), capsys=capsys)
    assert code == 2 and err == (
        "convert_from_mcore: error: the Hugging Face export needs transformers, safetensors, which do not import "
        "here: pip install 'transformers>=5.0' safetensors protobuf sentencepiece tokenizers (docs/megatron-lm.md, "
        "Installation)")
    assert not os.path.exists(tmp_path / "hf")


_WITHOUT_DEEPSPEED = """
import json, sys
sys.modules["deepspeed"] = None  # not installed: any import of it fails
sys.path.insert(0, {repo!r})
from tests.megatron_lm_record import recorded_namespace
from megatron_lev.megatron_lm.provider import lev_gpt_builder
from megatron_lev.megatron_lm.checkpoint import read_megatron_run
from megatron_lev.hf.cli import convert_from_mcore_main
run = read_megatron_run({load!r})
code = convert_from_mcore_main(["--load", {load!r}, "--output", {out!r}])
print(json.dumps({{"code": code, "vocab": run.config.vocab_size,
                   "modules": sorted(m for m in sys.modules if m.startswith("megatron_lev"))}}))
"""


def _third_party_imports(path: str) -> set[str]:
    """Top-level packages a module imports when it is imported (its module-level statements, but those
    an `except ImportError` guards). Imports inside functions run when called: the subprocess run
    above proves those of the route (DeepSpeed absent)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            skipped |= {id(n) for n in ast.walk(node)}
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError", "Exception")
                for h in node.handlers):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"megatron_lev"}


def test_megatron_lm_route_needs_neither_deepspeed_nor_another_megatron_core(gpt2_run, tmp_path):
    """pip install --no-deps + tools/megatron_lm/requirements.txt: the converter runs with DeepSpeed
    absent, and every package the route's modules import is the environment's (torch, megatron-core)
    or in the requirements, which name neither megatron-core nor DeepSpeed."""
    out = str(tmp_path / "hf")
    script = _WITHOUT_DEEPSPEED.format(repo=REPO, load=gpt2_run["load"], out=out)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["code"] == 0 and result["vocab"] == VOCAB and os.path.isfile(os.path.join(out, "config.json"))
    with open(os.path.join(REPO, "tools", "megatron_lm", "requirements.txt"), encoding="utf-8") as f:
        requirements = {re.split(r"[<>=\[ ]", line.strip())[0].lower() for line in f
                        if line.strip() and not line.startswith("#")}
    assert not requirements & {"megatron-core", "megatron_core", "deepspeed", "torch"}
    modules = {"pyyaml": "yaml", "protobuf": "google"}
    provided = {modules.get(r, r.replace("-", "_")) for r in requirements} | {"torch", "megatron", "model_provider"}
    for module in result["modules"]:
        path = os.path.join(REPO, *module.split(".")) + ".py"
        path = path if os.path.isfile(path) else os.path.join(path[:-3], "__init__.py")
        assert _third_party_imports(path) <= provided, (module, _third_party_imports(path) - provided)
