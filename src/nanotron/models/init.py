"""Initial weights as a pure function of (seed, parameter name), defined on the logical tensor.

Each parameter's full logical tensor is drawn from a generator seeded by a hash of (seed, logical name) and then
cut to the slices this rank holds. Every layout (any tp, pp, dp) therefore starts from bit-identical weights, which
is what makes parity tests between layouts meaningful, and no two parameters or pipeline stages share a stream.
How a tensor is drawn is the model family's choice (``ModelSpec.init_rule``); the helpers below cover the usual
cases, and a family may pass any function that fills a tensor from a generator.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from nanotron.layout import Axis
from nanotron.models.spec import Initializer
from nanotron.parallel.placement import get_placement


def parameter_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


def normal(std: float) -> Initializer:
    return lambda tensor, generator: tensor.normal_(0.0, std, generator=generator)


def uniform(bound: float) -> Initializer:
    return lambda tensor, generator: tensor.uniform_(-bound, bound, generator=generator)


def constant(value: float) -> Initializer:
    return lambda tensor, generator: tensor.fill_(value)


@torch.no_grad()
def init_parameters(params: dict[str, torch.Tensor], seed: int, rule: Callable[[str], Initializer],
                    coords: dict[Axis, int], sizes: dict[Axis, int]) -> None:
    """Fill every local parameter (by logical name: ``logical_parameters``) with its slice of the logical initial
    tensor; ``rule(name)`` draws it."""
    for name, param in params.items():
        placement = get_placement(param)
        full = torch.empty(placement.logical_shape, dtype=torch.float32, device=param.device)
        rule(name)(full, torch.Generator(device=param.device).manual_seed(parameter_seed(seed, name)))
        for local, logical in placement.boxes(coords, sizes):
            param[local].copy_(full[logical])
