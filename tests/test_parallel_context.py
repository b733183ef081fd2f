import pytest

from distributed import run_distributed


def _groups(tp, pp, dp, ep):
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(tp=tp, pp=pp, dp=dp, ep=ep)
    return pc.rank, pc.coordinates, {name: ranks for name, ranks in pc.group_ranks.items()}


def test_grid_layout_and_groups():
    results = run_distributed(_groups, 4, tp=2, pp=2, dp=1, ep=1)
    by_rank = {rank: (coords, groups) for rank, coords, groups in results}
    # tp is the innermost axis, pp the outermost: rank = pp*2 + tp.
    assert by_rank[0][0] == {"pp": 0, "dp": 0, "ep": 0, "cp": 0, "tp": 0}
    assert by_rank[3][0] == {"pp": 1, "dp": 0, "ep": 0, "cp": 0, "tp": 1}
    assert by_rank[0][1]["tp"] == [0, 1] and by_rank[2][1]["tp"] == [2, 3]
    assert by_rank[0][1]["pp"] == [0, 2] and by_rank[3][1]["pp"] == [1, 3]
    assert by_rank[1][1]["pp_dp_cp_ep"] == [1, 3]
    assert by_rank[1][1]["dp_ep"] == [1]


def _world_mismatch():
    from nanotron.parallel.context import ParallelContext, ParallelLayoutError

    with pytest.raises(ParallelLayoutError, match="nproc_per_node=4"):
        ParallelContext(tp=2, dp=2)
    return True


def test_world_size_mismatch_names_the_launcher_fix():
    assert run_distributed(_world_mismatch, 2) == [True, True]
