"""Save at one layout (dp, tp, pp, ZeRO stage), resume at another: the run continues as if nothing changed."""

from __future__ import annotations

import pytest

from nanotron.data.loader import global_batch_indices, rank_micro_batches
from support.configs import tiny_config_dict
from support.parity import assert_reference_trains
from support.runs import train_on_ranks
from support.tiers import full_tier

# Save at SAVED_AT, compare every step after it: 3 of 6 steps, or 6 of 16 under NANOTRON_TEST_TIER=full.
SAVED_AT, STEPS = (6, 16) if full_tier() else (3, 6)
WARMUP = 3
Layout = tuple[int, int, int, int]  # dp, tp, pp, zero_stage
# Muon's update at AdamW's rate (RMS matching) drops the loss a little slower over the first steps.
LEARNING_RATES = {"adamw": 3e-3, "muon": 6e-3}


def config_for(tiny_data, folder, layout: Layout, resume_from=None, optimizer: str = "adamw") -> dict:
    dp, tp, pp, zero = layout
    base = tiny_config_dict(tiny_data, folder)
    model = base["model"] | {"make_vocab_size_divisible_by": 128}  # 384 rows at tp=1, 512 at tp=2
    model["model_config"] = model["model_config"] | {"num_hidden_layers": 4}
    return tiny_config_dict(
        tiny_data, folder, model=model,
        parallelism={"dp": dp, "tp": tp, "pp": pp, "tp_mode": "REDUCE_SCATTER"},
        tokens={"train_steps": STEPS, "micro_batch_size": 4 // dp, "batch_accumulation_per_replica": 2},
        optimizer=base["optimizer"] | {"zero_stage": zero, "name": optimizer, "learning_rate_scheduler": {
            "learning_rate": LEARNING_RATES[optimizer], "lr_warmup_steps": WARMUP, "lr_decay_steps": STEPS - WARMUP,
            "min_decay_lr": 3e-4}},
        checkpoints={"checkpoint_interval": SAVED_AT, "resume_checkpoint_path": resume_from, "save_final_state": False},
    )


def ranks(layout: Layout) -> int:
    dp, tp, pp, _ = layout
    return dp * tp * pp


@pytest.fixture(scope="module")
def straight_runs(tiny_data, tmp_path_factory):
    """Uninterrupted runs at the source layouts, with a checkpoint at SAVED_AT."""
    runs = {}

    def run(layout: Layout, optimizer: str = "adamw"):
        if (layout, optimizer) not in runs:
            folder = tmp_path_factory.mktemp("straight")
            config = config_for(tiny_data, folder, layout, optimizer=optimizer)
            runs[layout, optimizer] = (folder, train_on_ranks(config, ranks(layout)))
            assert_reference_trains(runs[layout, optimizer][1], STEPS)
        return runs[layout, optimizer]

    return run


# The default tier keeps one pair per mechanism: the 3D (2,2,2) ZeRO-1 state saved, and one process's state loaded
# into ZeRO-1 shards over dp, into tp shards and into pp stages. The other pairs run under NANOTRON_TEST_TIER=full;
# the quick tier keeps the tp pair.
PAIRS = [
    pytest.param((2, 2, 2, 1), (1, 1, 1, 0), "adamw", marks=pytest.mark.slow),
    pytest.param((1, 1, 1, 0), (2, 2, 2, 1), "adamw", marks=pytest.mark.full_tier),
    pytest.param((2, 2, 2, 1), (1, 2, 2, 0), "adamw", marks=pytest.mark.full_tier),
    pytest.param((2, 2, 2, 1), (1, 2, 1, 0), "adamw", marks=pytest.mark.full_tier),
    pytest.param((2, 2, 2, 1), (2, 1, 1, 0), "adamw", marks=pytest.mark.full_tier),
    pytest.param((2, 2, 2, 1), (1, 1, 2, 1), "adamw", marks=pytest.mark.full_tier),
    pytest.param((1, 1, 1, 0), (2, 1, 1, 1), "adamw", marks=pytest.mark.slow),
    ((1, 1, 1, 0), (1, 2, 1, 0), "adamw"),
    pytest.param((1, 1, 1, 0), (1, 1, 2, 0), "adamw", marks=pytest.mark.slow),
]


# Muon's momentum is resharded like Adam's moments; its update needs whole matrices, gathered at any layout: one
# pair in the default tier (one process's state into ZeRO-1 shards that cut across matrices).
MUON_PAIRS = [
    pytest.param((1, 1, 1, 0), (2, 1, 1, 1), "muon", marks=pytest.mark.slow),
    pytest.param((1, 1, 1, 0), (1, 2, 1, 0), "muon", marks=pytest.mark.full_tier),
    pytest.param((2, 2, 2, 1), (1, 1, 1, 0), "muon", marks=pytest.mark.full_tier),
    pytest.param((2, 1, 1, 3), (1, 1, 2, 0), "muon", marks=pytest.mark.full_tier),
]


@pytest.mark.full_tier
@pytest.mark.parametrize("source, target, optimizer", PAIRS + MUON_PAIRS,
                         ids=lambda value: "dp{}tp{}pp{}z{}".format(*value) if isinstance(value, tuple) else value)
def test_resume_at_another_layout_continues_the_run(straight_runs, tiny_data, tmp_path, source, target, optimizer):
    folder, straight = straight_runs(source, optimizer)
    resumed = train_on_ranks(config_for(tiny_data, tmp_path / "resumed", target, optimizer=optimizer,
                                        resume_from=str(folder / str(SAVED_AT))), ranks(target))
    assert [m["step"] for m in resumed] == list(range(SAVED_AT + 1, STEPS + 1))
    for expected, got in zip(straight[SAVED_AT:], resumed, strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), got["step"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), got["step"]
        assert (got["lr"], got["consumed_tokens"]) == (expected["lr"], expected["consumed_tokens"])


def test_data_position_survives_a_change_of_dp():
    """Samples seen over steps 0..5 at dp=2 then 6..11 at dp=1: each exactly once, as in an uninterrupted run."""
    global_batch, seen = 8, []
    # Before the save: stage steps 0..5 from sample 0. After: the resumed loader starts at the consumed samples.
    for step, first_sample, dp in [(s, 0, 2) for s in range(6)] + [(s, 6 * global_batch, 1) for s in range(6)]:
        indices = global_batch_indices(step, first_sample, global_batch)
        for rank in range(dp):
            for micro in rank_micro_batches(indices, rank, dp, global_batch // dp // 2, 2):
                seen.extend(micro)
    assert sorted(seen) == list(range(12 * global_batch))
