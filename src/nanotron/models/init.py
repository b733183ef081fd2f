"""Initial weights as a pure function of (seed, parameter name), defined on the logical tensor.

Each parameter's full logical tensor is drawn from a generator seeded by a hash of (seed, logical name) and then
cut to the slices this rank holds. Every layout (any tp, pp, dp) therefore starts from bit-identical weights, which
is what makes parity tests between layouts meaningful, and no two parameters or pipeline stages share a stream.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from nanotron.parallel.placement import get_placement, logical_parameters


def parameter_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, std: float, coords: dict[str, int], sizes: dict[str, int]) -> None:
    """Fill every local parameter with its slice of the logical initial tensor (``model.init_rule`` decides how)."""
    for name, param in logical_parameters(model).items():
        placement = get_placement(param)
        rule, scale = model.init_rule(name, std)
        full = torch.empty(placement.logical_shape, dtype=torch.float32, device=param.device)
        if rule == "ones":
            full.fill_(1.0)
        else:
            generator = torch.Generator(device=param.device).manual_seed(parameter_seed(seed, name))
            full.normal_(0.0, scale, generator=generator)
        for local, logical in placement.boxes(coords, sizes):
            param[local].copy_(full[logical])
