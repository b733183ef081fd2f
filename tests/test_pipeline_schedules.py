"""Pipeline schedules as data (``pipeline_schedules.py``): each stage's order against the published schedules, the
bubble and the activations each holds, the order of messages, and the rules on chunks and micro-batches."""

from __future__ import annotations

import types

import pytest

from nanotron.config import ConfigError
from nanotron.layout import Layout
from nanotron.pipeline_schedules import SCHEDULES, ScheduleError, schedule_for, schedule_problems
from support.configs import tiny_config_dict, write_config
from support.runs import assert_user_error, cli

VIRTUAL = {"afab": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zbv": 2}


def _pytorch_order(name: str, pp: int, virtual: int, micro_batches: int, stage: int) -> list[str]:
    """The order ``torch.distributed.pipelining`` gives the same schedule (its generators, run on their own)."""
    from torch.distributed.pipelining import schedules

    rounds = max(1, micro_batches // pp)
    state = types.SimpleNamespace(pp_group_size=pp, n_local_stages=virtual, _n_microbatches=micro_batches,
                                  number_of_rounds=rounds, microbatches_per_round=micro_batches // rounds,
                                  rank=stage, num_stages=pp * virtual, _num_stages=pp)
    generator = {"interleaved_1f1b": schedules.ScheduleInterleaved1F1B,
                 "zb_h1": schedules.ScheduleInterleavedZeroBubble,
                 "zbv": schedules.ScheduleZBVZeroBubble}.get(name)
    if generator is None:  # GPipe gives every stage's order at once
        actions = schedules.ScheduleGPipe._get_pipeline_order(state)[stage]
    else:
        actions = generator._calculate_single_rank_operations(state, stage)
    return [str(action) for action in actions if action is not None and str(action)[-1].isdigit()
            and any(op in str(action) for op in "FBIW")]


@pytest.mark.parametrize("name", ["afab", "interleaved_1f1b", "zb_h1", "zbv"])
def test_every_stage_runs_the_published_order(name):
    """PyTorch's pipelining generators are the reference (torchtitan runs them). Its 1F1B order is for display only
    (it numbers the last stage's forwards from 1), so 1F1B is checked against the paper's order below."""
    for pp in range(1, 7):
        for micro_batches in range(1, 17):
            if list(schedule_problems(name, pp, VIRTUAL[name], micro_batches)):
                continue
            schedule = schedule_for(name, pp, VIRTUAL[name], micro_batches)
            for stage in range(pp):
                assert [str(a) for a in schedule.actions(stage)] == _pytorch_order(
                    name, pp, VIRTUAL[name], micro_batches, stage), (pp, micro_batches, stage)


# pp 4, 8 micro-batches: stage 0's order as the papers draw it (chunk, op, micro-batch in PyTorch's notation).
PUBLISHED_STAGE_0 = {
    # Narayanan et al. 2021, figure 4 (top): 3 warm-up forwards, then one forward and one backward in turn.
    "1f1b": "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
    "afab": "0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7 0B0 0B1 0B2 0B3 0B4 0B5 0B6 0B7",
    # Figure 4 (bottom): chunks 0 and 4 on stage 0, micro-batches in rounds of 4 through both chunks; 10 warm-up
    # forwards ((v - 1) pp + 2 (pp - 1)), then one forward and one backward in turn.
    "interleaved_1f1b": "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 "
                        "0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7",
    # Qi et al. 2023, figure 3 (ZB-H1): stage 0 defers no weight gradient, so I and W follow each other.
    "zb_h1": "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_STAGE_0))
def test_pp4_with_8_micro_batches_runs_the_papers_order(name):
    schedule = schedule_for(name, 4, VIRTUAL[name], 8)
    assert " ".join(map(str, schedule.actions(0))) == PUBLISHED_STAGE_0[name]


def test_zb_h1_defers_as_many_weight_gradients_as_stages_after_it():
    """Stage s runs s input backwards before its first weight backward (ZB-H1's shifted W passes)."""
    schedule = schedule_for("zb_h1", 4, 1, 8)
    for stage in range(4):
        ops = "".join(action.op.value for action in schedule.actions(stage))
        assert ops.index("W") == [i for i, op in enumerate(ops) if op == "I"][stage] + 1


# Idle units per stage (a chunk's forward is 1, its backward 2, each half 1) at pp 4 and 8 micro-batches, as the
# papers count the bubble: (pp - 1)(F + B) under AFAB and 1F1B, the same in chunk units under interleaved 1F1B
# (whose chunks are 1/v of a stage: bubble (pp - 1)/(v m) of the work), (pp - 1)(F + I - W) under ZB-H1, and ZBV's
# tail of weight gradients.
BUBBLE_UNITS = {"afab": 9, "1f1b": 9, "interleaved_1f1b": 9, "zb_h1": 3, "zbv": 3}


@pytest.mark.parametrize("name", sorted(BUBBLE_UNITS))
def test_pp4_with_8_micro_batches_idles_the_published_bubble_and_the_planner_says_so(name):
    layout = Layout(pp=4, virtual=VIRTUAL[name], pp_engine=name, accumulation=8)
    timeline = layout.timeline()
    rows = timeline.render().splitlines()[1:]
    idle = [sum(row.split()[1 + stage] == "." for row in rows) for stage in range(4)]
    assert idle == [BUBBLE_UNITS[name]] * 4
    work = 8 * VIRTUAL[name] * 3  # every chunk's forward and backward of every micro-batch
    assert len(rows) == work + BUBBLE_UNITS[name]
    assert timeline.bubble == pytest.approx(sum(idle) / (4 * len(rows)))
    assert layout.pipeline.idle_share() == BUBBLE_UNITS[name] / work  # the planner's bubble
    if name == "interleaved_1f1b":
        assert BUBBLE_UNITS[name] / work == pytest.approx((4 - 1) / (2 * 8))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_planners_bubble_is_the_timelines(name):
    """``idle_share`` (the closed form from 2 x pp micro-batches on, the timeline below) is every stage's idle time
    over its work in the simulated timeline."""
    for pp in range(2, 7):
        for micro_batches in range(1, 4 * pp):
            if list(schedule_problems(name, pp, VIRTUAL[name], micro_batches)):
                continue
            schedule = schedule_for(name, pp, VIRTUAL[name], micro_batches)
            timeline = schedule.timeline()
            for stage in range(pp):
                assert schedule.idle_share() == pytest.approx(timeline.idle(stage) / timeline.busy(stage)), (
                    pp, micro_batches, stage)


def test_activations_held_per_stage():
    """In units of one chunk's activations for a micro-batch: 1F1B holds pp - s on stage s; ZB-H1 holds 1F1B's most
    (pp) on every stage; ZBV holds 2pp chunks, half a stage each: 1F1B's most again; interleaved 1F1B holds more."""
    held = {name: [Layout(pp=4, virtual=VIRTUAL[name], pp_engine=name, accumulation=8).in_flight(stage)
                   for stage in range(4)] for name in BUBBLE_UNITS}
    assert held == {"afab": [8] * 4, "1f1b": [4, 3, 2, 1], "zb_h1": [4] * 4, "zbv": [8] * 4,
                    "interleaved_1f1b": [11, 9, 7, 5]}


def test_chunks_are_placed_round_robin_or_in_a_v():
    assert [schedule_for("interleaved_1f1b", 4, 2, 8).stage_of(c) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [schedule_for("zbv", 4, 2, 8).stage_of(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert schedule_for("zbv", 4, 2, 8).chunks_of(0) == [0, 7]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_allowed_schedule_runs_and_both_ends_agree_on_the_order_of_messages(name):
    """No stage waits for another that waits for it; each message between two stages is ready on its sender before
    any later one between them is needed (what the executor relies on to post both ends in one order)."""
    virtual_sizes = (1,) if VIRTUAL[name] == 1 else (2, 3) if name == "interleaved_1f1b" else (2,)
    for pp in range(1, 7):
        for virtual in virtual_sizes:
            for micro_batches in range(1, 20):
                if list(schedule_problems(name, pp, virtual, micro_batches)) or (pp == 1 and virtual > 1):
                    continue
                timeline = schedule_for(name, pp, virtual, micro_batches).timeline()
                for stage in range(pp):
                    for peer in range(stage + 1, pp):
                        messages = timeline.messages(stage, peer)
                        assert len(messages) == len(set(messages))


def test_interleaved_1f1b_needs_equal_rounds_of_micro_batches():
    assert list(schedule_problems("interleaved_1f1b", 4, 2, 8)) == []
    assert list(schedule_problems("interleaved_1f1b", 4, 2, 3)) == []  # one round of all of them
    (problem,) = schedule_problems("interleaved_1f1b", 4, 2, 9)
    assert "tokens.batch_accumulation_per_replica (9)" in problem and "use 8 or 10" in problem
    with pytest.raises(ScheduleError, match="does not run every chunk"):
        schedule_for("interleaved_1f1b", 4, 2, 9).timeline()


@pytest.mark.parametrize("name, pp, virtual, expected", [
    ("1f1b", 1, 2, "virtual_pipeline_size (2) splits each pipeline stage into chunks and needs parallelism.pp > 1"),
    ("1f1b", 2, 2, "1f1b runs one chunk per stage"),
    ("zb_h1", 2, 3, "zb_h1 runs one chunk per stage"),
    ("interleaved_1f1b", 2, 1, "interleaved_1f1b runs several chunks per stage"),
    ("zbv", 2, 3, "zbv runs two chunks per stage, in a V: set parallelism.virtual_pipeline_size: 2"),
])
def test_a_schedule_refuses_chunk_counts_it_does_not_run(name, pp, virtual, expected):
    (problem,) = schedule_problems(name, pp, virtual, 8)
    assert expected in problem


# --- the config, the command line, the planner ------------------------------------------------------------------


def _pipeline_config(tiny_data, folder, tokens: dict | None = None, model: dict | None = None, **parallelism) -> dict:
    base = tiny_config_dict(tiny_data, folder)
    model_config = base["model"]["model_config"] | {"num_hidden_layers": 4} | (model or {})
    return tiny_config_dict(tiny_data, folder, model=base["model"] | {"model_config": model_config},
                            parallelism={"pp": 2, **parallelism}, tokens=base["tokens"] | (tokens or {}))


@pytest.mark.parametrize("parallelism, tokens, model, fragments", [
    ({"pp_engine": "interleaved_1f1b", "virtual_pipeline_size": 3}, {}, {},
     ["num_hidden_layers (4) must be >= parallelism.pp x virtual_pipeline_size (2 x 3)"]),
    ({"pp": 1, "virtual_pipeline_size": 2}, {}, {}, ["virtual_pipeline_size (2)", "needs parallelism.pp > 1"]),
    ({"pp_engine": "interleaved_1f1b", "virtual_pipeline_size": 2}, {"batch_accumulation_per_replica": 5}, {},
     ["tokens.batch_accumulation_per_replica (5)", "use 4 or 6"]),
    ({"pp_engine": "interleaved_1f1b", "virtual_pipeline_size": 2, "pp_stage_layers": [2, 2]}, {}, {},
     ["pp_stage_layers has 2 entries", "pp x virtual_pipeline_size is 4"]),
    ({"pp_engine": "zb_h1", "recompute": "full"}, {}, {}, ["pp_engine: zb_h1", "parallelism.recompute (full)"]),
    ({"pp_engine": "zbv", "virtual_pipeline_size": 2}, {}, {}, ["pp_engine: zbv", "tie_word_embeddings"]),
    ({"pp_engine": "zbv"}, {}, {"tie_word_embeddings": False}, ["zbv runs two chunks per stage, in a V"]),
])
def test_a_pipeline_it_cannot_run_stops_the_command_with_one_line(tiny_data, tmp_path, parallelism, tokens, model,
                                                                   fragments):
    config = _pipeline_config(tiny_data, tmp_path / "run", tokens, model, **parallelism)
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "config.yaml", config)), *fragments)


def test_zero_bubble_schedules_refuse_compiled_layers(tiny_data, tmp_path):
    config = _pipeline_config(tiny_data, tmp_path / "run", pp_engine="zb_h1")
    config["model"]["compile"] = True
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "config.yaml", config)),
                      "pp_engine: zb_h1", "model.compile: false")


