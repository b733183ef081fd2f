"""Qwen3's costs: Qwen2's (windows bound the attended keys, experts count their used parameters), with each layer's
q and k norms (``2 * head_dim`` weights)."""

from __future__ import annotations

from nanotron.config import Qwen3Config
from nanotron.models.qwen2.costs import qwen2_costs
from nanotron.models.spec import ModelCosts


def qwen3_costs(c: Qwen3Config, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    return qwen2_costs(c, padded_vocab_size, sequence_length, head_norms=2 * c.head_dim)
