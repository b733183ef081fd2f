"""The process grid: the process groups of a ``Layout`` (``nanotron/layout.py``), and one rank's place in it.

World ranks are laid out as the 5-D grid of the layout (``arange(world).reshape(pp, dp, ep, cp, tp)``): tensor
parallelism innermost, so that a TP group is made of consecutive ranks (the fastest links on a node); context
parallelism next (every attention layer exchanges keys and values over it, so it stays inside a node too), then
expert parallelism (its all-to-alls stay inside a node for small degrees), then data parallelism, and pipeline
stages outermost (their point-to-point traffic is the lightest). Which ranks form a group, and what each group is
for, is the layout's (``Group``); this module creates them.

Code asks a rank's place and groups by ``Axis`` and ``Group``, never by a string: ``pc.size(Axis.CP)``,
``pc.coord(Axis.PP)``, ``pc.group(Group.TP)``, ``pc.members(Group.PP)`` (the world ranks of this rank's group, in
group order), ``pc.layout`` for every derived fact. A ``GridPosition`` answers the same questions without process
groups, for a rank this process is not (the memory planner builds every stage's model on the meta device).

All groups are created eagerly, in the same order on every rank, so that no collective ever creates a communicator
lazily (a classic source of pipeline deadlocks). With pipeline parallelism, ``pipeline_ends`` pairs the first and
last stage of each position, which both hold a copy of tied input/output embeddings.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanotron.layout import GRID_AXES, Axis, Group, Layout


class ParallelLayoutError(ValueError):
    """The launcher's world size does not match the configured parallel degrees."""


@dataclass(frozen=True)
class GroupShape:
    """What building a model reads of a process group: its size and this rank's place in it, asked as of a
    ``ProcessGroup`` (``size()``, ``rank()``). It stands for a group where a model is built on the meta device for
    a rank this process is not (the memory planner); no collective can run on it, and a meta model runs none."""

    group_rank: int
    group_size: int

    def rank(self) -> int:
        return self.group_rank

    def size(self) -> int:
        return self.group_size


class GridPosition:
    """One rank's place in the grid of ``layout``, without process groups: what ``build_stage`` reads (as a
    :class:`ParallelContext` offers it) to build that rank's part of the model on the meta device from any
    process."""

    def __init__(self, layout: Layout, coordinates: dict[Axis, int]):
        self.layout = layout
        self.coordinates = {axis: coordinates[axis] for axis in GRID_AXES}

    def size(self, axes: Axis | Group) -> int:
        """The ranks along an axis, or in a group."""
        return self.layout.size(axes)

    def coord(self, axis: Axis) -> int:
        return self.coordinates[axis]

    def group(self, group: Group) -> GroupShape:
        return GroupShape(self.layout.group_rank(group, self.coordinates), self.layout.size(group))

    @property
    def sizes(self) -> dict[Axis, int]:
        return self.layout.sizes

    @property
    def is_first_stage(self) -> bool:
        return self.coordinates[Axis.PP] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coordinates[Axis.PP] == self.layout.pp - 1

    def describe(self) -> str:
        return self.layout.describe(self.coordinates)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: torch.device) -> None:
    """Join the process group described by torchrun's variables, or form a world of one under plain ``python``, on a
    port of its own (a ``MASTER_PORT`` inherited without ``RANK`` may be the live group of the process that started
    this one).

    NCCL is bound to this rank's GPU up front, so communicators are created eagerly on the right device.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if device.type == "cuda":
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        dist.init_process_group(backend="gloo")


def rejoin_as(rank: int, device: torch.device) -> None:
    """Form the default process group again with this process as world rank ``rank``: every process calls it at once,
    each with a rank of its own. The group's store is the launcher's; the new group reads and writes its keys under a
    prefix of its own, so that nothing of the first group is taken for the second's."""
    store, world_size = dist.distributed_c10d._get_default_store(), dist.get_world_size()
    dist.destroy_process_group()
    os.environ["RANK"] = str(rank)
    store = dist.PrefixStore("nanotron-rejoined/", store)
    if device.type == "cuda":
        dist.init_process_group(backend="nccl", store=store, rank=rank, world_size=world_size, device_id=device)
    else:
        dist.init_process_group(backend="gloo", store=store, rank=rank, world_size=world_size)


