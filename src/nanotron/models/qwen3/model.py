"""Qwen3 (and Qwen3-MoE): Qwen2's model whose attention normalises each head's queries and keys before RoPE.

``q_norm`` and ``k_norm`` are RMSNorms over the head dimension, one weight of ``head_dim`` shared by all heads (as
transformers' Qwen3), applied to [batch, heads, positions, head_dim] before the rotation; generation caches the
normalised, rotated keys. The head size is the config's ``head_dim``, which Llama's attention already reads, so the
model subclasses ``Qwen2ForCausalLM`` and overrides only ``attention(config, index)``; windows, the decoder layers,
the MLPs and the mixtures of experts (``moe_config``) are Qwen2's.
"""

from __future__ import annotations

from nanotron.config import Qwen3Config
from nanotron.models.init import constant
from nanotron.models.moe.model import moe_init_rule
from nanotron.models.qwen2.model import Qwen2Attention, Qwen2ForCausalLM
from nanotron.models.spec import Initializer
from nanotron.nn.rmsnorm import RMSNorm


class Qwen3Attention(Qwen2Attention):
    """Qwen2's attention with RMSNorm on each head's queries and keys before RoPE."""

    def __init__(self, config: Qwen3Config, rope: bool, window: int | None):
        super().__init__(config, rope, window)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def encode_positions(self, q, k, rotary):
        return super().encode_positions(self.q_norm(q), self.k_norm(k), rotary)


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen2 with ``Qwen3Attention`` in every layer."""

    @staticmethod
    def attention(config: Qwen3Config, index: int) -> Qwen3Attention:
        return Qwen3Attention(config, config.uses_rope(index), config.attention_window(index))


def qwen3_init_rule(name: str, config: Qwen3Config, std: float) -> Initializer:
    """The q/k norms start at one like every norm; the rest as Qwen2's (``moe_init_rule``)."""
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return constant(1.0)
    return moe_init_rule(name, config, std)
