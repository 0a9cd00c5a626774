"""The pipeline form: PP=2 under DeepSpeed's pipeline engine (ZeRO-1, CPU, gloo) gives the
same loss and the same gradients after one step as the plain PP=1 model from the same seed."""
import pytest
import torch

from megatron_lev.models.pipeline import model_to_pipeline_key, pipeline_to_model_key
from tests.distributed import run_distributed

VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES = 1000, 16, 2, 2
LR = 1.0  # SGD: a parameter's step is exactly -LR x its gradient


def _batches(seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
        mask = (torch.rand(MICRO_BATCH, SEQ, generator=g) > 0.2).float()
        positions = torch.arange(SEQ).repeat(MICRO_BATCH, 1)
        out.append(((tokens[:, :-1], positions), (tokens[:, 1:], mask)))
    return out


def _pipeline_vs_plain(rank, world_size, cases):
    import deepspeed

    from megatron_lev.configs import load_config
    from megatron_lev.distributed.rng import set_seed
    from megatron_lev.distributed.state import initialize_model_parallel
    from megatron_lev.models.config import model_config_from_dict
    from megatron_lev.models.decoder import build_model
    from megatron_lev.models.pipeline import build_pipeline_model

    initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    set_seed(1234)
    section = load_config("tiny-lev")["model"]
    results = {}
    for kind, recompute in cases:
        batches = _batches(seed=7)
        # The reference: the plain PP=1 model, built from the same seed on every rank.
        ref = build_model(model_config_from_dict(section, embedding=kind))
        losses = []
        for (input_ids, position_ids), (labels, loss_mask) in batches:
            loss = ref(input_ids, position_ids, labels=labels, loss_mask=loss_mask)
            (loss / MICRO_BATCHES).backward()
            losses.append(loss.item())
        ref_grads = {name: p.grad.clone() for name, p in ref.named_parameters()}

        config = model_config_from_dict(section, embedding=kind, pipeline_model_parallel_size=2,
                                        recompute=recompute)
        pipe = build_pipeline_model(config)
        before = {name: p.detach().clone() for name, p in pipe.named_parameters()}
        engine, _, _, _ = deepspeed.initialize(
            model=pipe, model_parameters=[p for p in pipe.parameters()],
            optimizer=torch.optim.SGD(pipe.parameters(), lr=LR),
            config={"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
                    "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
                    "gradient_clipping": 0.0, "steps_per_print": 10**9, "wall_clock_breakdown": False})
        pipe_loss = engine.train_batch(iter(batches)).item()
        grads = {}
        for name, p in engine.module.named_parameters():
            model_name = pipeline_to_model_key(name, config.num_layers)
            assert model_to_pipeline_key(model_name, config.num_layers, tied=kind == "tied") == name
            grads[model_name] = ((before[name] - p.detach()) / LR, ref_grads[model_name])
        results[kind] = {"pipe_loss": pipe_loss, "ref_loss": sum(losses) / len(losses), "grads": grads,
                         "stage": engine.stage_id, "ref_names": sorted(ref_grads),
                         "checkpoint_interval": pipe.activation_checkpoint_interval}
    return results


def _check(results, kinds):
    for kind in kinds:
        stages = [r[kind] for r in results]
        assert sorted(s["stage"] for s in stages) == [0, 1]
        for s in stages:
            # Same loss on both stages (DeepSpeed broadcasts the last stage's mean).
            assert abs(s["pipe_loss"] - s["ref_loss"]) < 1e-5, (kind, s["pipe_loss"], s["ref_loss"])
        covered = set()
        for s in stages:
            for name, (pipe_grad, ref_grad) in s["grads"].items():
                torch.testing.assert_close(pipe_grad, ref_grad, atol=1e-5, rtol=1e-4, msg=f"{kind} {name}")
                covered.add(name)
        # Every parameter of the plain model lives on some stage (the tied table on both).
        assert covered == set(stages[0]["ref_names"])
        assert all(g.abs().sum() > 0 for s in stages for g, _ in s["grads"].values())
        if kind == "tied":
            assert all("embedding.weight" in s["grads"] for s in stages)


def test_pipeline_two_stages_match_plain_model_loss_and_grads():
    """Each embedding kind; tied and lev with per-layer activation checkpointing in the pipe
    (the plain reference never recomputes)."""
    cases = (("tied", True), ("untied", False), ("lev", True))
    results = run_distributed(_pipeline_vs_plain, world_size=2, args=(cases,))
    _check(results, [kind for kind, _ in cases])
    assert [results[0][kind]["checkpoint_interval"] for kind, _ in cases] == [1, 0, 1]


def test_name_mapping_round_trip():
    names = ["embedding.weight", "embedding.codebooks", "layers.0.attention.qkv.weight",
             "layers.3.mlp.down.weight", "final_norm.weight", "output_layer.weight"]
    for name in names:
        assert pipeline_to_model_key(model_to_pipeline_key(name, 4), 4) == name
    assert model_to_pipeline_key("layers.3.mlp_norm.weight", 4) == "4.mlp_norm.weight"
    assert model_to_pipeline_key("final_norm.weight", 4) == "5.weight"
    assert model_to_pipeline_key("output_layer.weight", 4) == "6.weight"
    assert model_to_pipeline_key("embedding.weight", 4, tied=True) == "tied_modules.embedding.weight"
    assert pipeline_to_model_key("tied_modules.embedding.weight", 4) == "embedding.weight"
    with pytest.raises(ValueError, match="past the head"):
        pipeline_to_model_key("7.weight", 4)
    with pytest.raises(ValueError, match="no such layer"):
        model_to_pipeline_key("layers.4.mlp.down.weight", 4)
