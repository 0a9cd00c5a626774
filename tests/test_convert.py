"""Release: training checkpoints -> Hugging Face folders -> training checkpoints, exactly.

Tiny models are trained 3 steps by the trainer (`megatron_lev.train.main`, one launch of 2
gloo ranks): lev at TP=2 and at PP=2 and tied at TP=2 under ZeRO-1, lev at DP=2 under ZeRO-3.
Exports load with plain `transformers`; their logits equal our model's (float32, atol 1e-4)
and greedy `generate()` equals greedy decoding with our model, loaded from the same
checkpoint at TP=1. That TP=1 model is itself checked against the TP=2 model built from
the raw shard files (no merge code involved).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_lev.checkpointing.catalog import COMPLETE_MARKER
from megatron_lev.hf.trust import hf_trust_remote_code
from tests.distributed import run_distributed
from tests.fixtures import assert_release_modes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGITS_ATOL = 1e-4  # HF vs ours, float32
SHARDS_ATOL = 1e-5  # TP=1 from merged weights vs TP=2 from raw shards
BF16_ATOL = 5e-2  # a bf16 export vs the float32 model
PROMPT_TOKENS, NEW_TOKENS = 12, 8


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def prompts(python_corpus, spm_tokenizer) -> torch.Tensor:
    """[2, PROMPT_TOKENS] ids of real text."""
    from megatron_lev.data.corpus import read_documents
    from megatron_lev.data.tokenizer import build_tokenizer

    tok = build_tokenizer("SentencePieceTokenizer", spm_tokenizer)
    docs = read_documents(python_corpus)
    rows = [tok.tokenize(next(docs).texts[0])[:PROMPT_TOKENS] for _ in range(2)]
    return torch.tensor(rows)


def _greedy(model, prompt: torch.Tensor, vocab_size: int) -> torch.Tensor:
    from megatron_lev.models.decoder import gather_logits

    seq = prompt
    for _ in range(NEW_TOKENS):
        nxt = gather_logits(model(seq), vocab_size)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def _train_then_reference(rank, world_size, runs: dict, raw_tp2: list, prompt: torch.Tensor):
    """Rank body: train every run (`megatron_lev.train.main`, the entry point of python -m
    megatron_lev.train), then compute the reference outputs:
      tp2  TP=2 models built from the raw DeepSpeed shard files of the `raw_tp2` runs (logits);
      tp1  each run's checkpoint merged by convert.py into a TP=1 model (logits, greedy tokens).
    """
    from megatron.core import parallel_state

    from megatron_lev.checkpointing.convert import find_checkpoint, load_checkpoint_full
    from megatron_lev.checkpointing.layout import load_full_state_dict
    from megatron_lev.distributed.launch import init_distributed
    from megatron_lev.distributed.state import initialize_model_parallel
    from megatron_lev.models.decoder import LeviathanModel, gather_logits
    from megatron_lev.train import main

    codes = [main(argv) for argv in runs.values()]
    if any(codes):
        return {"codes": dict(zip(runs, codes))}
    init_distributed(backend="gloo")  # main() tears the process group down at its end
    out = {"codes": dict(zip(runs, codes)), "tp2": {}, "tp1": {}}
    saves = {name: argv[argv.index("--save") + 1] for name, argv in runs.items()}
    initialize_model_parallel(2, 1)
    for name in raw_tp2:
        info = find_checkpoint(saves[name])
        cfg = info.model_config(tensor_model_parallel_size=2)
        model = LeviathanModel(cfg).eval()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        shard = torch.load(os.path.join(info.path, f"mp_rank_{tp_rank:02d}_model_states.pt"), weights_only=False)
        model.load_state_dict(shard["module"], strict=True)
        with torch.no_grad():
            out["tp2"][name] = gather_logits(model(prompt), cfg.vocab_size)
    initialize_model_parallel(1, 1)
    for name, path in saves.items():
        full, info = load_checkpoint_full(path)
        cfg = info.model_config()
        model = LeviathanModel(cfg).eval()
        load_full_state_dict(model, full, cfg, tp_rank=0)
        with torch.no_grad():
            out["tp1"][name] = (gather_logits(model(prompt), cfg.vocab_size), _greedy(model, prompt, cfg.vocab_size))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_dataset, spm_tokenizer, prompts) -> dict:
    """3-step runs on 2 ranks (one launch) and the reference outputs of their checkpoints.
    Returns {"checkpoints": name -> --save directory, "tp1": ..., "tp2": ...}."""
    root = tmp_path_factory.mktemp("convert_runs")
    common = ["--data-path", tiny_dataset, "--split", "98,2,0", "--tokenizer-type", "SentencePieceTokenizer",
              "--tokenizer-model", spm_tokenizer, "--train-iters", "3", "--eval-interval", "1000",
              "--eval-iters", "1", "--log-interval", "1"]
    runs = {
        "lev_tp2": ["--config", "tiny-lev", "--tensor-model-parallel-size", "2", "--zero-stage", "1"],
        "lev_pp2": ["--config", "tiny-lev", "--pipeline-model-parallel-size", "2", "--zero-stage", "1"],
        "tied_tp2": ["--config", "tiny-tied", "--tensor-model-parallel-size", "2", "--zero-stage", "1"],
        "lev_dp2_z3": ["--config", "tiny-lev", "--zero-stage", "3"],  # weights only in ZeRO-3 partitions
    }
    runs = {name: [*flags, *common, "--save", str(root / name)] for name, flags in runs.items()}
    out = run_distributed(_train_then_reference, world_size=2, args=(runs, ["lev_tp2", "tied_tp2"], prompts),
                          timeout=900)[0]
    assert not any(out["codes"].values()), out["codes"]
    out["checkpoints"] = {name: str(root / name) for name in runs}
    return out


@pytest.fixture(scope="module")
def checkpoints(trained) -> dict[str, str]:
    return trained["checkpoints"]


@pytest.fixture(scope="module")
def reference(trained) -> dict:
    return trained


@pytest.fixture(scope="module")
def exports(checkpoints, tmp_path_factory) -> dict[str, str]:
    """name -> Hugging Face folder written by tools/convert_to_hf.py's main."""
    from megatron_lev.hf.cli import convert_to_hf_main

    root = tmp_path_factory.mktemp("hf")
    jobs = {"lev_tp2": ("lev_tp2", "--dtype", "fp32", "--max-shard-size", "200KB"),
            "lev_pp2": ("lev_pp2",), "tied_tp2": ("tied_tp2",),
            "lev_tp2_materialized": ("lev_tp2", "--materialize-embeddings"),
            "lev_tp2_bf16": ("lev_tp2", "--dtype", "bf16")}
    out = {}
    for name, (ckpt, *flags) in jobs.items():
        out[name] = str(root / name)
        assert convert_to_hf_main(["--load", checkpoints[ckpt], "--output", out[name], *flags]) == 0
    return out


