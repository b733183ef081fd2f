"""Data parallelism: gradients in flat buckets, reduced over replicas while the backward pass is still running.

Every local parameter gets a slice of a flat gradient buffer (fp32 with ``accumulate_grad_in_fp32``, else the model
dtype) and of a flat parameter buffer (the parameter's storage). Buffers are cut into buckets of about
``model.ddp_bucket_cap_mb``, filled in reverse registration order, which is roughly the order in which the backward
pass produces gradients. A post-accumulate-grad hook adds each micro-batch's gradient into the buffer; the first
gradient of a parameter in a step is copied instead, so the buffer never needs a separate zeroing pass. During the
last micro-batch of a step, a bucket is reduced as soon as all its gradients have arrived, so communication overlaps
the rest of the backward pass; earlier micro-batches only accumulate.

Reduction is a SUM (each rank's loss is already divided by the global token count). Without ZeRO each bucket is
all-reduced. With ZeRO-1 (``shard=True``) each bucket is split into equal shards, one per data-parallel rank, and
reduce-scattered: a rank only receives the gradient sum of its shard, which is all its optimizer needs; after the
update the shards of the parameters are all-gathered. Both collectives work in place (a rank's shard is its slice of
the full buffer, the layout NCCL and gloo reduce-scatter into and all-gather from), so neither needs a staging copy.
A parameter tied across pipeline stages gets a bucket of its own, so that both copies have the same shard layout and
their gradients can be summed shard to shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from nanotron.parallel.placement import get_placement


@dataclass
class Bucket:
    names: list[str]
    ranges: dict[str, tuple[int, int]]  # name -> [start, end) in the flat buffers
    numel: int  # padded to a multiple of the data-parallel size
    weight_decay: bool
    grads: torch.Tensor
    params: torch.Tensor
    shard: slice  # the part this rank reduces and optimizes (all of it without ZeRO)
    pending: int = 0
    work: dist.Work | None = None
    shapes: dict[str, torch.Size] = field(default_factory=dict)
    written: set[str] = field(default_factory=set)  # parameters with a gradient in the buffer this step

    def shard_pieces(self) -> list[tuple[str, slice, slice]]:
        """(name, range in the parameter's flattened data, range in the shard) for every parameter in the shard."""
        pieces = []
        for name in self.names:
            start, end = self.ranges[name]
            lo, hi = max(start, self.shard.start), min(end, self.shard.stop)
            if lo < hi:
                pieces.append((name, slice(lo - start, hi - start), slice(lo - self.shard.start, hi - self.shard.start)))
        return pieces


class GradientBuckets:
    def __init__(self, params: dict[str, torch.nn.Parameter], no_decay: set[str], grad_dtype: torch.dtype,
                 bucket_bytes: int, group: dist.ProcessGroup, shard: bool):
        self.params = params
        self.group = group
        self.dp = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self.shard_optimizer = shard and self.dp > 1
        self.final_micro_batch = False
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[str, Bucket] = {}

        element_bytes = torch.finfo(grad_dtype).bits // 8
        for decay in (True, False):
            names = [n for n in reversed(params) if (n not in no_decay) == decay]
            current: list[str] = []
            for name in names:
                alone = bool(get_placement(params[name]).pipeline_copies)
                if alone and current:
                    self._add_bucket(current, decay, grad_dtype)
                    current = []
                current.append(name)
                if alone or sum(params[n].numel() for n in current) * element_bytes >= bucket_bytes:
                    self._add_bucket(current, decay, grad_dtype)
                    current = []
            if current:
                self._add_bucket(current, decay, grad_dtype)
        for name, param in params.items():
            param.register_post_accumulate_grad_hook(self._hook(name))

    def _add_bucket(self, names: list[str], decay: bool, grad_dtype: torch.dtype) -> None:
        first = self.params[names[0]]
        ranges, offset = {}, 0
        for name in names:
            ranges[name] = (offset, offset + self.params[name].numel())
            offset += self.params[name].numel()
        numel = -(-offset // self.dp) * self.dp
        per_rank = numel // self.dp
        shard = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank) if self.shard_optimizer else slice(0, numel)
        bucket = Bucket(
            names=list(names), ranges=ranges, numel=numel, weight_decay=decay,
            grads=torch.zeros(numel, dtype=grad_dtype, device=first.device),
            params=torch.zeros(numel, dtype=first.dtype, device=first.device), shard=shard,
        )
        for name in names:  # the parameter now lives in the flat buffer
            param, (start, end) = self.params[name], ranges[name]
            bucket.shapes[name] = param.shape
            bucket.params[start:end].copy_(param.detach().flatten())
            param.data = bucket.params[start:end].view(param.shape)
            self.bucket_of[name] = bucket
        bucket.pending = len(names)
        self.buckets.append(bucket)

    def _hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            bucket = self.bucket_of[name]
            start, end = bucket.ranges[name]
            if name in bucket.written:
                bucket.grads[start:end].add_(param.grad.flatten())
            else:  # the multi-tensor copy converts bf16 to fp32 at memory speed, unlike copy_ (measured on H200)
                torch._foreach_copy_([bucket.grads[start:end]], [param.grad.flatten()])
                bucket.written.add(name)
            param.grad = None
            if self.final_micro_batch:
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._launch(bucket)

        return hook

    def _launch(self, bucket: Bucket) -> None:
        if self.dp == 1:
            return
        if self.shard_optimizer:
            bucket.work = dist.reduce_scatter_tensor(bucket.grads[bucket.shard], bucket.grads, group=self.group,
                                                     async_op=True)
        else:
            bucket.work = dist.all_reduce(bucket.grads, group=self.group, async_op=True)

    def finish_reduction(self) -> None:
        """Wait for every bucket's reduction (launching those whose parameters got no gradient this step)."""
        for bucket in self.buckets:
            if bucket.work is None:
                for name in set(bucket.names) - bucket.written:  # no gradient this step: it is zero
                    bucket.grads[slice(*bucket.ranges[name])].zero_()
                    bucket.written.add(name)
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work = None

    def all_gather_params(self) -> None:
        """After a ZeRO-1 update, give every rank the parameters updated by the others."""
        if not self.shard_optimizer:
            return
        for bucket in self.buckets:
            dist.all_gather_into_tensor(bucket.params, bucket.params[bucket.shard], group=self.group)

    def zero(self) -> None:
        """Start a new step: the next gradient of every parameter overwrites its slice of the buffer."""
        self.final_micro_batch = False
        for bucket in self.buckets:
            bucket.written.clear()
            bucket.pending = len(bucket.names)

    def gradient(self, name: str) -> torch.Tensor:
        """The full accumulated gradient of a parameter, in its shape (complete only where this rank reduced it)."""
        bucket = self.bucket_of[name]
        return bucket.grads[slice(*bucket.ranges[name])].view(bucket.shapes[name])

    def grad_pieces(self) -> list[tuple[str, torch.Tensor]]:
        """(name, gradient values) of every parameter piece in this rank's shards, for norms and clipping."""
        return [(name, bucket.grads[bucket.shard][in_shard]) for bucket in self.buckets
                for name, _, in_shard in bucket.shard_pieces()]


@torch.no_grad()
def all_reduce_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """SUM-reduce ``tensors`` in place with one collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same_dtype in by_dtype.values():
        flat = _flatten_dense_tensors(same_dtype)
        dist.all_reduce(flat, group=group)
        for tensor, reduced in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
            tensor.copy_(reduced)


@torch.no_grad()
def sync_tied_copies(buckets: GradientBuckets, group: dist.ProcessGroup) -> None:
    """Sum the gradients of weights held by several pipeline stages, so every copy takes the same update.

    Each such weight has a bucket of its own with the same layout on every stage: shards line up.
    """
    tied = [b.grads[b.shard] for b in buckets.buckets
            if any(get_placement(buckets.params[n]).pipeline_copies for n in b.names)]
    if tied:
        all_reduce_coalesced(tied, group)


class ReplicaDivergenceError(RuntimeError):
    """Data-parallel replicas no longer hold the same weights."""


@torch.no_grad()
def check_replicas_agree(buckets: GradientBuckets, step: int) -> None:
    """Compare a checksum of this rank's weights with the other data-parallel replicas; fail loudly if they differ.

    Replicas apply identical updates, so their weights must be bit-identical; a difference means a bug or a faulty
    device, and continuing would silently train several different models.
    """
    if buckets.dp == 1:
        return
    checksum = torch.stack([torch.stack([b.params.double().sum(), b.params.double().pow(2).sum()])
                            for b in buckets.buckets]).sum(0)
    gathered = [torch.empty_like(checksum) for _ in range(buckets.dp)]
    dist.all_gather(gathered, checksum, group=buckets.group)
    if any(not torch.equal(other, gathered[0]) for other in gathered):
        raise ReplicaDivergenceError(
            f"data-parallel replicas hold different weights at step {step} (checksums "
            f"{[tuple(round(v, 6) for v in g.tolist()) for g in gathered]}); resume from the last checkpoint"
        )
