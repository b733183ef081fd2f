"""Pipeline schedules as data: where each model chunk runs, and the order of every stage's actions.

The decoder is cut into ``pp · v`` chunks (virtual stages, ``parallelism.virtual_pipeline_size`` v); pipeline stage
``s`` holds ``v`` of them. A schedule is an object over chunks: for every stage it lists the actions to run, in
order, each on one (chunk, micro-batch):

- ``F``, the chunk's forward;
- ``B``, its whole backward (input and weight gradients);
- ``I`` and ``W``, the same backward in two parts: ``I`` the gradient of the chunk's input (what the previous chunk
  waits for), ``W`` the gradients of the weights, deferred into what would otherwise be idle time.

Communication is not listed: an activation goes from ``F(c, m)`` to ``F(c + 1, m)`` and a gradient from
``B``/``I(c + 1, m)`` to ``B``/``I(c, m)``, between stages or, where both chunks are on one stage, within it. One
executor (``parallel/pipeline_parallel.py``) runs any list. Written as the notation of PyTorch's
``torch.distributed.pipelining``: ``3F5`` is the forward of chunk 3 on micro-batch 5.

The schedules, each the published one (PyTorch's order, which the tests compare against):

- ``afab``: all forwards, then all backwards (GPipe); every micro-batch's activations are held at once;
- ``1f1b``: ``pp - s - 1`` forwards, then one forward and one backward in turn (Narayanan et al., 2021);
- ``interleaved_1f1b``: ``v`` chunks per stage, placed round-robin (chunk ``c`` on stage ``c mod pp``), forwards in
  rounds of micro-batches over the chunks (Megatron-LM's virtual pipeline; PyTorch's Interleaved1F1B);
- ``zb_h1``: 1F1B with each backward split, stage ``s`` deferring ``s`` weight gradients (Qi et al., 2023, ZB-H1;
  PyTorch's InterleavedZeroBubble at one chunk per stage): the same activations held as 1F1B's first stage;
- ``zbv``: two chunks per stage in a V (chunk ``c`` on stage ``c`` and ``2pp - 1 - c``), backwards split (Qi et
  al., 2024, ZB-V; PyTorch's ZBVZeroBubble).

``simulate`` runs a schedule on unit costs (a chunk's forward 1, its backward 2, each half 1) and gives the
timeline: when every action starts, each stage's idle time (the bubble), the activations held at once, and the
order of the messages between each pair of stages, which both ends agree on so that every receive meets its send
in the same order on every backend (``Timeline.messages``).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"  # input and weight gradients at once
    BACKWARD_INPUT = "I"  # the input's gradient; the weights' wait for W
    BACKWARD_WEIGHT = "W"  # the weights' deferred gradients


F, B, IN, W = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
UNIT_COSTS = {F: 1, B: 2, IN: 1, W: 1}  # in units of a chunk's forward


@dataclass(frozen=True)
class Action:
    op: Op
    chunk: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.chunk}{self.op.value}{self.micro_batch}"


class ScheduleError(ValueError):
    """A schedule that cannot run: its actions wait for each other."""


@dataclass(frozen=True)
class Schedule(ABC):
    """The actions of every stage of a pipeline of ``pp`` stages holding ``virtual`` chunks each, over
    ``micro_batches`` micro-batches a step. Subclasses give the order (``actions``) and the chunks' placement."""

    pp: int
    virtual: int
    micro_batches: int

    name = ""
    v_shape = False  # chunks placed down and back up the stages (ZBV), else round-robin
    splits_backward = False  # backwards run as I and W
    CHUNKS_RULE = "runs one chunk per stage: set parallelism.virtual_pipeline_size: 1, or use interleaved_1f1b"

    @classmethod
    def runs_chunks(cls, virtual: int) -> bool:
        """Whether the schedule runs ``virtual`` chunks per stage."""
        return virtual == 1

    @classmethod
    def micro_batch_problem(cls, pp: int, micro_batches: int) -> str | None:
        """Why the schedule cannot run ``micro_batches`` a step over ``pp`` stages (None: it can)."""
        return None

    @property
    def chunks(self) -> int:
        return self.pp * self.virtual

    def stage_of(self, chunk: int) -> int:
        """The stage that holds ``chunk``."""
        turn, offset = divmod(chunk, self.pp)
        return self.pp - 1 - offset if self.v_shape and turn % 2 else offset

    def chunks_of(self, stage: int) -> list[int]:
        """The chunks ``stage`` holds, in model order."""
        return [chunk for chunk in range(self.chunks) if self.stage_of(chunk) == stage]

    @abstractmethod
    def actions(self, stage: int) -> list[Action]:
        """Stage ``stage``'s actions in the order it runs them: each schedule below defines its own."""

    def timeline(self) -> Timeline:
        return simulate(self)

    def idle_share(self) -> float:
        """A stage's idle time in a step over its work, on unit costs (the planner's bubble). With at least 2 × pp
        micro-batches it is the closed form the papers give: the fill and drain idle pp − 1 forwards and backwards
        of one chunk (3 units each), or pp − 1 units where the weight gradients fill the rest (split backwards),
        against 3 units per chunk and micro-batch of work: (pp − 1) / (v·m), a third of that split. Fewer
        micro-batches fall short of the steady phase: the timeline is simulated (tests check both)."""
        if self.micro_batches < 2 * self.pp:
            timeline = self.timeline()
            return max(map(timeline.idle, range(self.pp))) / timeline.busy(0)
        return (self.pp - 1) / (self.virtual * self.micro_batches * (3 if self.splits_backward else 1))

    @classmethod
    def fewest_chunks(cls) -> int:
        """The fewest model chunks per stage the schedule runs (``runs_chunks``)."""
        return next(virtual for virtual in range(1, 3) if cls.runs_chunks(virtual))


