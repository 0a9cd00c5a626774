"""The fused decoder and the step's plumbing (issue 16): torch.compile'd decoder layers ==
eager, the chunked float32 cross entropy == megatron-core's, fused AdamW on CPU == torch's
reference AdamW, LEV's distinct ids from the data loader, CPU processes reusing freed memory."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_lev.configs import load_config
from megatron_lev.data.datasets import collate_pretraining_batch
from megatron_lev.models import cross_entropy
from megatron_lev.models.config import model_config_from_dict
from megatron_lev.models.cross_entropy import language_model_loss
from megatron_lev.models.decoder import LeviathanModel
from megatron_lev.models.transformer import compile_decoder_layers
from megatron_lev.training.optim import build_optimizer
from tests.test_model import single_rank  # noqa: F401  (fixture: one in-process rank)


def relative_error(actual, expected):
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def tiny_model_and_batch():
    config = model_config_from_dict(load_config("tiny-lev")["model"])  # GQA: 4 heads, 2 groups
    ids = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    return config, ids[:, :-1], ids[:, 1:]


def test_compiled_decoder_layers_equal_eager_loss_and_gradients(single_rank):  # noqa: F811
    config, tokens, labels = tiny_model_and_batch()
    results = {}
    for compiled in (False, True):
        model = LeviathanModel(config)
        if compiled:
            assert compile_decoder_layers(model) == config.num_layers
        loss = model(tokens, labels=labels)
        loss.backward()
        results[compiled] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    (loss, grads), (ref_loss, ref_grads) = results[True], results[False]
    # Inductor reorders float32 sums inside its fused kernels. Measured: equal losses,
    # gradients within 1e-6 of each tensor's scale.
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert relative_error(grads[name], ref_grads[name]) < 1e-5, name


def layer_inputs(config):
    """A decoder layer's input [s, b, H], RoPE tables and an output gradient (seeded)."""
    from megatron_lev.models.layers import rotary_cos_sin

    s, b = 16, 2
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s, b, config.hidden_size, generator=g)
    cos, sin = rotary_cos_sin(torch.arange(s).unsqueeze(0).expand(b, s), config.kv_channels, config.rotary_base)
    return x, cos, sin, torch.randn(s, b, config.hidden_size, generator=g)


def explain_and_run_layer(tp: int, compiled: bool) -> dict:
    """torch._dynamo.explain of what `compile_decoder_layers` compiles in one tiny-lev layer
    (GQA) at this TP size, then its forward + backward (compiled or eager); gradients gathered
    to their global shapes. Records megatron-core's tp_group warnings."""
    import hashlib
    import warnings

    from megatron_lev.models.decoder import gather_tensor_parallel
    from megatron_lev.models.transformer import DecoderLayer

    config = model_config_from_dict(load_config("tiny-lev")["model"], tensor_model_parallel_size=tp)
    x, cos, sin, grad = layer_inputs(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = DecoderLayer(config, 0)
        assert compile_decoder_layers(layer) == 1
        torch._dynamo.reset()
        explained = torch._dynamo.explain(layer.layer_forward)(x, cos, sin)
        torch._dynamo.reset()
        if not compiled:
            layer.compiled_forward = None
        x = x.requires_grad_()
        out = layer(x, cos, sin)
        out.backward(grad)
    return {"graphs": explained.graph_count, "breaks": explained.graph_break_count,
            "reasons": [reason.reason.splitlines()[0] for reason in explained.break_reasons],
            "graph_code": [hashlib.sha256(graph.code.encode()).hexdigest() for graph in explained.graphs],
            "tp_group_warnings": [str(w.message) for w in caught if "tp_group" in str(w.message)],
            "still_compiled": layer.compiled_forward is not None, "out": out.detach(), "dx": x.grad,
            "grads": {name: gather_tensor_parallel(p.grad, p) for name, p in layer.named_parameters()}}


def _compiled_layer_at_tp2(rank, world_size):
    from megatron_lev.distributed.state import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=2)
    return explain_and_run_layer(tp=2, compiled=True)


