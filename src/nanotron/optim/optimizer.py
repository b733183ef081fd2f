"""AdamW on fp32 master weights, over the flat shards of the gradient buckets (ZeRO when they are sharded), a
parameter at a time where a bucket holds the gradients autograd produced (``data_parallel.py``).

The optimizer keeps fp32 master weights of this rank's shard of every bucket and updates them: small updates that
would vanish when added to a bf16 weight are kept. After each step the model's parameters take the new masters (and,
with ZeRO-1 and ZeRO-2, are all-gathered over data-parallel ranks; ZeRO-3 keeps only the shards, gathered a unit at
a time when used). Without ZeRO a rank's shard is the whole bucket; with ZeRO it is 1/n of it (n the ranks it is
sharded over), so masters and Adam moments take 1/n of the memory. The masters of bf16 weights are held as those
weights plus 16 remainder bits each (``param_remainders.py``, ``optimizer.store_param_remainders``), others as fp32
copies.

The Adam moments are fp32, or bf16 with ``optimizer.adam_moments_dtype: bfloat16`` (the update still computes in
fp32, ``adamw.py``); masters stay fp32 either way.

Checkpoints need state per logical parameter, not per shard: ``bucket_states`` gathers one bucket at a time over
data-parallel ranks and cuts it into parameters; ``load_bucket_states`` does the reverse. Checkpoints hold fp32
moments whatever their dtype in training, so a run resumes with either setting.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nanotron.config import OptimizerArgs
from nanotron.layout import Axis
from nanotron.optim.adamw import AdamWHyperparameters, adamw_update_function
from nanotron.optim.param_remainders import joined, split_, stores_remainders
from nanotron.parallel.data_parallel import GradientBuckets, ZeroSettings

if TYPE_CHECKING:
    from nanotron.optim.qk_clip import QKClip

STATE_KINDS = ("exp_avg", "exp_avg_sq", "master")


def no_weight_decay(name: str, param: torch.Tensor, exclude_patterns: list[str] | None,
                    declared: set[str] = frozenset()) -> bool:
    """Built-in rule: norms and biases (1-D tensors), embeddings and the parameters a model declares
    (``no_weight_decay_parameters``, e.g. state-space decay rates) are not decayed; patterns replace the rule."""
    if exclude_patterns is not None:
        return any(re.search(pattern, name) for pattern in exclude_patterns)
    return param.dim() < 2 or "embed" in name or name in declared


class MixedPrecisionAdamW:
    def __init__(self, buckets: GradientBuckets, args: OptimizerArgs):
        self.buckets = buckets
        self.args = args
        # Per bucket, what the master keeps beyond the weights: int16 remainders (zero: the weights are the masters
        # now), or an fp32 copy.
        self.remainders = [stores_remainders(b.params.dtype, args.store_param_remainders) for b in buckets.buckets]
        self.master_state = [torch.zeros_like(b.shard_params, dtype=torch.int16) if remainders
                             else b.shard_params.detach().float().clone()
                             for b, remainders in zip(buckets.buckets, self.remainders)]
        moments_dtype = getattr(torch, args.adam_moments_dtype)
        self.exp_avgs = [torch.zeros_like(m, dtype=moments_dtype) for m in self.master_state]
        self.exp_avg_sqs = [torch.zeros_like(m, dtype=moments_dtype) for m in self.master_state]
        self.step_count = 0
        self.device = buckets.buckets[0].params.device
        self._updates = {remainders: adamw_update_function(self.device, args.torch_adam_is_fused, remainders)
                         for remainders in set(self.remainders)}

    @torch.no_grad()
    def step(self, lr: float, grad_multiplier: torch.Tensor | None = None) -> None:
        """One AdamW update of this rank's shards, with the gradients multiplied by ``grad_multiplier`` (clipping);
        the model's weights get the new masters (all-gathered over data-parallel ranks under ZeRO-1)."""
        self.step_count += 1
        self._adamw_step(lr, grad_multiplier, range(len(self.buckets.buckets)))
        self.buckets.all_gather_params()

    def _adamw_step(self, lr: float, grad_multiplier: torch.Tensor | None, indices: Iterable[int]) -> None:
        """The AdamW update of the shards of buckets ``indices``."""
        a = self.args
        hyper = {(decay, scale): AdamWHyperparameters.at_step(
                     self.step_count, lr * scale, a.adam_beta1, a.adam_beta2, a.adam_eps,
                     a.weight_decay if decay else 0.0, grad_multiplier, self.device)
                 for decay, scale in {(bucket.weight_decay, bucket.lr_scale) for bucket in self.buckets.buckets}}
        for index in indices:
            bucket = self.buckets.buckets[index]
            update = self._updates[self.remainders[index]]
            for grad, master, exp_avg, exp_avg_sq, weights in self._shard_pieces(index):
                update(master, grad, exp_avg, exp_avg_sq, weights, hyper[bucket.weight_decay, bucket.lr_scale])

    def _shard_pieces(self, index: int) -> Iterator[tuple[torch.Tensor, ...]]:
        """(gradient, master state, moments, weights) of bucket ``index``'s shard, flat: the whole shard where the
        bucket has a gradient buffer, else a parameter at a time with the gradient autograd produced."""
        bucket = self.buckets.buckets[index]
        state = (self.master_state[index], self.exp_avgs[index], self.exp_avg_sqs[index], bucket.shard_params)
        if bucket.reduced_gradient is not None:
            yield bucket.reduced_gradient, *state
            return
        for name in bucket.names:  # not sharded: the shard is the whole bucket
            piece = slice(*bucket.ranges[name])
            yield bucket.held[name].view(-1), *(tensor[piece] for tensor in state)

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        """Take the masters from the model's weights (after weights were loaded without optimizer state)."""
        for index, bucket in enumerate(self.buckets.buckets):
            if self.remainders[index]:
                self.master_state[index].zero_()
            else:
                self.master_state[index].copy_(bucket.shard_params)

    def metrics(self) -> dict:
        """metrics.jsonl fields of the step just taken (every rank calls it: a collective where one is needed)."""
        return {}

    def master(self, index: int) -> torch.Tensor:
        """The fp32 masters of bucket ``index``'s shard (a new tensor where they are held as remainders)."""
        if self.remainders[index]:
            bucket = self.buckets.buckets[index]
            return joined(bucket.shard_params, self.master_state[index])
        return self.master_state[index]

    def local_state_numel(self) -> int:
        """Elements of optimizer state held by this rank (masters and moments)."""
        return sum(self.master_state[index].numel() if kind == "master" else self._shard_state(index, kind).numel()
                   for index in range(len(self.buckets.buckets)) for kind in self.state_kinds(index))

    # --- checkpointing -------------------------------------------------------------------------------------------

    def state_kinds(self, index: int) -> tuple[str, ...]:
        """The kinds of state bucket ``index`` keeps per parameter (names in checkpoints: ``<kind>/<parameter>``)."""
        return STATE_KINDS

    def _shard_state(self, index: int, kind: str) -> torch.Tensor:
        if kind == "master":
            return self.master(index)
        return {"exp_avg": self.exp_avgs, "exp_avg_sq": self.exp_avg_sqs}[kind][index]

    def bucket_states(self) -> Iterator[dict[str, dict[str, torch.Tensor]]]:
        """Per bucket: {parameter name: {state kind: fp32 tensor of the parameter's local shape}}.

        Collective over data-parallel ranks under ZeRO (the shards are all-gathered), local otherwise. bf16 moments
        are upcast, a bucket at a time.
        """
        buckets = self.buckets
        for index, bucket in enumerate(buckets.buckets):
            full = {}
            for kind in self.state_kinds(index) if self.step_count else ("master",):
                shard = self._shard_state(index, kind)
                if bucket.sharded:
                    whole = torch.empty(bucket.numel, dtype=shard.dtype, device=shard.device)
                    dist.all_gather_into_tensor(whole, shard.contiguous(), group=bucket.group)
                else:
                    whole = shard
                full[kind] = whole.float()
            yield {name: {kind: full[kind][slice(*bucket.ranges[name])].view(bucket.shapes[name]) for kind in full}
                   for name in bucket.names}

    @torch.no_grad()
    def load_bucket_states(self, read: Callable[[str, str, torch.Tensor], None], step: int) -> None:
        """Fill masters and moments; ``read(name, kind, out)`` fills ``out`` (the parameter's local shape) in fp32,
        which the moments' dtype then rounds. The weights become the masters. Rows the checkpoint lacks (another
        vocabulary padding) keep zero moments and, as masters, the loaded weights (this rank's shard of them: under
        ZeRO-3 the rest is not held)."""
        for index, bucket in enumerate(self.buckets.buckets):
            for kind in self.state_kinds(index):
                whole = torch.zeros(bucket.numel, dtype=torch.float32, device=self.master_state[index].device)
                if kind == "master":
                    whole[bucket.shard] = bucket.shard_params
                for name in bucket.names:
                    read(name, kind, whole[slice(*bucket.ranges[name])].view(bucket.shapes[name]))
                if kind != "master":
                    self._shard_state(index, kind).copy_(whole[bucket.shard])
                elif self.remainders[index]:
                    split_(whole[bucket.shard], bucket.shard_params, self.master_state[index])
                else:
                    self.master_state[index].copy_(whole[bucket.shard])
                    bucket.shard_params.copy_(self.master_state[index])
        self.step_count = step
        self.buckets.all_gather_params()


