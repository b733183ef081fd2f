"""Pipeline schedules run over model chunks: one executor for any schedule's list of actions.

Each stage holds one or more model chunks (virtual stages) and runs every micro-batch of the step through them in the
order its schedule lists (``pipeline_schedules.py``, which the layout picks: ``Layout.timeline``): a chunk's forward,
its whole backward, or its backward in two parts (the input's gradient, then the deferred weights'; see
``split_backward.py``). Activations go to the next chunk and their gradients come back, through point-to-point messages
where the chunks are on two stages and by hand within one stage. Shapes are fixed by the config (micro-batch, sequence
or sequence shard, hidden), so no shape metadata is ever exchanged.

Messages between two stages are posted, on both, in the one order their timeline gives (``Timeline.messages``): a
send when its tensor exists, and every receive that comes before it in that order, so that each send meets its
receive in the same order on every backend (NCCL matches a pair's messages by order); a receive waits for its message
just before the action that needs it, with a deadline: a stage that waits longer than ``parallelism.pp_timeout_s``
(or whose neighbour died) fails with an error naming the stage, the step and the exchange instead of hanging.

The language-model loss of each micro-batch is computed on the last chunk only, as ``sum of token losses / global
token count``, so accumulating over the schedule's micro-batches gives the mean over the global batch with no further
scaling. A chunk's forward (the step program's, ``training/step.py``) returns a :class:`StageOutput`: the activations
for the next chunk (none on the last), the chunk's contributions to the loss (the language-model loss on the last
chunk, a router's load-balancing loss on any chunk, each backpropagated together with the gradient that comes back for
the activations) and named statistics, which the schedule sums over the step's micro-batches
(``parallel/statistics.py``).

With one stage and one chunk every schedule is plain gradient accumulation, one micro-batch at a time. A stage frees
each activation it has sent once the send is done; the autograd graph behind it stays until its backward.

On GPUs each stage measures the share of the step its device idles (``IdleTimes``): CUDA events mark the step's start
and, around every action, the moment its inputs have arrived and the end of its computation, so that waiting for a
neighbouring stage counts as idle. The step's statistics carry the share per stage (``IDLE_SHARE``, measured two
steps earlier, when its events are done: reading them sooner would wait for the GPU).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from nanotron.data.batch import MicroBatch
from nanotron.layout import Axis, Group
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.split_backward import DeferredWeightGradients, backward_input
from nanotron.parallel.statistics import Statistics, accumulate
from nanotron.pipeline_schedules import Action, Message, Op, Timeline


class PipelineTimeoutError(RuntimeError):
    """A point-to-point exchange between pipeline stages did not complete in time."""


@dataclass
class P2P:
    """Exchanges with the other stages of this rank's pipeline (same dp/ep/cp/tp coordinates)."""

    parallel_context: ParallelContext
    shape: tuple[int, ...]
    dtype: torch.dtype
    timeout_s: float
    step: int = 0

    def __post_init__(self):
        pc = self.parallel_context
        self.ranks, self.stage = pc.members(Group.PP), pc.coord(Axis.PP)
        self.group = pc.group(Group.PP)

    def post(self, tensor: torch.Tensor | None, stage: int) -> tuple[dist.Work, torch.Tensor]:
        """Start sending ``tensor`` to ``stage``, or receiving into a new buffer from it (``tensor`` None)."""
        if tensor is None:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.parallel_context.device)
            return dist.irecv(buffer, self.ranks[stage], self.group), buffer
        tensor = tensor.contiguous()
        return dist.isend(tensor, self.ranks[stage], self.group), tensor

    def wait(self, work: dist.Work, what: str, deadline: float | None = None) -> None:
        """Wait for ``work`` until ``deadline`` (by default ``timeout_s`` from now)."""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        try:
            work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError as error:  # the backends raise RuntimeError subclasses on timeouts and lost peers
            raise PipelineTimeoutError(
                f"pipeline stage {self.stage} could not {what} at step {self.step} within "
                f"parallelism.pp_timeout_s={self.timeout_s:g}s: a neighbouring stage is stuck or crashed "
                f"(raise the timeout if it is only slow). Backend said: {str(error).splitlines()[0][:200]}"
            ) from error

    def recv_from(self, stage: int) -> torch.Tensor:
        """Activations from ``stage``, waited for (generation's forward, one chunk after the other)."""
        work, buffer = self.post(None, stage)
        self.wait(work, f"receive activations from stage {stage}")
        return buffer

    def send_to(self, y: torch.Tensor, stage: int) -> None:
        work, _ = self.post(y, stage)
        self.wait(work, f"send activations to stage {stage}")


