"""``checkpoints_path_is_shared_file_system: false``: two "nodes" on this machine (two torchrun agents joined by a
c10d rendezvous), each started in a folder of its own, so that the relative ``checkpoints_path`` names a different
folder on each, which the other node never sees. Each folder gets a checkpoint complete for its node's ranks, and
a run stopped and resumed with ``auto`` continues exactly as an uninterrupted one."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT
from support.configs import short_config, write_config
from support.distributed import run_distributed
from support.processes import wait_for_all
from support.runs import assert_user_error, cli, fresh_environment, metrics

TIMEOUT_S = 240
ENV = fresh_environment(OMP_NUM_THREADS="1",
                        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
RUN = "run"  # checkpoints_path, relative: each node's own folder <node>/run
TOTAL_STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_on_nodes(config_path: Path, nodes: list[Path], ranks_per_node: int = 1) -> None:
    """One torchrun agent per node folder (its working directory), all joined by one rendezvous; every agent exits
    0. Agents start in the order of ``nodes``: c10d ranks agents of one host by their process ids, so that the first
    folder's node gets node rank 0."""
    agent = ["--nnodes", str(len(nodes)), "--nproc-per-node", str(ranks_per_node), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "nodes"]
    processes, logs = [], []
    for node in nodes:
        node.mkdir(exist_ok=True)
        logs.append(node / "agent.log")
        with open(logs[-1], "a") as out:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", *agent, str(ROOT / "run_train.py"), "--config-file",
                 str(config_path)], cwd=node, stdout=out, stderr=subprocess.STDOUT, env=ENV))
    wait_for_all(processes, logs, TIMEOUT_S)


def _node_config(tiny_data, tmp_path: Path, name: str, steps: int, parallelism: dict) -> Path:
    config = short_config(tiny_data, Path(RUN), steps, parallelism=parallelism,
                          checkpoints={"checkpoint_interval": 3, "resume_checkpoint_path": "auto",
                                       "checkpoints_path_is_shared_file_system": False})
    config["tokens"]["micro_batch_size"] = 8 // parallelism.get("dp", 1) // 2  # a global batch of 8 sequences
    config["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = TOTAL_STEPS  # the same schedule if stopped
    return write_config(tmp_path / f"{name}.yaml", config)


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def _tensor_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            names |= {entry["name"] for entry in json.loads(handle.metadata()["nanotron"])["entries"].values()}
    return names


def _check_node_folders(nodes: list[Path], step: int) -> None:
    """Each node's checkpoint lists exactly its own files, has the random generators of its own rank only, and
    holds every tensor its rank needs, also those whose only copy in a shared save would be on the other node."""
    for rank, node in enumerate(nodes):
        checkpoint = node / RUN / str(step)
        metadata = json.loads((checkpoint / "checkpoint.json").read_text())
        assert metadata["node_ranks"] == [rank]
        assert _files(checkpoint) == {*metadata["files"], "checkpoint.json", "config.yaml"}
        assert {name for name in metadata["files"] if name.startswith("rng/")} == {f"rng/rank-{rank:05d}.safetensors"}
        assert (node / RUN / "latest.txt").read_text().strip() == str(step)


@pytest.mark.parametrize("parallelism", [
    # Every tensor replicated: node 1's copies have their unique copy on node 0. The default tier resumes node
    # folders in test_node_folders_resume_whatever_order_the_nodes_join_in.
    pytest.param({"dp": 2}, marks=pytest.mark.full_tier),
    # Tied embeddings, a copy on each stage, one per node; norms replicated over tensor-parallel ranks. The box
    # choice for these is covered in every tier by test_each_folder_gets_every_box_its_ranks_hold_once.
    pytest.param({"pp": 2}, marks=pytest.mark.full_tier),
    pytest.param({"tp": 2}, marks=pytest.mark.full_tier),
], ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
@pytest.mark.slow
def test_each_node_keeps_its_own_ranks_files_and_the_run_resumes_exactly(tiny_data, tmp_path, parallelism):
    straight = [tmp_path / "straight0", tmp_path / "straight1"]
    _train_on_nodes(_node_config(tiny_data, tmp_path, "straight", TOTAL_STEPS, parallelism), straight)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    _train_on_nodes(_node_config(tiny_data, tmp_path, "first", 3, parallelism), nodes)  # stops after step 3
    _check_node_folders(nodes, 3)
    assert not (nodes[1] / RUN / "metrics.jsonl").exists()  # rank 0 logs, on its node
    if "dp" in parallelism:  # node 1 has whole tensors of its own, although node 0 holds their unique copies
        for kind in ("model", "optimizer"):
            assert _tensor_names(nodes[1] / RUN / "3" / kind) == _tensor_names(nodes[0] / RUN / "3" / kind)
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    stale = {"host": socket.gethostname(), "pid": dead.pid, "started": "earlier"}
    (nodes[1] / RUN / "run.lock").write_text(json.dumps(stale))  # node 1's own lock, left by a killed run

    _train_on_nodes(_node_config(tiny_data, tmp_path, "resumed", TOTAL_STEPS, parallelism), nodes)
    assert f"removed the lock of {RUN} left by pid {dead.pid}" in (nodes[1] / "agent.log").read_text()
    assert "resumed from run/3 at step 3" in (nodes[0] / "agent.log").read_text()
    _check_node_folders(nodes, TOTAL_STEPS)
    reference = {r["step"]: r["lm_loss"] for r in metrics(straight[0] / RUN)}
    assert sorted(reference) == list(range(1, TOTAL_STEPS + 1))
    assert {r["step"]: r["lm_loss"] for r in metrics(nodes[0] / RUN)} == reference

    checked = cli("checkpoint", "verify", nodes[1] / RUN)
    assert checked.code == 0 and "one node's folder: the files of ranks 1" in checked.stdout, checked.stderr
    converted = cli("convert", "nanotron-to-hf", "--ckpt-path", nodes[1] / RUN, "--save-path", tmp_path / "hf")
    if "dp" in parallelism:  # the nodes split only the data: each folder holds the whole model
        assert converted.code == 0 and (tmp_path / "hf" / "model.safetensors").exists(), converted.stderr
    else:
        assert_user_error(converted, str(nodes[1] / RUN / str(TOTAL_STEPS) / "model"))
    # Another layout cannot find the other node's files: refused before anything is built.
    other = short_config(tiny_data, tmp_path / "other", TOTAL_STEPS + 2,
                         checkpoints={"resume_checkpoint_path": str(nodes[1] / RUN),
                                      "checkpoints_path_is_shared_file_system": False})
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "other.yaml", other)),
                      "holds only the files of ranks 1", "checkpoints_path_is_shared_file_system: false",
                      "this run's layout is pp=1, dp=1, ep=1, cp=1, tp=1", "resume at the layout")


