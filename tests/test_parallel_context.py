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


def test_a_world_of_one_takes_a_port_of_its_own_whatever_master_port_it_inherits():
    """A process started by one that holds a process group inherits its ``MASTER_PORT`` (without ``RANK``): its own
    world of one must not listen there."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        environment = {name: value for name, value in os.environ.items() if name not in ("RANK", "WORLD_SIZE")}
        environment |= {"MASTER_PORT": str(taken.getsockname()[1]), "MASTER_ADDR": "127.0.0.1"}
        code = ("import torch, torch.distributed as dist\n"
                "from nanotron.parallel.context import init_distributed\n"
                "init_distributed(torch.device('cpu'))\n"
                "print(dist.get_world_size())\n")
        done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr[-2000:]
