"""ZeRO-3: every rank keeps a shard of each parameter; a unit's parameters are gathered just before it computes and
released after, in the forward and again in the backward.

Units: each decoder layer, and the outer unit (the embeddings, the final norm and the LM head: what the stage holds
outside its layers). Their parameters live in buckets of their own (``data_parallel.py``, ``ZeroSettings.units``);
gathering a unit all-gathers its buckets' shards into their full buffers, releasing it frees those buffers' storage.
The parameters are views of the buffers, and so is whatever autograd saved of them in the forward: a unit gathered
again for its backward gives them their values back.

Rules of the schedule (``ShardedUnits``):

- forward: a layer's pre-hook waits for its gather (launched when the layer before it started: prefetched), then
  launches the next layer's; its post-hook releases it, except the stage's last layer when a backward follows (its
  backward comes first);
- backward: a hook on a layer's outputs, which fires before any of the layer's backward runs, waits for the layer's
  gather (or launches it) and launches the gather of the layer before it; once every bucket of the layer has been
  reduced (``GradientBuckets.on_reduced``), the layer is released;
- the outer unit is gathered by the model's forward pre-hook and stays gathered until the update (its weights are
  used at both ends of the backward, and the fused loss reads the LM head's weight outside the head's forward); the
  update leaves every gathered unit stale, so all are released then (``GradientBuckets.after_update``).

Recomputed layers recompute inside their backward, after the hook on their outputs gathered them. The hooks are
kept out of compiled graphs (``torch._dynamo.disable``): a compiled layer's graph runs between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from nanotron.parallel.data_parallel import Bucket, GradientBuckets, gather, release
from nanotron.parallel.placement import get_placement

OUTER = "outer"  # the unit of everything a stage holds outside its decoder layers


def parameter_units(model: nn.Module) -> dict[str, str]:
    """The unit of every parameter of a model (logical name -> unit): ``layers.<index>`` for a decoder layer's,
    ``outer`` for the rest."""
    units = {get_placement(param).name: OUTER for param in model.parameters()}
    for index, layer in model.layers.items():
        for param in layer.parameters():
            units[get_placement(param).name] = f"layers.{index}"
    return units


@dataclass
class Unit:
    """The sharded buckets of one unit, and where its gather stands."""

    name: str
    buckets: list[Bucket] = field(default_factory=list)
    gathering: list[dist.Work] = field(default_factory=list)  # the gather in flight
    gathered: bool = False  # its buffers hold the whole parameters (once ``gathering`` is waited for)
    reduced: int = 0  # its buckets reduced in the backward running


class ShardedUnits:
    """Gathers and releases the units of ``model`` over the ZeRO-3 buckets of ``buckets``. ``events``, when given,
    records ``(what, unit)`` in order: ``gather`` (launched), ``wait``, ``release``."""

    def __init__(self, model: nn.Module, buckets: GradientBuckets, events: list[tuple[str, str]] | None = None):
        self.events = events
        self.units: dict[str, Unit] = {}
        for bucket in buckets.buckets:
            if bucket.sharded_params:
                self.units.setdefault(bucket.unit, Unit(bucket.unit)).buckets.append(bucket)
        self.layers = [f"layers.{index}" for index in model.layers]
        model.register_forward_pre_hook(torch._dynamo.disable(self._before_model))
        for position, layer in enumerate(model.layers.values()):
            layer.register_forward_pre_hook(torch._dynamo.disable(self._pre_hook(position)))
            layer.register_forward_hook(torch._dynamo.disable(self._post_hook(position)))
        buckets.on_reduced = self._reduced
        buckets.after_update = self.release_all

    # --- gathering and releasing ---------------------------------------------------------------------------------

    def _launch(self, name: str) -> None:
        unit = self.units.get(name)
        if unit is None or unit.gathered:
            return
        self._record("gather", name)
        unit.gathering = [gather(bucket) for bucket in unit.buckets]
        unit.gathered = True

    def _wait(self, name: str) -> None:
        self._launch(name)
        unit = self.units.get(name)
        if unit is not None and unit.gathering:
            self._record("wait", name)
            for work in unit.gathering:
                work.wait()
            unit.gathering = []

    def _release(self, name: str) -> None:
        unit = self.units.get(name)
        if unit is None or not unit.gathered:
            return
        for work in unit.gathering:  # a prefetch nobody used: its buffers are written before they are freed
            work.wait()
        self._record("release", name)
        for bucket in unit.buckets:
            release(bucket)
        unit.gathering, unit.gathered = [], False

    def release_all(self) -> None:
        """Release every gathered unit (after an update their values are stale)."""
        for name in self.units:
            self._release(name)

    def _record(self, what: str, name: str) -> None:
        if self.events is not None:
            self.events.append((what, name))

    # --- hooks ---------------------------------------------------------------------------------------------------

    def _before_model(self, module: nn.Module, args) -> None:
        self._launch(OUTER)
        if self.layers:
            self._launch(self.layers[0])
        self._wait(OUTER)

    def _pre_hook(self, position: int):
        def before_layer(module: nn.Module, args) -> None:
            self._wait(self.layers[position])
            if position + 1 < len(self.layers):
                self._launch(self.layers[position + 1])

        return before_layer

    def _post_hook(self, position: int):
        def after_layer(module: nn.Module, args, output) -> None:
            outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            backward = torch.is_grad_enabled() and bool(outputs)
            if backward:
                torch.autograd.graph.register_multi_grad_hook(outputs, self._backward_hook(position), mode="any")
            if not (backward and position == len(self.layers) - 1):
                self._release(self.layers[position])

        return after_layer

    def _backward_hook(self, position: int):
        def before_layer_backward(grad: torch.Tensor) -> None:
            self._wait(self.layers[position])
            if position > 0:
                self._launch(self.layers[position - 1])

        return before_layer_backward

    def _reduced(self, bucket: Bucket) -> None:
        """A bucket's gradients of this backward are reduced: the layer is released once all of its are."""
        unit = self.units.get(bucket.unit)
        if unit is None or unit.name == OUTER or not bucket.sharded_params:
            return
        unit.reduced += 1
        if unit.reduced == len(unit.buckets):
            unit.reduced = 0
            self._release(unit.name)
