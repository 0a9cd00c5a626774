"""metrics.py: Megatron-LM's TensorBoard tag names (with the `vs samples` series) and a
W&B run that keeps one id across restarts, its files under the run folder."""
import sys
import types

import pytest

from megatron_lev.training.metrics import MetricsWriter

TRAIN = {"iteration": 10, "consumed_samples": 80, "consumed_tokens": 5120, "global_batch_size": 8, "loss": 6.5,
         "lr": 1e-3, "grad_norm": 1.25, "step_time_s": 0.5, "tokens_per_s": 1024.0, "mfu": None, "skipped_steps": 0}
VALID = {"iteration": 10, "consumed_samples": 80, "consumed_tokens": 5120, "valid_loss": 6.25, "valid_ppl": 518.0}


def test_tensorboard_tags_are_megatrons(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(active=True, tensorboard_dir=str(tmp_path / "tb"))
    writer.write(TRAIN, 10)
    writer.write(VALID, 10)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    got = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    expected = {
        "lm loss": [(10, 6.5)], "lm loss vs samples": [(80, 6.5)], "lm loss vs tokens": [(5120, 6.5)],
        "learning-rate": [(10, 1e-3)], "learning-rate vs samples": [(80, 1e-3)],
        "grad-norm": [(10, 1.25)], "grad-norm vs samples": [(80, 1.25)],
        "batch-size": [(10, 8)], "batch-size vs samples": [(80, 8)], "iteration-time": [(10, 0.5)],
        "lm loss validation": [(10, 6.25)], "lm loss validation vs samples": [(80, 6.25)],
        "lm loss validation vs tokens": [(5120, 6.25)], "lm loss validation ppl": [(10, 518.0)],
        "lm loss validation ppl vs samples": [(80, 518.0)],
        "tokens-per-sec": [(10, 1024.0)], "skipped-iterations": [(10, 0)],
    }
    assert set(got) == set(expected)
    for tag, points in expected.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points] and [v for _, v in got[tag]] == pytest.approx(
            [v for _, v in points], rel=1e-6), tag


def test_wandb_run_id_is_kept_in_the_run_folder(tmp_path, monkeypatch):
    """A restarted job (same --save) continues the same W&B run: same id, resume="allow",
    files under <save>/wandb; the tags are Megatron's."""
    calls = []

    class Run:
        def __init__(self):
            self.logged = []

        def log(self, scalars, step):
            self.logged.append((step, scalars))

        def finish(self):
            pass

    def init(**kwargs):
        calls.append(kwargs)
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    wandb_dir = str(tmp_path / "save" / "wandb")
    runs = []
    for _ in range(2):
        writer = MetricsWriter(active=True, wandb_project="p", wandb_name="lev", wandb_dir=wandb_dir, config={"a": 1})
        runs.append(writer._wandb)
        writer.write(TRAIN, 10)
        writer.close()
    assert len(calls) == 2 and calls[0]["id"] == calls[1]["id"] and len(calls[0]["id"]) == 16
    assert calls[0]["dir"] == wandb_dir and calls[0]["resume"] == "allow" and calls[0]["project"] == "p"
    with open(tmp_path / "save" / "wandb" / "run_id") as f:
        assert f.read().strip() == calls[0]["id"]
    step, scalars = runs[0].logged[0]
    assert step == 10 and scalars["lm loss"] == 6.5 and scalars["learning-rate"] == 1e-3 and "loss" not in scalars
