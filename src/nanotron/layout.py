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
adds, and what it changes in the derived facts. The next two have their places: a sharded data-parallel degree
(ZeRO-3/FSDP; HSDP as replicate × shard) splits the dp axis into two, adds the shard group to ``Group`` and divides
the weights' state the planner counts. Virtual pipeline stages have theirs: ``virtual``, the model chunks per
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

    def __str__(self) -> str:
        return self.value


GRID_AXES = (Axis.PP, Axis.DP, Axis.EP, Axis.CP, Axis.TP)  # outermost first: world rank = grid index


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
    zero_stage: int = 0  # optimizer state sharded over the data-parallel replicas (1) or not (0)
    sequence_length: int = 1
    micro_batch_size: int = 1
    accumulation: int = 1  # micro-batches per step on each rank (tokens.batch_accumulation_per_replica)

    @classmethod
    def from_config(cls, config: Config) -> Layout:
        p, t = config.parallelism, config.tokens
        return cls(pp=p.pp, dp=p.dp, ep=p.expert_parallel_size, cp=p.context_parallel_size, tp=p.tp,
                   sequence_parallel=p.tp > 1 and p.tp_mode == "REDUCE_SCATTER",
                   overlapped_linears=p.tp_linear_async_communication, pp_engine=p.pp_engine,
                   virtual=p.virtual_pipeline_size,
                   zero_stage=config.optimizer.zero_stage, sequence_length=t.sequence_length,
                   micro_batch_size=t.micro_batch_size, accumulation=t.batch_accumulation_per_replica)

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
            index = index * getattr(self, axis.value) + coordinates[axis]
        return index

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
        """The schedule that runs: the configured engine with several stages, else plain gradient accumulation."""
        return self.pp_engine if self.pp > 1 else "1f1b"

    @property
    def chunks(self) -> int:
        """The model chunks the decoder is cut into: ``virtual`` per pipeline stage."""
        return self.pp * self.virtual

    @property
    def pipeline(self) -> Schedule:
        """The schedule of a step's ``accumulation`` micro-batches over the stages' chunks."""
        return self.timeline().schedule

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
        """The rules between the layout, the sequence length and the schedule (each line names its keys and the
        fix)."""
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
        return {axis.value: getattr(self, axis.value) for axis in GRID_AXES} | {"zero_stage": self.zero_stage}

    @staticmethod
    def recorded(layout: dict) -> dict[str, int]:
        """A checkpoint's layout record in today's form (axes added since default to 1)."""
        return {axis.value: int(layout.get(axis.value, 1)) for axis in GRID_AXES} | {
            "zero_stage": int(layout.get("zero_stage", 0))}

    def summary(self) -> str:
        """The layout in one line: the sizes, the schedule and the micro-batches of a step."""
        schedule = self.schedule.upper() if self.pp > 1 else "gradient accumulation"
        if self.virtual > 1:
            schedule += f", {self.virtual} chunks per stage"
        return (f"dp {self.dp} x ep {self.ep} x cp {self.cp} x tp {self.tp} x pp {self.pp} ({schedule}), micro-batch "
                f"{self.micro_batch_size} x {self.sequence_length} tokens, {self.accumulation} per step")

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


@functools.cache
def _timeline(name: str, pp: int, virtual: int, micro_batches: int) -> Timeline:
    return schedule_for(name, pp, virtual, micro_batches).timeline()


def _axes(axes: Axis | Group) -> tuple[Axis, ...]:
    return (axes,) if isinstance(axes, Axis) else axes.axes
