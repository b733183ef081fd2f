"""Where each parameter lives: its logical name and shape, and which slice of it this rank holds.

Every model parameter (and persistent buffer) carries a :class:`Placement`. Gradient reduction, grad-norm, ZeRO,
the replica check and checkpoints read this metadata instead of guessing from shapes or names. On each of the axes
``dp``, ``cp``, ``ep`` and ``tp`` a parameter is either sharded along one tensor dim or replicated (every rank on
that axis holds the same values); pipeline stages hold different parameters, except copies tied across stages. Fused
projections (q|k|v, gate|up) are sharded chunk-wise: each chunk is split evenly, so every rank holds matching slices
of every chunk.

The axes a parameter is replicated over decide two things:

* its **gradient axes**, the replicated axes among the data axes ``dp``, ``cp`` and ``ep`` (ranks there see
  different tokens: other samples, or other parts of the same sequences): its gradient is summed over them. A dense
  weight is reduced over ``dp`` × ``cp`` × ``ep``; an expert weight, sharded over ``ep``, over ``dp`` × ``cp``.
* where it is **counted once** (grad-norm, checkpoints): on the rank at coordinate 0 of every replicated axis,
  except the axes over which ZeRO-1 splits its gradient and optimizer state, where every rank holds a different
  piece.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from nanotron.layout import Axis

REPLICA_AXES = (Axis.DP, Axis.CP, Axis.EP, Axis.TP)  # axes a parameter is either sharded or replicated over
DATA_AXES = (Axis.DP, Axis.CP, Axis.EP)  # axes whose ranks train on different tokens


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one dim that a rank holds: where it sits locally and in the logical tensor, and which
    copy it is (``replica`` > 0: other ranks hold the same values, and the one with ``replica`` 0 counts them)."""

    local_start: int
    global_start: int
    length: int
    replica: int = 0
    replicas: int = 1  # ranks holding this same piece (consecutive ranks of the axis)


