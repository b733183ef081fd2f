"""Qwen2's costs: Llama's, with the keys each layer's queries attend to, which a sliding window bounds."""

from __future__ import annotations

from nanotron.config import Qwen2Config
from nanotron.models.llama.costs import decoder_costs, llama_layer_activations
from nanotron.models.spec import ActivationShape, ModelCosts


def attended_keys(window: int | None, sequence_length: int) -> float:
    """The keys a query attends to on average over a sequence, in the causal count's continuous form (s / 2 without a
    window): with a window of W < s, min(position, W) averaged over the positions, W - W² / 2s."""
    if window is None or window >= sequence_length:
        return sequence_length / 2
    return window - window * window / (2 * sequence_length)


def qwen2_costs(c: Qwen2Config, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    """Llama's dense costs (``decoder_costs``) with each sliding layer's attention FLOPs counting at most its window
    of keys per query."""
    dense = 3 * c.hidden_size * c.intermediate_size
    keys = [attended_keys(c.attention_window(i), sequence_length) for i in range(c.num_hidden_layers)]
    return decoder_costs(c, padded_vocab_size, sequence_length, [(dense, dense)] * c.num_hidden_layers, keys)


def qwen2_layer_activations(c: Qwen2Config, layer: int, shape: ActivationShape) -> tuple[int, int]:
    """``ModelSpec.layer_activations``: Llama's, plus a sliding layer's boolean window mask (sequence² bytes), which
    SDPA keeps for the backward, or which a recomputed layer builds again in its backward (derived from
    ``model.py``, not measured). Under context parallelism every layer has a mask, which Llama's count holds."""
    kept, transient = llama_layer_activations(c, layer, shape)
    mask = shape.sequence_length ** 2 if c.attention_window(layer) is not None and shape.cp == 1 else 0
    return (kept, transient + mask) if shape.recomputed else (kept + mask, transient)
