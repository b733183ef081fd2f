"""The Layout: the grid's coordinates and groups as the process groups are built, the token shares, the micro-batches
in flight and the checkpoint record, each computed in one place."""

import math

import pytest
import torch

from nanotron.config import load_config
from nanotron.layout import GRID_AXES, Axis, Group, Layout
from support import ROOT

LAYOUTS = [Layout(pp=2, dp=2, ep=1, cp=2, tp=2), Layout(pp=1, dp=3, ep=2, cp=1, tp=2), Layout(pp=3, dp=1, ep=2, cp=2)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_coordinates_and_group_ranks_follow_the_grid_the_process_groups_are_cut_from(layout):
    grid = torch.arange(layout.world_size).reshape(layout.grid_shape)
    for group in (group for group in Group if not {Axis.DP_SHARD, Axis.DP_REPLICATE} & set(group.axes)):
        keep = [GRID_AXES.index(axis) for axis in group.axes]
        other = [i for i in range(len(GRID_AXES)) if i not in keep]
        slices = grid.permute(*other, *keep).reshape(-1, math.prod(grid.shape[i] for i in keep)).tolist()
        assert layout.group_members(group) == slices
        assert all(len(ranks) == layout.size(group) for ranks in slices)
        for ranks in slices:
            for index, rank in enumerate(ranks):
                coordinates = layout.coordinates(rank)
                assert layout.rank_of(coordinates) == rank
                assert layout.group_rank(group, coordinates) == index, (group, rank)


def test_hsdp_splits_dp_into_replicas_of_neighbouring_shard_groups():
    """dp 4 = 2 replicas x 2 shards, with ep 2: a dense weight's shards span dp_shard x ep (4 neighbouring ranks),
    an expert's dp_shard only, and each shard's replicas the two halves of dp."""
    layout = Layout(dp=4, ep=2, dp_shard=2, zero_stage=3)
    assert (layout.dps, layout.dpr, layout.size(Group.DENSE_SHARDS), layout.size(Group.SHARD_REPLICAS)) == (2, 2, 4, 2)
    assert layout.group_members(Group.DENSE_SHARDS) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.group_members(Group.EXPERT_SHARDS) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.group_members(Group.SHARD_REPLICAS) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for group in (Group.DENSE_SHARDS, Group.EXPERT_SHARDS, Group.SHARD_REPLICAS):
        for ranks in layout.group_members(group):
            assert [layout.group_rank(group, layout.coordinates(rank)) for rank in ranks] == list(range(len(ranks)))
    plain = Layout(dp=4, zero_stage=3)  # without HSDP the shard groups are the replica groups
    assert plain.served_by(Group.DENSE_SHARDS) == Group.DENSE_REPLICAS and plain.served_by(Group.SHARD_REPLICAS) is None
    assert layout.served_by(Group.DENSE_SHARDS) == Group.DENSE_SHARDS
    assert "optimizer.zero_stage is 0" in next(Layout(dp=4, dp_shard=2).problems())


def test_the_config_sets_every_size_and_token_setting():
    config = load_config(ROOT / "examples" / "config_tiny_llama.yaml", [
        "parallelism.pp=2", "parallelism.dp=3", "parallelism.tp=2", "parallelism.context_parallel_size=2",
        "parallelism.tp_mode=REDUCE_SCATTER", "parallelism.tp_linear_async_communication=true",
        "parallelism.pp_engine=afab", "optimizer.zero_stage=1", "tokens.sequence_length=64",
        "tokens.micro_batch_size=3", "tokens.batch_accumulation_per_replica=5"])
    assert Layout.from_config(config) == Layout(
        pp=2, dp=3, cp=2, tp=2, sequence_parallel=True, overlapped_linears=True, pp_engine="afab", zero_stage=1,
        sequence_length=64, micro_batch_size=3, accumulation=5)
    assert config.global_batch_size == Layout.from_config(config).global_batch_size == 3 * 5 * 3


def test_token_shares_and_the_activations_between_stages():
    layout = Layout(tp=4, cp=2, sequence_parallel=True, overlapped_linears=True, sequence_length=64,
                    micro_batch_size=3)
    assert layout.rank_sequence_length == 32 and layout.stage_sequence_length == 8
    assert layout.stage_activation_shape(16) == (3, 8, 16)
    assert (layout.residual_share, layout.linear_input_share) == (0.25, 0.25)
    plain = Layout(tp=4, sequence_length=64)
    assert plain.stage_sequence_length == 64 and (plain.residual_share, plain.linear_input_share) == (1.0, 1.0)


def test_micro_batches_in_flight_per_schedule():
    assert [Layout(pp=4, accumulation=8).in_flight(stage) for stage in range(4)] == [4, 3, 2, 1]
    assert [Layout(pp=4, accumulation=2).in_flight(stage) for stage in range(4)] == [2, 2, 2, 1]
    assert [Layout(pp=2, accumulation=8, pp_engine="afab").in_flight(stage) for stage in range(2)] == [8, 8]
    assert Layout(pp=1, accumulation=8, pp_engine="afab").in_flight(0) == 1  # one stage: plain accumulation
    # a loss pooled over the global batch (the experts' balance over it): one stage runs every forward first
    assert Layout(pp=1, accumulation=8, forwards_first=True).in_flight(0) == 8
    assert "gradient accumulation, every forward first" in Layout(accumulation=8, forwards_first=True).summary()


@pytest.mark.parametrize("layout", [Layout(pp=4, accumulation=8), Layout(pp=4, accumulation=2),
                                    Layout(pp=3, accumulation=5, pp_engine="afab"), Layout(accumulation=3),
                                    Layout(accumulation=3, forwards_first=True)])
def test_the_actions_the_schedule_runs_hold_the_micro_batches_the_planner_counts(layout):
    """The executor runs the schedule's actions in order: counted along them, the activations held at once are
    ``in_flight``, for any number of micro-batches: ``min(pp - stage, m)`` under 1F1B, every one under AFAB."""
    for micro_batches in range(1, 10):
        for stage in range(layout.pp):
            held = peak = 0
            for action in layout.timeline(micro_batches).schedule.actions(stage):
                held += 1 if action.op == "F" else -1
                peak = max(peak, held)
            assert peak == layout.in_flight(stage, micro_batches), (stage, micro_batches)
            assert peak == (micro_batches if layout.schedule == "afab" else min(layout.pp - stage, micro_batches))
        assert layout.in_flight(0) == layout.in_flight(0, layout.accumulation)


def test_the_layout_in_one_line_and_its_grid_in_messages():
    layout = Layout(pp=2, dp=3, tp=2, pp_engine="afab", micro_batch_size=4, sequence_length=256, accumulation=8)
    assert layout.summary() == "dp 3 x ep 1 x cp 1 x tp 2 x pp 2 (AFAB), micro-batch 4 x 256 tokens, 8 per step"
    assert "(gradient accumulation)" in Layout(pp_engine="afab").summary()
    assert layout.describe_grid() == "pp=2, dp=3, ep=1, cp=1, tp=2"
    assert Layout(cp=2, sequence_length=64, micro_batch_size=3).rank_tokens == 3 * 32


def test_global_batch_and_sample_shards():
    layout = Layout(dp=2, ep=3, cp=2, micro_batch_size=2, accumulation=4)
    assert layout.global_batch_size == 2 * 4 * 2 * 3
    shards = {layout.sample_shard(layout.coordinates(rank)) for rank in range(layout.world_size)}
    assert shards == set(range(layout.size(Group.SAMPLE_SHARDS)))


def test_rules_between_the_sequence_and_the_split():
    assert "2 x parallelism.context_parallel_size" in next(Layout(cp=3, sequence_length=10).problems())
    assert "divisible by parallelism.tp" in next(Layout(cp=2, tp=4, sequence_parallel=True,
                                                        sequence_length=12).problems())
    assert "divisible by parallelism.tp (4)" in next(Layout(tp=4, sequence_parallel=True, sequence_length=6).problems())
    assert list(Layout(cp=2, tp=2, sequence_parallel=True, sequence_length=16).problems()) == []


def test_checkpoint_record_reads_records_written_before_an_axis_existed():
    layout = Layout(pp=2, dp=2, tp=2, zero_stage=1)
    assert layout.to_dict() == {"pp": 2, "dp": 2, "ep": 1, "cp": 1, "tp": 2, "zero_stage": 1, "dp_shard": 2}
    assert Layout.recorded({"dp": 2, "pp": 2, "tp": 2, "zero_stage": 1}) == layout.to_dict()
    assert layout.describe(layout.coordinates(5)) == "DP=0|PP=1|TP=1"
    assert Axis.CP == "cp" and layout.size(Axis.DP) == 2
