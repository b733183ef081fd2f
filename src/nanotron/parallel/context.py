"""The process grid: which rank holds which slice of the model and of the data.

World ranks are laid out as a 5-D grid ``arange(world).reshape(pp, dp, ep, cp, tp)``. Tensor parallelism is the
innermost axis, so a TP group is made of consecutive ranks (the fastest links on a node); context parallelism comes
next (every attention layer exchanges keys and values over it, so it stays inside a node too), then expert
parallelism (its all-to-alls stay inside a node for small degrees), then data parallelism, and pipeline stages are
the outermost axis (their point-to-point traffic is the lightest).

Samples are sharded over the ``dp`` and ``ep`` axes alike (the ``dp_ep`` group: every (dp, ep) pair of coordinates
sees different samples); the ``cp`` ranks of one (dp, ep) pair read the same samples and each keeps its part of
every sequence. Expert weights are sharded over ``ep``; every other weight is replicated over it and over ``cp``, so
dense gradients are reduced over the ``dp_cp_ep`` group and expert gradients over ``dp_cp`` (``reduction_groups``).
Step statistics (loss sums, token counts) are summed over ``pp_dp_cp_ep``: every stage, data shard and sequence part
contributes, TP ranks hold identical copies. With pipeline parallelism, ``pipeline_ends`` pairs the first and last
stage of each position, which both hold a copy of tied input/output embeddings.

All groups are created eagerly, in the same order on every rank, so that no collective ever creates a communicator
lazily (a classic source of pipeline deadlocks).
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

AXES = ("pp", "dp", "ep", "cp", "tp")


class ParallelLayoutError(ValueError):
    """The launcher's world size does not match the configured parallel degrees."""


@dataclass(frozen=True)
class Coordinates:
    pp: int
    dp: int
    ep: int
    cp: int
    tp: int


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


@dataclass(frozen=True)
class GridPosition:
    """One rank's coordinates in a process grid of ``sizes``, without process groups: what ``build_stage`` needs
    (``size``, ``coord``, ``groups``, as a :class:`ParallelContext` offers them) to build that rank's part of the
    model on the meta device from any process."""

    sizes: dict[str, int]
    coordinates: dict[str, int]

    def size(self, axis: str) -> int:
        return self.sizes[axis]

    def coord(self, axis: str) -> int:
        return self.coordinates[axis]

    @property
    def groups(self) -> dict[str, GroupShape]:
        return {axis: GroupShape(self.coordinates[axis], self.sizes[axis]) for axis in AXES}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: torch.device) -> None:
    """Join the process group described by torchrun's variables, or form a world of one under plain ``python``.

    NCCL is bound to this rank's GPU up front, so communicators are created eagerly on the right device.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
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


class ParallelContext:
    """Owns the process groups of every parallel axis and this rank's coordinates on them."""

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, cp: int = 1,
                 device: torch.device | None = None):
        self.device = device if device is not None else default_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_distributed(self.device)

        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.sizes = {"pp": pp, "dp": dp, "ep": ep, "cp": cp, "tp": tp}
        expected = pp * dp * ep * cp * tp
        if self.world_size != expected:
            raise ParallelLayoutError(
                f"the launcher started {self.world_size} processes but parallelism.dp*pp*tp*expert_parallel_size*"
                f"context_parallel_size = {dp}*{pp}*{tp}*{ep}*{cp} = {expected}; change those keys or launch with "
                f"`torchrun --nproc_per_node={expected}`"
            )

        self.grid = torch.arange(self.world_size).reshape(pp, dp, ep, cp, tp)
        where = (self.grid == self.rank).nonzero()[0].tolist()
        self.coords = Coordinates(*where)

        self.groups: dict[str, dist.ProcessGroup] = {}
        self.group_ranks: dict[str, list[int]] = {}
        for name, axes in (
            ("tp", ("tp",)),
            ("cp", ("cp",)),
            ("ep", ("ep",)),
            ("dp", ("dp",)),
            ("pp", ("pp",)),
            ("dp_ep", ("dp", "ep")),  # ranks reading different samples
            ("dp_cp", ("dp", "cp")),  # data-parallel replicas of expert weights
            ("dp_cp_ep", ("dp", "cp", "ep")),  # data-parallel replicas of dense weights
            ("pp_dp_cp_ep", ("pp", "dp", "cp", "ep")),  # one rank per TP group: step statistics are summed over it
        ):
            self._create_groups(name, axes)
        # First and last pipeline stage of each (dp, ep, tp) position: they hold the two copies of tied embeddings.
        if pp > 1:
            for ranks in self.grid[[0, -1]].permute(1, 2, 3, 4, 0).reshape(-1, 2).tolist():
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.groups["pipeline_ends"], self.group_ranks["pipeline_ends"] = group, ranks
        # Every rank over gloo, for what the hosts agree on between steps (a stop request): over NCCL, reading the
        # result would wait for the GPU to finish the step queued before it.
        self.host_group = dist.new_group(backend="gloo") if self.world_size > 1 else None

    def _create_groups(self, name: str, axes: tuple[str, ...]) -> None:
        """Create one group per slice of the grid spanning ``axes``; keep the one that holds this rank."""
        keep = [AXES.index(a) for a in axes]
        other = [i for i in range(len(AXES)) if i not in keep]
        slices = self.grid.permute(*other, *keep).reshape(-1, math.prod(self.grid.shape[i] for i in keep))
        for ranks in slices.tolist():
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.groups[name] = group
                self.group_ranks[name] = ranks

    def size(self, axis: str) -> int:
        return self.sizes[axis] if axis in self.sizes else len(self.group_ranks[axis])

    def coord(self, axis: str) -> int:
        return getattr(self.coords, axis)

    @property
    def reduction_groups(self) -> dict[tuple[str, ...], dist.ProcessGroup]:
        """The group of every combination of gradient axes (``Placement.gradient_axes``): the data-parallel
        replicas of a dense weight span dp × cp × ep, those of an expert weight (sharded over ep) dp × cp."""
        return {("dp", "cp", "ep"): self.groups["dp_cp_ep"], ("dp", "cp"): self.groups["dp_cp"]}

    @property
    def coordinates(self) -> dict[str, int]:
        return {axis: getattr(self.coords, axis) for axis in AXES}

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.sizes["pp"] - 1

    def describe(self) -> str:
        c = self.coords
        return (f"DP={c.dp}|PP={c.pp}|TP={c.tp}" + (f"|EP={c.ep}" if self.sizes["ep"] > 1 else "")
                + (f"|CP={c.cp}" if self.sizes["cp"] > 1 else ""))

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