def _hf_outputs(folder: str, prompt: torch.Tensor, load_dtype=torch.float32, **load_kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=load_dtype, **load_kwargs).eval()
    with torch.no_grad():
        logits = model(prompt).logits
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                                do_sample=False, eos_token_id=None)
    return model, logits, tokens


# --------------------------------------------------------------------------- exports load and agree


def test_merged_tp1_model_equals_tp2_shards(reference):
    for name, tp2_logits in reference["tp2"].items():
        torch.testing.assert_close(reference["tp1"][name][0], tp2_logits, rtol=0, atol=SHARDS_ATOL, msg=name)
    # PP=2 and TP=2 runs of tiny-lev start from the same weights (seeded) and see the same data,
    # so after 3 steps they are the same model up to reduction order.
    # The lev runs start from the same weights (one seed, whatever the layout) and see the same
    # global batches, so after 3 steps they are one model up to summation order (measured: 3e-7).
    # This checks the PP and ZeRO-3 merges against the TP=2 shards, independently of convert.py.
    for name in ("lev_pp2", "lev_dp2_z3"):
        torch.testing.assert_close(reference["tp1"][name][0], reference["tp1"]["lev_tp2"][0], rtol=0,
                                   atol=SHARDS_ATOL, msg=name)


@pytest.mark.parametrize("name", ["lev_tp2", "lev_pp2"])
def test_lev_export_loads_with_remote_code(name, exports, reference, prompts):
    folder = exports[name]
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["model_type"] == "leviathan" and config["auto_map"]["AutoModelForCausalLM"] == "modeling_lev.LevForCausalLM"
    assert config["vocab_size"] == 1000 and not config["tie_word_embeddings"]
    for exported, source in (("lev.py", "generator.py"), ("lev_config.py", "lev_config.py")):
        with open(os.path.join(REPO, "megatron_lev", "lev", source), encoding="utf-8") as f:
            assert open(os.path.join(folder, exported), encoding="utf-8").read() == f.read()  # verbatim copy
    sharded = name == "lev_tp2"  # exported with --max-shard-size 200KB
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json")) == sharded
    files = glob.glob(os.path.join(folder, "*.safetensors"))
    assert (len(files) > 1) if sharded else files == [os.path.join(folder, "model.safetensors")]
    trust = hf_trust_remote_code(folder)  # its code is byte-identical to ours: no flag needed
    assert trust is True
    model, logits, tokens = _hf_outputs(folder, prompts, trust_remote_code=trust)
    assert type(model).__name__ == "LevForCausalLM"
    assert model.lm_head.weight.shape == (1000, 64)  # padding trimmed
    ours_logits, ours_tokens = reference["tp1"][name]
    torch.testing.assert_close(logits, ours_logits, rtol=0, atol=LOGITS_ATOL)
    assert torch.equal(tokens, ours_tokens), f"{tokens}\n{ours_tokens}"


