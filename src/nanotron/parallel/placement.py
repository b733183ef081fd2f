"""Where each parameter lives: its logical name and shape, and which slice of it this rank holds.

Every model parameter carries a :class:`Placement`. Grad-norm, checkpoints and (later) ZeRO read this metadata
instead of guessing from shapes or names. A parameter is either replicated over an axis (every rank on that axis
holds the same values) or sharded over it along one tensor dim. Fused projections (q|k|v, gate|up) are sharded
chunk-wise: each chunk is split evenly, so every rank holds matching slices of every chunk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

SHARDABLE_AXES = ("tp", "ep")


@dataclass(frozen=True)
class Shard:
    """Split a tensor over the ranks of ``axis`` along ``dim``; ``chunks`` are the logical sizes of fused parts."""

    axis: str
    dim: int
    chunks: tuple[int, ...] | None = None

    def intervals(self, logical_size: int, rank: int, size: int) -> list[tuple[int, int, int]]:
        """(local_start, global_start, length) of every contiguous piece this rank holds along ``dim``."""
        chunks = self.chunks or (logical_size,)
        if sum(chunks) != logical_size:
            raise ValueError(f"chunks {chunks} do not add up to the logical size {logical_size}")
        pieces, local, start = [], 0, 0
        for chunk in chunks:
            if chunk % size:
                raise ValueError(f"a chunk of {chunk} along dim {self.dim} cannot be split over {size} ranks")
            length = chunk // size
            pieces.append((local, start + rank * length, length))
            local += length
            start += chunk
        return pieces


@dataclass
class Placement:
    """Logical identity of a parameter plus how it is laid out over the process grid."""

    name: str
    logical_shape: tuple[int, ...]
    shards: tuple[Shard, ...] = ()
    tied_names: tuple[str, ...] = field(default=())
    pipeline_copies: tuple[int, ...] = ()  # stages holding a tied copy (embeddings tied across stages)

    def shard_on(self, axis: str) -> Shard | None:
        return next((s for s in self.shards if s.axis == axis), None)

    def local_shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        shape = list(self.logical_shape)
        for shard in self.shards:
            shape[shard.dim] //= sizes[shard.axis]
        return tuple(shape)

    def boxes(self, coords: dict[str, int], sizes: dict[str, int]) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
        """Pairs (local slices, logical slices) that together cover this rank's part of the tensor."""
        per_dim: list[list[tuple[int, int, int]]] = [[(0, 0, n)] for n in self.logical_shape]
        for shard in self.shards:
            per_dim[shard.dim] = shard.intervals(self.logical_shape[shard.dim], coords[shard.axis], sizes[shard.axis])
        pairs = []
        for combo in itertools.product(*per_dim):
            local = tuple(slice(lo, lo + n) for lo, _, n in combo)
            logical = tuple(slice(go, go + n) for _, go, n in combo)
            pairs.append((local, logical))
        return pairs

    def is_unique_copy(self, coords: dict[str, int], axes: tuple[str, ...] = SHARDABLE_AXES) -> bool:
        """True on exactly one rank among those holding identical copies along ``axes``.

        Grad-norm counts a replicated parameter once, and a checkpoint writes it once: both ask this question. A copy
        tied across pipeline stages counts on the first stage holding it.
        """
        if self.pipeline_copies and coords["pp"] != self.pipeline_copies[0]:
            return False
        return all(coords[axis] == 0 for axis in axes if self.shard_on(axis) is None)


def set_placement(param: torch.nn.Parameter, placement: Placement) -> None:
    param._nanotron_placement = placement


def get_placement(param: torch.Tensor) -> Placement:
    try:
        return param._nanotron_placement
    except AttributeError:
        raise RuntimeError("parameter has no placement: call nanotron.parallel.placement.set_placement") from None


def annotate_placements(model: torch.nn.Module) -> None:
    """Give every parameter its placement, named by its module path in the whole model.

    A module that holds a shard declares it in ``parameter_shards`` ({attribute: (logical shape, shards)});
    every other parameter is replicated. Tied parameters appear once in ``named_parameters``; their other names are
    recorded as ``tied_names``.
    """
    names: dict[int, list[str]] = {}
    specs: dict[int, tuple[torch.nn.Parameter, tuple[int, ...], tuple[Shard, ...]]] = {}
    for module_name, module in model.named_modules():
        declared = getattr(module, "parameter_shards", {})
        for attribute, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{attribute}" if module_name else attribute
            names.setdefault(id(param), []).append(name)
            logical_shape, shards = declared.get(attribute, (tuple(param.shape), ()))
            specs.setdefault(id(param), (param, tuple(logical_shape), tuple(shards)))
    for key, (param, logical_shape, shards) in specs.items():
        first, *others = names[key]
        set_placement(param, Placement(first, logical_shape, shards, tied_names=tuple(others)))


def logical_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Unique parameters keyed by logical name, in a sorted, layout-independent order."""
    unique = {get_placement(p).name: p for p in model.parameters()}
    return dict(sorted(unique.items()))
