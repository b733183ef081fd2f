"""Run folders that not every rank sees: ``checkpoints.checkpoints_path_is_shared_file_system: false``.

The same ``checkpoints_path`` may then name a different folder on each node (a local disk). Each folder must hold a
checkpoint complete for the ranks that see it, since they resume from it alone:

* every box of a logical tensor that one of its ranks holds is written into it once, by the lowest of its ranks
  holding that box (a replicated tensor is written once per folder, not once in all);
* its lowest rank does what global rank 0 does on a shared file system: the lock, the temporary folder, the rename,
  ``latest.txt``, ``checkpoint.json`` (listing the folder's own files, and the ranks they are for: ``node_ranks``)
  and pruning;
* a loader verifies its own folder's files, and refuses a checkpoint saved for other ranks or another layout (its
  folder lacks their files).

Which ranks share a folder is found out, not assumed: the lowest rank of each node (torchrun's ``GROUP_RANK``)
creates a file of a name fresh to this run in its folder and looks for the other nodes' files. Nodes that see each
other's files share their folder; when every node does, the run saves exactly as on a shared file system.

A resume does not depend on the order in which the nodes join: a launcher that numbers them as they join (torchrun's
c10d rendezvous) may give a node another node rank than it saved with, so before the process grid is built, each
process takes the rank whose files its folder holds (``take_the_ranks_of_node_folders``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from nanotron.checkpoint.run_folder import METADATA, complete_checkpoints, resolve_checkpoint
from nanotron.checkpoint.run_lock import not_writable
from nanotron.config.checkpoints import CheckpointsArgs
from nanotron.errors import CheckpointError
from nanotron.layout import Axis, Layout
from nanotron.parallel.context import ParallelContext, default_device, init_distributed, rejoin_as
from nanotron.parallel.placement import Placement

logger = logging.getLogger(__name__)

PROBE_PREFIX = ".node-probe-"
NODE_RANKS = "node_ranks"  # checkpoint.json: the ranks a folder's files are for (absent: every rank)
SHARED_KEY = "checkpoints.checkpoints_path_is_shared_file_system"


@dataclass(frozen=True)
class FolderRanks:
    """The ranks that see this rank's run folder (every rank on a shared file system), and their coordinates."""

    rank: int
    world_size: int
    ranks: tuple[int, ...]
    coordinates: dict[int, dict[Axis, int]] = field(default_factory=dict)  # of ``ranks``, when not shared

    @classmethod
    def everyone(cls, parallel_context: ParallelContext) -> FolderRanks:
        return cls(parallel_context.rank, parallel_context.world_size, tuple(range(parallel_context.world_size)))

    @classmethod
    def find(cls, root: Path, shared_file_system: bool, parallel_context: ParallelContext) -> FolderRanks:
        """The ranks sharing this rank's ``root``: every rank if ``shared_file_system``, else as the nodes' probe
        files show. Collective (all ranks) unless ``shared_file_system``."""
        pc = parallel_context
        if shared_file_system or pc.world_size == 1:
            return cls.everyone(pc)
        nodes: list[str] = [None] * pc.world_size  # type: ignore[list-item]
        dist.all_gather_object(nodes, os.environ.get("GROUP_RANK", "0"))
        lowest = {node: rank for rank, node in reversed(list(enumerate(nodes)))}  # each node's lowest rank
        firsts = sorted(lowest.values())
        first = lowest[nodes[pc.rank]]
        token = [secrets.token_hex(8)]
        dist.broadcast_object_list(token, src=0)
        probe = root / f"{PROBE_PREFIX}{token[0]}-"
        seen, problem = None, None
        if pc.rank == first:
            try:
                root.mkdir(parents=True, exist_ok=True)
                Path(f"{probe}{pc.rank}").touch()
            except OSError as error:
                problem = str(not_writable(root, error))
        problems: list[str | None] = [None] * pc.world_size
        dist.all_gather_object(problems, problem)
        if any(problems):
            raise CheckpointError(next(p for p in problems if p))
        if pc.rank == first:  # each name is new to this run: no cache of a shared file system can answer for it
            seen = next(other for other in firsts if Path(f"{probe}{other}").exists())
        folders: list[int | None] = [None] * pc.world_size  # the lowest node sharing a node's folder
        dist.all_gather_object(folders, seen)
        if pc.rank == first:
            Path(f"{probe}{pc.rank}").unlink()
        ranks = tuple(r for r, node in enumerate(nodes) if folders[lowest[node]] == folders[first])
        if len(ranks) == pc.world_size:
            if pc.rank == 0:
                logger.warning(f"{SHARED_KEY} is false but every node sees {root}: checkpoints are saved once, as on "
                               "a shared file system")
            return cls.everyone(pc)
        return cls(pc.rank, pc.world_size, ranks, {r: pc.layout.coordinates(r) for r in ranks})

    @property
    def shared(self) -> bool:
        return len(self.ranks) == self.world_size

    @property
    def is_main(self) -> bool:
        """Whether this rank keeps the folder's books (lock, completion, ``latest.txt``, pruning)."""
        return self.rank == self.ranks[0]

    def same_checkpoint(self, path: Path | None) -> Path | None:
        """The checkpoint every folder resumes from, given the path to resume from (a run folder or a checkpoint;
        None: start from scratch), or the path unchanged on a shared file system. A save interrupted while the nodes
        completed it leaves some folders a checkpoint ahead: every folder resumes from the newest checkpoint they all
        hold. Collective (all ranks) unless shared."""
        if self.shared:
            return path
        mine, problem = None, None
        if path is not None:
            try:
                mine = resolve_checkpoint(path)
            except CheckpointError as error:
                problem = str(error)
        complete = [c.name for c in complete_checkpoints(mine.parent)] if mine is not None else []
        answers: list[tuple] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(answers, (mine and mine.name, complete, problem))
        if any(problem for *_, problem in answers):
            raise CheckpointError(next(problem for *_, problem in answers if problem))
        names = [name for name, *_ in answers]
        if len(set(names)) == 1:
            return mine
        if None in names:
            raise CheckpointError(
                f"{path} holds a checkpoint on ranks {describe_ranks([r for r, n in enumerate(names) if n])} but none "
                f"on ranks {describe_ranks([r for r, n in enumerate(names) if n is None])} ({SHARED_KEY}: false, each "
                "node resuming from its own folder); restore those nodes' folders, or start over in a new "
                "checkpoints_path")
        common = [name for name in answers[0][1] if all(name in held for _, held, _ in answers)]
        if not common:
            raise CheckpointError(f"the nodes' folders {path} hold no checkpoint in common (their latest: "
                                  f"{', '.join(sorted(set(names)))}); restore one checkpoint on every node")
        if self.rank == 0:
            latest = ", ".join(sorted(set(names)))
            logger.warning(f"the nodes' folders {path} name different latest checkpoints ({latest}: a save was "
                           f"interrupted): resuming from {common[-1]}, the newest they all hold")
        return mine.parent / common[-1]

    def boxes_to_write(self, placement: Placement, coords: dict[Axis, int],
                       sizes: dict[Axis, int]) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
        """This rank's boxes of ``placement`` that no lower rank of its folder holds: together, each box held in the
        folder, once (not shared: the shared rule is ``Placement.is_unique_copy``)."""
        stages = placement.pipeline_copies or (coords[Axis.PP],)
        lower = [self.coordinates[r] for r in self.ranks if r < self.rank and self.coordinates[r][Axis.PP] in stages]
        taken = {_key(logical) for other in lower for _, logical in placement.boxes(other, sizes)}
        return [(local, logical) for local, logical in placement.boxes(coords, sizes) if _key(logical) not in taken]