@dataclass(frozen=True)
class Shard:
    """Split a tensor over the ranks of ``axis`` along ``dim``; ``chunks`` are the logical sizes of fused parts.

    ``units`` are the indivisible sizes of the chunks (a head's ``head_dim``). A chunk with fewer units than ranks
    is replicated in groups: with 2 kv heads over 4 ranks, ranks 0-1 hold head 0 and ranks 2-3 head 1 (as Megatron-LM
    replicates kv heads), so its gradient must be summed over each group (``shared_pieces``).
    """

    axis: Axis
    dim: int
    chunks: tuple[int, ...] | None = None
    units: tuple[int, ...] | None = None

    def intervals(self, logical_size: int, rank: int, size: int) -> list[Piece]:
        """Every contiguous piece this rank holds along ``dim``, in local order."""
        chunks = self.chunks or (logical_size,)
        units = self.units or (1,) * len(chunks)
        if sum(chunks) != logical_size:
            raise ValueError(f"chunks {chunks} do not add up to the logical size {logical_size}")
        pieces, local, start = [], 0, 0
        for chunk, unit in zip(chunks, units):
            count = chunk // unit
            if count % size == 0:
                length = chunk // size
                pieces.append(Piece(local, start + rank * length, length))
            elif size % count == 0:
                replicas = size // count
                length = unit
                pieces.append(Piece(local, start + rank // replicas * unit, unit, rank % replicas, replicas))
            else:
                raise ValueError(f"a chunk of {count} units of {unit} along dim {self.dim} cannot be split over "
                                 f"{size} ranks (neither divides the other)")
            local += length
            start += chunk
        return pieces

    def local_size(self, logical_size: int, size: int) -> int:
        return sum(piece.length for piece in self.intervals(logical_size, 0, size))


@dataclass
class Placement:
    """Logical identity of a parameter plus how it is laid out over the process grid."""

    name: str
    logical_shape: tuple[int, ...]
    shards: tuple[Shard, ...] = ()
    pipeline_copies: tuple[int, ...] = ()  # stages holding a tied copy (embeddings tied across stages)

    def shard_on(self, axis: Axis) -> Shard | None:
        return next((s for s in self.shards if s.axis == axis), None)

    def local_shape(self, sizes: dict[Axis, int]) -> tuple[int, ...]:
        shape = list(self.logical_shape)
        for shard in self.shards:
            shape[shard.dim] = shard.local_size(shape[shard.dim], sizes[shard.axis])
        return tuple(shape)

    def _pieces(self, coords: dict[Axis, int], sizes: dict[Axis, int]) -> list[list[Piece]]:
        per_dim = [[Piece(0, 0, n)] for n in self.logical_shape]
        for shard in self.shards:
            per_dim[shard.dim] = shard.intervals(self.logical_shape[shard.dim], coords[shard.axis], sizes[shard.axis])
        return per_dim

    def boxes(self, coords: dict[Axis, int], sizes: dict[Axis, int],
              unique: bool = False) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
        """Pairs (local slices, logical slices) that together cover this rank's part of the tensor; with ``unique``,
        only the boxes no other rank of the sharded axes counts (no replicated piece of a group other than its
        first)."""
        pairs = []
        for combo in itertools.product(*self._pieces(coords, sizes)):
            if unique and any(piece.replica for piece in combo):
                continue
            local = tuple(slice(p.local_start, p.local_start + p.length) for p in combo)
            logical = tuple(slice(p.global_start, p.global_start + p.length) for p in combo)
            pairs.append((local, logical))
        return pairs

    def duplicate_rows(self, coords: dict[Axis, int], sizes: dict[Axis, int]) -> list[tuple[int, int]]:
        """Local row ranges (dim 0) that are replicas counted on another rank; replication is only along dim 0."""
        per_dim = self._pieces(coords, sizes)
        if any(piece.replica for pieces in per_dim[1:] for piece in pieces):
            raise ValueError(f"{self.name}: replicated pieces are supported along dim 0 only")
        return [(p.local_start, p.local_start + p.length) for p in per_dim[0] if p.replica]

    def shared_pieces(self, axis: Axis, coords: dict[Axis, int], sizes: dict[Axis, int]) -> list[Piece]:
        """Pieces along the ``axis`` shard's dim that a group of ranks of ``axis`` holds alike: each of those ranks
        computes a part of their gradient, which must be summed over the group."""
        shard = self.shard_on(axis)
        if shard is None:
            return []
        pieces = shard.intervals(self.logical_shape[shard.dim], coords[axis], sizes[axis])
        return [piece for piece in pieces if piece.replicas > 1]

    @property
    def replicated_axes(self) -> tuple[Axis, ...]:
        return tuple(axis for axis in REPLICA_AXES if self.shard_on(axis) is None)

    @property
    def gradient_axes(self) -> tuple[Axis, ...]:
        """Data axes over which this parameter's gradient is summed (and ZeRO-1 splits its optimizer state)."""
        return tuple(axis for axis in DATA_AXES if self.shard_on(axis) is None)

    def is_unique_copy(self, coords: dict[Axis, int], split_axes: tuple[Axis, ...] = ()) -> bool:
        """True on exactly one rank among those holding identical values of this parameter's local part.

        ``split_axes`` are replicated axes over which the values in question are split anyway (ZeRO-1 shards of the
        gradient), so every rank there counts. Grad-norm counts a replicated parameter once, and a checkpoint writes
        it once: both ask this question. A copy tied across pipeline stages counts on the first stage holding it.
        """
        if self.pipeline_copies and coords[Axis.PP] != self.pipeline_copies[0]:
            return False
        return all(coords[axis] == 0 for axis in self.replicated_axes if axis not in split_axes)


def set_placement(param: torch.nn.Parameter, placement: Placement) -> None:
    param._nanotron_placement = placement


def get_placement(param: torch.Tensor) -> Placement:
    try:
        return param._nanotron_placement
    except AttributeError:
        raise RuntimeError("parameter has no placement: call nanotron.parallel.placement.set_placement") from None


def _persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for attribute, buffer in module.named_buffers(recurse=False):
        if buffer is not None and attribute not in module._non_persistent_buffers_set:
            yield attribute, buffer


def annotate_placements(model: torch.nn.Module) -> None:
    """Give every parameter and persistent buffer its placement, named by its module path in the whole model.

    A module that holds a shard declares it in ``parameter_shards`` ({attribute: (logical shape, shards)});
    everything else is replicated. A parameter shared by two modules is named after the first.
    """
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        declared = getattr(module, "parameter_shards", {})
        for attribute, tensor in [*module.named_parameters(recurse=False), *_persistent_buffers(module)]:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            logical_shape, shards = declared.get(attribute, (tuple(tensor.shape), ()))
            name = f"{module_name}.{attribute}" if module_name else attribute
            set_placement(tensor, Placement(name, tuple(logical_shape), tuple(shards)))


def logical_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Unique parameters keyed by logical name, in a sorted, layout-independent order."""
    unique = {get_placement(p).name: p for p in model.parameters()}
    return dict(sorted(unique.items()))


def logical_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers (model state that is not trained by the optimizer, e.g. scaling statistics) by logical
    name; checkpoints store them next to the weights."""
    unique = {get_placement(b).name: b for module in model.modules() for _, b in _persistent_buffers(module)}
    return dict(sorted(unique.items()))


def declared_names(model: torch.nn.Module, attribute: str) -> set[str]:
    """Logical names of the parameters that their modules list in ``attribute`` (a tuple of attribute names).

    Models state per-parameter facts this way, next to the parameters: ``fp32_parameters`` stay in fp32 whatever
    the model dtype, ``no_weight_decay_parameters`` are never decayed.
    """
    names = set()
    for module in model.modules():
        for key in getattr(module, attribute, ()):
            param = getattr(module, key, None)
            if param is not None:
                names.add(get_placement(param).name)
    return names
