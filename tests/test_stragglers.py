"""Issue 43, item 4: stragglers named. Two gloo ranks train with one of them slowed (its forward
sleeps): every log line, metrics.jsonl record and TensorBoard point names that rank and its host,
with the minimum and maximum own step time over ranks (training/timers.py); `--timing-log-level 2`
prints Megatron's timer block, the same text megatron-core's Timers prints for the same times."""
import contextlib
import io
import os
import re
import socket

import pytest

from tests.distributed import run_distributed
from tests.test_train import read_metrics, train_flags, train_records

DELAY_S = 0.3  # the slowed rank's extra time in every forward (one micro-batch per step per rank)


def _slowed_runs(rank, world_size, runs):
    """Rank body: each (argv, slow_rank) run with `slow_rank`'s forward slowed; rank 0's stdout."""
    import time

    from megatron_lev.models.decoder import LeviathanModel
    from megatron_lev.train import main

    original = LeviathanModel.forward

    def slowed(self, *args, **kwargs):
        time.sleep(DELAY_S)
        return original(self, *args, **kwargs)

    codes, out = [], io.StringIO()
    for argv, slow_rank in runs:
        LeviathanModel.forward = slowed if rank == slow_rank else original
        with contextlib.redirect_stdout(out):
            codes.append(main(argv))
    LeviathanModel.forward = original
    return codes, out.getvalue()


def test_a_slowed_rank_is_named(tiny_dataset, spm_tokenizer, tmp_path):
    work = str(tmp_path)
    # The tied model: nothing compiles in its first step, whose time would vary between ranks.
    short = ("--config", "tiny-tied", "--exit-interval", "4", "--log-interval", "2", "--eval-interval", "100")
    runs = [(train_flags(tiny_dataset, spm_tokenizer, work, "slow1", *short, "--timing-log-level", "2",
                         "--tensorboard-dir", os.path.join(work, "tb")), 1),
            (train_flags(tiny_dataset, spm_tokenizer, work, "slow0", *short, "--timing-log-level", "1", "--timing-log-option", "max"), 0)]
    results = run_distributed(_slowed_runs, world_size=2, args=(runs,), timeout=900)
    assert [codes for codes, _ in results] == [[0, 0], [0, 0]]
    host = socket.gethostname()
    for name, slow in (("slow1", 1), ("slow0", 0)):
        records = train_records(work, name)
        assert sorted(records) == [2, 4]
        for record in records.values():
            assert (record["slowest_rank"], record["fastest_rank"], record["slowest_host"]) == (slow, 1 - slow, host)
            # The fast rank waits for the slow one inside the gradient all-reduce: not its own time.
            assert record["rank_time_max_s"] - record["rank_time_min_s"] > 0.7 * DELAY_S, record
            assert 0 < record["rank_time_min_s"] < record["rank_time_max_s"] <= record["step_time_s"] * 1.05
    out = results[0][1]
    lines = [line for line in out.splitlines() if "] iteration " in line]
    assert len(lines) == 4
    for line, slow in zip(lines, (1, 1, 0, 0)):
        match = re.search(r" rank time \(ms\) min/max: ([\d.]+) \(rank (\d)\) / ([\d.]+) \(rank (\d), (\S+)\) \|", line)
        assert match and (int(match[2]), int(match[4]), match[5]) == (1 - slow, slow, host), line
    # --timing-log-level 2 (the first run): Megatron's block after each log line, per iteration in ms;
    # the slowed rank's forward holds the sleep, so forward-compute spans it between the ranks.
    blocks = re.findall(r"\(min, max\) time across ranks \(ms\):\n((?:    .*\n)+)", out)
    assert len(blocks) == 2, out[-3000:]
    for block in blocks:
        times = {m[1]: (float(m[2]), float(m[3])) for m in re.finditer(r"    (\S+) \.+: \(([\d.]+), ([\d.]+)\)", block)}
        assert list(times) == ["forward-backward", "all-grads-sync", "optimizer", "batch-generator",
                               "forward-compute", "backward-compute"]
        low, high = times["forward-compute"]
        assert 1000 * DELAY_S <= high and high - low > 700 * DELAY_S, times
        low, high = times["all-grads-sync"]
        assert high - low > 700 * DELAY_S, times  # the fast rank's wait
    # --timing-log-level 1 --timing-log-option max (the second run): level 1's timers, their max.
    blocks = re.findall(r"^max time across ranks \(ms\):\n((?:    .*\n)+)", out, re.M)
    assert [re.findall(r"    (\S+) \.+: [\d.]+\n", block) for block in blocks] == \
        [["forward-backward", "all-grads-sync", "optimizer"]] * 2, out[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(work, "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("slowest-rank")] == [(2, 1), (4, 1)]
    maxima = {e.step: e.value for e in events.Scalars("rank-time-max")}
    assert maxima == pytest.approx({i: r["rank_time_max_s"] for i, r in train_records(work, "slow1").items()})
    assert not [r for r in read_metrics(work, "slow1") if r.get("iteration") == 0 and "slowest_rank" in r]


def test_the_timer_block_is_megatrons(monkeypatch):
    """Our block and megatron-core's Timers text for the same per-rank times (ms), every option."""
    import torch
    from megatron.core import timers as megatron_timers

    from megatron_lev.training.timers import timers_block

    seconds = {"forward-backward": [0.5, 0.75], "optimizer": [0.0125, 0.0], "forward-compute": [0.1, 0.4]}
    names = list(seconds)
    for option in ("max", "minmax", "all"):
        reference = megatron_timers.Timers(log_level=2, log_option=option)
        # [ranks, timers] seconds, as Timers gathers them; normalizer 1: per iteration already.
        monkeypatch.setattr(reference, "_get_elapsed_time_all_ranks",
                            lambda names, reset, barrier: torch.tensor([[seconds[n][r] for n in names] for r in (0, 1)]))
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
        assert timers_block(seconds, option) == reference.get_all_timers_string(names, normalizer=1.0), option


def test_timing_flags_refuse_other_values(capsys, monkeypatch):
    from megatron_lev.training.arguments import parse_args

    monkeypatch.setenv("RANK", "0")
    for flag, value in (("--timing-log-level", "3"), ("--timing-log-option", "median")):
        with pytest.raises(SystemExit):
            parse_args(["--config", "tiny-lev", flag, value])
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"argument {flag}: invalid choice: " in err[0], err