class AllForwardAllBackward(Schedule):
    name = "afab"

    def actions(self, stage: int) -> list[Action]:
        batches = range(self.micro_batches)
        return [Action(F, stage, i) for i in batches] + [Action(B, stage, i) for i in batches]


class OneForwardOneBackward(Schedule):
    name = "1f1b"

    def actions(self, stage: int) -> list[Action]:
        m = self.micro_batches
        warmup = min(self.pp - stage - 1, m)
        actions = [Action(F, stage, i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action(F, stage, warmup + i), Action(B, stage, i)]
        return actions + [Action(B, stage, i) for i in range(m - warmup, m)]


class _Rounds(Schedule):
    """PyTorch's interleaved order (``_get_1f1b_rank_ops``): micro-batches go through a stage's chunks in rounds of
    ``micro_batches // max(1, micro_batches // pp)``; after ``warmup`` forwards, one forward and one backward (input
    backward, when split) in turn, then the backwards left. Split, stage ``s`` defers its first ``s`` weight
    gradients and then runs each one after a backward."""

    warmup_per_hop = 2

    @property
    def per_round(self) -> int:
        return self.micro_batches // max(1, self.micro_batches // self.pp)

    def warmup(self, stage: int) -> int:
        return min((self.virtual - 1) * self.per_round + self.warmup_per_hop * (self.pp - 1 - stage),
                   self.micro_batches * self.virtual)

    def actions(self, stage: int) -> list[Action]:
        v, per_round, warmup = self.virtual, self.per_round, self.warmup(stage)
        total = self.micro_batches * v
        next_batch: dict[tuple[Op, int], int] = {}
        actions: list[Action] = []

        def add(op: Op, local: int) -> None:
            chunk = local * self.pp + stage
            index = next_batch.get((op, chunk), 0)
            next_batch[op, chunk] = index + 1
            actions.append(Action(op, chunk, index))

        backward = IN if self.splits_backward else B
        backwards: list[int] = []  # local chunk of each backward so far, for the weight gradients that follow
        for step in range(total + warmup):
            if step < total:
                add(F, (step // per_round) % v)
            if step >= warmup:
                backwards.append(v - 1 - ((step - warmup) // per_round) % v)
                add(backward, backwards[-1])
                deferred = len(backwards) - 1 - stage
                if self.splits_backward and deferred >= 0:
                    add(W, backwards[deferred])
        if self.splits_backward:
            for local in backwards[max(len(backwards) - stage, 0):]:
                add(W, local)
        return actions


class Interleaved1F1B(_Rounds):
    name = "interleaved_1f1b"
    CHUNKS_RULE = ("runs several chunks per stage: set parallelism.virtual_pipeline_size >= 2 (with one chunk per "
                   "stage it is 1f1b holding more activations: use pp_engine: 1f1b)")

    @classmethod
    def runs_chunks(cls, virtual: int) -> bool:
        return virtual >= 2

    @classmethod
    def micro_batch_problem(cls, pp: int, micro_batches: int) -> str | None:
        """Micro-batches go through the chunks in equal rounds of at least ``pp`` (fewer: one round of all)."""
        if _equal_rounds(pp, micro_batches):
            return None
        below = max(m for m in range(1, micro_batches) if _equal_rounds(pp, m))
        above = next(m for m in range(micro_batches + 1, 2 * micro_batches + 1) if _equal_rounds(pp, m))
        return (f"tokens.batch_accumulation_per_replica ({micro_batches}) does not split into equal rounds of at "
                f"least parallelism.pp ({pp}) micro-batches, which parallelism.pp_engine: interleaved_1f1b runs "
                f"through each stage's chunks; use {below} or {above} (a multiple of pp always splits)")


def _equal_rounds(pp: int, micro_batches: int) -> bool:
    return micro_batches % max(1, micro_batches // pp) == 0


class ZeroBubbleH1(_Rounds):
    name = "zb_h1"
    splits_backward = True
    warmup_per_hop = 1


class ZeroBubbleV(Schedule):
    """PyTorch's ZBVZeroBubble order: the forwards of the first chunk fill the way down, the V's second chunk then
    runs forward, input and weight backward in a row, one of each chunk in turn in the steady phase, and the deferred
    weight gradients close the step."""

    name = "zbv"
    v_shape = True
    splits_backward = True
    CHUNKS_RULE = "runs two chunks per stage, in a V: set parallelism.virtual_pipeline_size: 2"

    @classmethod
    def runs_chunks(cls, virtual: int) -> bool:
        return virtual == 2

    def actions(self, stage: int) -> list[Action]:
        pp, m = self.pp, self.micro_batches
        down, up = stage, 2 * pp - 1 - stage
        counts = {(op, chunk): 0 for op in (F, IN, W) for chunk in (down, up)}
        actions: list[Action] = []

        def add(*steps: tuple[Op, int]) -> None:
            for op, chunk in steps:
                actions.append(Action(op, chunk, counts[op, chunk]))
                counts[op, chunk] += 1

        n = max(2 * pp - 1, m)  # PyTorch's count: enough to fill the V; those past m are dropped below
        add(*[(F, down)] * (2 * (pp - stage) - 1))
        add(*[(F, up), (F, down)] * stage)
        add(*[(F, up), (IN, up), (W, up)] * (pp - stage))
        while counts[F, up] < counts[F, down] or counts[F, down] < n:
            add(*[(F, down)] * (counts[F, down] < n), (IN, down), (W, down), (F, up), (IN, up), (W, up))
        add(*[(IN, down), (IN, up)] * stage)
        add(*[(IN, down), (W, down)] * (pp - stage))
        add(*[(W, up)] * (counts[IN, up] - counts[W, up]))
        add(*[(W, down)] * (counts[IN, down] - counts[W, down]))
        return [action for action in actions if action.micro_batch < m]


SCHEDULES: dict[str, type[Schedule]] = {
    schedule.name: schedule
    for schedule in (AllForwardAllBackward, OneForwardOneBackward, Interleaved1F1B, ZeroBubbleH1, ZeroBubbleV)
}


def schedule_for(name: str, pp: int, virtual: int, micro_batches: int) -> Schedule:
    return SCHEDULES[name](pp, virtual, micro_batches)


def schedule_problems(name: str, pp: int, virtual: int, micro_batches: int) -> Iterator[str]:
    """Why schedule ``name`` cannot run ``virtual`` chunks per stage over ``pp`` stages and ``micro_batches`` a step
    (one line each, naming the keys and the fix). With one stage every schedule is plain gradient accumulation."""
    if virtual < 1:
        yield f"parallelism.virtual_pipeline_size must be >= 1 (got {virtual})"
    elif pp == 1 and virtual > 1:
        yield (f"parallelism.virtual_pipeline_size ({virtual}) splits each pipeline stage into chunks and needs "
               "parallelism.pp > 1; set it to 1, or raise pp")
    elif pp > 1 and not SCHEDULES[name].runs_chunks(virtual):
        yield (f"parallelism.pp_engine: {name} with parallelism.virtual_pipeline_size {virtual}: {name} "
               f"{SCHEDULES[name].CHUNKS_RULE}")
    elif pp > 1:
        problem = SCHEDULES[name].micro_batch_problem(pp, micro_batches)
        if problem is not None:
            yield problem


# --- the timeline ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """An activation (forward) or a gradient (backward) that ``chunk`` sends for ``micro_batch`` to another stage."""

    forward: bool
    chunk: int
    micro_batch: int

    @property
    def receiver_chunk(self) -> int:
        return self.chunk + 1 if self.forward else self.chunk - 1


@dataclass
class Timeline:
    """A schedule run on unit costs: each action's start, and what follows from them."""

    schedule: Schedule
    starts: list[list[tuple[int, Action]]]  # per stage, in its order
    length: int  # the step's makespan
    _messages: dict[tuple[int, int], list[Message]] = field(default_factory=dict)

    def busy(self, stage: int) -> int:
        return sum(UNIT_COSTS[action.op] for _, action in self.starts[stage])

    def idle(self, stage: int) -> int:
        return self.length - self.busy(stage)

    @property
    def bubble(self) -> float:
        """The share of the step's stage-time spent idle, over all stages."""
        return sum(map(self.idle, range(self.schedule.pp))) / (self.schedule.pp * self.length)

    def held(self, stage: int, chunk_weights: dict[int, float] | None = None) -> float:
        """The most activations ``stage`` holds at once: (chunk, micro-batch) pairs between their forward and their
        last backward action, each weighing ``chunk_weights[chunk]`` (1 by default)."""
        weight = (lambda chunk: 1.0) if chunk_weights is None else chunk_weights.__getitem__
        last = W if self.schedule.splits_backward else B
        held = peak = 0.0
        for _, action in self.starts[stage]:
            if action.op == F:
                held += weight(action.chunk)
                peak = max(peak, held)
            elif action.op == last:
                held -= weight(action.chunk)
        return peak

    def summary(self) -> str:
        """The predicted bubble and activations in flight, one line."""
        schedule = self.schedule
        chunks = f", {schedule.virtual} chunks per stage" if schedule.virtual > 1 else ""
        held = ", ".join(str(int(self.held(stage))) for stage in range(schedule.pp))
        return (f"pipeline: {schedule.name}{chunks}, {schedule.micro_batches} micro-batches: bubble {self.bubble:.1%} "
                f"of the step (unit costs: a chunk's forward 1, its backward 2); (chunk, micro-batch) activations in "
                f"flight per stage: {held}")

    def messages(self, stage: int, peer: int) -> list[Message]:
        """The messages between two stages, both ways, in the order both post them: by the time they are ready, the
        sender's stage and the message settling ties. Each end runs its actions in its order, so a message ready
        earlier is always posted earlier, and a receive never waits behind a send that cannot be made yet."""
        return self._messages.get((min(stage, peer), max(stage, peer)), [])

    def render(self) -> str:
        """One row per time unit, one column per stage: the action running there, ``.`` where the stage idles."""
        pp = self.schedule.pp
        grid = [["."] * pp for _ in range(self.length)]
        for stage, starts in enumerate(self.starts):
            for start, action in starts:
                for t in range(start, start + UNIT_COSTS[action.op]):
                    grid[t][stage] = str(action)
        width = max(len("stage 00"), *(len(cell) for row in grid for cell in row))
        lines = ["time " + " ".join(f"stage {s}".rjust(width) for s in range(pp))]
        lines += [f"{t:4d} " + " ".join(cell.rjust(width) for cell in row) for t, row in enumerate(grid)]
        return "\n".join(lines)


def _dependencies(schedule: Schedule, action: Action) -> Iterator[Action]:
    """The actions ``action`` waits for (any of their ops where backwards are split or not)."""
    c, m, last = action.chunk, action.micro_batch, schedule.chunks - 1
    if action.op == F and c > 0:
        yield Action(F, c - 1, m)
    elif action.op in (B, IN):
        yield Action(F, c, m)
        if c < last:
            yield Action(IN if schedule.splits_backward else B, c + 1, m)
    elif action.op == W:
        yield Action(IN, c, m)


def simulate(schedule: Schedule) -> Timeline:
    """Run every stage's actions in order, each as soon as its stage is free and what it waits for is done (messages
    take no time); ``ScheduleError`` if the stages wait for each other or an action is missing."""
    pp = schedule.pp
    lists = [schedule.actions(stage) for stage in range(pp)]
    _check_complete(schedule, lists)
    done: dict[Action, int] = {}  # action -> end time
    position, free = [0] * pp, [0] * pp
    starts: list[list[tuple[int, Action]]] = [[] for _ in range(pp)]
    ready: list[tuple[int, int, int, int, bool]] = []  # (time, sender, chunk, micro-batch, forward) of messages
    progress = True
    while progress:
        progress = False
        for stage in range(pp):
            while position[stage] < len(lists[stage]):
                action = lists[stage][position[stage]]
                waits = list(_dependencies(schedule, action))
                if any(dependency not in done for dependency in waits):
                    break
                start = max([free[stage], *(done[dependency] for dependency in waits)])
                end = start + UNIT_COSTS[action.op]
                done[action], free[stage] = end, end
                starts[stage].append((start, action))
                position[stage] += 1
                progress = True
                _message_ready(schedule, action, end, ready)
    if any(position[stage] < len(lists[stage]) for stage in range(pp)):
        stuck = ", ".join(f"stage {s} at {lists[s][position[s]]}" for s in range(pp) if position[s] < len(lists[s]))
        raise ScheduleError(f"{schedule.name} with pp {pp}, {schedule.virtual} chunks per stage and "
                            f"{schedule.micro_batches} micro-batches cannot run: {stuck} wait for each other")
    messages: dict[tuple[int, int], list[Message]] = {}
    for _, sender, chunk, micro_batch, forward in sorted(ready):
        message = Message(forward, chunk, micro_batch)
        pair = tuple(sorted((sender, schedule.stage_of(message.receiver_chunk))))
        messages.setdefault(pair, []).append(message)
    return Timeline(schedule, starts, max(free), messages)


def _message_ready(schedule: Schedule, action: Action, end: int, ready: list) -> None:
    """Record the message ``action`` sends to another stage, if any."""
    forward = action.op == F
    if action.op == W or (forward and action.chunk == schedule.chunks - 1) or (not forward and action.chunk == 0):
        return
    message = Message(forward, action.chunk, action.micro_batch)
    sender = schedule.stage_of(action.chunk)
    if schedule.stage_of(message.receiver_chunk) != sender:
        heapq.heappush(ready, (end, sender, action.chunk, action.micro_batch, forward))


def _check_complete(schedule: Schedule, lists: list[list[Action]]) -> None:
    """Every chunk's stage runs its forward and backward (or both halves) of every micro-batch exactly once."""
    expected = []
    ops = (F, IN, W) if schedule.splits_backward else (F, B)
    for chunk in range(schedule.chunks):
        expected += [(schedule.stage_of(chunk), Action(op, chunk, i)) for op in ops
                     for i in range(schedule.micro_batches)]
    got = [(stage, action) for stage, actions in enumerate(lists) for action in actions]
    if sorted(got, key=str) != sorted(expected, key=str):
        raise ScheduleError(f"{schedule.name} with pp {schedule.pp} and {schedule.micro_batches} micro-batches does "
                            "not run every chunk's forward and backward of every micro-batch once")
