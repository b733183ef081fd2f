"""The run's parallel layout: the sizes of the process grid, and every fact derived from them and the token settings.

A ``Layout`` is built once from the config (``Layout.from_config``) and read by everything that needs to know how
the run is split: the process groups (``parallel/context.py``: ``ParallelContext(layout)``), the pipeline schedule's
message shapes and warm-up, the memory planner, the data loader's sample shards, the config's rules between the
sequence and the split, and checkpoints, which store its ``to_dict()`` form and compare layouts through
``Layout.recorded``. Nothing else derives these facts. It reads only the config, so that the config's own rules can
ask it (it sits below every package but the config's layer).

Axes (``Axis``), outermost first: pipeline stages, data-parallel replicas, expert-parallel ranks, context-parallel
ranks, tensor-parallel ranks (consecutive world ranks: the fastest links). Named groups of axes (``Group``) are the
collectives' scopes: the ranks that read different samples (dp × ep), the replicas of a dense weight (dp × cp × ep)
or of an expert weight (dp × cp), the ranks whose step statistics add up (pp × dp × cp × ep). Code outside this
module names an axis or a group by these enums, never by its string (``tests/test_layout.py`` checks it).

Rules:
- the world size is the product of the five sizes;
- samples are sharded over dp × ep; the cp ranks of one (dp, ep) pair read the same samples and each keeps
  ``sequence_length / cp`` tokens of every sequence (two chunks, for an even share of causal attention), which
  sequence parallelism splits again over tp between layers;
- the decoder is cut into ``chunks`` = pp × ``virtual`` model chunks (virtual stages), stage ``stage_of(chunk)``
  holding chunk ``chunk``; the schedule (``pipeline``, ``pipeline_schedules.py``) orders each stage's forwards and
  backwards over its chunks, and so says how many (chunk, micro-batch) activations a stage holds at once
  (``in_flight``): all of the step's under AFAB, at most ``pp - stage`` under 1F1B (plain gradient accumulation, one
  at a time, with one stage).

A new mechanism declares itself here: its degree (a field, with its rule in ``problems``), the axis or group it
adds, and what it changes in the derived facts. Sharded data parallelism (ZeRO, ``zero_stage``) with HSDP
(``dp_shard``) splits the dp axis into two parts that are not grid axes of their own: ``dp = dp_replicate ×
dp_shard`` (``Axis.DP_REPLICATE`` outer, ``Axis.DP_SHARD`` inner, so a shard group is made of neighbouring ranks).
Its groups (``Group.DENSE_SHARDS``, ``EXPERT_SHARDS``, ``SHARD_REPLICAS``) exist only when dp_shard < dp; otherwise
the shard groups are the replica groups (``served_by``). Virtual pipeline stages: ``virtual``, the model chunks per
stage, read by the schedule and the stage split.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from nanotron.pipeline_schedules import Schedule, Timeline, schedule_for, schedule_problems

if TYPE_CHECKING:
    from nanotron.config import Config


class Axis(str, Enum):
    """One dimension of the process grid, named as in the config's section and checkpoints."""

    PP = "pp"
    DP = "dp"
    EP = "ep"
    CP = "cp"
    TP = "tp"
    # The two parts of dp under HSDP (not grid axes: a rank's coordinate on them comes from its dp coordinate).
    DP_REPLICATE = "dpr"  # replicas of a ZeRO shard: dp / dp_shard
    DP_SHARD = "dps"  # ranks ZeRO shards over: parallelism.dp_shard

    def __str__(self) -> str:
        return self.value


GRID_AXES = (Axis.PP, Axis.DP, Axis.EP, Axis.CP, Axis.TP)  # outermost first: world rank = grid index
# The grid with dp split into its replicate and shard parts, for the groups that name those parts.
FINE_AXES = (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.EP, Axis.CP, Axis.TP)


class Group(str, Enum):
    """A scope of collectives: the ranks that differ only along its axes."""

    TP = "tp"
    CP = "cp"
    EP = "ep"
    DP = "dp"
    PP = "pp"
    SAMPLE_SHARDS = "dp_ep"  # ranks reading different samples
    EXPERT_REPLICAS = "dp_cp"  # data-parallel replicas of an expert weight (sharded over ep)
    DENSE_REPLICAS = "dp_cp_ep"  # data-parallel replicas of every other weight
    STATISTICS = "pp_dp_cp_ep"  # one rank per TP group: step statistics are summed over it
    DENSE_SHARDS = "dps_cp_ep"  # ZeRO's shards of a dense weight (HSDP: within one replica)
    EXPERT_SHARDS = "dps_cp"  # ZeRO's shards of an expert weight (HSDP: within one replica)
    SHARD_REPLICAS = "dpr"  # HSDP: the replicas of one ZeRO shard

    def __str__(self) -> str:
        return self.value

    @property
    def axes(self) -> tuple[Axis, ...]:
        return tuple(Axis(name) for name in self.value.split("_"))