def test_a_compiled_layer_is_one_graph_the_same_on_every_rank_and_equals_tp1(single_rank):  # noqa: F811
    """Issue 22: before, TP=2 gave 10 graphs (9 breaks) on rank 0 and 7 (6) on rank 1:
    megatron-core's tp_group=None warning (rank 0 only) and the async dgrad all-reduce."""
    from tests.distributed import run_distributed

    tp1 = explain_and_run_layer(tp=1, compiled=False)
    assert (tp1["graphs"], tp1["breaks"]) == (1, 0)
    ranks = run_distributed(_compiled_layer_at_tp2, world_size=2)
    for rank in ranks:
        assert (rank["graphs"], rank["breaks"], rank["reasons"]) == (1, 0, [])
        assert rank["tp_group_warnings"] == [] and rank["still_compiled"]
        # TP=2 compiled == TP=1 eager (same weights: initialisation does not depend on TP).
        assert relative_error(rank["out"], tp1["out"]) < 1e-5
        assert relative_error(rank["dx"], tp1["dx"]) < 1e-5  # the dgrad all-reduce happened
        for name, grad in tp1["grads"].items():
            assert relative_error(rank["grads"][name], grad) < 1e-5, name
    assert ranks[0]["graph_code"] == ranks[1]["graph_code"]  # the same graph around the collectives


def test_a_layer_whose_compile_fails_warns_once_and_runs_eagerly(single_rank, monkeypatch):  # noqa: F811
    import warnings

    from torch._inductor.exc import InductorError

    from megatron_lev.models import transformer

    config, tokens, labels = tiny_model_and_batch()
    reference = LeviathanModel(config)
    ref_loss = reference(tokens, labels=labels)
    model = LeviathanModel(config)
    compile_decoder_layers(model)
    calls = []

    def compile_without_a_compiler(*args, **kwargs):
        calls.append(1)
        raise InductorError(RuntimeError("InvalidCxxCompiler: No working C++ compiler found"), "tb")

    for layer in model.layers:
        layer.compiled_forward = compile_without_a_compiler
    monkeypatch.setattr(transformer, "_compile_failures", [])
    with pytest.warns(UserWarning) as caught:
        loss = model(tokens, labels=labels)
    messages = [str(w.message) for w in caught if "--compile-layers" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith(
        "--compile-layers: torch.compile failed for decoder layer 0, running the layers that fail eagerly "
        "(same math, slower): InductorError: ")
    assert "No working C++ compiler" in messages[0]
    assert torch.equal(loss, ref_loss) and calls == [1] * config.num_layers
    assert all(layer.compiled_forward is None for layer in model.layers)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="--compile-layers")
        assert torch.equal(model(tokens, labels=labels), ref_loss)  # no retry, no second warning
    assert transformer._compile_failures == list(range(config.num_layers))
    # A model error is not a compiler failure: it propagates.
    model.layers[0].compiled_forward = lambda *args: (_ for _ in ()).throw(ValueError("shapes"))
    with pytest.raises(ValueError, match="shapes"):
        model(tokens, labels=labels)


def test_chunked_cross_entropy_equals_megatron_without_a_float32_copy(single_rank, monkeypatch):  # noqa: F811
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(7, 3, 200, generator=g)
    logits[..., 190:] = float("-inf")  # vocabulary padding
    labels = torch.randint(0, 190, (3, 7), generator=g)
    mask = (torch.rand(3, 7, generator=g) > 0.3).float()
    for dtype, chunk_bytes in ((torch.float32, 1 << 29), (torch.float32, 4 * 200 * 2), (torch.bfloat16, 4 * 200 * 2)):
        monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK_BYTES", chunk_bytes)  # one chunk; 2 tokens a chunk
        ours = logits.to(dtype).detach().clone().requires_grad_()
        theirs = logits.to(dtype).detach().clone().requires_grad_()
        loss = language_model_loss(ours, labels, mask)
        loss.backward()
        ref = (vocab_parallel_cross_entropy(theirs.float(), labels.t().contiguous()).t() * mask).sum() / mask.sum()
        ref.backward()
        assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
        assert ours.grad.dtype == dtype
        assert relative_error(ours.grad, theirs.grad) <= 1e-6, dtype