def default_device() -> torch.device:
    """CUDA when present (one GPU per local rank), else the CPU; ``NANOTRON_DEVICE`` overrides."""
    name = os.environ.get("NANOTRON_DEVICE")
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


class ParallelContext(GridPosition):
    """This process's place in the grid of ``layout`` and the process groups it belongs to."""

    def __init__(self, layout: Layout, device: torch.device | None = None):
        self.device = device if device is not None else default_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_distributed(self.device)

        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        if self.world_size != layout.world_size:
            raise ParallelLayoutError(
                f"the launcher started {self.world_size} processes but parallelism.dp*pp*tp*expert_parallel_size*"
                f"context_parallel_size = {layout.dp}*{layout.pp}*{layout.tp}*{layout.ep}*{layout.cp} = "
                f"{layout.world_size}; change those keys or launch with `torchrun --nproc_per_node={layout.world_size}`"
            )
        super().__init__(layout, layout.coordinates(self.rank))

        self._grid = torch.arange(self.world_size).reshape(layout.grid_shape)
        self._groups: dict[Group, dist.ProcessGroup] = {}
        for group in Group:
            if layout.served_by(group) == group:
                self._create_groups(group)
        # First and last pipeline stage of each (dp, ep, cp, tp) position: they hold the two copies of tied embeddings.
        self.pipeline_ends: dist.ProcessGroup | None = None
        if layout.pp > 1:
            for ranks in self._grid[[0, -1]].permute(1, 2, 3, 4, 0).reshape(-1, 2).tolist():
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.pipeline_ends = group
        # Every rank over gloo, for what the hosts agree on between steps (a stop request): over NCCL, reading the
        # result would wait for the GPU to finish the step queued before it.
        self.host_group = dist.new_group(backend="gloo") if self.world_size > 1 else None

    def _create_groups(self, group: Group) -> None:
        """Create one process group per slice of the grid spanning ``group``'s axes (in the order its name lists
        them, the last fastest: ``Layout.group_members``); keep the one that holds this rank."""
        for ranks in self.layout.group_members(group):
            process_group = dist.new_group(ranks)
            if self.rank in ranks:
                self._groups[group] = process_group

    def group(self, group: Group) -> dist.ProcessGroup:
        """The process group of ``group`` (that of the same ranks where the layout creates no other,
        ``Layout.served_by``)."""
        return self._groups[self.layout.served_by(group)]

    def members(self, group: Group) -> list[int]:
        """The world ranks of this rank's ``group``, in the group's order (also of a group the layout creates no
        process group for)."""
        return next(ranks for ranks in self.layout.group_members(group) if self.rank in ranks)

    @property
    def reduction_groups(self) -> dict[tuple[Axis, ...], dist.ProcessGroup]:
        """The group of every combination of gradient axes (``Placement.gradient_axes``): the data-parallel
        replicas of a dense weight span dp × cp × ep, those of an expert weight (sharded over ep) dp × cp."""
        return {group.axes: self._groups[group] for group in (Group.DENSE_REPLICAS, Group.EXPERT_REPLICAS)}

    @property
    def shard_groups(self) -> dict[tuple[Axis, ...], tuple[dist.ProcessGroup, dist.ProcessGroup | None]]:
        """For every combination of gradient axes, the ranks ZeRO shards a bucket over and the replicas of each
        shard (HSDP; None without it): dp_shard × cp × ep and dp / dp_shard for a dense weight, dp_shard × cp and
        dp / dp_shard for an expert weight."""
        replicas = self.group(Group.SHARD_REPLICAS) if self.layout.dpr > 1 else None
        return {replicated.axes: (self.group(shards), replicas)
                for replicated, shards in ((Group.DENSE_REPLICAS, Group.DENSE_SHARDS),
                                           (Group.EXPERT_REPLICAS, Group.EXPERT_SHARDS))}

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
