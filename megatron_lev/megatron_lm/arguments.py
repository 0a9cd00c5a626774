"""Megatron-LM's argument namespace <-> LEV: the --lev-* flags and what they build.

`add_lev_args(parser)` adds one `--lev-<field>` flag per LEVConfig field (lev/generator.py), with
that field's default, except `vocab_size` (the tokenizer's) and `hidden_size` (--hidden-size);
`register_lev_args()` adds them to every parser Megatron-LM builds (pretrain_lev_gpt.py calls it).

`transformer_config_from_args(args)` is Megatron-LM's `core_transformer_config_from_args` when
megatron.training imports (a Megatron-LM checkout); without it (megatron-core alone, the tests)
it copies the same-named fields of a dense GPT and the few renamed ones (--swiglu,
--group-query-attention, ...), which is enough to build the model, not to train it.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import typing

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lev.lev.generator import DIGIT_ORDERS, MATMUL_DTYPES, MODE_PRODUCTS, LEVConfig
from megatron_lev.models.config import MODEL_FIELDS
from megatron_lev.models.settings import model_section_from_megatron_args

MODEL_OWNED = ("vocab_size", "hidden_size")  # LEV fields set by the model's own flags
CHOICES = {"digit_order": DIGIT_ORDERS, "mode_product": MODE_PRODUCTS, "matmul_dtype": MATMUL_DTYPES}  # LEV's string fields


def lev_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(LEVConfig) if f.name not in MODEL_OWNED]


def flag_name(field_name: str) -> str:
    return "--lev-" + field_name.replace("_", "-")


def add_lev_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's extra_args_provider: the --lev-* flags (dest lev_<field>); a parser that
    has them already (register_lev_args) is returned as it is."""
    if any(action.dest.startswith("lev_") for action in parser._actions):
        return parser
    group = parser.add_argument_group(title="LEV embedding (megatron_lev)")
    hints = typing.get_type_hints(LEVConfig)
    for field in lev_fields():
        flag, dest, default = flag_name(field.name), "lev_" + field.name, field.default
        help_text = f"LEVConfig.{field.name} (default {default})"
        if hints[field.name] is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif field.name in CHOICES:
            group.add_argument(flag, dest=dest, choices=CHOICES[field.name], default=default, help=help_text)
        else:
            kind = int if hints[field.name] in (int, typing.Optional[int]) else float
            group.add_argument(flag, dest=dest, type=kind, default=default, help=help_text)
    return parser


def register_lev_args() -> None:
    """Add the --lev-* flags to every parse of Megatron-LM's command line in this process.

    pretrain_gpt.py's main block parses the command line before `pretrain()` adds its
    extra_args_provider: the in-process-restart wrapper (and, inside `pretrain()`, the
    fault-tolerance set-up) call `parse_args(ignore_unknown_args=True)`, so `--help` there would
    print Megatron-LM's flags without LEV's and exit. Megatron-LM builds each of those parsers with
    `megatron.training.arguments.add_megatron_arguments`; wrapped here, every one of them has the
    --lev-* flags, and pretrain_lev_gpt.py's main block stays pretrain_gpt.py's."""
    from megatron.training import arguments

    if getattr(arguments.add_megatron_arguments, "adds_lev_args", False):
        return
    megatron_arguments = arguments.add_megatron_arguments

    def add_megatron_and_lev_arguments(parser):
        return add_lev_args(megatron_arguments(parser))

    add_megatron_and_lev_arguments.adds_lev_args = True
    arguments.add_megatron_arguments = add_megatron_and_lev_arguments


def lev_values(args) -> dict:
    """LEVConfig's fields from the --lev-* flags of a namespace. A namespace with none of them was
    parsed without add_lev_args: refused. One saved before a field existed (the arguments of an
    older checkpoint) lacks only that field: its default, the generator that checkpoint trained."""
    if not any(hasattr(args, "lev_" + field.name) for field in lev_fields()):
        raise ValueError(f"{flag_name(lev_fields()[0].name)}: missing from Megatron-LM's arguments (pass "
                         "extra_args_provider=megatron_lev.megatron_lm.add_lev_args to pretrain())")
    return {field.name: getattr(args, "lev_" + field.name, field.default) for field in lev_fields()}


def lev_config_from_args(args, vocab_size: int) -> LEVConfig:
    """The generator's config: the --lev-* flags, `vocab_size` (the tokenizer's, unpadded) and --hidden-size."""
    values = lev_values(args)
    try:
        return LEVConfig(vocab_size=vocab_size, hidden_size=args.hidden_size, **values)
    except ValueError as exc:
        raise ValueError(f"--lev-*: {exc}") from None


def model_section_from_args(args, vocab_size: int) -> dict:
    """This project's `model:` section for the model Megatron-LM's namespace `args` builds
    (models/settings.py reads the settings; the --lev-* flags give the generator's fields)."""
    section = model_section_from_megatron_args(args, vocab_size, lev_values(args))
    assert set(section) == set(MODEL_FIELDS), sorted(set(section) ^ set(MODEL_FIELDS))
    return section


def transformer_config_from_args(args) -> TransformerConfig:
    """Megatron-LM's own translation when it imports, else the dense-GPT subset (see the module docstring)."""
    try:
        from megatron.training.arguments import core_transformer_config_from_args
    except ImportError:
        return _dense_transformer_config(args)
    return core_transformer_config_from_args(args)


def _dense_transformer_config(args) -> TransformerConfig:
    values = {}
    for field in dataclasses.fields(TransformerConfig):
        if not field.init or not hasattr(args, field.name):
            continue
        value = getattr(args, field.name)
        default = field.default if field.default is not dataclasses.MISSING else None
        if isinstance(default, enum.Enum) or callable(default) or not _plain(value):
            continue  # enums, functions: TransformerConfig's defaults (a real run uses Megatron-LM's translation)
        values[field.name] = value
    values.update(
        pipeline_dtype=args.params_dtype,
        persist_layer_norm=not args.no_persist_layer_norm, rotary_interleaved=args.rotary_interleaved,
        num_query_groups=args.num_query_groups if args.group_query_attention else None)
    if args.swiglu:
        values.update(activation_func=F.silu, gated_linear_unit=True, bias_activation_fusion=args.bias_swiglu_fusion)
    return TransformerConfig(**values)


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype))