def test_torchtitans_names_are_read_as_ours(tiny_data, tmp_path):
    from nanotron.config import config_from_dict

    config = _pipeline_config(tiny_data, tmp_path, pp_engine="Interleaved1F1B", pipeline_parallel_layers_per_stage=1)
    parallelism = config_from_dict(config).parallelism
    assert (parallelism.pp_engine, parallelism.virtual_pipeline_size) == ("interleaved_1f1b", 2)
    assert parallelism.pp_stage_layers == [1, 1, 1, 1]
    assert config_from_dict(_pipeline_config(tiny_data, tmp_path, pp_engine="ZBVZeroBubble", virtual_pipeline_size=2,
                                             model={"tie_word_embeddings": False})).parallelism.pp_engine == "zbv"
    with pytest.raises(ConfigError, match=r"pipeline_parallel_layers_per_stage \(3\) must split"):
        config_from_dict(_pipeline_config(tiny_data, tmp_path, pipeline_parallel_layers_per_stage=3))


def test_the_schedule_command_prints_the_timeline_and_estimate_memory_the_bubble(tiny_data, tmp_path):
    config = write_config(tmp_path / "config.yaml", _pipeline_config(tiny_data, tmp_path / "run"))
    overrides = ["--override", "parallelism.pp=4", "parallelism.pp_engine=zb_h1",
                 "tokens.batch_accumulation_per_replica=8"]
    outcome = cli("schedule", "--config-file", config, *overrides)
    assert outcome.code == 0, outcome.stderr
    summary, header, *rows = outcome.stdout.splitlines()
    assert summary.startswith("pipeline: zb_h1, 8 micro-batches: bubble 11.1% of the step")
    assert summary.endswith("activations in flight per stage: 4, 4, 4, 4")
    assert header.split() == ["time", "stage", "0", "stage", "1", "stage", "2", "stage", "3"]
    assert len(rows) == 27 and rows[0].split() == ["0", "0F0", ".", ".", "."]
    assert [row.split()[1] for row in rows[4:10]] == [".", ".", ".", "0I0", "0W0", "0F4"]

    outcome = cli("estimate-memory", "--config-file", config, *overrides)
    assert outcome.code == 0, outcome.stderr
    assert summary in outcome.stdout.splitlines()
