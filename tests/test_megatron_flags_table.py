"""The table of Megatron-LM arguments that change GPTModel (megatron_lev/megatron_lm/flags.py) against
what tools/megatron_lm/record.py recorded from Megatron-LM core_v0.16.1 itself: it covers every
TransformerConfig field of the namespace and every argument the GPT builder code reads; each
refused value stops the LEV builder in one line naming the flag; each carried setting reaches the
model section (models/settings.py, the one table the own trainer's flags also come from);
docs/megatron-lm.md shows the table."""
import ast
import dataclasses
import os
import re

import pytest

from megatron_lev.megatron_lm.flags import (CARRIED, GPT_BUILDER_ARGS, MEGATRON_ARGS, NO_EFFECT, OPTIONAL_ARGS,
                                            PRECISION, REFUSED, check_megatron_args, megatron_flag_table)
from tests.megatron_lm_record import RERECORD, recorded, recorded_namespace, recorded_source

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Read by the builder code but handled outside the table: ModelOpt's switch (check_megatron_args refuses it).
HANDLED_ELSEWHERE = {"modelopt_enabled"}


def _args_read_by(source: str) -> set[str]:
    """Every `args.<name>`, getattr(args, "<name>") and hasattr(args, "<name>") of a source file."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
            names.add(node.attr)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"
                and isinstance(node.args[1], ast.Constant)):
            names.add(node.args[1].value)
    return names


def test_table_covers_every_argument_that_reaches_the_model():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    record = recorded()
    namespace, parser = record["args"], record["parser"]
    config_fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}  # TransformerConfig's and MLA's
    read = set().union(*(_args_read_by(recorded_source(name)) for name in (
        "gpt_builders.py", "model_provider.py", "core_transformer_config_from_args.py")))
    assert {"qk_layernorm", "swiglu", "rotary_percent", "use_rope_scaling", "spec"} <= read  # the parse found them
    scope = ((config_fields & set(namespace)) | read) - HANDLED_ELSEWHERE
    assert not sorted(scope - set(MEGATRON_ARGS)), f"unclassified Megatron-LM arguments ({RERECORD})"
    assert not sorted(read - config_fields - set(GPT_BUILDER_ARGS) - HANDLED_ELSEWHERE)
    for dest, arg in MEGATRON_ARGS.items():
        assert dest in namespace or dest in OPTIONAL_ARGS, dest
        flags = parser.get(dest, {}).get("flags")
        if dest not in OPTIONAL_ARGS:  # (defined only where NVIDIA Kitchen imports)
            assert arg.flag in flags if flags else "(from " in arg.flag, (dest, arg.flag, flags)
    kinds = {kind: sum(a.kind == kind for a in MEGATRON_ARGS.values()) for kind in (CARRIED, PRECISION, NO_EFFECT,
                                                                                     REFUSED)}
    print(f"Megatron-LM arguments: {kinds} ({len(MEGATRON_ARGS)})")
    assert kinds[REFUSED] >= 30 and kinds[CARRIED] >= 15


def test_the_documented_flags_pass():
    check_megatron_args(recorded_namespace())  # the recorded run: docs/megatron-lm.md's flags


def _refused_value(arg, current):
    if callable(arg.accepted):
        return ["full_iteration"]
    if isinstance(current, bool):
        return not current
    if isinstance(current, str):
        return "other"
    if isinstance(current, float):
        return current + 1.5
    return 2


@pytest.mark.parametrize("dest", sorted(d for d, a in MEGATRON_ARGS.items() if a.kind == REFUSED))
def test_each_refused_value_stops_the_builder_in_one_line(dest):
    from megatron_lev.megatron_lm.provider import lev_gpt_builder

    arg = MEGATRON_ARGS[dest]
    args = recorded_namespace()
    bad = _refused_value(arg, getattr(args, dest, None))
    setattr(args, dest, bad)
    with pytest.raises(ValueError) as error:
        lev_gpt_builder(args)  # refused before anything is built
    message = str(error.value)
    assert "\n" not in message and message.startswith(arg.flag), message
    if arg.required:
        assert message.startswith(f"{arg.flag} is required: "), message


def test_gelu_model_is_refused_at_build_and_at_conversion(tmp_path):
    """Without --swiglu Megatron-LM builds a GeLU MLP: refused at build; a checkpoint trained so (by an
    earlier version) is refused by the converter in one line before any tensor is read."""
    import torch

    from megatron_lev.megatron_lm.checkpoint import read_megatron_run
    from megatron_lev.megatron_lm.provider import lev_gpt_builder
    from megatron_lev.utils.errors import CheckpointError

    args = recorded_namespace(swiglu=False)
    with pytest.raises(ValueError, match=r"^--swiglu is required: the MLP of the Leviathan decoder .* is SwiGLU"):
        lev_gpt_builder(args)
    tag = tmp_path / "iter_0000005"
    tag.mkdir()
    (tag / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (tag / ".metadata").write_bytes(b"")  # never read: the arguments are checked first
    torch.save({"args": args, "iteration": 5}, tag / "common.pt")
    with pytest.raises(CheckpointError, match=rf"^{tag}: trained with --swiglu is required: "):
        read_megatron_run(str(tag))


CARRIED_VALUES = {  # Megatron-LM dest -> a value other than the recorded run's -> (model field, value)
    "num_layers": 3, "hidden_size": 128, "ffn_hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 4,
    "kv_channels": 8, "seq_length": 128, "rotary_base": 500000, "rotary_percent": 0.5, "use_rope_scaling": True,
    "qk_layernorm": True, "layernorm_epsilon": 1e-6, "init_method_std": 0.01, "hidden_dropout": 0.1,
    "attention_dropout": 0.05, "make_vocab_size_divisible_by": 64, "seed": 7,
}


def test_each_carried_setting_reaches_the_model_section():
    from megatron_lev.megatron_lm.arguments import model_section_from_args
    from megatron_lev.models.settings import SETTINGS

    by_dest = {s.dest or s.field: s for s in SETTINGS if s.flag}
    # The settings without a Megatron-LM flag (ours alone; GPTModel+LEV has one input side).
    assert set(CARRIED_VALUES) | {"rope_scaling_factor", "embedding", "freeze_input_embedding",
                                  "embedding_rank", "lev_init_from"} == set(by_dest)
    base = model_section_from_args(recorded_namespace(), 1024)
    for dest, value in CARRIED_VALUES.items():
        section = model_section_from_args(recorded_namespace(**{dest: value}), 1024)
        field = by_dest[dest].field
        assert section[field] == value and base[field] != value, (dest, section[field], base[field])
        assert MEGATRON_ARGS[dest].kind == CARRIED, dest
    assert model_section_from_args(recorded_namespace(group_query_attention=False), 1024)["num_query_groups"] is None


def test_own_trainer_model_flags_are_the_tables():
    """The trainer takes the table's settings under Megatron-LM's flags; a Megatron-LM flag it
    ignores is accepted only at the value the decoder has anyway."""
    from megatron_lev.training.arguments import parse_args

    args = parse_args(["--config", "tiny-lev", "--rotary-percent", "0.5", "--qk-layernorm", "--use-rope-scaling",
                       "--kv-channels", "8", "--norm-epsilon", "1e-6", "--normalization", "RMSNorm"])
    model = args.model
    assert (model["rotary_percent"], model["qk_layernorm"], model["rope_scaling"], model["kv_channels"],
            model["layernorm_epsilon"]) == (0.5, True, True, 8, 1e-6)


def test_own_trainer_refuses_another_normalization(capsys):
    from megatron_lev.training.arguments import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", "tiny-lev", "--normalization", "LayerNorm"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("python -m megatron_lev.train: error: --normalization LayerNorm is not "
                                       "supported: always RMSNorm (accepted: RMSNorm)\n")


def test_docs_page_holds_the_table():
    with open(os.path.join(REPO, "docs", "megatron-lm.md"), encoding="utf-8") as f:
        page = f.read()
    table = megatron_flag_table()
    assert table in page, "regenerate it: python -m megatron_lev.megatron_lm.flags docs/megatron-lm.md"
    counts = [int(n) for n in re.match(r"(\d+) carried, (\d+) precision only, (\d+) refused", table).groups()]
    assert counts == [sum(a.kind == k for a in MEGATRON_ARGS.values()) for k in (CARRIED, PRECISION, REFUSED)]