def test_lev_export_in_bf16(exports, reference, prompts):
    """--dtype bf16: bf16 files, loaded as bf16 by default (the generator too, computing in
    float32 inside), close to the float32 model."""
    from safetensors.torch import load_file

    folder = exports["lev_tp2_bf16"]
    assert {t.dtype for t in load_file(os.path.join(folder, "model.safetensors")).values()} == {torch.bfloat16}
    model, logits, _ = _hf_outputs(folder, prompts, trust_remote_code=True, load_dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # bf16 rounding of weights and activations (measured: 5e-3 on logits of magnitude ~1).
    torch.testing.assert_close(logits.float(), reference["tp1"]["lev_tp2"][0], rtol=0, atol=BF16_ATOL)


def test_tied_export_is_standard_llama(exports, reference, prompts):
    from transformers import LlamaForCausalLM

    folder = exports["tied_tp2"]
    assert not glob.glob(os.path.join(folder, "*.py")) and hf_trust_remote_code(folder) is False
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] and "auto_map" not in config
    model, logits, tokens = _hf_outputs(folder, prompts)
    assert type(model) is LlamaForCausalLM
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ours_logits, ours_tokens = reference["tp1"]["tied_tp2"]
    torch.testing.assert_close(logits, ours_logits, rtol=0, atol=LOGITS_ATOL)
    assert torch.equal(tokens, ours_tokens)


def test_materialized_lev_is_standard_llama(exports, reference, prompts):
    from transformers import LlamaForCausalLM

    folder = exports["lev_tp2_materialized"]
    assert not glob.glob(os.path.join(folder, "*.py")) and hf_trust_remote_code(folder) is False
    model, logits, tokens = _hf_outputs(folder, prompts)  # no trust_remote_code
    assert type(model) is LlamaForCausalLM and not model.config.tie_word_embeddings
    assert model.model.embed_tokens.weight.shape == (1000, 64)
    ours_logits, ours_tokens = reference["tp1"]["lev_tp2"]
    torch.testing.assert_close(logits, ours_logits, rtol=0, atol=LOGITS_ATOL)
    assert torch.equal(tokens, ours_tokens)


def test_exported_tokenizer_matches_training_tokenizer(exports, python_corpus, spm_tokenizer):
    from transformers import AutoTokenizer

    from megatron_lev.data.corpus import read_documents
    from megatron_lev.data.tokenizer import build_tokenizer

    ours = build_tokenizer("SentencePieceTokenizer", spm_tokenizer)
    for folder in (exports["lev_tp2"], exports["tied_tp2"]):
        assert os.path.isfile(os.path.join(folder, "tokenizer.model"))
        hf = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # v5 reads config.json too
        assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (ours.bos, ours.eod, ours.pad) == (1, 2, 3)
        config = json.load(open(os.path.join(folder, "generation_config.json")))
        assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 3)
        texts = [record.texts[0] for _, record in zip(range(60), read_documents(python_corpus))]
        texts += ["  two leading spaces\n\tand a tab", "ünïcödé 漢字 🎉", "x = 12345  # digits"]
        for text in texts:
            ids = ours.tokenize(text)
            assert hf(text)["input_ids"] == ids, text[:80]  # no BOS/EOS added, same pieces
            assert hf.decode(ids) == text


