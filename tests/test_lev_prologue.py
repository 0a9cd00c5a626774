"""Issue 50: the modes' prologue (generator.seed_coordinates: W_seed, LayerNorm, sigmoid, the casts)
compiled by torch.compile on CUDA (lev/dispatch.py, COMPILED_PROLOGUE_DEVICES). Run here on CPU by
listing the CPU: compiled equals eager (the embedding and every gradient), one compilation serves
every number of ids, and a compiler failure falls back to eager with one warning."""
from __future__ import annotations

import pytest
import torch

from megatron_lev.lev import dispatch as lev_dispatch
from megatron_lev.lev.generator import LEVConfig, LEVGenerator, seed_coordinates
from tests.test_lev import assert_close_at_scale, compile_without_a_compiler
from tests.test_lev_knobs import EXPERIMENT


def embedding_and_grads(gen: LEVGenerator, ids: torch.Tensor):
    gen.zero_grad(set_to_none=True)
    out = gen(ids)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), {n: p.grad.clone() for n, p in gen.named_parameters()}


@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_the_compiled_prologue_equals_eager(monkeypatch, matmul_dtype):
    gen = LEVGenerator(LEVConfig(**EXPERIMENT, matmul_dtype=matmul_dtype), init_seed=3)
    monkeypatch.setattr(lev_dispatch, "COMPILED_PROLOGUE_DEVICES", ())
    monkeypatch.setattr(lev_dispatch, "_compiled_prologue", None)
    calls = []
    monkeypatch.setattr(lev_dispatch, "CompiledOrEager", _counting(lev_dispatch.CompiledOrEager, calls))
    sizes = (torch.arange(0, 8000, 61), torch.arange(5, 8000, 37))  # 132 and 216 ids: two row counts
    eager = [embedding_and_grads(gen, ids) for ids in sizes]
    assert lev_dispatch._compiled_prologue is None and calls == []  # off the listed devices: eager
    monkeypatch.setattr(lev_dispatch, "COMPILED_PROLOGUE_DEVICES", ("cpu",))
    # float32: to float32 rounding. bfloat16: the products round their float32 sums to bfloat16, so
    # another order of those sums (inductor's matmul layouts) flips a last bfloat16 bit here and there.
    atol = 1e-5 if matmul_dtype == "float32" else 2.0 ** -8
    for ids, (want_out, want_grads) in zip(sizes, eager):
        out, grads = embedding_and_grads(gen, ids)
        assert_close_at_scale(out, want_out, atol=atol)
        for name, grad in grads.items():
            assert_close_at_scale(grad, want_grads[name], atol=atol), name
    compiled = lev_dispatch._compiled_prologue
    assert callable(compiled.compiled) and compiled.function is seed_coordinates and len(calls) == 1


def _counting(cls, calls):
    def make(*args):
        if "prologue" in args[1]:  # (the CPU mode product is one too)
            calls.append(args[1])
        return cls(*args)
    return make


def test_a_compiler_failure_falls_back_to_eager_once(monkeypatch):
    gen = LEVGenerator(LEVConfig(**EXPERIMENT), init_seed=3)
    ids = torch.arange(0, 8000, 53)
    monkeypatch.setattr(lev_dispatch, "COMPILED_PROLOGUE_DEVICES", ())
    want = embedding_and_grads(gen, ids)
    monkeypatch.setattr(lev_dispatch, "COMPILED_PROLOGUE_DEVICES", ("cpu",))
    monkeypatch.setattr(lev_dispatch, "_compiled_prologue", None)

    monkeypatch.setattr(torch, "compile", compile_without_a_compiler)
    with pytest.warns(UserWarning, match=r"torch.compile of the LEV prologue \(W_seed, LayerNorm, sigmoid\) failed"
                                         r".*no C\+\+ compiler"):
        got = embedding_and_grads(gen, ids)
    assert lev_dispatch._compiled_prologue.compiled is False
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][n], want[1][n]) for n in want[1])
