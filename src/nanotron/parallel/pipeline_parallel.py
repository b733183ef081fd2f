"""Pipeline schedules: all-forward-all-backward (AFAB) and one-forward-one-backward (1F1B).

Each stage runs its part of the model on every micro-batch of the step. Activations go to the next stage and their
gradients come back through point-to-point messages. Shapes are fixed by the config (micro-batch, sequence or
sequence shard, hidden), so no shape metadata is ever exchanged. Every exchange is a ``batch_isend_irecv`` on the
pipeline group created at start-up, and every wait has a deadline: a stage that waits longer than
``parallelism.pp_timeout_s`` (or whose neighbour died) fails with an error naming the stage, the step and the exchange
instead of hanging.

The language-model loss of each micro-batch is computed on the last stage only, as ``sum of token losses / global
token count``, so accumulating over the schedule's micro-batches gives the mean over the global batch with no further
scaling. A stage's forward (the step program's, ``training/step.py``) returns a :class:`StageOutput`: the activations
for the next stage (none on the last), the stage's contributions to the loss (the language-model loss on the last
stage, a router's load-balancing loss on any stage, each backpropagated together with the gradient that comes back
for the activations) and named statistics, which the schedule sums over the step's micro-batches
(``parallel/statistics.py``).

Both schedules are one loop: a warm-up of forwards, then one forward and one backward in turn, then the remaining
backwards (cool-down). The layout (``Layout.warmup``) says how many forwards the warm-up runs on stage ``s`` of
``P``: ``min(P - s - 1, M)`` under 1F1B (Narayanan et al., 2021), so that at most ``P - s`` micro-batches are in
flight, and all ``M`` under AFAB (all forwards, then all backwards). With one stage both reduce to plain gradient
accumulation, one micro-batch at a time. A stage frees each activation it has sent; the autograd graph behind it
stays until its backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from nanotron.data.batch import MicroBatch
from nanotron.layout import Axis, Group
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.statistics import Statistics, accumulate


class PipelineTimeoutError(RuntimeError):
    """A point-to-point exchange between pipeline stages did not complete in time."""


@dataclass
class P2P:
    """Exchanges with the neighbouring stages (same dp/ep/tp coordinates)."""

    parallel_context: ParallelContext
    shape: tuple[int, ...]
    dtype: torch.dtype
    timeout_s: float
    step: int = 0

    def __post_init__(self):
        pc = self.parallel_context
        ranks, stage = pc.members(Group.PP), pc.coord(Axis.PP)
        self.stage = stage
        self.group = pc.group(Group.PP)
        self.prev = ranks[stage - 1] if stage > 0 else None
        self.next = ranks[stage + 1] if stage < len(ranks) - 1 else None

    def _exchange(self, what: str, send: list[tuple[torch.Tensor, int]], recv_from: list[int]) -> list[torch.Tensor]:
        received = [torch.empty(self.shape, dtype=self.dtype, device=self.parallel_context.device) for _ in recv_from]
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), peer, self.group) for tensor, peer in send]
        ops += [dist.P2POp(dist.irecv, buffer, peer, self.group) for buffer, peer in zip(received, recv_from)]
        deadline = time.monotonic() + self.timeout_s
        try:
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError as error:  # the backends raise RuntimeError subclasses on timeouts and lost peers
            raise PipelineTimeoutError(
                f"pipeline stage {self.stage} could not {what} at step {self.step} within "
                f"parallelism.pp_timeout_s={self.timeout_s:g}s: a neighbouring stage is stuck or crashed "
                f"(raise the timeout if it is only slow). Backend said: {str(error).splitlines()[0][:200]}"
            ) from error
        return received

    def recv_forward(self) -> torch.Tensor:
        (x,) = self._exchange("receive activations from the previous stage", [], [self.prev])
        return x

    def send_forward(self, y: torch.Tensor) -> None:
        self._exchange("send activations to the next stage", [(y, self.next)], [])

    def recv_backward(self) -> torch.Tensor:
        (g,) = self._exchange("receive gradients from the next stage", [], [self.next])
        return g

    def send_backward(self, g: torch.Tensor) -> None:
        self._exchange("send gradients to the previous stage", [(g, self.prev)], [])

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor:
        (g,) = self._exchange("exchange activations/gradients with the next stage", [(y, self.next)], [self.next])
        return g

    def send_backward_recv_forward(self, g: torch.Tensor) -> torch.Tensor:
        (x,) = self._exchange("exchange gradients/activations with the previous stage", [(g, self.prev)], [self.prev])
        return x


@dataclass
class StageOutput:
    """One stage's forward of one micro-batch.

    The activations are freed once sent (see ``PipelineSchedule._free``), so a loss of an inner stage must be computed
    from tensors inside the stage (router logits), never from the output itself.
    """

    output: torch.Tensor | None  # activations for the next stage; None on the last stage
    statistics: Statistics = field(default_factory=dict)  # summed over micro-batches, detached
    losses: tuple[torch.Tensor, ...] = ()  # scalars this stage adds to the objective, each a root of its backward


class PipelineSchedule:
    """Runs forward and backward of all micro-batches of one step on this stage.

    ``forward(micro_batch, inputs)`` returns the stage's :class:`StageOutput`. ``before_last_backward()`` is called
    before the step's last backward on this stage, when data-parallel gradient reduction may start.
    """

    def __init__(self, parallel_context: ParallelContext, p2p: P2P,
                 forward: Callable[[dict, torch.Tensor | None], StageOutput], before_last_backward: Callable[[], None]):
        self.layout, self.stage = parallel_context.layout, parallel_context.coord(Axis.PP)
        self.p2p = p2p
        self.forward_fn = forward
        self.before_last_backward = before_last_backward
        self.first, self.last = parallel_context.is_first_stage, parallel_context.is_last_stage

    def run(self, micro_batches: list[MicroBatch], step: int) -> Statistics:
        """Forward and backward every micro-batch; returns this stage's statistics summed over the micro-batches."""
        self.p2p.step = step
        self.statistics: Statistics = {}
        self._pending_input: list[torch.Tensor] = []
        self._backwards_left = len(micro_batches)
        self._run(micro_batches, self.layout.warmup(self.stage, len(micro_batches)))
        return self.statistics

    # --- one micro-batch on this stage ----------------------------------------------------------------------

    def _forward(self, micro_batch: MicroBatch) -> tuple[torch.Tensor | None, StageOutput]:
        x = None if self.first else self._next_input()
        if x is not None:
            x.requires_grad_()
        y = self.forward_fn(micro_batch, x)
        accumulate(self.statistics, y.statistics)
        return x, y

    def _next_input(self) -> torch.Tensor:
        """This micro-batch's input: already received with the previous backward exchange, or received now."""
        return self._pending_input.pop(0) if self._pending_input else self.p2p.recv_forward()

    @staticmethod
    def _free(y: StageOutput) -> None:
        """Release a sent activation's memory; its autograd node needs only its shape for the backward.

        The stage output comes from a residual addition, whose backward does not read the output's values.
        """
        y.output.untyped_storage().resize_(0)

    def _backward(self, x: torch.Tensor | None, y: StageOutput, grad: torch.Tensor | None) -> torch.Tensor | None:
        self._backwards_left -= 1
        if self._backwards_left == 0:
            self.before_last_backward()
        outputs, grads = ([], []) if y.output is None else ([y.output], [grad])
        torch.autograd.backward(outputs + list(y.losses), grads + [None] * len(y.losses))
        return None if x is None else x.grad

    # --- the schedule -------------------------------------------------------------------------------------------

    def _run(self, micro_batches: list[dict], warmup: int) -> None:
        """``warmup`` forwards, then one forward and one backward in turn, then the backwards left."""
        in_flight = []
        for micro_batch in micro_batches[:warmup]:
            x, y = self._forward(micro_batch)
            if not self.last:
                self.p2p.send_forward(y.output)
                self._free(y)
            in_flight.append((x, y))

        steady = micro_batches[warmup:]
        for i, micro_batch in enumerate(steady):
            x, y = self._forward(micro_batch)
            in_flight.append((x, y))
            grad = None
            if not self.last:
                grad = self.p2p.send_forward_recv_backward(y.output)
                self._free(y)
            x_old, y_old = in_flight.pop(0)
            dx = self._backward(x_old, y_old, grad)
            if not self.first:
                if i == len(steady) - 1:
                    self.p2p.send_backward(dx)
                else:  # receive the next micro-batch's input in the same exchange
                    self._pending_input.append(self.p2p.send_backward_recv_forward(dx))

        for x, y in in_flight:
            grad = None if self.last else self.p2p.recv_backward()
            dx = self._backward(x, y, grad)
            if not self.first:
                self.p2p.send_backward(dx)