def take_the_ranks_of_node_folders(checkpoints: CheckpointsArgs) -> None:
    """Before the process grid is built, where nodes keep folders of their own and the run resumes: each process takes
    the world rank whose files its node's folder holds.

    A launcher that numbers the nodes as they join (torchrun's c10d rendezvous, which ``examples/slurm`` uses) may
    give a node another node rank than it had when it saved, and its folder then holds another node's ranks' files.
    Each process reads the ranks that its folder's checkpoint is for (``node_ranks``); where the folders hold every
    rank once, as many as the processes that see each folder, each folder's ranks go to its processes in launch
    order and the process group is formed again with those ranks. Anything else (no checkpoint, a folder copied,
    lost or of another layout) is left to the checks that follow, which refuse it in one line."""
    if checkpoints.checkpoints_path_is_shared_file_system or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_distributed(device)
    path = Path(checkpoints.checkpoints_path) if checkpoints.resumes_if_present else checkpoints.resume_checkpoint_path
    node, held = os.environ.get("GROUP_RANK", "0"), _held_ranks(path)
    answers: list[tuple] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(answers, (node, held))
    ranks = _ranks_by_folder([held for _, held in answers])
    if ranks is None or ranks == list(range(len(ranks))):
        return
    rank = dist.get_rank()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and ranks[rank] != rank:
        numbered = [process for process, (other, _) in enumerate(answers) if other == node]
        logger.warning(f"the launcher numbered this node's processes {describe_ranks(numbered)} but its folder {path} "
                       f"holds the files of ranks {describe_ranks(list(held))} ({SHARED_KEY}: false): they take those "
                       "ranks")
    rejoin_as(ranks[rank], device)


