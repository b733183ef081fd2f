"""fp32 master weights held as the bf16 weights plus 16 remainder bits (``optimizer.store_param_remainders``).

A bf16 number is the upper half of an fp32 one: the same sign and exponent bits, the mantissa cut to 7 bits. So a
bf16 weight and an int16 remainder hold an fp32 master exactly. The weight is the master rounded to the nearest bf16
(ties away from zero) and the remainder is the difference of their bit patterns as integers, which rounding to the
nearest keeps within [-2^15, 2^15): rounding up carries one into the upper half, and the remainder is then negative.
Rounding ties to even, as ``Tensor.to(torch.bfloat16)`` does, would need one value more.

The optimizer updates such masters in the same fp32 arithmetic as a separate copy (``adamw.py`` joins, updates and
splits them in one compiled kernel), so the masters are the same numbers. What changes is the cost: 2 bytes a
parameter instead of 4 (7 GB for a 3.5B model), and 2 bytes less moved by every update. Transformer Engine's fused
Adam and Megatron-LM (``store_param_remainders``) keep masters the same way. The weights then differ from
``master.to(torch.bfloat16)`` only at exact ties, a 2^-16 chance per weight and update.

Only bf16 weights qualify: an fp16 weight is not the upper half of an fp32 number, and an fp32 weight needs no
remainder. Weights in other dtypes keep a separate fp32 master.
"""

from __future__ import annotations

import torch

HALF_UNIT = 1 << 15  # half of the unit of the low 16 bits: what rounds the upper half to the nearest


def stores_remainders(weight_dtype: torch.dtype, store_param_remainders: bool) -> bool:
    """Whether the masters of weights of ``weight_dtype`` are held as remainders."""
    return store_param_remainders and weight_dtype == torch.bfloat16


def master_element_bytes(weight_dtype: torch.dtype, store_param_remainders: bool) -> int:
    """Bytes the optimizer holds per weight element for its master, beyond the weight itself."""
    return 2 if stores_remainders(weight_dtype, store_param_remainders) else 4


def joined(weights: torch.Tensor, remainders: torch.Tensor) -> torch.Tensor:
    """The fp32 masters of bf16 ``weights`` and their int16 ``remainders``."""
    upper = weights.view(torch.int16).to(torch.int32) << 16
    return (upper + remainders.to(torch.int32)).view(torch.float32)


def split_(masters: torch.Tensor, weights: torch.Tensor, remainders: torch.Tensor) -> None:
    """Write fp32 ``masters`` into bf16 ``weights`` (rounded to the nearest, ties away from zero) and their int16
    ``remainders``, so that ``joined(weights, remainders)`` gives them back bit for bit."""
    bits = masters.view(torch.int32)
    upper = (bits + HALF_UNIT) >> 16  # the sign bit is the top one: adding rounds the magnitude
    weights.copy_(upper.to(torch.int16).view(torch.bfloat16))
    remainders.copy_((bits - (upper << 16)).to(torch.int16))
