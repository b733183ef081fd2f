"""Qwen2's costs: Llama's, with the keys each layer's queries attend to, which a sliding window bounds, and the
mixture-of-experts layers' feed-forward sizes (``models/moe/costs.py``) where the config has a ``moe_config``."""

from __future__ import annotations

from nanotron.config import Qwen2Config
from nanotron.models.llama.costs import decoder_costs
from nanotron.models.moe.costs import feed_forward_costs
from nanotron.models.spec import ModelCosts


def attended_keys(window: int | None, sequence_length: int) -> float:
    """The keys a query attends to on average over a sequence, in the causal count's continuous form (s / 2 without a
    window): with a window of W < s, min(position, W) averaged over the positions, W - W² / 2s."""
    if window is None or window >= sequence_length:
        return sequence_length / 2
    return window - window * window / (2 * sequence_length)


def qwen2_costs(c: Qwen2Config, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    """Llama-style decoder costs (``decoder_costs``) with each sliding layer's attention FLOPs counting at most its
    window of keys per query."""
    keys = [attended_keys(c.attention_window(i), sequence_length) for i in range(c.num_hidden_layers)]
    return decoder_costs(c, padded_vocab_size, sequence_length, feed_forward_costs(c), keys)
