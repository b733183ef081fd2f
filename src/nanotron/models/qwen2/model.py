"""Qwen2 (and SmolLM3): Llama whose layers each have their own attention type and RoPE switch.

A sliding layer with a window of W lets each query attend to the W latest positions, its own included (as
transformers' masks and flash-attention's ``window_size=(W - 1, 0)``); a NoPE layer leaves queries and keys
unrotated. Both are properties of the attention block, so the model subclasses ``LlamaForCausalLM`` and overrides
only ``attention(config, index)``; the decoder layers, MLPs, norms, embeddings and tensor-parallel plan are Llama's.

The window is the attention core's mask rule (``nn/attention.py``), over token indices: on one rank queries are the
last of the keys, as in training and in generation with the KV cache (the cache holds every position, and
generation's left padding sits before the first real token, so slot distances are position distances); under context
parallelism the indices are the tokens' places in the whole sequence.
"""

from __future__ import annotations

from nanotron.config import Qwen2Config
from nanotron.models.llama.model import LlamaAttention, LlamaForCausalLM
from nanotron.nn.attention import MaskRule


class Qwen2Attention(LlamaAttention):
    """Llama's attention with RoPE switched off (``rope`` False) or a sliding window (``window`` positions)."""

    def __init__(self, config: Qwen2Config, rope: bool, window: int | None):
        super().__init__(config, MaskRule(window))
        self.rope, self.window = rope, window

    def encode_positions(self, q, k, rotary):
        return super().encode_positions(q, k, rotary) if self.rope else (q, k)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with each layer's attention as the config says (``Qwen2Config.uses_rope``, ``attention_window``)."""

    @staticmethod
    def attention(config: Qwen2Config, index: int) -> Qwen2Attention:
        return Qwen2Attention(config, config.uses_rope(index), config.attention_window(index))