@pytest.fixture(scope="session")
def transformers4_python(tmp_path_factory) -> str:
    """A venv with transformers 4.x (from the package registry) that reuses this venv's torch,
    safetensors and numpy (a .pth line: `--system-site-packages` would reach the base
    interpreter's packages, not this venv's). Built once per test session."""
    venv = tmp_path_factory.mktemp("transformers4") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    import sysconfig

    with open(os.path.join(site, "reuse_outer_venv.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    # transformers 4.x pins huggingface-hub < 1 and tokenizers < 0.23 (this venv has newer ones).
    subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "transformers>=4.45,<5",
                    "huggingface-hub>=0.34,<1", "tokenizers>=0.22,<0.23"], check=True, timeout=900)
    return py


TRANSFORMERS4_SCRIPT = """
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
assert transformers.__version__.startswith("4."), transformers.__version__
prompt, texts, out = torch.load(sys.argv[1]), json.loads(sys.argv[2]), {"version": transformers.__version__}
for folder in sys.argv[3:]:
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = model(prompt).logits
    out[folder] = {"class": type(model).__name__, "tokenizer": type(tokenizer).__name__,
                   "ids": [tokenizer(t)["input_ids"] for t in texts], "logits": logits.tolist()}
print(json.dumps(out))
"""


