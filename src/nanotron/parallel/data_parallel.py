"""Data parallelism: gradients in flat buckets, reduced over replicas while the backward pass is still running.

Every local parameter gets a slice of a flat parameter buffer (the parameter's storage) and, where its gradient is
summed, of a flat gradient buffer (``gradient_dtype``: fp32 with ``accumulate_grad_in_fp32``, else the model dtype).
Buffers are cut into buckets of about ``model.ddp_bucket_cap_mb``, filled in reverse registration order, which is
roughly the order in which the backward pass produces gradients. A post-accumulate-grad hook adds each micro-batch's
gradient into the buffer; the first gradient of a parameter in a step is copied instead, so the buffer never needs a
separate zeroing pass. During the last micro-batch of a step, a bucket is reduced as soon as all its gradients have
arrived, so communication overlaps the rest of the backward pass; earlier micro-batches only accumulate.

Where nothing would be summed in a gradient (one micro-batch a step, no replicas over its gradient axes, no copy on
another pipeline stage) and it is large (``holds_autograd_gradient``), its bucket has no gradient buffer: the hook
keeps the gradient autograd produced until the update, as a loop that frees its gradients after each update does.
That saves a copy of the gradient every step and the buffer's memory outside the backward and update, where the
activations peak (``memory.py`` counts what is held when). The update and the norm then take a kernel per such
parameter instead of one per bucket, so small gradients are still copied into a buffer.

Reduction is a SUM (each rank's loss is already divided by the global token count). Without ZeRO each bucket is
all-reduced. With ZeRO-1 (``shard=True``) each bucket is split into equal shards, one per data-parallel rank, and
reduce-scattered: a rank only receives the gradient sum of its shard, which is all its optimizer needs; after the
update the shards of the parameters are all-gathered. Both collectives work in place (a rank's shard is its slice of
the full buffer, the layout NCCL and gloo reduce-scatter into and all-gather from), so neither needs a staging copy.
A parameter tied across pipeline stages gets a bucket of its own, so that both copies have the same shard layout and
their gradients can be summed shard to shard.

With ZeRO-2 (``ZeroSettings.stage`` 2) a sharded bucket keeps no full gradient buffer: each micro-batch's gradients
are copied into a transient one (``staging``, in ``reduce_dtype``), reduce-scattered as soon as the bucket is complete
and added into the rank's shard of the step's gradient (``shard_grads``, fp32 with ``accumulate_grad_in_fp32``), the
staging buffer then freed; at most ``REDUCTIONS_IN_FLIGHT`` reductions are pending, and the end of each backward pass
settles them all. With ZeRO-3 the parameters are sharded too: a bucket holds one unit's parameters (a decoder layer,
or the rest: ``units``), keeps its shard (``shard_params``) and has its full buffer's storage only while the unit is
gathered (``parameter_sharding.py`` gathers and releases them). Under HSDP (``replicas``) buckets shard over part of
their replicas and each shard's step gradient is then all-reduced over the replicas of that shard.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from nanotron.layout import Axis
from nanotron.parallel.placement import get_placement


def gradient_dtype(param_dtype: torch.dtype, accumulate_in_fp32: bool, single_micro_batch: bool, replicas: int,
                   tied_across_stages: bool) -> torch.dtype:
    """The dtype of a parameter's slice of the gradient buffer.

    ``accumulate_in_fp32`` asks for fp32 so that the sums made in the buffer are made in fp32: the micro-batches of a
    step (added by the hook), the reduction over ``replicas`` and the tied copies' sum over pipeline stages
    (``sync_tied_copies``). Where none of them happens the buffer only ever holds the backward's gradient, which is
    in the parameter's dtype: fp32 would hold the same numbers in twice the bytes, written by the hook and read by
    the grad norm and the optimizer every step. Any other sum of a gradient (sequence-parallel weights over TP, kv
    heads shared by TP ranks) happens in autograd, in the parameter's dtype, before the gradient reaches the buffer.
    """
    summed = not single_micro_batch or replicas > 1 or tied_across_stages
    return torch.float32 if accumulate_in_fp32 and summed else param_dtype


# Gradients of fewer elements are copied into a buffer even where nothing is summed: launching an update and a norm
# of their own costs more than the copy. Mamba 130M on an H200 (eight of a layer's ten parameters under 2^20
# elements) lost 15% of its speed with every gradient held.
HELD_GRADIENT_MIN_ELEMENTS = 1 << 20


def holds_autograd_gradient(numel: int, single_micro_batch: bool, replicas: int, tied_across_stages: bool,
                            persistent_buffers: bool) -> bool:
    """Whether a parameter's gradient is held as autograd produced it rather than copied into a buffer: nothing is
    summed in it and it is large enough."""
    summed = not single_micro_batch or replicas > 1 or tied_across_stages
    return not (summed or persistent_buffers) and numel >= HELD_GRADIENT_MIN_ELEMENTS


# Reductions of ZeRO-2/3 buckets pending at once: each holds a full-size staging buffer until it is settled.
REDUCTIONS_IN_FLIGHT = 2


@dataclass(frozen=True)
class ZeroSettings:
    """How buckets are sharded over their data-parallel replicas (``optimizer.zero_stage``): 1 optimizer state, 2 and
    gradients, 3 and parameters, each unit's (``units``: parameter name -> unit) in buckets of its own. ``replicas``
    (HSDP) maps gradient axes to the replicas of each shard (the groups the buckets shard over are then part of
    those axes); ``reduce_in_bf16`` reduce-scatters ZeRO-2/3 gradients in bf16 before they are summed in fp32."""

    stage: int = 0
    replicas: dict[tuple[Axis, ...], dist.ProcessGroup | None] | None = None
    units: dict[str, str] | None = None
    reduce_in_bf16: bool = False


@dataclass
class Bucket:
    names: list[str]
    ranges: dict[str, tuple[int, int]]  # name -> [start, end) in the flat buffers
    numel: int  # padded to a multiple of the reduction group's size
    weight_decay: bool
    grads: torch.Tensor | None  # the flat gradient buffer; None where the bucket holds autograd's gradients or shards
    params: torch.Tensor  # the flat parameters (under ZeRO-3, with storage only while gathered)
    group: dist.ProcessGroup  # the data-parallel replicas of these parameters (their gradient axes), or its shards'
    group_size: int
    axes: tuple[Axis, ...]  # the gradient axes of every parameter in the bucket
    sharded: bool  # ZeRO over a group of more than one rank: each rank reduces and optimizes its own shard
    shard: slice  # the part this rank reduces and optimizes (all of it without ZeRO)
    shard_params: torch.Tensor  # this rank's shard of the parameters (a view of ``params`` but under ZeRO-3)
    unit: str = ""  # ZeRO-3: the unit its parameters belong to (gathered and released together)
    lr_scale: float = 1.0  # its parameters' learning rate over the schedule's (spectral µP: fan_out / fan_in)
    orthogonalised: bool = False  # its parameters take Muon's update of whole matrices (``optim/muon.py``)
    sharded_grads: bool = False  # ZeRO-2/3: each micro-batch's gradients reduce-scattered into ``shard_grads``
    sharded_params: bool = False  # ZeRO-3: ``params`` has storage only while gathered
    replicas: dist.ProcessGroup | None = None  # HSDP: the replicas of this rank's shard
    counted: bool = True  # counted in norms: the first of the replicas of its shard
    shard_grads: torch.Tensor | None = None  # ZeRO-2/3: the step's reduced gradient of this rank's shard
    staging: torch.Tensor | None = None  # ZeRO-2/3: this micro-batch's full gradient, until reduced
    accumulated: bool = False  # ZeRO-2/3: ``shard_grads`` holds gradients of this step
    pending: int = 0
    work: dist.Work | None = None
    shapes: dict[str, torch.Size] = field(default_factory=dict)
    written: set[str] = field(default_factory=set)  # parameters with a gradient in the buffer this step
    held: dict[str, torch.Tensor] = field(default_factory=dict)  # without a buffer: this step's gradients by name

    @property
    def split_axes(self) -> tuple[Axis, ...]:
        """Axes over which the ranks hold different shards of this bucket's gradient and optimizer state."""
        return self.axes if self.sharded else ()

    @property
    def reduced_gradient(self) -> torch.Tensor | None:
        """The step's gradient of this rank's shard once reduced (None where autograd's gradients are held)."""
        if self.sharded_grads:
            return self.shard_grads
        return None if self.grads is None else self.grads[self.shard]

    def shard_pieces(self) -> list[tuple[str, slice, slice]]:
        """(name, range in the parameter's flattened data, range in the shard) for every parameter in the shard."""
        pieces = []
        for name in self.names:
            start, end = self.ranges[name]
            lo, hi = max(start, self.shard.start), min(end, self.shard.stop)
            if lo < hi:
                pieces.append((name, slice(lo - start, hi - start),
                               slice(lo - self.shard.start, hi - self.shard.start)))
        return pieces