def _held_ranks(path: Path | None) -> tuple[int, ...] | None:
    """The ranks whose files the checkpoint at ``path`` (a run folder or a checkpoint) holds where it holds only some
    ranks' files; None otherwise, or where there is none."""
    if path is None:
        return None
    try:
        metadata = json.loads((resolve_checkpoint(Path(path)) / METADATA).read_text(encoding="utf-8"))
    except (CheckpointError, OSError, ValueError):
        return None
    ranks = metadata.get(NODE_RANKS) if isinstance(metadata, dict) else None
    if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        return None
    return tuple(sorted(ranks))


def _ranks_by_folder(held: list[tuple[int, ...] | None]) -> list[int] | None:
    """The world rank each process takes, given the ranks whose files each one's folder holds: each folder's ranks
    go to the processes naming them, in launch order. None where a folder names no ranks, or the folders do not hold
    every rank once, each as many ranks as the processes that see it."""
    if None in held:
        return None
    folders: dict[tuple[int, ...], list[int]] = {}
    for process, ranks in enumerate(held):
        folders.setdefault(ranks, []).append(process)
    every_rank_once = sorted(rank for ranks in folders for rank in ranks) == list(range(len(held)))
    if not every_rank_once or any(len(ranks) != len(processes) for ranks, processes in folders.items()):
        return None
    taken = [0] * len(held)
    for ranks, processes in folders.items():
        for process, rank in zip(processes, ranks):
            taken[process] = rank
    return taken


def _key(box: tuple[slice, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in box)


def describe_ranks(ranks: list[int]) -> str:
    """``0-3`` for a run of consecutive ranks, else the list."""
    consecutive = len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1))
    return f"{ranks[0]}-{ranks[-1]}" if consecutive else ", ".join(map(str, ranks))


def node_checkpoint_problem(checkpoint: Path, metadata: dict, rank: int, layout: Layout) -> str | None:
    """Why this rank cannot load ``checkpoint`` if it holds only the files of some ranks (``node_ranks``): it was
    saved for other ranks or at another grid than ``layout``'s, whose files are on other nodes' folders. None when
    it can."""
    node_ranks = metadata.get(NODE_RANKS)
    if node_ranks is None:
        return None
    saved = Layout(**Layout.recorded(metadata["layout"]))
    same_grid = saved.grid_shape == layout.grid_shape
    if same_grid and rank in node_ranks:
        return None
    differs = (f"this run's layout is {layout.describe_grid()}" if not same_grid
               else f"rank {rank} now runs here, and the nodes' folders do not hold every rank's files once (restore "
                    "the folder each node saved)")
    return (f"{checkpoint} holds only the files of ranks {describe_ranks(node_ranks)} of a run at "
            f"{saved.describe_grid()} (saved with {SHARED_KEY}: false, each node keeping its own ranks' files), but "
            f"{differs}; resume at the layout and on the nodes that saved it (a run that changes its layout needs "
            f"{SHARED_KEY}: true and one folder that every node sees)")