@dataclass(frozen=True)
class Layout:
    """How a run is split over processes, and the token settings the split depends on."""

    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False  # parallelism.tp_mode: REDUCE_SCATTER (at tp > 1)
    overlapped_linears: bool = False  # parallelism.tp_linear_async_communication
    pp_engine: str = "1f1b"
    virtual: int = 1  # model chunks per pipeline stage (parallelism.virtual_pipeline_size)
    zero_stage: int = 0  # sharded over the data-parallel replicas: 1 optimizer state, 2 and gradients, 3 and weights
    dp_shard: int | None = None  # HSDP: ZeRO shards over this many dp ranks (parallelism.dp_shard; None: all of dp)
    sequence_length: int = 1
    micro_batch_size: int = 1
    accumulation: int = 1  # micro-batches per step on each rank (tokens.batch_accumulation_per_replica)
    forwards_first: bool = False  # every forward of a step before its first backward (a loss pooled over the step)

    @classmethod
    def from_config(cls, config: Config) -> Layout:
        p, t = config.parallelism, config.tokens
        return cls(pp=p.pp, dp=p.dp, ep=p.expert_parallel_size, cp=p.context_parallel_size, tp=p.tp,
                   sequence_parallel=p.tp > 1 and p.tp_mode == "REDUCE_SCATTER",
                   overlapped_linears=p.tp_linear_async_communication, pp_engine=p.pp_engine,
                   virtual=p.virtual_pipeline_size,
                   zero_stage=config.optimizer.zero_stage, dp_shard=p.dp_shard, sequence_length=t.sequence_length,
                   micro_batch_size=t.micro_batch_size, accumulation=t.batch_accumulation_per_replica,
                   forwards_first=_pools_the_global_batch(config))

    # --- the grid -------------------------------------------------------------------------------------------------

    def size(self, axes: Axis | Group) -> int:
        """The number of ranks along an axis, or in a group."""
        return math.prod(getattr(self, axis.value) for axis in _axes(axes))

    @property
    def world_size(self) -> int:
        return self.size(Group.STATISTICS) * self.tp

    @property
    def grid_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis.value) for axis in GRID_AXES)

    def coordinates(self, rank: int) -> dict[Axis, int]:
        """World rank ``rank``'s place on every axis."""
        place = {}
        for axis in reversed(GRID_AXES):
            rank, place[axis] = divmod(rank, getattr(self, axis.value))
        return {axis: place[axis] for axis in GRID_AXES}

    def rank_of(self, coordinates: dict[Axis, int]) -> int:
        rank = 0
        for axis in GRID_AXES:
            rank = rank * getattr(self, axis.value) + coordinates.get(axis, 0)
        return rank

    def group_rank(self, group: Group, coordinates: dict[Axis, int]) -> int:
        """A rank's index in its ``group``: the group's axes in the order its name lists them, the last fastest."""
        index = 0
        for axis in group.axes:
            index = index * getattr(self, axis.value) + self.coordinate(axis, coordinates)
        return index

    def group_members(self, group: Group) -> list[list[int]]:
        """The world ranks of every process group of ``group``: one list per slice of the grid spanning its axes (dp
        spans its replicate and shard parts), each in group order (``group_rank``), the slices in grid order."""
        axes = {part for axis in group.axes for part in ((Axis.DP_REPLICATE, Axis.DP_SHARD) if axis == Axis.DP
                                                          else (axis,))}
        slices: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for rank in range(self.world_size):
            coordinates = self.coordinates(rank)
            key = tuple(self.coordinate(axis, coordinates) for axis in FINE_AXES if axis not in axes)
            slices.setdefault(key, []).append((self.group_rank(group, coordinates), rank))
        return [[rank for _, rank in sorted(members)] for members in slices.values()]

    def coordinate(self, axis: Axis, coordinates: dict[Axis, int]) -> int:
        """A rank's place on ``axis``, a grid axis or a part of dp."""
        if axis == Axis.DP_SHARD:
            return coordinates[Axis.DP] % self.dps
        if axis == Axis.DP_REPLICATE:
            return coordinates[Axis.DP] // self.dps
        return coordinates[axis]

    # --- sharded data parallelism ------------------------------------------------------------------------------------

    @property
    def dps(self) -> int:
        """The dp ranks ZeRO shards over: ``dp_shard``, or all of dp."""
        return self.dp_shard or self.dp

    @property
    def dpr(self) -> int:
        """The replicas of each ZeRO shard over dp (HSDP when above 1)."""
        return self.dp // self.dps

    def served_by(self, group: Group) -> Group | None:
        """The group whose process group this layout creates for ``group``: itself, or the group of the same ranks
        (without HSDP the shard groups are the replica groups); None for HSDP's replica group without HSDP."""
        if self.dpr > 1 or group not in _HSDP_GROUPS:
            return group
        return _HSDP_GROUPS[group]

    # --- data ------------------------------------------------------------------------------------------------------

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: every (dp, ep) pair reads its own ``accumulation`` micro-batches."""
        return self.micro_batch_size * self.accumulation * self.size(Group.SAMPLE_SHARDS)

    def sample_shard(self, coordinates: dict[Axis, int]) -> int:
        """Which of the ``size(Group.SAMPLE_SHARDS)`` shards of each global batch a rank reads."""
        return coordinates[Axis.DP] * self.ep + coordinates[Axis.EP]

    @property
    def rank_sequence_length(self) -> int:
        """The tokens of each sequence one rank holds: its context-parallel share."""
        return self.sequence_length // self.cp

    @property
    def rank_tokens(self) -> int:
        """The tokens of a micro-batch one rank holds: its context-parallel share of every sequence."""
        return self.micro_batch_size * self.rank_sequence_length

    @property
    def stage_sequence_length(self) -> int:
        """The tokens of each sequence in the activations between layers and pipeline stages (sequence parallelism
        splits the rank's share over tp)."""
        return self.rank_sequence_length // (self.tp if self.sequence_parallel else 1)

    def stage_activation_shape(self, hidden_size: int) -> tuple[int, int, int]:
        """The shape of a micro-batch's activations sent from one pipeline stage to the next."""
        return (self.micro_batch_size, self.stage_sequence_length, hidden_size)

    @property
    def residual_share(self) -> float:
        """The share of a rank's tokens it keeps of the residual stream (1/tp with sequence parallelism)."""
        return 1 / self.tp if self.sequence_parallel else 1.0

    @property
    def linear_input_share(self) -> float:
        """The share of a column-parallel linear's input tokens a rank keeps for the backward: 1/tp only when the
        backward is overlapped (it keeps its shard and gathers it again); the plain one keeps the gathered input."""
        return 1 / self.tp if self.sequence_parallel and self.overlapped_linears else 1.0

    # --- the pipeline -----------------------------------------------------------------------------------------------

    @property
    def schedule(self) -> str:
        """The schedule that runs: the configured engine with several stages, else plain gradient accumulation (every
        forward first where the step's loss needs them all before a backward)."""
        if self.pp > 1:
            return self.pp_engine
        return "afab" if self.forwards_first else "1f1b"

    @property
    def chunks(self) -> int:
        """The model chunks the decoder is cut into: ``virtual`` per pipeline stage."""
        return self.pp * self.virtual

    @property
    def pipeline(self) -> Schedule:
        """The schedule of a step's ``accumulation`` micro-batches over the stages' chunks."""
        return schedule_for(self.schedule, self.pp, self.virtual, self.accumulation)

    def timeline(self, micro_batches: int | None = None) -> Timeline:
        """The schedule of ``micro_batches`` (by default the step's ``accumulation``), run on unit costs."""
        return _timeline(self.schedule, self.pp, self.virtual, micro_batches or self.accumulation)

    def stage_of(self, chunk: int) -> int:
        """The pipeline stage that holds model chunk ``chunk``."""
        return self.pipeline.stage_of(chunk)

    def chunks_of(self, stage: int) -> list[int]:
        """The model chunks pipeline stage ``stage`` holds, in model order."""
        return self.pipeline.chunks_of(stage)

    def in_flight(self, stage: int, micro_batches: int | None = None) -> int:
        """The (chunk, micro-batch) activations stage ``stage`` holds at once (of ``micro_batches``, by default the
        step's ``accumulation``), in the order its schedule runs: from a forward to the backward that ends with it
        (the weight gradients, where they are deferred)."""
        return int(self.timeline(micro_batches).held(stage))

    # --- rules and records -----------------------------------------------------------------------------------------

    def problems(self) -> Iterator[str]:
        """The rules between the layout, ZeRO, the sequence length and the schedule (each line names its keys and
        the fix)."""
        shard = self.dp_shard
        if self.zero_stage == 0 and shard is not None and 2 <= shard < self.dp and self.dp % shard == 0:
            yield (f"parallelism.dp_shard ({self.dp_shard}) shards ZeRO's state over part of dp ({self.dp}), but "
                   "optimizer.zero_stage is 0; set zero_stage 1, 2 or 3 (3 for HSDP), or remove dp_shard")
        if self.zero_stage >= 2 and self.pp > 1 and self.pp_engine not in ("afab", "1f1b"):
            yield (f"optimizer.zero_stage {self.zero_stage} runs with parallelism.pp_engine afab or 1f1b, not "
                   f"{self.pp_engine} (its sharded gradients and gathers are not yet composed with model chunks or a "
                   "split backward); use afab or 1f1b, or zero_stage 1")
        if self.forwards_first and self.pp > 1 and self.pp_engine != "afab":
            yield (f"model.model_config.moe_config.load_balancing_scope: global_batch needs every forward of a step "
                   f"before its first backward, which parallelism.pp_engine {self.pp_engine} does not run; set "
                   "pp_engine: afab, or load_balancing_scope: sequence")
        yield from schedule_problems(self.pp_engine, self.pp, self.virtual, self.accumulation)
        length, cp, tp = self.sequence_length, self.cp, self.tp
        if cp > 1 and length % (2 * cp):
            yield (f"tokens.sequence_length ({length}) must be divisible by 2 x parallelism.context_parallel_size "
                   f"= {2 * cp}: each sequence is cut into two chunks per context-parallel rank")
        elif self.sequence_parallel and cp > 1 and (length // cp) % tp:
            yield (f"tokens.sequence_length / parallelism.context_parallel_size ({length // cp}) must be divisible "
                   f"by parallelism.tp ({tp}) with parallelism.tp_mode: REDUCE_SCATTER, which splits each rank's part "
                   "of the sequence over TP; change tokens.sequence_length or tp_mode")
        elif self.sequence_parallel and length % tp:
            yield (f"tokens.sequence_length ({length}) must be divisible by parallelism.tp ({tp}) with "
                   "parallelism.tp_mode: REDUCE_SCATTER, which splits activations along the sequence")

    def to_dict(self) -> dict[str, int]:
        """What a checkpoint records of the layout that wrote it: the grid and how the optimizer state is sharded."""
        return {axis.value: getattr(self, axis.value) for axis in GRID_AXES} | {"zero_stage": self.zero_stage,
                                                                                "dp_shard": self.dps}

    @staticmethod
    def recorded(layout: dict) -> dict[str, int]:
        """A checkpoint's layout record in today's form (axes added since default to 1, the shard degree to dp)."""
        grid = {axis.value: int(layout.get(axis.value, 1)) for axis in GRID_AXES}
        sharding = {"zero_stage": int(layout.get("zero_stage", 0)), "dp_shard": int(layout.get("dp_shard", grid["dp"]))}
        return grid | sharding

    def summary(self) -> str:
        """The layout in one line: the sizes, the schedule and the micro-batches of a step."""
        schedule = self.schedule.upper() if self.pp > 1 else "gradient accumulation"
        if self.pp == 1 and self.forwards_first:
            schedule += ", every forward first"
        if self.virtual > 1:
            schedule += f", {self.virtual} chunks per stage"
        zero = f" (ZeRO-{self.zero_stage}{self._hsdp})" if self.zero_stage else ""
        return (f"dp {self.dp}{zero} x ep {self.ep} x cp {self.cp} x tp {self.tp} x pp {self.pp} ({schedule}), "
                f"micro-batch {self.micro_batch_size} x {self.sequence_length} tokens, {self.accumulation} per step")

    @property
    def _hsdp(self) -> str:
        return f", HSDP {self.dpr} replicas x {self.dps} shards" if self.dpr > 1 else ""

    def describe_grid(self) -> str:
        """The grid's sizes, for messages: ``pp=2, dp=1, ep=1, cp=1, tp=2``."""
        return ", ".join(f"{axis}={size}" for axis, size in self.sizes.items())

    def describe(self, coordinates: dict[Axis, int]) -> str:
        """A rank's place, for log lines: dp, pp and tp always, ep and cp where they split the run."""
        shown = (Axis.DP, Axis.PP, Axis.TP) + tuple(axis for axis in (Axis.EP, Axis.CP) if self.size(axis) > 1)
        return "|".join(f"{axis.value.upper()}={coordinates[axis]}" for axis in shown)

    @property
    def sizes(self) -> dict[Axis, int]:
        return {axis: self.size(axis) for axis in GRID_AXES}


# Without HSDP these groups are the ranks of others (``Layout.served_by``); HSDP's replica group then has no
# process group.
_HSDP_GROUPS = {Group.DENSE_SHARDS: Group.DENSE_REPLICAS, Group.EXPERT_SHARDS: Group.EXPERT_REPLICAS,
                Group.SHARD_REPLICAS: None}


@functools.cache
def _timeline(name: str, pp: int, virtual: int, micro_batches: int) -> Timeline:
    return schedule_for(name, pp, virtual, micro_batches).timeline()


def _axes(axes: Axis | Group) -> tuple[Axis, ...]:
    return (axes,) if isinstance(axes, Axis) else axes.axes


def _pools_the_global_batch(config: Config) -> bool:
    """Whether the run's loss pools a statistic over the whole global batch before its gradient is known (the
    mixture of experts' load balancing at ``balance_scope: global_batch``)."""
    moe = config.model.model_config.moe
    return moe is not None and moe.balance_scope == "global_batch"
