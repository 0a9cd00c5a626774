"""The LEV embedding on Megatron-LM's GPTModel path (models/gpt_lev.py, megatron_lm/provider.py):
no host synchronisation in a forward and backward step (counted as issue 16 counted the own
trainer's, utils/profiling.py), equal to the per-token generator in both of its buffer forms;
no V x D table built and dropped at construction; LEV's vocabulary is Megatron-LM's tokenizer's
(NullTokenizer's N ids plus its EOD), so Megatron-LM's own mock data trains."""
import numpy as np
import pytest
import torch

from megatron_lev.configs import load_config
from megatron_lev.models.config import model_config_from_dict
from megatron_lev.utils.profiling import KernelCounter
from tests.distributed import one_in_process_rank
from tests.mcore_cpu import causal_mask, patch_mcore_for_cpu
from tests.megatron_lm_record import recorded_namespace

BASE = load_config("tiny-lev")["model"]
BATCH, SEQ = 4, 64


@pytest.fixture(scope="module")
def rank():
    with pytest.MonkeyPatch.context() as monkeypatch, one_in_process_rank():
        patch_mcore_for_cpu(monkeypatch)
        yield


def _gpt(vocab: int):
    from megatron_lev.models.gpt_lev import build_lev_gpt_model_from_config

    return build_lev_gpt_model_from_config(model_config_from_dict({**BASE, "vocab_size": vocab}))


# 200 ids <= 256 tokens: the whole vocabulary is evaluated and gathered; 8000 > 256: one row per token.
@pytest.mark.parametrize("vocab", [200, 8000])
def test_gptmodel_step_has_no_host_sync(vocab, rank, capsys):
    gpt = _gpt(vocab)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, vocab, (BATCH, SEQ), generator=g), torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    with KernelCounter() as forward:
        loss = gpt(ids, positions, causal_mask(SEQ), labels=labels).mean()
    with KernelCounter() as backward:
        loss.backward()
    with capsys.disabled():
        print(f"GPTModel+LEV, V={vocab}, {BATCH}x{SEQ} tokens: {forward.kernels} + {backward.kernels} kernels, "
              f"host syncs {forward.host_syncs} + {backward.host_syncs}")
    assert forward.host_syncs == backward.host_syncs == 0, (forward.syncs, backward.syncs)
    # The embedding is the generator's per-token output (as the own trainer's loader-ids path computes it).
    with torch.no_grad():
        expected = gpt.embedding.generator.embed(ids).transpose(0, 1)
        assert (gpt.embedding(ids, positions) - expected).abs().max() <= 1e-6 * expected.abs().max()
    # The own trainer's path without the loader's ids finds them on the device: the sync this path avoids.
    from megatron_lev.lev.parallel import ParallelLEVEmbedding

    with KernelCounter() as in_step:
        ParallelLEVEmbedding.forward(gpt.embedding, ids)
    assert in_step.syncs["aten::_unique2"] == 1


def test_no_vocabulary_table_is_built(rank, monkeypatch):
    """GPTModel's LanguageModelEmbedding would allocate (and with CPU initialisation draw) the padded
    V x D table LEV replaces: it is never constructed, and the only V x D tensors are the output layer's."""
    from megatron.core.models.common.embeddings import language_model_embedding

    built = []
    original = language_model_embedding.LanguageModelEmbedding.__init__
    monkeypatch.setattr(language_model_embedding.LanguageModelEmbedding, "__init__",
                        lambda self, *a, **k: built.append(1) or original(self, *a, **k))
    vocab, padded, hidden = 100_000, 100_096, BASE["hidden_size"]

    class Allocations(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.tables = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and func._schema.name.startswith("aten::empty") and out.numel() >= vocab * hidden:
                self.tables += 1
            return out

    with Allocations() as allocations:
        gpt = _gpt(vocab)
    assert not built and not any("word_embeddings" in name for name, _ in gpt.named_parameters())
    assert gpt.output_layer.weight.shape == (padded, hidden)
    assert allocations.tables == 2  # the output layer's weight and its CPU-initialisation master copy
    assert all(p.is_embedding_or_output_parameter for p in gpt.embedding.parameters())  # as GPTModel marks its table


def test_null_tokenizer_mock_data_trains(rank):
    """--mock-data --tokenizer-type NullTokenizer --vocab-size 1000: Megatron-LM's tokenizer has 1001 ids
    (its EOD is 1000, which ends every mock document); LEV generates for all of them."""
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    from megatron_lev.megatron_lm.provider import lev_gpt_builder

    tokenizer = NullTokenizer(1000)
    args = recorded_namespace(vocab_size=1000)
    gpt = lev_gpt_builder(args)
    assert tokenizer.vocab_size == gpt.embedding.lev_config.vocab_size == args.lev_vocab_size == 1001
    assert gpt.output_layer.weight.shape[0] == 1024  # padded as Megatron-LM pads: 1001 -> 1024
    documents = MockGPTLowLevelDataset(tokenizer)
    stream = np.concatenate([documents[i] for i in range(3)])  # packed, as GPTDataset packs documents
    start = len(documents[0]) - SEQ  # a window over the first document's end
    tokens = torch.as_tensor(stream[start:start + 2 * (SEQ + 1)]).view(2, SEQ + 1)
    assert (tokens == tokenizer.eod).any()  # the id that stopped training at step 2
    loss = gpt(tokens[:, :-1], torch.arange(SEQ).expand(2, SEQ), causal_mask(SEQ), labels=tokens[:, 1:]).mean()
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in gpt.embedding.parameters())


def test_cpu_check_reports_the_model_or_the_refusal(rank):
    """tools/megatron_lm/check_lev_gpt.py's report (megatron_lm/check.py) for Megatron-LM's parsed
    arguments of a TP=8 run: the model built in this process has this project's parameter count."""
    from megatron_lev.megatron_lm.check import check_lev_gpt

    args = recorded_namespace(tensor_model_parallel_size=8, lev_num_heads=8, qk_layernorm=True, rotary_percent=0.5)
    report = check_lev_gpt(args).splitlines()
    assert report[0].startswith("model: 2 layers x 64, 4 heads (2 kv heads) of 16, MLP 192, ")
    assert report[1].startswith("LEV: vocabulary 1,024 (NullTokenizer; the output layer pads it to 1,024 at TP 8), "
                                "8 heads")
    assert report[2] == "RoPE: base 10000, on 8 of 16 dims per head, q/k layernorm"
    assert "'partial_rotary_factor': 0.5" in report[3]
    with pytest.raises(ValueError, match=r"^LEVConfig.num_heads=4 must be divisible by the tensor-parallel size 8"):
        check_lev_gpt(recorded_namespace(tensor_model_parallel_size=8))
    with pytest.raises(ValueError, match=r"^--swiglu is required"):
        check_lev_gpt(recorded_namespace(swiglu=False))
