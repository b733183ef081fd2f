"""Muon: momentum orthogonalised by Newton-Schulz for the decoder's matrices, AdamW for every other parameter.

Which parameters Muon takes is decided by role, not by name: the matrices a module declares in ``matrix_parameters``
(a linear layer's weight, a stack of per-expert matrices) inside the decoder layers, except those of the modules
whose outputs weigh experts (a MoE block's ``keeps_model_dtype``: the router, the shared expert's gate). Embeddings,
the LM head, norms and biases take AdamW with the ``adam_*`` settings. ``optimizer.muon_named_params`` replaces the
rule with name patterns, and refuses a parameter that is no matrix.

The update of a matrix ``W`` (each expert's on its own) at learning rate ``lr``:

    M <- momentum * M + G                        (elementwise: on the rank's shard, where Adam keeps its moments)
    U <- G + momentum * M  (Nesterov) or M
    W <- W * (1 - lr * weight_decay) - lr * scale(rows, columns) * NewtonSchulz(U)

with ``scale`` Moonlight's RMS matching, 0.2 * sqrt(max(rows, columns)) (the update's RMS is then about AdamW's, so
AdamW's learning rate and weight decay carry over), or the original sqrt(max(1, rows / columns)).

**At any layout, exactly.** Newton-Schulz needs each matrix whole, which ZeRO and TP split. A Muon parameter lives in
buckets of its own (``GradientBuckets``, ``orthogonalised``); each rank updates the momentum of its shard of the
bucket, then all-gathers the bucket's ``U`` over the shard group (ZeRO: a flat shard cuts across parameters), makes
each parameter it holds a piece of whole over TP (``parallel/whole_matrices.py``), orthogonalises it and keeps the
part of the result in its shard. Every rank of a TP group computes the same matrices redundantly: the simple exact
scheme, whose cost is one all-gather of the update per bucket and step and, at tp > 1, one per matrix (the ranks of
a ZeRO group orthogonalise only the matrices that reach into their shard). Under expert parallelism each rank
orthogonalises its own experts; under pipeline parallelism each stage its own matrices.

The elementwise parts run as plain torch, compiled on CUDA into one kernel each: the momentum and direction of a
piece of the shard (``momentum_step_``), the scaled copy of each orthogonalised matrix into the shard's fp32 update
(``scaled_copy_``) and the decayed step of the masters with the new weights (``apply_update_``, masters held as
remainders or as fp32 copies). Run eagerly, they were about half of the step's overhead on a GPU.

Checkpoints hold Muon's state like Adam's, as logical tensors: ``momentum/<name>`` (fp32) and ``master/<name>``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from nanotron.config import OptimizerArgs
from nanotron.config.rules import ConfigError
from nanotron.nn.kernels import available
from nanotron.optim.newton_schulz import newton_schulz_function
from nanotron.optim.optimizer import STATE_KINDS, MixedPrecisionAdamW
from nanotron.optim.param_remainders import joined, split_
from nanotron.optim.qk_clip import QKClip
from nanotron.parallel.data_parallel import GradientBuckets
from nanotron.parallel.placement import declared_names, get_placement, logical_parameters
from nanotron.parallel.whole_matrices import gather_over_tp, local_part

MUON_STATE_KINDS = ("momentum", "master")


def muon_parameters(model: nn.Module, patterns: list[str] | None) -> set[str]:
    """The logical names of the parameters Muon takes (the rest take AdamW): the decoder layers' declared matrices
    but the routing modules', or those matching ``patterns`` (``optimizer.muon_named_params``), each of which must
    be a matrix (2-D or a declared stack of matrices)."""
    declared = declared_names(model, "matrix_parameters")
    if patterns is not None:
        params = logical_parameters(model)
        chosen = {name for name in params if any(re.search(pattern, name) for pattern in patterns)}
        for name in sorted(chosen):
            shape = get_placement(params[name]).logical_shape
            if name not in declared and len(shape) != 2:
                raise ConfigError(f"optimizer.muon_named_params matches {name}, of shape {list(shape)}: Muon "
                                  "orthogonalises matrices (2-D weights, stacks of per-expert matrices); narrow the "
                                  "patterns so that they match matrices only")
        return chosen
    chosen = set()
    for layer in model.layers.values():
        routing = {get_placement(param).name for module in layer.modules()
                   for child in getattr(module, "keeps_model_dtype", ()) if getattr(module, child) is not None
                   for param in getattr(module, child).parameters()}
        chosen |= declared_names(layer, "matrix_parameters") - routing
    return chosen


def update_scale(rule: str, rows: int, columns: int) -> float:
    """What the orthogonalised update of a ``rows`` x ``columns`` matrix is multiplied by
    (``optimizer.muon_update_scale``)."""
    if rule == "rms_matching":
        return 0.2 * max(rows, columns) ** 0.5
    return max(1.0, rows / columns) ** 0.5


def momentum_step_(momentum: torch.Tensor, grad: torch.Tensor, direction: torch.Tensor, multiplier: torch.Tensor,
                   beta: float, nesterov: bool) -> None:
    """``momentum`` <- beta * momentum + grad * multiplier, in place, and ``direction`` <- the step's update before
    orthogonalisation (Nesterov's or the momentum itself), in fp32 whatever the gradient's dtype."""
    grad = grad.float() * multiplier
    momentum.mul_(beta).add_(grad)
    direction.copy_(grad + beta * momentum if nesterov else momentum)


def scaled_copy_(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> None:
    """``out`` <- ``x`` * ``scale``, computed in fp32."""
    out.copy_(x.float() * scale)


def apply_update_(master_state: torch.Tensor, weights: torch.Tensor, update: torch.Tensor, lr: torch.Tensor,
                  decay: float, remainders: bool) -> None:
    """masters <- masters * (1 - lr * decay) - lr * update, and the weights take them; the masters are
    ``master_state`` (fp32) or, with ``remainders``, ``weights`` joined with the int16 ``master_state``."""
    masters = joined(weights, master_state) if remainders else master_state
    masters.mul_(1 - lr * decay).sub_(lr * update)
    if remainders:
        split_(masters, weights, master_state)
    else:
        weights.copy_(masters)


@functools.cache
def _compiled(function):
    return torch.compile(function, dynamic=True, fullgraph=True)


class MixedPrecisionMuon(MixedPrecisionAdamW):
    """Muon for the buckets of orthogonalised parameters, AdamW for the others; fp32 masters for both."""

    def __init__(self, buckets: GradientBuckets, args: OptimizerArgs, tp_group: dist.ProcessGroup | None,
                 qk_clip: QKClip | None = None):
        super().__init__(buckets, args)
        self.tp_group, self.qk_clip = tp_group, qk_clip
        self.orthogonalise, self.ns_dtype = newton_schulz_function(self.device, compiled=True)
        fused = available(self.device)
        self.momentum_step_ = _compiled(momentum_step_) if fused else momentum_step_
        self.apply_update_ = _compiled(apply_update_) if fused else apply_update_
        self.scaled_copy_ = _compiled(scaled_copy_) if fused else scaled_copy_
        for index, bucket in enumerate(buckets.buckets):
            if bucket.orthogonalised:  # the momentum in fp32; no second moment
                self.exp_avgs[index] = torch.zeros_like(self.master_state[index], dtype=torch.float32)
                self.exp_avg_sqs[index] = self.exp_avgs[index].new_empty(0)

    def state_kinds(self, index: int) -> tuple[str, ...]:
        return MUON_STATE_KINDS if self.buckets.buckets[index].orthogonalised else STATE_KINDS

    def _shard_state(self, index: int, kind: str) -> torch.Tensor:
        return self.exp_avgs[index] if kind == "momentum" else super()._shard_state(index, kind)

    @torch.no_grad()
    def step(self, lr: float, grad_multiplier: torch.Tensor | None = None) -> None:
        """One update: Muon's of the orthogonalised buckets, AdamW's of the others, then QK-clip's rescale where it
        is on (``optim/qk_clip.py``); then, as AdamW's, the weights take the new masters."""
        self.step_count += 1
        buckets = self.buckets.buckets
        self._adamw_step(lr, grad_multiplier, [i for i, bucket in enumerate(buckets) if not bucket.orthogonalised])
        for index, bucket in enumerate(buckets):
            if bucket.orthogonalised:
                self._muon_step(index, lr, grad_multiplier)
        if self.qk_clip is not None:
            self._scale_rows(self.qk_clip.row_factors())
        self.buckets.all_gather_params()

    def metrics(self) -> dict:
        """QK-clip's fields where it is on (``QKClip.metrics``)."""
        return self.qk_clip.metrics() if self.qk_clip is not None else {}

    def _scale_rows(self, factors: dict[str, torch.Tensor]) -> None:
        """Multiply the masters (and weights) of the parameters ``factors`` names, row by row (a factor per row of
        the parameter's local shape), in this rank's shard."""
        for index, bucket in enumerate(self.buckets.buckets):
            pieces = [piece for piece in bucket.shard_pieces() if piece[0] in factors]
            if not pieces:
                continue
            masters = self.master(index)
            for name, in_param, in_shard in pieces:
                shape = bucket.shapes[name]
                rows = factors[name].view(-1, *[1] * (len(shape) - 1)).expand(shape)
                masters[in_shard] *= rows.reshape(-1)[in_param]
            self._take_masters(index, masters)

    def _take_masters(self, index: int, masters: torch.Tensor) -> None:
        """The weights of bucket ``index``'s shard become ``masters`` (with the remainders where they are kept)."""
        bucket = self.buckets.buckets[index]
        if self.remainders[index]:
            split_(masters, bucket.shard_params, self.master_state[index])
        else:
            bucket.shard_params.copy_(masters)

    def _gradient_pieces(self, index: int) -> Iterator[tuple[torch.Tensor, slice]]:
        """(flat gradient, its range in the shard) of bucket ``index``: its reduced shard, or a parameter at a time
        where the bucket holds autograd's gradients."""
        bucket = self.buckets.buckets[index]
        if bucket.reduced_gradient is not None:
            yield bucket.reduced_gradient, slice(None)
            return
        for name in bucket.names:
            yield bucket.held[name].view(-1), slice(*bucket.ranges[name])

    def _direction(self, index: int, grad_multiplier: torch.Tensor | None) -> torch.Tensor:
        """The momentum of bucket ``index``'s shard, updated, and the step's update before orthogonalisation."""
        a, momentum = self.args, self.exp_avgs[index]
        direction = torch.zeros_like(momentum)
        multiplier = torch.ones((), device=momentum.device) if grad_multiplier is None else grad_multiplier.float()
        for grad, piece in self._gradient_pieces(index):
            self.momentum_step_(momentum[piece], grad, direction[piece], multiplier, a.muon_momentum, a.muon_nesterov)
        return direction

    def _orthogonalised(self, index: int, direction: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the scaled, orthogonalised update of every matrix in bucket ``index``."""
        bucket, a = self.buckets.buckets[index], self.args
        whole = direction
        if bucket.sharded:
            whole = direction.new_empty(bucket.numel)
            dist.all_gather_into_tensor(whole, direction, group=bucket.group)
        update = torch.zeros_like(direction)
        for name, in_param, in_shard in bucket.shard_pieces():
            placement = get_placement(self.buckets.params[name])
            local = whole[slice(*bucket.ranges[name])].view(bucket.shapes[name])
            matrix = gather_over_tp(local, placement, self.tp_group)
            orthogonal = self.orthogonalise(matrix, a.muon_ns_steps, tuple(a.muon_ns_coefficients), self.ns_dtype)
            scale = torch.full((), update_scale(a.muon_update_scale, *matrix.shape[-2:]), device=update.device)
            self.scaled_copy_(update[in_shard], local_part(orthogonal, placement, self.tp_group).reshape(-1)[in_param],
                              scale)
        return update

    def _muon_step(self, index: int, lr: float, grad_multiplier: torch.Tensor | None) -> None:
        bucket, a = self.buckets.buckets[index], self.args
        update = self._orthogonalised(index, self._direction(index, grad_multiplier))
        decay = (a.weight_decay if a.muon_weight_decay is None else a.muon_weight_decay) if bucket.weight_decay else 0
        lr_tensor = torch.full((), lr, dtype=torch.float32, device=update.device)  # a fill: no recompile, no sync
        self.apply_update_(self.master_state[index], bucket.shard_params, update, lr_tensor, float(decay),
                           self.remainders[index])

