"""tools/megatron_lm/pretrain_lev_gpt.py against Megatron-LM's own pretrain_gpt.py (recorded from
core_v0.16.1 by tools/megatron_lm/record.py): the main block is pretrain_gpt.py's but for the model
builder, so in-process restart and the ModelOpt argument hooks are kept; its names are
pretrain_gpt.py's objects; `--help` inside a checkout lists the --lev-* flags; megatron_lev's
model_provider refuses ModelOpt's builder, which would replace LEV's, and is Megatron-LM's otherwise."""
import ast
import dataclasses
import os
import sys
import types

import pytest

from tests.megatron_lm_record import RERECORD, recorded_source

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tools", "megatron_lm", "pretrain_lev_gpt.py")


def _main_block(tree: ast.Module) -> ast.If:
    blocks = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"]
    assert len(blocks) == 1
    return blocks[0]


def _imported_names(tree: ast.Module) -> dict[str, str]:
    """name -> module it is imported from (`from m import name`), at module level and in try blocks."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                names[alias.asname or alias.name] = node.module
    return names


class _Rename(ast.NodeTransformer):
    def visit_Name(self, node):
        return ast.copy_location(ast.Name("lev_gpt_builder" if node.id == "gpt_builder" else node.id, node.ctx), node)


def test_main_block_is_pretrain_gpts_but_the_builder():
    ours = ast.parse(open(SCRIPT, encoding="utf-8").read())
    theirs = ast.parse(recorded_source("pretrain_gpt.py"))
    expected = _Rename().visit(_main_block(theirs))
    assert ast.dump(_main_block(ours)) == ast.dump(expected), (
        f"pretrain_lev_gpt.py's main block is not pretrain_gpt.py's with lev_gpt_builder ({RERECORD})")
    # Every name the block uses is bound as in pretrain_gpt.py: imported from it, or from the module it
    # imports it from; model_provider and the builder are megatron_lev's.
    used = {node.id for node in ast.walk(_main_block(ours)) if isinstance(node, ast.Name)}
    ours_from, theirs_from = _imported_names(ours), _imported_names(theirs)
    assert ours_from["model_provider"] == ours_from["lev_gpt_builder"] == "megatron_lev.megatron_lm.provider"
    for name in sorted(used - {"__name__", "model_provider", "lev_gpt_builder", "_MAIN_ENTRY_TIME", "store"}):
        if name == "_PROGRAM_START_TIME":
            continue  # set at the script's first line, as pretrain_gpt.py does
        assert ours_from.get(name) in ("pretrain_gpt", theirs_from.get(name)), (name, ours_from.get(name))
    assert {"inprocess_restart", "add_modelopt_args", "has_nvidia_modelopt"} <= used


def test_help_inside_a_checkout_lists_the_lev_flags():
    """Recorded from `python pretrain_lev_gpt.py --help` in a Megatron-LM checkout: the in-process
    restart wrapper parses (and prints --help) before pretrain() adds extra flags, so only the
    registration makes them appear. One flag per LEVConfig field but vocab_size and hidden_size."""
    from megatron_lev.lev.generator import LEVConfig

    text = recorded_source("pretrain_lev_gpt_help.txt")
    assert text.startswith("usage: pretrain_lev_gpt.py [-h]") and "exit 0" in text
    fields = [f.name for f in dataclasses.fields(LEVConfig) if f.name not in ("vocab_size", "hidden_size")]
    missing = [f for f in fields if f"  --lev-{f.replace('_', '-')}" not in text]
    assert not missing, f"{missing} not in the recorded --help ({RERECORD})"


def test_lev_flags_register_once():
    """Registered with Megatron-LM's parser and given again as an extra_args_provider: one set of flags."""
    import argparse

    from megatron_lev.megatron_lm.arguments import add_lev_args

    parser = add_lev_args(add_lev_args(argparse.ArgumentParser()))
    assert parser.parse_args(["--lev-num-heads", "2"]).lev_num_heads == 2


@pytest.fixture
def megatron_lm_modules(monkeypatch):
    """Stand-ins for the two Megatron-LM modules model_provider reaches: megatron.training's get_args
    and the checkout's model_provider module (recording the builder it is called with)."""
    calls, args = [], types.SimpleNamespace(modelopt_enabled=False)
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args
    checkout = types.ModuleType("model_provider")
    checkout.model_provider = lambda builder, *a, **k: calls.append((builder, a, k)) or "model"
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "model_provider", checkout)
    return args, calls


def test_model_provider_refuses_modelopts_builder(megatron_lm_modules):
    from megatron_lev.megatron_lm.provider import lev_gpt_builder, model_provider

    args, calls = megatron_lm_modules
    assert model_provider(lev_gpt_builder, True, False, vp_stage=None) == "model"
    assert calls == [(lev_gpt_builder, (True, False, None), {"config": None, "pg_collection": None})]
    args.modelopt_enabled = True
    with pytest.raises(ValueError, match=r"^ModelOpt \(a ModelOpt checkpoint in --load, or --export-kd-teacher-load\): "
                                         r"its model builder would replace the LEV builder"):
        model_provider(lev_gpt_builder)
    assert len(calls) == 1


def test_docs_name_every_lev_flag_and_the_readme_every_command():
    """docs/megatron-lm.md lists every --lev-* flag (LEVConfig's fields: a new field needs its line), and
    the README's list of commands names every console script setup.py installs."""
    import argparse
    import re

    from megatron_lev.megatron_lm.arguments import add_lev_args

    parser = add_lev_args(argparse.ArgumentParser())
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--lev-")]
    docs = open(os.path.join(REPO, "docs", "megatron-lm.md"), encoding="utf-8").read()
    assert [f for f in flags if f"`{f}`" not in docs] == []
    scripts = re.findall(r'"(megatron-lev-[\w-]+)=', open(os.path.join(REPO, "setup.py"), encoding="utf-8").read())
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    commands = readme[readme.index("`pip install .` installs"):].split("\n\n")[0]
    assert len(scripts) >= 6 and [s for s in scripts if f"`{s}`" not in commands] == []
