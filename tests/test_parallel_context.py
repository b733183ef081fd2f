import pytest

from nanotron.layout import Axis, Group
from support.distributed import run_distributed


def _groups(tp, pp, dp, ep):
    from nanotron.layout import Group, Layout
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(Layout(tp=tp, pp=pp, dp=dp, ep=ep))
    return pc.rank, pc.coordinates, {group: pc.members(group) for group in Group}


@pytest.mark.slow
def test_grid_layout_and_groups():
    results = run_distributed(_groups, 4, tp=2, pp=2, dp=1, ep=1)
    by_rank = {rank: (coords, groups) for rank, coords, groups in results}
    # tp is the innermost axis, pp the outermost: rank = pp*2 + tp.
    assert by_rank[0][0] == {Axis.PP: 0, Axis.DP: 0, Axis.EP: 0, Axis.CP: 0, Axis.TP: 0}
    assert by_rank[3][0] == {Axis.PP: 1, Axis.DP: 0, Axis.EP: 0, Axis.CP: 0, Axis.TP: 1}
    assert by_rank[0][1][Group.TP] == [0, 1] and by_rank[2][1][Group.TP] == [2, 3]
    assert by_rank[0][1][Group.PP] == [0, 2] and by_rank[3][1][Group.PP] == [1, 3]
    assert by_rank[1][1][Group.STATISTICS] == [1, 3]
    assert by_rank[1][1][Group.SAMPLE_SHARDS] == [1]


def _world_mismatch():
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext, ParallelLayoutError

    with pytest.raises(ParallelLayoutError, match="nproc_per_node=4"):
        ParallelContext(Layout(tp=2, dp=2))
    return True


def test_world_size_mismatch_names_the_launcher_fix():
    assert run_distributed(_world_mismatch, 2) == [True, True]
