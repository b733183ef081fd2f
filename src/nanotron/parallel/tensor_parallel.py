"""Tensor parallelism (Megatron-style), applied to a pure model by swapping modules according to a plan.

Two modes (``parallelism.tp_mode``):

- ``ALL_REDUCE``: activations between blocks are replicated on every TP rank. A column-parallel linear takes the
  full input and produces a feature shard; a row-parallel linear takes a feature shard and all-reduces its partial
  output.
- ``REDUCE_SCATTER`` (sequence parallelism): activations between blocks are sharded along the sequence, so norms and
  residual adds touch 1/tp of the tokens. A column-parallel linear all-gathers the sequence first; a row-parallel
  linear reduce-scatters its output back to a sequence shard. Norm weights then see different tokens on every rank,
  so their gradients are summed over TP (``GradientSummedRMSNorm``), as those of a norm over each head's features
  are in both modes (every rank normalises its own heads).

Every parallel layer records, per parameter, the logical shape and how it is sharded (``parameter_shards``);
``annotate_placements`` turns that into each parameter's ``Placement`` after materialisation. Constructors read only
the group's ``size()`` and ``rank()``, so that a ``GroupShape`` (``parallel/context.py``) can stand in for the group
where a rank's model is built on the meta device without process groups (the memory planner).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanotron.layout import Axis
from nanotron.nn.linear import Linear
from nanotron.nn.rmsnorm import RMSNorm, rms_normalize
from nanotron.parallel.placement import Shard
from nanotron.parallel.tp_collectives import (
    all_gather_sequence,
    copy_to_tp,
    finish_gather_sequence,
    gather_sequence,
    reduce_from_tp,
    reduce_scatter_sequence,
    start_gather_sequence,
    start_reduce_scatter_sequence,
    sum_partials,
)

ALL_REDUCE, REDUCE_SCATTER = "ALL_REDUCE", "REDUCE_SCATTER"


def matmul_in_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (``a`` of any leading dims, ``b`` 2-D) with its products summed in fp32 and returned in fp32, unrounded
    to the operands' dtype: cuBLAS's fp32 output on GPUs, fp32 operands elsewhere (the same exact products)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a.flatten(0, -2), b, out_dtype=torch.float32).unflatten(0, a.shape[:-1])
    return a.float() @ b.float()


class _LinearWithFP32Output(torch.autograd.Function):
    """``x W^T`` in fp32 (a row-parallel linear's partial output, summed over TP before it is rounded); the backward
    takes the gradient in the operands' dtype, whose values it holds exactly (it is the gradient of the rounded sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return matmul_in_fp32(x, weight.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.to(x.dtype)
        return grad @ weight, grad.flatten(0, -2).t() @ x.flatten(0, -2)


class _ColumnLinearSummingInFP32(torch.autograd.Function):
    """Column-parallel linear whose input gradient (a partial sum on each rank) is computed and summed over TP in
    fp32, then rounded once: the rounding tp=1 makes (``parallelism.tp_partial_sums_in_fp32``). It keeps the whole
    input for the backward, as the plain path does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup, mode: str) -> torch.Tensor:
        ctx.group, ctx.scatter = group, mode == REDUCE_SCATTER
        if ctx.scatter:
            x = all_gather_sequence(x, group)
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_input = sum_partials(matmul_in_fp32(grad, weight), ctx.group, ctx.scatter).to(x.dtype)
        return grad_input, grad.flatten(0, -2).t() @ x.flatten(0, -2), None, None


class _OverlappedSequenceColumnLinear(torch.autograd.Function):
    """Column-parallel linear on a sequence shard whose backward hides communication behind matmuls.

    The forward keeps only the input shard (1/tp of the memory of the gathered input). The backward re-gathers it
    while computing the input gradient, then reduce-scatters the input gradient while computing the weight gradient.
    On GPUs, set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` so that each collective starts before the matmul queued after it.
    """

    @staticmethod
    def forward(ctx, x_shard: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup,
                sum_in_fp32: bool) -> torch.Tensor:
        ctx.group, ctx.sum_in_fp32 = group, sum_in_fp32
        ctx.save_for_backward(x_shard, weight)
        return F.linear(gather_sequence(x_shard, group), weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x_shard, weight = ctx.saved_tensors
        buffer, gathering = start_gather_sequence(x_shard, ctx.group)
        grad_input = matmul_in_fp32(grad, weight) if ctx.sum_in_fp32 else grad @ weight
        gathering.wait()
        x = finish_gather_sequence(buffer, ctx.group)
        grad_x_shard, scattering = start_reduce_scatter_sequence(grad_input, ctx.group)
        grad_weight = grad.flatten(0, -2).t() @ x.flatten(0, -2)
        scattering.wait()
        return grad_x_shard.to(x_shard.dtype), grad_weight, None, None


class _SumOverSharingRanks(torch.autograd.Function):
    """Identity in the forward; in the backward, sums the gradient rows of pieces that several TP ranks hold alike
    (kv heads replicated over the ranks whose query heads use them) over those ranks.

    Each rank places its rows at the piece's position in a buffer spanning the replicated chunks and the buffer is
    all-reduced over TP: a piece gets the sum of the ranks that hold it and nothing from the others.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, rows: tuple[tuple[int, int, int], ...], buffer_rows: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rows, ctx.buffer_rows, ctx.group = rows, buffer_rows, group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        buffer = grad.new_zeros((ctx.buffer_rows, *grad.shape[1:]))
        for local, length, offset in ctx.rows:
            buffer[offset:offset + length] = grad[local:local + length]
        dist.all_reduce(buffer, group=ctx.group)
        grad = grad.clone()
        for local, length, offset in ctx.rows:
            grad[local:local + length] = buffer[offset:offset + length]
        return grad, None, None, None


def _shared_rows(shard: Shard, logical_size: int,
                 group: dist.ProcessGroup) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """(local start, length, buffer offset) of this rank's replicated pieces, and the rows of a buffer holding every
    replicated chunk (``_SumOverSharingRanks``)."""
    rank, size = group.rank(), group.size()
    rows, buffer_rows, chunk_start = [], 0, 0
    for chunk, piece in zip(shard.chunks or (logical_size,), shard.intervals(logical_size, rank, size)):
        if piece.replicas > 1:
            rows.append((piece.local_start, piece.length, buffer_rows + piece.global_start - chunk_start))
            buffer_rows += chunk
        chunk_start += chunk
    return tuple(rows), buffer_rows


class _SplitLinear(nn.Module):
    """A linear whose features are split over the ranks of ``group`` along ``split_features`` (``"out"`` or
    ``"in"``); a matmul that scales its operands by their amax (FP8) maximises it over those ranks with
    ``max_over_ranks``, so that each slice is scaled as the whole tensor. ``sum_in_fp32``
    (``parallelism.tp_partial_sums_in_fp32``): the partial sums this layer's ranks add up (a row-parallel output, a
    column-parallel input gradient) are computed and summed in fp32 and rounded once, as at tp=1; it applies to the
    plain matmul only (``sums_in_fp32``)."""

    split_features: str
    group: dist.ProcessGroup
    sum_in_fp32: bool = False
    matrix_parameters = ("weight",)  # a matrix of the model (Muon orthogonalises those of the decoder)

    @property
    def sums_in_fp32(self) -> bool:
        return self.sum_in_fp32 and self.matmul is F.linear

    def max_over_ranks(self, amax: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        return amax


class ColumnParallelLinear(_SplitLinear):
    """``y = x W^T + b`` with W (and the optional bias b) split along the output features; the output stays sharded
    on features.

    ``chunks`` are the logical sizes of fused outputs (e.g. q|k|v): each chunk is split evenly so that every rank holds
    matching slices of all of them, and the bias is cut exactly like the weight's rows (a rank's bias entries are
    those of its output features). A chunk of fewer ``units`` (heads) than ranks is replicated over groups of ranks
    (kv heads at tp > num_key_value_heads), and its gradient summed over each group. ``output_chunks`` are this
    rank's widths of the chunks. ``overlap`` (sequence-parallel mode only) selects the backward that overlaps
    communication with computation; it computes its own products, so a layer given another ``matmul`` (see
    ``nn/linear.py``) runs the plain sequence-parallel path instead.
    """

    matmul = staticmethod(F.linear)
    split_features = "out"

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup, mode: str,
                 chunks: tuple[int, ...] | None = None, overlap: bool = False, bias: bool = False,
                 units: tuple[int, ...] | None = None):
        super().__init__()
        tp = group.size()
        self.group, self.mode = group, mode
        self.overlap = overlap and mode == REDUCE_SCATTER
        shard = Shard(Axis.TP, 0, chunks, units)
        pieces = shard.intervals(out_features, group.rank(), tp)
        self.output_chunks = tuple(piece.length for piece in pieces)
        self.shared_rows, self.shared_buffer_rows = _shared_rows(shard, out_features, group)
        self.weight = nn.Parameter(torch.empty(sum(self.output_chunks), in_features))
        self.parameter_shards = {"weight": ((out_features, in_features), (shard,))}
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.output_chunks)))
            self.parameter_shards["bias"] = ((out_features,), (shard,))

    def _shared(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """The parameter, with replicated rows' gradients summed over the ranks that share them."""
        if tensor is None or not self.shared_rows:
            return tensor
        return _SumOverSharingRanks.apply(tensor, self.shared_rows, self.shared_buffer_rows, self.group)

    def operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The (input, weight, bias) of the local matmul: the whole sequence (gathered in sequence-parallel mode,
        whose backward reduce-scatters the gradient; all-reduced over TP in the backward otherwise) and this rank's
        rows. A loss that applies the layer itself (``linear_cross_entropy.py``) takes these."""
        x = gather_sequence(x, self.group) if self.mode == REDUCE_SCATTER else copy_to_tp(x, self.group)
        return x, self._shared(self.weight), self._shared(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._shared(self.weight), self._shared(self.bias)
        if self.overlap and self.matmul is F.linear:
            y = _OverlappedSequenceColumnLinear.apply(x, weight, self.group, self.sum_in_fp32)
        elif self.sums_in_fp32:
            y = _ColumnLinearSummingInFP32.apply(x, weight, self.group, self.mode)
        else:
            return self.matmul(*self.operands(x))
        return y if bias is None else y + bias


class RowParallelLinear(_SplitLinear):
    """``y = x W^T`` with W split along its input features; partial outputs are summed over TP."""

    matmul = staticmethod(F.linear)
    split_features = "in"

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup, mode: str):
        super().__init__()
        tp = group.size()
        self.group, self.mode = group, mode
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp))
        self.parameter_shards = {"weight": ((out_features, in_features), (Shard(Axis.TP, 1),))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _LinearWithFP32Output.apply(x, self.weight) if self.sums_in_fp32 else self.matmul(x, self.weight)
        y = reduce_scatter_sequence(y, self.group) if self.mode == REDUCE_SCATTER else reduce_from_tp(y, self.group)
        return y.to(x.dtype) if self.sums_in_fp32 else y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds the embeddings of a contiguous vocabulary slice; other ids contribute zeros to the sum."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: dist.ProcessGroup, mode: str):
        super().__init__()
        tp = group.size()
        self.group, self.mode = group, mode
        self.local_vocab = num_embeddings // tp
        self.start = group.rank() * self.local_vocab
        self.weight = nn.Parameter(torch.empty(self.local_vocab, embedding_dim))
        self.parameter_shards = {"weight": ((num_embeddings, embedding_dim), (Shard(Axis.TP, 0),))}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.local_vocab)
        local = F.embedding(torch.where(outside, 0, ids - self.start), self.weight)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.mode == REDUCE_SCATTER:
            return reduce_scatter_sequence(local, self.group)
        return reduce_from_tp(local, self.group)


class GradientSummedRMSNorm(RMSNorm):
    """RMSNorm whose weight, whole on every rank, is applied to this rank's part of the values (``part``: a
    ``"sequence"`` shard, or its ``"heads"``): the weight's gradient is summed over TP."""

    def __init__(self, hidden_size: int, eps: float, group: dist.ProcessGroup, part: str):
        super().__init__(hidden_size, eps)
        self.group, self.part = group, part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(self.weight, self.group) * rms_normalize(x, self.eps)


class GradientSummedLinear(Linear):
    """A linear layer replicated over TP whose weight gradient is summed over TP: each rank backpropagates only its
    part of what depends on the layer (a router, whose outputs weight experts split over TP)."""

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup):
        super().__init__(in_features, out_features, bias=False)
        self.group = group

    def operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return x, copy_to_tp(self.weight, self.group), None


class Style(ABC):
    """How one module of a plan is split: ``parallelize`` returns the module's tensor-parallel replacement (None:
    keep it). A family defines styles of its own for the blocks it splits as a whole (``models/<family>/
    parallelize.py``); the five below serve every family's linears, embeddings and norms."""

    keeps_bias = False  # whether the parallel module adds the original module's bias (else one is refused)

    @abstractmethod
    def parallelize(self, module: nn.Module, group: dist.ProcessGroup, mode: str, overlap: bool) -> nn.Module | None:
        """``overlap`` is ``parallelism.tp_linear_async_communication``."""


@dataclass(frozen=True)
class Column(Style):
    chunks: tuple[int, ...] | None = None
    units: tuple[int, ...] | None = None  # indivisible sizes of the chunks (heads): see ColumnParallelLinear
    keeps_bias = True

    def parallelize(self, module, group, mode, overlap):
        return ColumnParallelLinear(module.in_features, module.out_features, group, mode, self.chunks, overlap,
                                    bias=module.bias is not None, units=self.units)


@dataclass(frozen=True)
class Row(Style):
    def parallelize(self, module, group, mode, overlap):
        return RowParallelLinear(module.in_features, module.out_features, group, mode)


@dataclass(frozen=True)
class VocabEmbedding(Style):
    def parallelize(self, module, group, mode, overlap):
        return VocabParallelEmbedding(module.num_embeddings, module.embedding_dim, group, mode)


@dataclass(frozen=True)
class SequenceParallelNorm(Style):
    """A norm is only swapped in sequence-parallel mode, where it sees a sequence shard and its gradient is summed."""

    def parallelize(self, module, group, mode, overlap):
        if mode != REDUCE_SCATTER:
            return None
        return GradientSummedRMSNorm(module.weight.shape[0], module.eps, group, "sequence")


@dataclass(frozen=True)
class HeadNorm(Style):
    """A norm over each head's features (Qwen3's q/k norm): its weight is replicated and every rank applies it to
    its own heads, so its gradient is summed over TP in both modes."""

    def parallelize(self, module, group, mode, overlap):
        return GradientSummedRMSNorm(module.weight.shape[0], module.eps, group, "heads")


def apply_tensor_parallel(model: nn.Module, plan: dict[str, Style], group: dist.ProcessGroup, mode: str,
                          overlap: bool = False, sum_in_fp32: bool = False) -> None:
    """Swap every module whose name matches a plan entry (exactly, or as a dotted suffix) for its parallel version.

    Call on the meta device, before materialisation. Column-parallel linears keep their bias (sharded like the
    weight's rows); other styles refuse one: a row-parallel bias would have to be added once, after the reduction.
    ``overlap`` is ``parallelism.tp_linear_async_communication``, ``sum_in_fp32`` ``tp_partial_sums_in_fp32``
    (``_SplitLinear``).
    """
    for name, module in list(model.named_modules()):
        style = next((s for key, s in plan.items() if name == key or name.endswith("." + key)), None)
        if style is None or module is None:
            continue
        if getattr(module, "bias", None) is not None and not style.keeps_bias:
            raise ValueError(f"tensor parallelism of {name} ({type(style).__name__}) with a bias is not supported: "
                             "only column-parallel layers may have one; remove the bias or leave the module unsharded")
        replacement = style.parallelize(module, group, mode, overlap)
        if isinstance(replacement, _SplitLinear):
            replacement.sum_in_fp32 = sum_in_fp32
        if replacement is not None:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