def test_cpu_optimizer_is_torch_fused_adamw_and_steps_like_the_reference():
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    initial = nets[0][0].weight.detach().clone()
    fused = build_optimizer(nets[0], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"]
    # The reference: torch's plain per-tensor AdamW over the twin's parameters, same groups.
    reference = torch.optim.AdamW(_matching_groups(fused, nets[0], nets[1]), foreach=False, fused=False)
    x = torch.randn(4, 8)
    for _ in range(3):
        for net, opt in zip(nets, (fused, reference)):
            opt.zero_grad()
            net(x).square().sum().backward()
            opt.step()
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert (nets[0][0].weight - initial).abs().min() > 1e-3  # every weight moved


def _matching_groups(optimizer, net, twin):
    """`optimizer`'s param groups with `net`'s parameters swapped for `twin`'s."""
    twin_of = {id(p): q for p, q in zip(net.parameters(), twin.parameters())}
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [twin_of[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups]


def test_collate_ships_distinct_ids_range_checked():
    tokens = torch.tensor([[5, 9, 5, 0], [9, 9, 2, 5]])
    samples = [{"tokens": t, "labels": t, "loss_mask": torch.ones(4), "position_ids": torch.arange(4)} for t in tokens]
    batch = collate_pretraining_batch(samples, lev_vocab_size=10)
    assert batch["lev_ids"].tolist() == [0, 2, 5, 9]
    assert torch.equal(batch["lev_ids"][batch["lev_inverse"]], tokens)
    assert "lev_ids" not in collate_pretraining_batch(samples)
    with pytest.raises(ValueError, match=r"training data: token id 9 is out of range \[0, 9\)"):
        collate_pretraining_batch(samples, lev_vocab_size=9)


FAULTS_PER_ALLOCATION = textwrap.dedent("""
    import resource, sys, torch
    from megatron_lev.distributed.launch import retain_freed_cpu_memory
    applied = retain_freed_cpu_memory() if sys.argv[1] == "retain" else None
    faults = []
    for _ in range(8):  # a 64 MB tensor, written, freed: what a training step does with its logits
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.ones(16 * 2**20)
        del t
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(applied, *faults)
""")


def _page_faults_per_allocation(mode: str, **env) -> tuple:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", FAULTS_PER_ALLOCATION, mode], env={**clean, **env},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], [int(n) for n in out[1:]]


def test_cpu_processes_reuse_freed_memory_instead_of_faulting_it_in_again():
    from megatron_lev.distributed.launch import CPU_MALLOC_TUNABLES, cpu_malloc_environ

    applied, default = _page_faults_per_allocation("default")
    assert min(default[2:]) >= 32  # glibc unmaps a large free: every allocation faults again
    # Started with the tunables, the process reuses the block every time, whatever the heap's layout
    # (which the environment's size shifts: with mallopt alone, in-process, it depended on it).
    for padding in ("", "x" * 1000, "y" * 4097):
        env = {**cpu_malloc_environ({}), "LAYOUT_PADDING": padding}
        assert env["GLIBC_TUNABLES"] == CPU_MALLOC_TUNABLES
        _, retained = _page_faults_per_allocation("default", **env)
        assert max(retained[2:]) * 4 < min(default[2:]), (padding and len(padding), retained, default)
    applied, _ = _page_faults_per_allocation("retain")
    assert applied == "True"
    # A user's own allocator settings win, in the process and for the children it starts.
    applied, _ = _page_faults_per_allocation("retain", MALLOC_TRIM_THRESHOLD_="1000000")
    assert applied == "False"
    assert cpu_malloc_environ({"MALLOC_TRIM_THRESHOLD_": "1000000"}) == {}
    assert cpu_malloc_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {}


def test_compile_time_line(single_rank, capsys):  # noqa: F811
    """--compile-layers compiles in the first step: one line before the first iteration line says
    how many decoder layers and how long torch.compile took (its own count, else the first step)."""
    from types import SimpleNamespace

    from megatron_lev.training.trainer import Trainer

    config, _, _ = tiny_model_and_batch()
    model = LeviathanModel(config)
    trainer = SimpleNamespace(engine=SimpleNamespace(module=model), device=torch.device("cuda"), model_config=config)
    Trainer.report_compilation(trainer, 0.31, 0.0)
    assert capsys.readouterr().out == ""  # nothing compiled: no line
    assert compile_decoder_layers(model) == 2
    Trainer.report_compilation(trainer, 12.34, 11.02)
    Trainer.report_compilation(trainer, 12.34, None)  # a torch that keeps no count
    assert capsys.readouterr().out.splitlines() == [
        " > compiled 2 decoder layers in 11.0 s (torch.compile, during the first step: 12.3 s)",
        " > compiled 2 decoder layers in 12.3 s (torch.compile, during the first step: 12.3 s)"]
    trainer.device = torch.device("cpu")  # LEV's mode product is compiled on CPU too
    Trainer.report_compilation(trainer, 7.0, 6.0)
    assert capsys.readouterr().out == (" > compiled 2 decoder layers and LEV's CPU mode product in 6.0 s "
                                       "(torch.compile, during the first step: 7.0 s)\n")
