"""Shared test set-up. Session-wide fixtures (tokenizer, tiny dataset) live here so
they are built once per run."""
import os

# Before anything imports deepspeed: run its CPU accelerator.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Triton (LEV's CUDA kernels, tests/test_lev_kernels.py) on CPU tensors: its interpreter. It
# must be set before anything imports triton (DeepSpeed and torch.compile do).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# --- data fixtures (built once per session; see tests/fixtures.py for what they hold) ---
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def python_corpus(tmp_path_factory) -> str:
    """Path of a small Pile-format corpus (.jsonl.zst, {"text", "meta": {"pile_set_name"}}):
    the pydoc topics (79 on Python 3.11) then standard-library docstrings, 500 documents."""
    from tests.fixtures import build_corpus

    return build_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="session")
def spm_tokenizer(python_corpus, tmp_path_factory) -> str:
    """Path of a SentencePiece BPE .model trained on python_corpus: vocab_size 1000,
    ids unk 0, bos 1, eod (</s>) 2, pad 3; lossless (byte fallback, no normalisation).
    Load it with megatron_lev.data.tokenizer.build_tokenizer("SentencePieceTokenizer", path)."""
    from tests.fixtures import build_spm

    return build_spm(python_corpus, str(tmp_path_factory.mktemp("spm")))


@pytest.fixture(scope="session")
def tiny_dataset(python_corpus, spm_tokenizer, tmp_path_factory) -> str:
    """Indexed-dataset prefix (`..._text_document`, .bin/.idx) of python_corpus tokenized
    with spm_tokenizer, EOD appended to every document (uint16)."""
    from tests.fixtures import build_tiny_dataset

    return build_tiny_dataset(python_corpus, spm_tokenizer, str(tmp_path_factory.mktemp("tiny_dataset")))


# --- a real Slurm cluster (tests/slurm_cluster.py), started once for the tests that use it ---
_slurm_report: list[str] = []


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running single-node SlurmCluster (munged, slurmctld, slurmd on this machine), stopped
    at the end of the session; its `env()` gives the environment for sbatch and friends. Where
    it cannot start the tests are skipped (the reason is the run's last line), or fail under
    MEGATRON_LEV_REQUIRE_SLURM=1 (.ci/run)."""
    from tests.slurm_cluster import start_for_tests

    cluster = start_for_tests(_slurm_report)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def slurm_report() -> list[str]:
    """Lines printed at the end of the run (the cluster's start-up, a job's timeline)."""
    return _slurm_report


def pytest_terminal_summary(terminalreporter):
    for line in _slurm_report:
        terminalreporter.write_line(line)