def copy_gradient(buffer: torch.Tensor, grad: torch.Tensor) -> None:
    """``buffer.copy_(grad)`` at memory speed (``scripts/benchmark_gradient_passes.py``, on an H200 over the mixtral
    shape's 3.6G gradient elements): between equal dtypes ``copy_`` (a device-to-device memcpy) takes 3.65 ms where
    the multi-tensor copy takes 5.79; from bf16 to fp32 the multi-tensor copy takes 7.36 ms where ``copy_`` takes
    10.55."""
    if buffer.dtype == grad.dtype:
        buffer.copy_(grad)
    else:
        torch._foreach_copy_([buffer], [grad])


class GradientBuckets:
    """Flat gradient and parameter buffers of this rank's parameters, reduced over their data-parallel replicas.

    A bucket only holds parameters that share a reduction group (their gradient axes: dense weights over dp × cp ×
    ep, expert weights over dp × cp), a dtype (an fp32 parameter among bf16 ones keeps its precision), a weight-decay
    setting, a learning-rate scale (``lr_scales``, by name; 1 by default) and, under ZeRO-3, a unit. ``groups`` maps
    gradient axes to the process group a bucket is reduced (and sharded) over (``ParallelContext.shard_groups``).
    ``single_micro_batch`` promises one gradient per parameter and step (``batch_accumulation_per_replica`` 1), which
    lets buckets that are not reduced keep their gradients in the
    parameter's dtype (``gradient_dtype``), and hold large ones as autograd produced them, without a buffer, unless
    ``persistent_buffers`` (``holds_autograd_gradient``); a second gradient in a step then is an error rather than a
    sum in lower precision. A parameter without storage (a placeholder of ``build_model(initialize=False)``) gets its
    values from ``fill``. The ``orthogonalised`` parameters (Muon's) are kept out of the other parameters' buckets.
    """

    def __init__(self, params: dict[str, torch.nn.Parameter], no_decay: set[str], accumulate_in_fp32: bool,
                 bucket_bytes: int, groups: dict[tuple[Axis, ...], dist.ProcessGroup],
                 zero: ZeroSettings = ZeroSettings(), single_micro_batch: bool = False,
                 persistent_buffers: bool = False, lr_scales: dict[str, float] | None = None,
                 orthogonalised: set[str] = frozenset()):
        self.params = params
        self.orthogonalised = orthogonalised
        self.settings = zero
        self.single_micro_batch = single_micro_batch
        self.final_micro_batch = False
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[str, Bucket] = {}
        self.in_flight: list[Bucket] = []  # ZeRO-2/3 reductions launched and not yet settled, oldest first
        self.backward_running = False  # a ZeRO-2/3 backward has queued its end (``_end_of_backward``)
        self.on_reduced: Callable[[Bucket], None] | None = None  # ZeRO-3: told of each bucket a backward reduced
        self.after_update: Callable[[], None] | None = None  # ZeRO-3: told when the shards changed

        units, lr_scales = zero.units or {}, lr_scales or {}
        for decay in (True, False):
            by_kind: dict[tuple[str, tuple[Axis, ...], torch.dtype, float, bool], list[str]] = {}
            for name in reversed(params):
                if (name not in no_decay) == decay:
                    kind = (units.get(name, ""), get_placement(params[name]).gradient_axes, params[name].dtype,
                            lr_scales.get(name, 1.0), name in orthogonalised)
                    by_kind.setdefault(kind, []).append(name)
            for (unit, axes, dtype, lr_scale, _), names in by_kind.items():
                count = len(self.buckets)
                self._add_buckets(names, unit, axes, dtype, decay, groups[axes], accumulate_in_fp32, bucket_bytes,
                                  persistent_buffers)
                for bucket in self.buckets[count:]:
                    bucket.lr_scale = lr_scale
        for name, param in params.items():
            param.register_post_accumulate_grad_hook(self._hook(name))

    def _add_buckets(self, names: list[str], unit: str, axes: tuple[Axis, ...], dtype: torch.dtype, decay: bool,
                     group: dist.ProcessGroup, accumulate_in_fp32: bool, bucket_bytes: int,
                     persistent_buffers: bool) -> None:
        """Buckets of about ``bucket_bytes`` of the parameters ``names`` (one kind), a tied copy in one of its own."""
        params, replicas = self.params, dist.get_world_size(group)
        grad_dtype = gradient_dtype(dtype, accumulate_in_fp32, self.single_micro_batch, replicas, False)
        element_bytes = torch.finfo(grad_dtype).bits // 8
        current: dict[bool, list[str]] = {True: [], False: []}  # by whether their bucket has a buffer
        for name in names:
            if get_placement(params[name]).pipeline_copies:  # a tied copy: a bucket of its own
                for buffered, filled in current.items():
                    if filled:
                        self._add_bucket(filled, unit, decay, grad_dtype, axes, group, buffered)
                current = {True: [], False: []}
                tied_dtype = gradient_dtype(dtype, accumulate_in_fp32, self.single_micro_batch, replicas, True)
                self._add_bucket([name], unit, decay, tied_dtype, axes, group, buffered=True)
                continue
            buffered = not holds_autograd_gradient(params[name].numel(), self.single_micro_batch, replicas, False,
                                                   persistent_buffers)
            current[buffered].append(name)
            if sum(params[n].numel() for n in current[buffered]) * element_bytes >= bucket_bytes:
                self._add_bucket(current[buffered], unit, decay, grad_dtype, axes, group, buffered)
                current[buffered] = []
        for buffered, filled in current.items():
            if filled:
                self._add_bucket(filled, unit, decay, grad_dtype, axes, group, buffered)

    def _add_bucket(self, names: list[str], unit: str, decay: bool, grad_dtype: torch.dtype, axes: tuple[Axis, ...],
                    group: dist.ProcessGroup, buffered: bool) -> None:
        first = self.params[names[0]]
        ranges, offset = {}, 0
        for name in names:
            ranges[name] = (offset, offset + self.params[name].numel())
            offset += self.params[name].numel()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        numel = -(-offset // size) * size
        per_rank = numel // size
        stage = self.settings.stage
        sharded = stage >= 1 and size > 1
        shard = slice(rank * per_rank, (rank + 1) * per_rank) if sharded else slice(0, numel)
        replicas = (self.settings.replicas or {}).get(axes)
        device = first.device
        params = torch.zeros(numel, dtype=first.dtype, device=device)
        sharded_grads, sharded_params = sharded and stage >= 2, sharded and stage == 3
        bucket = Bucket(
            names=list(names), ranges=ranges, numel=numel, weight_decay=decay,
            grads=torch.zeros(numel, dtype=grad_dtype, device=device) if buffered and not sharded_grads else None,
            params=params, group=group, group_size=size, axes=axes, sharded=sharded, shard=shard,
            shard_params=torch.empty(per_rank, dtype=first.dtype, device=device) if sharded_params else params[shard],
            unit=unit, orthogonalised=names[0] in self.orthogonalised, sharded_grads=sharded_grads,
            sharded_params=sharded_params, replicas=replicas,
            counted=replicas is None or dist.get_rank(replicas) == 0,
            shard_grads=torch.zeros(per_rank, dtype=grad_dtype, device=device) if sharded_grads else None,
        )
        for name in names:  # the parameter now lives in the flat buffer
            param, (start, end) = self.params[name], ranges[name]
            bucket.shapes[name] = param.shape
            if param.untyped_storage().nbytes():  # a placeholder has no values yet (``fill``)
                bucket.params[start:end].copy_(param.detach().flatten())
            param.data = bucket.params[start:end].view(param.shape)
            self.bucket_of[name] = bucket
        if sharded_params:
            bucket.shard_params.copy_(params[shard])
            release(bucket)
        bucket.pending = len(names)
        self.buckets.append(bucket)

    def _hook(self, name: str):
        # A weak reference: a hook holding the buckets, which hold the parameter the hook is registered on, made a
        # cycle that the garbage collector did not free, so every trainer's weights outlived it.
        owner = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            buckets = owner()
            bucket = buckets.bucket_of[name]
            if bucket.sharded_grads:
                buckets._stage_gradient(bucket, name, param.grad)
                param.grad = None
                return
            start, end = bucket.ranges[name]
            if name in bucket.written:
                if buckets.single_micro_batch:
                    raise RuntimeError(f"{name} got a second gradient in a step of one micro-batch: its gradient "
                                       "is kept in the model dtype, where a sum would lose precision")
                bucket.grads[start:end].add_(param.grad.flatten())
            elif bucket.grads is None:
                bucket.held[name] = param.grad
                bucket.written.add(name)
            else:
                copy_gradient(bucket.grads[start:end], param.grad.flatten())
                bucket.written.add(name)
            param.grad = None
            if buckets.final_micro_batch:
                bucket.pending -= 1
                if bucket.pending == 0:
                    buckets._launch(bucket)

        return hook

    # --- ZeRO-2/3: every micro-batch's gradients reduce-scattered into shards -------------------------------------

    def _stage_gradient(self, bucket: Bucket, name: str, grad: torch.Tensor) -> None:
        """Put one micro-batch's gradient of ``name`` into its bucket's staging buffer; reduce the bucket once full."""
        if not self.backward_running:  # settle what this backward launched when it ends
            self.backward_running = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if bucket.staging is None:
            dtype = torch.bfloat16 if self.settings.reduce_in_bf16 else bucket.shard_grads.dtype
            bucket.staging = torch.empty(bucket.numel, dtype=dtype, device=bucket.shard_grads.device)
            bucket.staging[bucket.ranges[bucket.names[-1]][1]:].zero_()  # the padding
        start, end = bucket.ranges[name]
        if name in bucket.written:
            bucket.staging[start:end].add_(grad.flatten())
            return
        copy_gradient(bucket.staging[start:end], grad.flatten())
        bucket.written.add(name)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._reduce_scatter(bucket)

    def _reduce_scatter(self, bucket: Bucket) -> None:
        """Launch the reduction of a complete staging buffer; settle the oldest beyond ``REDUCTIONS_IN_FLIGHT``."""
        bucket.work = dist.reduce_scatter_tensor(bucket.staging[bucket.shard], bucket.staging, group=bucket.group,
                                                 async_op=True)
        bucket.written.clear()
        bucket.pending = len(bucket.names)
        self.in_flight.append(bucket)
        if self.on_reduced is not None:
            self.on_reduced(bucket)
        while len(self.in_flight) > REDUCTIONS_IN_FLIGHT:
            self._settle(self.in_flight.pop(0))

    @staticmethod
    def _settle(bucket: Bucket) -> None:
        """Wait for a bucket's reduction, add its shard into the step's and free the staging buffer."""
        bucket.work.wait()
        bucket.work = None
        reduced = bucket.staging[bucket.shard]
        if bucket.accumulated:
            bucket.shard_grads.add_(reduced)
        else:
            bucket.shard_grads.copy_(reduced)
            bucket.accumulated = True
        bucket.staging = None

    def _end_of_backward(self) -> None:
        """After each backward pass: a bucket some of whose parameters got no gradient in it is reduced with zeros
        for them, in bucket order (the same on every rank), and every reduction is settled."""
        self.backward_running = False
        for bucket in self.buckets:
            if bucket.sharded_grads and bucket.written:
                for name in set(bucket.names) - bucket.written:
                    bucket.staging[slice(*bucket.ranges[name])].zero_()
                self._reduce_scatter(bucket)
        while self.in_flight:
            self._settle(self.in_flight.pop(0))

    # --- the step's reduction ----------------------------------------------------------------------------------------

    def _launch(self, bucket: Bucket) -> None:
        if bucket.group_size == 1:
            return
        if bucket.sharded:
            bucket.work = dist.reduce_scatter_tensor(bucket.grads[bucket.shard], bucket.grads, group=bucket.group,
                                                     async_op=True)
        else:
            bucket.work = dist.all_reduce(bucket.grads, group=bucket.group, async_op=True)

    def finish_reduction(self) -> None:
        """Wait for every bucket's reduction (launching those whose parameters got no gradient this step), then sum
        each shard over its replicas (HSDP)."""
        for bucket in self.buckets:
            if bucket.sharded_grads:
                if not bucket.accumulated:  # no gradient this step: it is zero
                    bucket.shard_grads.zero_()
                    bucket.accumulated = True
            elif bucket.work is None:
                for name in set(bucket.names) - bucket.written:  # no gradient this step: it is zero
                    if bucket.grads is None:
                        bucket.held[name] = torch.zeros_like(self.params[name])
                    else:
                        bucket.grads[slice(*bucket.ranges[name])].zero_()
                    bucket.written.add(name)
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work = None
        works = [dist.all_reduce(bucket.reduced_gradient, group=bucket.replicas, async_op=True)
                 for bucket in self.buckets if bucket.replicas is not None]
        for work in works:
            work.wait()

    def all_gather_params(self) -> None:
        """After an update of sharded buckets, give every rank the parameters updated by the others (ZeRO-3: the
        gathered units are stale, and are gathered again when next used)."""
        for bucket in self.buckets:
            if bucket.sharded and not bucket.sharded_params:
                dist.all_gather_into_tensor(bucket.params, bucket.shard_params, group=bucket.group)
        if self.after_update is not None:
            self.after_update()

    def zero(self) -> None:
        """Start a new step: the next gradient of every parameter overwrites its slice of the buffer."""
        self.final_micro_batch = False
        for bucket in self.buckets:
            bucket.written.clear()
            bucket.held.clear()  # autograd's gradients of the step are freed
            bucket.pending = len(bucket.names)
            bucket.accumulated = False

    # --- whole parameters --------------------------------------------------------------------------------------------

    def whole_parameters(self, write_back: bool = False, gather: bool = True) -> Iterator[dict[str, torch.Tensor]]:
        """Every parameter whole, a bucket at a time (by name): ZeRO-3's buckets gathered (``gather``; else only
        given storage, to be written) and, once the caller is done with them, released, their shard taken from
        the whole bucket first with ``write_back``. Collective under ZeRO-3 (same order on every rank)."""
        for bucket in self.buckets:
            with _whole(bucket, write_back, gather):
                yield {name: self.params[name] for name in bucket.names}

    def fill(self, initialize: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """Give the parameters their values, a bucket at a time: ``initialize(params)`` writes whole parameters."""
        with torch.no_grad():
            for params in self.whole_parameters(write_back=True, gather=False):
                initialize(params)

    # --- reading gradients ---------------------------------------------------------------------------------------

    def gradient(self, name: str) -> torch.Tensor:
        """The full accumulated gradient of a parameter, in its shape (complete only where this rank reduced it:
        under ZeRO-2/3 the rest is zero)."""
        bucket = self.bucket_of[name]
        if bucket.sharded_grads:
            whole = torch.zeros(bucket.numel, dtype=bucket.shard_grads.dtype, device=bucket.shard_grads.device)
            whole[bucket.shard] = bucket.shard_grads
            return whole[slice(*bucket.ranges[name])].view(bucket.shapes[name])
        if bucket.grads is None:
            return bucket.held[name]
        return bucket.grads[slice(*bucket.ranges[name])].view(bucket.shapes[name])

    def held_gradient_bytes(self) -> int:
        """Bytes of the gradients held from the backward to the update only (buckets without a buffer)."""
        return sum(self.params[name].numel() * self.params[name].element_size()
                   for bucket in self.buckets if bucket.grads is None and not bucket.sharded_grads
                   for name in bucket.names)

    def grad_pieces(self) -> list[tuple[str, torch.Tensor | None, tuple[Axis, ...], slice]]:
        """(name, gradient values, split axes, range in the parameter's flattened data) of every parameter piece in
        this rank's shards, for norms and clipping; the split axes are those over which other ranks hold other
        pieces of the same gradient (HSDP: a shard's replicas other than the first have none). The values are views
        of a buffer, or None where a bucket holds autograd's gradients, which are new tensors every step
        (``gradient``)."""
        return [(name, None if bucket.reduced_gradient is None else bucket.reduced_gradient[in_shard],
                 bucket.split_axes, in_param)
                for bucket in self.buckets if bucket.counted for name, in_param, in_shard in bucket.shard_pieces()]


def gather(bucket: Bucket) -> dist.Work:
    """Launch the all-gather of a ZeRO-3 bucket's shards into its full buffer, given storage again."""
    bucket.params.untyped_storage().resize_(bucket.numel * bucket.params.element_size())
    return dist.all_gather_into_tensor(bucket.params, bucket.shard_params, group=bucket.group, async_op=True)


def release(bucket: Bucket) -> None:
    """Free a ZeRO-3 bucket's full buffer (its parameters, views of it, keep their shapes)."""
    bucket.params.untyped_storage().resize_(0)


@contextlib.contextmanager
def _whole(bucket: Bucket, write_back: bool, gathered: bool):
    if not bucket.sharded_params or bucket.params.untyped_storage().nbytes():  # whole already
        yield
        if write_back and bucket.sharded_params:
            bucket.shard_params.copy_(bucket.params[bucket.shard])
        return
    if gathered:
        gather(bucket).wait()
    else:
        bucket.params.untyped_storage().resize_(bucket.numel * bucket.params.element_size())
        bucket.params.zero_()
    try:
        yield
        if write_back:
            bucket.shard_params.copy_(bucket.params[bucket.shard])
    finally:
        release(bucket)


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
    tied = [b.reduced_gradient for b in buckets.buckets
            if any(get_placement(buckets.params[n]).pipeline_copies for n in b.names)]
    if tied:
        all_reduce_coalesced(tied, group)


class ReplicaDivergenceError(RuntimeError):
    """Data-parallel replicas no longer hold the same weights."""


@torch.no_grad()
def check_replicas_agree(buckets: GradientBuckets, step: int) -> None:
    """Compare a checksum of this rank's weights with their other data-parallel replicas; fail loudly if they differ.

    Replicas apply identical updates, so their weights must be bit-identical; a difference means a bug or a faulty
    device, and continuing would silently train several different models. Each reduction group (dense weights over
    dp × cp × ep, expert weights over dp × cp) compares its own buckets: whole weights over the ranks of a bucket's
    group, and under HSDP the shards over their replicas (ZeRO-3 holds shards only, which differ within a group).
    """
    compared: dict[tuple[str, ...], list[tuple[dist.ProcessGroup, torch.Tensor]]] = {}
    for bucket in buckets.buckets:
        if bucket.group_size > 1 and not bucket.sharded_params:
            compared.setdefault(tuple(map(str, bucket.axes)), []).append((bucket.group, bucket.params))
        if bucket.replicas is not None:
            compared.setdefault(("shard replicas",), []).append((bucket.replicas, bucket.shard_params))
    for axes, members in sorted(compared.items()):
        group = members[0][0]
        checksum = torch.stack([torch.stack([values.double().sum(), values.double().pow(2).sum()])
                                for _, values in members]).sum(0)
        gathered = [torch.empty_like(checksum) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, checksum, group=group)
        if any(not torch.equal(other, gathered[0]) for other in gathered):
            raise ReplicaDivergenceError(
                f"replicas over {' x '.join(axes)} hold different weights at step {step} (checksums "
                f"{[tuple(round(v, 6) for v in g.tolist()) for g in gathered]}); resume from the last checkpoint"
            )
