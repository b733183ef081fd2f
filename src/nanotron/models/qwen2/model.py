"""Qwen2 (and SmolLM3): Llama whose layers each have their own attention type and RoPE switch.

A sliding layer with a window of W lets each query attend to the W latest positions, its own included (as
transformers' masks and flash-attention's ``window_size=(W - 1, 0)``); a NoPE layer leaves queries and keys
unrotated. Both are properties of the attention block, so the model subclasses ``LlamaForCausalLM`` and overrides
only ``attention(config, index)``; the decoder layers, MLPs, norms, embeddings and tensor-parallel plan are Llama's.
With a ``moe_config``, ``feed_forward(config, index)`` gives its layers LlaMoE's mixture-of-experts block
(``models/moe/model.py``) with Qwen2's shared expert.

The window is one term of the attention rule (``nn/attention.py``), over the tokens' indices in the sequence, which
also serves generation with the KV cache (the cache holds every position, and generation's left padding sits before
the first real token, so index distances are position distances).
"""

from __future__ import annotations

from torch import nn

from nanotron.config import Qwen2Config
from nanotron.models.llama.model import LlamaAttention, LlamaForCausalLM, LlamaMLP
from nanotron.models.moe.model import MoEFeedForward


class Qwen2Attention(LlamaAttention):
    """Llama's attention with RoPE switched off (``rope`` False) or a sliding window (``window`` positions)."""

    def __init__(self, config: Qwen2Config, rope: bool, window: int | None):
        super().__init__(config, window)
        self.rope = rope

    def encode_positions(self, q, k, rotary):
        return super().encode_positions(q, k, rotary) if self.rope else (q, k)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with each layer's attention as the config says (``Qwen2Config.uses_rope``, ``attention_window``), and
    mixtures of experts in the layers its ``moe_config`` lists."""

    @staticmethod
    def attention(config: Qwen2Config, index: int) -> Qwen2Attention:
        return Qwen2Attention(config, config.uses_rope(index), config.attention_window(index))

    @staticmethod
    def feed_forward(config: Qwen2Config, index: int) -> nn.Module:
        moe = config.moe
        return MoEFeedForward(config) if moe is not None and index in moe.layers else LlamaMLP(config)