def build_optimizer(params: dict[str, torch.nn.Parameter], args: OptimizerArgs, bucket_mb: float,
                    groups: dict[tuple[Axis, ...], dist.ProcessGroup], declared_no_decay: set[str] = frozenset(),
                    single_micro_batch: bool = False,
                    replicas: dict[tuple[Axis, ...], dist.ProcessGroup | None] | None = None,
                    units: dict[str, str] | None = None,
                    initialize: Callable[[dict[str, torch.Tensor]], None] | None = None,
                    lr_scales: dict[str, float] | None = None,
                    matrices: set[str] = frozenset(), tp_group: dist.ProcessGroup | None = None,
                    qk_clip: QKClip | None = None) -> tuple[GradientBuckets, MixedPrecisionAdamW]:
    """Gradient buckets (fp32 when accumulating in fp32 where gradients are summed, ``gradient_dtype``) reduced over
    ``groups`` (gradient axes -> process group, ``ParallelContext.shard_groups``; under HSDP the ranks of one shard
    group, each shard's ``replicas`` then summed) and the optimizer over their shards; ``single_micro_batch``: every
    step has one micro-batch per replica. ZeRO-3: ``units`` (parameter name -> unit) cut the buckets, and
    ``initialize`` gives the parameters their values a bucket at a time (``GradientBuckets.fill``). ``lr_scales``
    multiply the learning rate of the parameters they name (spectral µP). With ``optimizer.name: muon``, Muon takes
    the ``matrices`` (``optim/muon.py``), made whole over ``tp_group``, and ``qk_clip`` rescales the attention's
    queries and keys after each step (``optim/qk_clip.py``)."""
    from nanotron.optim.muon import MixedPrecisionMuon  # Muon builds on this module's AdamW

    exclude = args.weight_decay_exclude_named_params
    no_decay = {n for n, p in params.items() if no_weight_decay(n, p, exclude, declared_no_decay)}
    zero = ZeroSettings(args.zero_stage, replicas, units, args.grad_reduce_in_bf16)
    buckets = GradientBuckets(params, no_decay, args.accumulate_grad_in_fp32, int(bucket_mb * 2**20), groups, zero,
                              single_micro_batch=single_micro_batch,
                              persistent_buffers=args.persistent_gradient_buffers, lr_scales=lr_scales,
                              orthogonalised=matrices)
    if initialize is not None:
        buckets.fill(initialize)
    if args.name == "muon":
        return buckets, MixedPrecisionMuon(buckets, args, tp_group, qk_clip)
    return buckets, MixedPrecisionAdamW(buckets, args)