@pytest.mark.full_tier
def test_node_folders_resume_whatever_order_the_nodes_join_in(tiny_data, tmp_path):
    """c10d numbers the nodes in the order it ranks their agents (here: by process id). Resumed with the agents started
    the other way round, the processes of node 1's folder, which holds rank 1's files, join as rank 0: each process
    takes the rank whose files its folder holds, and the run goes on exactly as an uninterrupted one. At tp=2 each
    folder holds its rank's half of every sharded tensor, so the other node's rank could not load from it."""
    parallelism = {"tp": 2}
    straight = [tmp_path / "straight0", tmp_path / "straight1"]
    _train_on_nodes(_node_config(tiny_data, tmp_path, "straight", TOTAL_STEPS, parallelism), straight)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    _train_on_nodes(_node_config(tiny_data, tmp_path, "first", 3, parallelism), nodes)
    _check_node_folders(nodes, 3)
    _train_on_nodes(_node_config(tiny_data, tmp_path, "resumed", TOTAL_STEPS, parallelism), nodes[::-1])
    assert "launcher numbered this node's processes 0 but its folder run holds the files of ranks 1" in (
        nodes[1] / "agent.log").read_text()
    _check_node_folders(nodes, TOTAL_STEPS)
    reference = {r["step"]: r["lm_loss"] for r in metrics(straight[0] / RUN)}
    assert sorted(reference) == list(range(1, TOTAL_STEPS + 1))
    assert {r["step"]: r["lm_loss"] for r in metrics(nodes[0] / RUN)} == reference


def _placements():
    from nanotron.parallel.placement import Placement, Shard

    return [
        Placement("norm", (8,)),  # replicated everywhere
        Placement("tied", (16, 8), (Shard("tp", 0),), pipeline_copies=(0, 1)),  # on the first and last stage
        # q (4 heads) | k | v (2 kv heads each) of head_dim 2: with tp=4, pairs of tp ranks hold the same kv head.
        Placement("qkv", (16, 8), (Shard("tp", 0, chunks=(8, 4, 4), units=(2, 2, 2)),)),
        Placement("experts", (2, 8, 4), (Shard("ep", 0), Shard("tp", 1))),
    ]


@pytest.mark.parametrize("layout", [(1, 2, 1, 1), (2, 1, 1, 2), (1, 1, 1, 4), (1, 2, 2, 2), (2, 2, 1, 4)],
                         ids=lambda sizes: "pp{}-dp{}-ep{}-tp{}".format(*sizes))
