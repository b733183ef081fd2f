"""Diverging runs (``nanotron/divergence.py``): a step whose loss or grad-norm is not finite, or whose loss spikes
above the recent mean, is skipped up to ``optimizer.skip_bad_steps`` times in a row, then the run stops with one
``error:`` line, keeping the checkpoint from before the spike."""

from __future__ import annotations

import json

import pytest

from support.configs import short_config, write_config
from support.runs import assert_user_error, checkpoint_steps, cli, metrics


def test_bad_step_guard_judges_non_finite_values_and_spikes():
    from nanotron.divergence import BadStepGuard

    guard = BadStepGuard(skip_limit=1, spike_factor=1.5)
    assert [guard.judge(loss, 1.0) for loss in (4.0, 4.1, 3.9)] == [None, None, None]
    assert "more than optimizer.loss_spike_factor=1.5 times" in guard.judge(6.5, 1.0) and not guard.exhausted
    assert "not finite" in guard.judge(4.0, float("nan")) and guard.exhausted  # two bad steps in a row
    assert guard.judge(4.0, 1.0) is None and guard.bad_in_a_row == 0
    assert "not finite" in BadStepGuard(0, None).judge(float("inf"), 1.0)


@pytest.mark.slow
def test_a_loss_spike_is_skipped_then_stops_and_the_checkpoint_before_it_survives(tiny_data, tmp_path):
    """From step 31 on the data is characters the corpus never has: the loss jumps well above the recent mean. Steps
    31 and 32 are skipped (skip_bad_steps 2), step 33 stops the run; keep_last_n 1 would prune checkpoint 30, the
    newest before the spike, when 32 is saved, but it is kept."""
    import random

    from nanotron.data.preprocess import preprocess

    rng = random.Random(0)
    noise = tmp_path / "noise.jsonl"
    noise.write_text("".join(json.dumps({"text": "".join(rng.choice("QXZJ#@%&") for _ in range(400))}) + "\n"
                             for _ in range(200)))
    preprocess([noise], tiny_data["tokenizer"], tmp_path / "noise", num_workers=1)
    stages = [{"name": name, "start_training_step": start,
               "data": {"seed": 3, "num_loading_workers": 0, "dataset": {"dataset_folder": [str(folder)]}}}
              for name, start, folder in (("main", 1, tiny_data["tokenized"]), ("noise", 31, tmp_path / "noise"))]
    run = tmp_path / "run"
    config = short_config(tiny_data, run, 40, data_stages=stages,
                          checkpoints={"checkpoint_interval": 2, "keep_last_n": 1})
    config["optimizer"] |= {"skip_bad_steps": 2, "loss_spike_factor": 1.3}
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    line = assert_user_error(outcome, "at step 33", "loss_spike_factor=1.3", "after 2 skipped step(s)")
    assert "training diverged" in line
    assert "step 31: loss" in outcome.stderr and "update skipped (1 in a row" in outcome.stderr
    records = metrics(run)
    assert [r["step"] for r in records if r.get("skipped_update")] == [31, 32]
    # 30 is protected; 32 holds the weights of step 30 (both updates skipped)
    assert checkpoint_steps(run) == ["30", "32"]