def _describe(message: Message, sending: bool) -> str:
    kind = "activations" if message.forward else "gradients"
    return f"{'send' if sending else 'receive'} the {kind} of chunk {message.chunk}, micro-batch {message.micro_batch}"


class Mailbox:
    """One step's messages between this stage and the others, posted in the order the timeline gives each pair."""

    def __init__(self, p2p: P2P, timeline: Timeline):
        self.p2p, self.schedule = p2p, timeline.schedule
        stage = p2p.stage
        self.queues = {peer: deque(timeline.messages(stage, peer)) for peer in range(self.schedule.pp)
                       if peer != stage}
        self.receives: dict[Message, tuple[dist.Work, torch.Tensor]] = {}
        self.sends: list[tuple[dist.Work, Message, torch.Tensor | None]] = []  # the tensor to free once sent

    def _peer(self, message: Message, sending: bool) -> int:
        chunk = message.receiver_chunk if sending else message.chunk
        return self.schedule.stage_of(chunk)

    def _post_until(self, peer: int, target: Message) -> None:
        """Post the pair's receives up to ``target`` (a send of this stage's must already be posted)."""
        queue = self.queues[peer]
        while queue and queue[0] != target:
            message = queue.popleft()
            if self.schedule.stage_of(message.chunk) == self.p2p.stage:
                raise RuntimeError(f"pipeline stage {self.p2p.stage}: {message} comes before {target} between "
                                   f"stages {self.p2p.stage} and {peer}, but it is not ready: the schedule's "
                                   "order is not one its timeline allows")
            self.receives[message] = self.p2p.post(None, peer)

    def send(self, message: Message, tensor: torch.Tensor, free: bool) -> None:
        """Send ``tensor`` as ``message``; ``free``: release its memory once it is sent (see ``_free``)."""
        peer = self._peer(message, sending=True)
        self._post_until(peer, message)
        self.queues[peer].popleft()
        work, _ = self.p2p.post(tensor, peer)
        self.sends.append((work, message, tensor if free else None))
        self._free_sent()

    def receive(self, message: Message) -> torch.Tensor:
        peer = self._peer(message, sending=False)
        if message not in self.receives:
            self._post_until(peer, message)
            self.queues[peer].popleft()
            self.receives[message] = self.p2p.post(None, peer)
        work, buffer = self.receives.pop(message)
        self.p2p.wait(work, _describe(message, sending=False))
        self._free_sent()
        return buffer

    def _free_sent(self, wait: bool = False) -> None:
        deadline = time.monotonic() + self.p2p.timeout_s
        left = []
        for work, message, tensor in self.sends:
            if wait:
                self.p2p.wait(work, _describe(message, sending=True), deadline)
            elif not work.is_completed():
                left.append((work, message, tensor))
                continue
            if tensor is not None:
                _free(tensor)
        self.sends = left

    def finish(self) -> None:
        """Wait for every send of the step."""
        self._free_sent(wait=True)


def _free(tensor: torch.Tensor) -> None:
    """Release a sent activation's memory; its autograd node needs only its shape for the backward.

    The chunk output comes from a residual addition, whose backward does not read the output's values.
    """
    tensor.untyped_storage().resize_(0)


@dataclass
class StageOutput:
    """One chunk's forward of one micro-batch.

    The activations are freed once sent (see ``_free``), so a loss of an inner chunk must be computed from tensors
    inside the chunk (router logits), never from the output itself.
    """

    output: torch.Tensor | None  # activations for the next chunk; None on the last chunk
    statistics: Statistics = field(default_factory=dict)  # summed over micro-batches, detached
    losses: tuple[torch.Tensor, ...] = ()  # scalars this chunk adds to the objective, each a root of its backward


@dataclass
class Chunk:
    """A model chunk as the schedule runs it: its forward, ``forward(micro_batch, inputs)``, and the weights whose
    gradients a split backward may defer (``split_backward.py``)."""

    forward: Callable[[MicroBatch, torch.Tensor | None], StageOutput]
    weights: Sequence[torch.nn.Parameter] = ()