def test_each_folder_gets_every_box_its_ranks_hold_once(layout):
    """Whatever nodes split the grid, each folder receives exactly the boxes its ranks hold, each once; a folder
    that every rank sees receives exactly the boxes of a shared save (each box's unique copy)."""
    from nanotron.checkpoint.node_folders import FolderRanks
    from nanotron.layout import Axis, Layout

    pp, dp, ep, tp = layout
    grid = Layout(pp=pp, dp=dp, ep=ep, tp=tp)
    sizes, world = grid.sizes, range(grid.world_size)
    coordinates = {rank: grid.coordinates(rank) for rank in world}
    stage = {0: 0, 1: pp - 1}
    for per_node, placement in itertools.product([n for n in (1, 2, 4) if len(world) % n == 0], _placements()):
        holders = [r for r, c in coordinates.items()
                   if c[Axis.PP] in ([stage[s] for s in placement.pipeline_copies] or [0])]
        if placement.pipeline_copies and pp > 1:
            placement.pipeline_copies = (0, pp - 1)
        for first in range(0, len(world), per_node):
            ranks = tuple(range(first, first + per_node))
            written, held = [], set()
            for rank in ranks:
                if rank not in holders:
                    continue
                folder = FolderRanks(rank, len(world), ranks, {r: coordinates[r] for r in ranks})
                written += [_box(b) for _, b in folder.boxes_to_write(placement, coordinates[rank], sizes)]
                held |= {_box(b) for _, b in placement.boxes(coordinates[rank], sizes)}
            assert sorted(written) == sorted(held), (per_node, placement.name, ranks)
        unique = [_box(b) for r in holders if placement.is_unique_copy(coordinates[r])
                  for _, b in placement.boxes(coordinates[r], sizes, unique=True)]
        everyone = [_box(b) for r in holders
                    for _, b in FolderRanks(r, len(world), tuple(coordinates), coordinates).boxes_to_write(
                        placement, coordinates[r], sizes)]
        assert sorted(everyone) == sorted(unique), placement.name


def _box(box: tuple[slice, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in box)


def _complete_checkpoint(run: Path, step: int, saved_at: float) -> None:
    (run / str(step)).mkdir(parents=True)
    (run / str(step) / "checkpoint.json").write_text(json.dumps({"saved_at": saved_at}))
    (run / "latest.txt").write_text(f"{step}\n")


def _find_folders(runs: list[list[str]]) -> list[dict]:
    """On each rank (a node of its own), for each run (its folder on each node): the ranks sharing this rank's folder,
    the checkpoint they resume from with ``auto``, and what the folder holds afterwards."""
    import torch.distributed as dist

    from nanotron.checkpoint.node_folders import FolderRanks
    from nanotron.checkpoint.run_folder import describe_existing_run
    from nanotron.errors import CheckpointError
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(Layout(dp=2))
    os.environ["GROUP_RANK"] = str(pc.rank)
    results = []
    for roots in runs:
        root = Path(roots[pc.rank])
        folder = FolderRanks.find(root, False, pc)
        try:
            resumed = str(folder.same_checkpoint(root if describe_existing_run(root) else None))
        except CheckpointError as error:
            resumed = f"error: {error}"
        dist.barrier()  # every node has removed its probe file
        results.append({"ranks": folder.ranks, "shared": folder.shared, "resumed": resumed,
                        "left": sorted(os.listdir(root))})
    return results


def test_nodes_find_which_folders_they_share_and_resume_from_a_checkpoint_they_all_hold(tmp_path):
    shared = tmp_path / "shared"
    _complete_checkpoint(shared, 2, 1.0)
    interrupted = [tmp_path / "interrupted0", tmp_path / "interrupted1"]  # a save stopped between the two nodes'
    for node in interrupted:                                               # completions: node 1 lacks step 3
        _complete_checkpoint(node, 2, 1.0)
    _complete_checkpoint(interrupted[0], 3, 2.0)
    replaced = [tmp_path / "replaced0", tmp_path / "replaced1"]  # node 1's folder is empty (a node replaced)
    _complete_checkpoint(replaced[0], 2, 1.0)
    replaced[1].mkdir()
    runs = [[str(shared)] * 2, [str(node) for node in interrupted], [str(node) for node in replaced]]
    results = list(zip(*run_distributed(_find_folders, 2, runs=runs)))

    assert [r["ranks"] for r in results[0]] == [(0, 1), (0, 1)] and all(r["shared"] for r in results[0])
    assert [r["resumed"] for r in results[0]] == [str(shared)] * 2  # unchanged: resolved as on a shared file system
    assert all(r["left"] == ["2", "latest.txt"] for r in results[0])  # no probe file left behind
    assert [r["ranks"] for r in results[1]] == [(0,), (1,)] and not any(r["shared"] for r in results[1])
    assert [r["resumed"] for r in results[1]] == [str(node / "2") for node in interrupted]
    assert all(r["resumed"].startswith("error: ") and "none on ranks 1" in r["resumed"] for r in results[2])


def test_a_node_folder_refuses_ranks_it_holds_no_files_for():
    """A record written before the ep and cp axes existed reads as ep = cp = 1 (``Layout.recorded``)."""
    from nanotron.checkpoint.node_folders import node_checkpoint_problem
    from nanotron.layout import Layout

    metadata = {"node_ranks": [2, 3], "layout": {"pp": 1, "dp": 2, "tp": 2, "zero_stage": 0}}
    layout = Layout(dp=2, tp=2)
    assert node_checkpoint_problem(Path("run/3"), metadata, 2, layout) is None
    problem = node_checkpoint_problem(Path("run/3"), metadata, 0, layout)
    assert "holds only the files of ranks 2-3" in problem and "rank 0 now runs here" in problem
    problem = node_checkpoint_problem(Path("run/3"), metadata, 2, Layout(dp=2, cp=2))
    assert "of a run at pp=1, dp=2, ep=1, cp=1, tp=2" in problem and "layout is pp=1, dp=2, ep=1, cp=2, tp=1" in problem
