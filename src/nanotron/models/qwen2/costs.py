"""Qwen2's costs: Llama's, with each layer's sliding window (which bounds the keys its queries attend to), and the
mixture-of-experts layers' feed-forward sizes (``models/moe/costs.py``) where the config has a ``moe_config``."""

from __future__ import annotations

from nanotron.config import Qwen2Config
from nanotron.models.llama.costs import decoder_costs
from nanotron.models.moe.costs import feed_forward_costs
from nanotron.models.spec import ModelCosts


def qwen2_costs(c: Qwen2Config, padded_vocab_size: int, sequence_length: int, head_norms: int = 0) -> ModelCosts:
    """Llama-style decoder costs (``decoder_costs``) with each sliding layer's attention FLOPs counting at most its
    window of keys per query; ``head_norms``: the weights of each layer's norms inside its attention (Qwen3's)."""
    windows = [c.attention_window(i) for i in range(c.num_hidden_layers)]
    return decoder_costs(c, padded_vocab_size, sequence_length, feed_forward_costs(c), windows, head_norms)