GRADIENT_OPS = (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
IDLE_SHARE, IDLE_RANKS = "pipeline_idle_share", "pipeline_idle_ranks"  # per stage: summed shares, ranks measured


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class IdleTimes:
    """Events around every action of a step on this stage, kept until they are read (two steps later): CUDA events
    by default; ``event`` makes any other (anything with ``record()`` and ``elapsed_time(end)`` in milliseconds)."""

    def __init__(self, event: Callable[[], torch.cuda.Event] = _timing_event):
        self.event = event
        self.steps: dict[int, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}

    def around(self, step: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """A (start, end) pair of events to record around one action of ``step``."""
        pair = (self.event(), self.event())
        self.steps.setdefault(step, []).append(pair)
        return pair

    def mark_start(self, step: int) -> None:
        """Record the start of ``step`` on this stage (a pair of no length), before its first action waits."""
        for event in self.around(step):
            event.record()

    def statistics(self, step: int, stage: int, stages: int, device: torch.device) -> Statistics:
        """This stage's idle share of step ``step - 2`` in its slot (none measured yet: zeros), and how many ranks
        measured it (1 here)."""
        share, ranks = torch.zeros(stages, device=device), torch.zeros(stages, device=device)
        pairs = self.steps.pop(step - 2, None)
        for old in [s for s in self.steps if s < step - 2]:
            del self.steps[old]
        if pairs:
            share[stage], ranks[stage] = idle_share(pairs), 1.0
        return {IDLE_SHARE: share, IDLE_RANKS: ranks}


def idle_share(pairs: Sequence[tuple]) -> float:
    """The share of the time from the first pair's start to the last's end spent outside the pairs, from (start, end)
    event pairs in order (anything with ``elapsed_time``)."""
    total = pairs[0][0].elapsed_time(pairs[-1][1])
    busy = sum(start.elapsed_time(end) for start, end in pairs)
    return max(0.0, 1.0 - busy / total) if total > 0 else 0.0


class PipelineSchedule:
    """Runs forward and backward of all micro-batches of one step on this stage's ``chunks`` (in model order, those
    ``Layout.chunks_of`` gives the stage), in the order of the layout's schedule.

    ``before_last_backward()`` is called before the first gradient computation after which every gradient is the
    step's last for its weight, when data-parallel gradient reduction may start; ``before_first_backward(sums)``
    before the step's first gradient computation, with the statistics of the forwards run so far (summed over their
    micro-batches: all of the step's where the schedule runs every forward first).
    """

    def __init__(self, parallel_context: ParallelContext, p2p: P2P, chunks: Sequence[Chunk],
                 before_last_backward: Callable[[], None],
                 before_first_backward: Callable[[Statistics], None] = lambda sums: None):
        self.layout, self.stage = parallel_context.layout, parallel_context.coord(Axis.PP)
        self.p2p = p2p
        self.chunks = dict(zip(self.layout.chunks_of(self.stage), chunks, strict=True))
        self.before_last_backward = before_last_backward
        self.before_first_backward = before_first_backward
        self.device = parallel_context.device
        self.idle = IdleTimes() if self.device.type == "cuda" and self.layout.pp > 1 else None

    def template(self) -> dict[str, tuple[int, ...]]:
        """The statistics the schedule adds to the step's (``IDLE_SHARE`` and ``IDLE_RANKS`` where measured)."""
        return {} if self.idle is None else {IDLE_SHARE: (self.layout.pp,), IDLE_RANKS: (self.layout.pp,)}

    def metrics(self, sums: Statistics) -> dict:
        """``pipeline_idle_share``: each stage's idle share averaged over its ranks (once measured)."""
        if self.idle is None or not sums[IDLE_RANKS].any():
            return {}
        return {IDLE_SHARE: (sums[IDLE_SHARE] / sums[IDLE_RANKS].clamp(min=1)).tolist()}

    def run(self, micro_batches: list[MicroBatch], step: int) -> Statistics:
        """Forward and backward every micro-batch; returns this stage's statistics summed over the micro-batches."""
        self.p2p.step = step
        timeline = self.layout.timeline(len(micro_batches))
        actions = timeline.schedule.actions(self.stage)
        run = _StepRun(self, micro_batches, Mailbox(self.p2p, timeline))
        start_reducing = _first_final_gradient(actions, len(micro_batches))
        first_gradient = next(i for i, action in enumerate(actions) if action.op in GRADIENT_OPS)
        if self.idle is not None:
            self.idle.mark_start(step)
        for index, action in enumerate(actions):
            if index == first_gradient:
                self.before_first_backward(run.statistics)
            if index == start_reducing:
                self.before_last_backward()
            received = run.receive(action)
            if self.idle is None:
                run.act(action, received)
            else:
                start, end = self.idle.around(step)
                start.record()
                run.act(action, received)
                end.record()
        run.mailbox.finish()
        if self.idle is not None:
            run.statistics |= self.idle.statistics(step, self.stage, self.layout.pp, self.device)
        return run.statistics


def _first_final_gradient(actions: list[Action], micro_batches: int) -> int:
    """The index of the first gradient action after which every gradient action is of the last micro-batch."""
    last_earlier = max((i for i, a in enumerate(actions) if a.op in GRADIENT_OPS and a.micro_batch < micro_batches - 1),
                       default=-1)
    return next(i for i in range(last_earlier + 1, len(actions)) if actions[i].op in GRADIENT_OPS)


class _StepRun:
    """The state of one step on one stage: activations and gradients in flight, deferred weight gradients."""

    def __init__(self, schedule: PipelineSchedule, micro_batches: list[MicroBatch], mailbox: Mailbox):
        self.chunks, self.micro_batches, self.mailbox = schedule.chunks, micro_batches, mailbox
        self.pipeline = mailbox.schedule
        self.stage, self.last = schedule.stage, self.pipeline.chunks - 1
        self.statistics: Statistics = {}
        self.local: dict[tuple[bool, int, int], torch.Tensor] = {}  # messages between chunks of this stage
        self.held: dict[tuple[int, int], tuple[torch.Tensor | None, StageOutput]] = {}
        self.deferred: dict[tuple[int, int], DeferredWeightGradients] = {}

    def receive(self, action: Action) -> torch.Tensor | None:
        """What ``action`` takes from a neighbouring chunk, waited for: the activations of the chunk before (a
        forward) or the gradient of the chunk after (a backward); None for the first chunk's forward, the last
        chunk's backward and the weights' half."""
        chunk, index = action.chunk, action.micro_batch
        if action.op == Op.FORWARD and chunk > 0:
            return self._take(Message(True, chunk - 1, index))
        if action.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and chunk < self.last:
            return self._take(Message(False, chunk + 1, index))
        return None

    def act(self, action: Action, received: torch.Tensor | None) -> None:
        """Run ``action`` on what it ``received`` (``receive``)."""
        if action.op == Op.FORWARD:
            self.forward(action.chunk, action.micro_batch, received)
        elif action.op == Op.BACKWARD_WEIGHT:
            self.deferred.pop((action.chunk, action.micro_batch)).run()
        else:
            self.backward(action.chunk, action.micro_batch, received, split=action.op == Op.BACKWARD_INPUT)

    def _take(self, message: Message) -> torch.Tensor:
        if self.pipeline.stage_of(message.chunk) == self.stage:
            return self.local.pop((message.forward, message.chunk, message.micro_batch))
        return self.mailbox.receive(message)

    def _give(self, message: Message, tensor: torch.Tensor, free: bool) -> None:
        if self.pipeline.stage_of(message.receiver_chunk) == self.stage:
            self.local[message.forward, message.chunk, message.micro_batch] = tensor
        else:
            self.mailbox.send(message, tensor, free)

    def forward(self, chunk: int, index: int, activations: torch.Tensor | None) -> None:
        x = None if activations is None else activations.detach().requires_grad_()
        y = self.chunks[chunk].forward(self.micro_batches[index], x)
        accumulate(self.statistics, y.statistics)
        if chunk < self.last:
            self._give(Message(True, chunk, index), y.output, free=True)
        self.held[chunk, index] = (x, y)

    def backward(self, chunk: int, index: int, gradient: torch.Tensor | None, split: bool) -> None:
        x, y = self.held.pop((chunk, index))
        roots, grads = ([], []) if y.output is None else ([y.output], [gradient])
        roots, grads = roots + list(y.losses), grads + [None] * len(y.losses)
        if split:
            self.deferred[chunk, index] = backward_input(roots, grads, x, self.chunks[chunk].weights)
        else:
            torch.autograd.backward(roots, grads)
        if chunk > 0:
            self._give(Message(False, chunk, index), x.grad, free=False)