def test_exports_load_in_transformers_4(exports, reference, prompts, transformers4_python, spm_tokenizer, tmp_path):
    """The tied export and the materialized LEV export load in transformers 4.x (no remote
    code) with the same logits as our model and the training tokenizer's ids."""
    from megatron_lev.data.tokenizer import build_tokenizer

    torch.save(prompts, tmp_path / "prompt.pt")
    texts = ["def f(x):\n    return x  # ünïcode", "  two spaces\tand a tab"]
    folders = {exports["tied_tp2"]: "tied_tp2", exports["lev_tp2_materialized"]: "lev_tp2"}
    proc = subprocess.run([transformers4_python, "-c", TRANSFORMERS4_SCRIPT, str(tmp_path / "prompt.pt"),
                           json.dumps(texts), *folders], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = build_tokenizer("SentencePieceTokenizer", spm_tokenizer)
    for folder, run in folders.items():
        got = out[folder]
        assert (got["class"], got["tokenizer"]) == ("LlamaForCausalLM", "PreTrainedTokenizerFast")
        assert got["ids"] == [ours.tokenize(t) for t in texts]
        torch.testing.assert_close(torch.tensor(got["logits"]), reference["tp1"][run][0], rtol=0, atol=LOGITS_ATOL)


def test_export_metadata_and_model_card(exports, checkpoints):
    """config.json has torch_dtype beside dtype; tokenizer_config.json a class both transformers
    4.x and 5.x know; README.md the model card with the run's numbers."""
    import yaml

    from megatron_lev.checkpointing.convert import find_checkpoint

    info = find_checkpoint(checkpoints["lev_tp2"])
    for name, dtype in (("lev_tp2", "float32"), ("lev_tp2_bf16", "bfloat16"), ("tied_tp2", "float32")):
        config = json.load(open(os.path.join(exports[name], "config.json")))
        assert config["dtype"] == config["torch_dtype"] == dtype
        assert json.load(open(os.path.join(exports[name], "tokenizer_config.json")))["tokenizer_class"] == \
            "PreTrainedTokenizerFast"
    card = open(os.path.join(exports["lev_tp2"], "README.md"), encoding="utf-8").read()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    tokens = 3 * info.config["training"]["global_batch_size"] * info.config["training"]["seq_length"]
    from safetensors.torch import load_file

    parameters = sum(t.numel() for f in glob.glob(os.path.join(exports["lev_tp2"], "*.safetensors"))
                     for t in load_file(f).values())
    assert f"| training tokens | {tokens:,} |" in card and f"| parameters | {parameters:,} |" in card
    assert "trust_remote_code=True" in card and "--materialize-embeddings" in card
    with open(os.path.join(checkpoints["lev_tp2"], "metrics.jsonl")) as f:
        valid = [json.loads(line)["valid_loss"] for line in f if "valid_loss" in line][-1]
    metrics = meta["model-index"][0]["results"][0]["metrics"]
    assert metrics[0] == {"type": "loss", "name": "validation loss", "value": round(valid, 4)}
    plain = open(os.path.join(exports["lev_tp2_materialized"], "README.md"), encoding="utf-8").read()
    assert "trust_remote_code" not in plain and "LlamaForCausalLM" in plain


# --------------------------------------------------------------------------- round trip


def _assert_same_export(first_dir: str, second_dir: str) -> dict:
    """Two HF folders hold identical tensors and configs; returns the first's tensors."""
    from megatron_lev.hf.export import read_safetensors

    first, second = read_safetensors(first_dir), read_safetensors(second_dir)
    assert sorted(first) == sorted(second)
    for key in first:
        assert first[key].dtype == second[key].dtype and torch.equal(first[key], second[key]), key
    with open(os.path.join(first_dir, "config.json")) as a, open(os.path.join(second_dir, "config.json")) as b:
        assert json.load(a) == json.load(b)
    return first


def test_export_import_at_other_tp_export_is_identical(checkpoints, exports, tmp_path, tiny_dataset):
    """lev TP=2 checkpoint -> HF -> checkpoint at TP=1 -> HF: identical tensors. Then the trainer
    resumes from the imported checkpoint (lr 0, so the weights must come back unchanged)."""
    from safetensors.torch import load_file

    from megatron_lev.checkpointing.convert import find_checkpoint
    from megatron_lev.hf.cli import convert_from_hf_main, convert_to_hf_main

    imported = str(tmp_path / "imported_tp1")
    assert convert_from_hf_main(["--load", exports["lev_tp2"], "--save", imported,
                                 "--tensor-model-parallel-size", "1"]) == 0
    info = find_checkpoint(imported)
    assert (info.iteration, info.tensor_model_parallel_size, info.layout) == (0, 1, "plain")
    again = str(tmp_path / "hf_again")
    assert convert_to_hf_main(["--load", imported, "--output", again]) == 0
    first = _assert_same_export(exports["lev_tp2"], again)

    # The trainer loads it: one step at lr 0 (weights unchanged), saved, exported -> same tensors.
    tokenizer = os.path.join(exports["lev_tp2"], "tokenizer.model")
    cmd = [sys.executable, "-m", "megatron_lev.train", "--config", os.path.join(imported, "model.yaml"),
           "--load", imported, "--no-load-optim", "--save", imported, "--data-path", tiny_dataset, "--split", "98,2,0",
           "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tokenizer, "--micro-batch-size", "2",
           "--train-iters", "1", "--lr", "0", "--min-lr", "0", "--eval-interval", "1000", "--eval-iters", "1"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    assert find_checkpoint(imported).iteration == 1
    trained = str(tmp_path / "hf_trained")
    assert convert_to_hf_main(["--load", imported, "--output", trained]) == 0
    third = load_file(os.path.join(trained, "model.safetensors"))
    for key in first:
        assert torch.equal(first[key], third[key]), key


def test_tied_import_into_pipeline_round_trips(exports, tmp_path):
    """tied TP=2 -> HF -> checkpoint at PP=2 (pipeline layer files, tied module) -> HF: identical.
    The import, written under umask 077, is readable by group and others."""
    from megatron_lev.checkpointing.convert import find_checkpoint
    from megatron_lev.hf.cli import convert_from_hf_main, convert_to_hf_main

    imported = str(tmp_path / "imported_pp2")
    old_umask = os.umask(0o077)
    try:
        assert convert_from_hf_main(["--load", exports["tied_tp2"], "--save", imported,
                                     "--pipeline-model-parallel-size", "2"]) == 0
    finally:
        os.umask(old_umask)
    assert_release_modes(imported)
    info = find_checkpoint(imported)
    assert (info.pipeline_model_parallel_size, info.layout) == (2, "pipeline")
    again = str(tmp_path / "hf_again")
    assert convert_to_hf_main(["--load", imported, "--output", again]) == 0
    _assert_same_export(exports["tied_tp2"], again)


# --------------------------------------------------------------------------- errors


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst, symlinks=True)
    return str(dst)


def _tag_dir(ckpt: str) -> str:
    from megatron_lev.checkpointing.convert import find_checkpoint

    return find_checkpoint(ckpt).path


def _error(capsys, argv, main=None) -> str:
    from megatron_lev.hf.cli import convert_to_hf_main

    assert (main or convert_to_hf_main)(argv) == 2
    # Progress bars (tqdm, on stderr) are not messages: drop their redraws before counting lines.
    lines = [line for line in re.split(r"[\r\n]+", capsys.readouterr().err) if line.strip()
             and not re.search(r"\d+%\|", line)]
    assert len(lines) == 1, lines  # one line
    return lines[0]


def test_missing_shard_is_named(checkpoints, tmp_path, capsys):
    plain = _copy(checkpoints["tied_tp2"], tmp_path / "plain")
    os.remove(os.path.join(_tag_dir(plain), "mp_rank_01_model_states.pt"))
    err = _error(capsys, ["--load", plain, "--output", str(tmp_path / "out1")])
    assert "checkpoint iter_0000003 is damaged" in err and "mp_rank_01_model_states.pt: missing" in err
    pipe = _copy(checkpoints["lev_pp2"], tmp_path / "pipe")
    os.remove(os.path.join(_tag_dir(pipe), "layer_02-model_00-model_states.pt"))
    err = _error(capsys, ["--load", pipe, "--output", str(tmp_path / "out2")])
    assert "layer_02-model_00-model_states.pt: missing" in err
    assert not os.path.exists(tmp_path / "out1") and not glob.glob(str(tmp_path / ".out*"))


def test_unknown_layout(checkpoints, tmp_path, capsys):
    from megatron_lev.hf.cli import convert_from_hf_main

    ckpt = _copy(checkpoints["tied_tp2"], tmp_path / "ckpt")
    tag_dir = _tag_dir(ckpt)
    for path in glob.glob(os.path.join(tag_dir, "*model_states.pt")):
        os.rename(path, path + ".bak")
    # A marker without a file list (as older runs wrote) lets the layout check, not the damage check, speak.
    marker = os.path.join(tag_dir, COMPLETE_MARKER)
    with open(marker, encoding="utf-8") as f:
        info = json.load(f)
    info.pop("files")
    with open(marker, "w", encoding="utf-8") as f:
        json.dump(info, f)
    err = _error(capsys, ["--load", ckpt, "--output", str(tmp_path / "out")])
    assert "unknown checkpoint layout" in err and "mp_rank_*_model_states.pt" in err
    not_ours = tmp_path / "gpt2"
    not_ours.mkdir()
    (not_ours / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    err = _error(capsys, ["--load", str(not_ours), "--save", str(tmp_path / "ck")], main=convert_from_hf_main)
    assert "unknown layout: model_type 'gpt2'" in err


def test_tokenizer_size_disagreeing_with_model(checkpoints, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(1200)} | {"</s>": 1200}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = str(tmp_path / "big.json")
    tok.save(path)
    err = _error(capsys, ["--load", checkpoints["lev_tp2"], "--output", str(tmp_path / "out"),
                          "--tokenizer-model", path])
    assert "has 1201 tokens but the model's vocab_size is 1000" in err and path in err


def test_replicated_parameter_mismatch(checkpoints, tmp_path, capsys):
    ckpt = _copy(checkpoints["tied_tp2"], tmp_path / "ckpt")
    shard_path = os.path.join(_tag_dir(ckpt), "mp_rank_01_model_states.pt")
    shard = torch.load(shard_path, weights_only=False)
    shard["module"]["final_norm.weight"] += 1e-3
    torch.save(shard, shard_path)
    err = _error(capsys, ["--load", ckpt, "--output", str(tmp_path / "out")])
    assert "replicated parameter final_norm.weight differs between tensor-parallel ranks 0 and 1" in err
