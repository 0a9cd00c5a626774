"""Issue 43, item 8: the install range says what was tested. setup.py's range stays (a cluster's
newer megatron-core must still install); a run on a megatron-core or DeepSpeed version the
suite has not run on starts with one warning line naming it."""
import re

import pytest

from megatron_lev.utils import versions
from megatron_lev.utils.versions import TESTED, untested_versions_warning


def test_the_warning_names_each_untested_version():
    assert untested_versions_warning({"megatron-core": "0.16.1", "deepspeed": "0.19.8"}) is None
    assert untested_versions_warning({"megatron-core": None, "deepspeed": "0.19.8"}) is None  # not installed
    assert untested_versions_warning({"megatron-core": "0.17.0", "deepspeed": "0.19.8"}) == (
        "megatron_lev: warning: untested megatron-core 0.17.0 (tested: 0.16.1); the test suite ran on these "
        "tested versions only (docs/cluster.md, \"1. The environment (login node, once)\")")
    line = untested_versions_warning({"megatron-core": "0.19.0", "deepspeed": "0.19.9"})
    assert "untested megatron-core 0.19.0 (tested: 0.16.1) and deepspeed 0.19.9 (tested: 0.19.8);" in line
    assert "\n" not in line


def test_the_suite_runs_on_the_tested_versions():
    """The environment this suite runs in is the one TESTED names: a new version here must be
    added to TESTED (and docs/cluster.md) deliberately."""
    assert versions.installed_versions() == {name: tested[0] for name, tested in TESTED.items()}


def test_setup_range_holds_the_tested_versions():
    from packaging.requirements import Requirement

    with open("setup.py", encoding="utf-8") as f:
        setup = f.read()
    for name, tested in TESTED.items():
        (spec,) = re.findall(rf'"({re.escape(name)}[<>=!~][^"]*)"', setup)
        assert all(Requirement(spec).specifier.contains(v) for v in tested), spec


@pytest.mark.parametrize("rank", [0, 1])
def test_a_run_on_an_untested_megatron_core_warns_once_at_start(tiny_dataset, spm_tokenizer, tmp_path, monkeypatch,
                                                               capsys, rank):
    from megatron_lev.training.validation import validate_run
    from tests.test_train import train_flags

    real = versions.version
    monkeypatch.setattr(versions, "version", lambda name: "0.17.0" if name == "megatron-core" else real(name))
    validate_run(train_flags(tiny_dataset, spm_tokenizer, str(tmp_path), "run", "--config", "tiny-lev"), 2, rank)
    err = [line for line in capsys.readouterr().err.splitlines() if "untested" in line]
    assert err == ([untested_versions_warning({"megatron-core": "0.17.0", "deepspeed": real("deepspeed")})]
                   if rank == 0 else [])
