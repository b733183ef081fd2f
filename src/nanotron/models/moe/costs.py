"""Costs of Llama with mixtures of experts: every expert's weights are parameters, a token's FLOPs use only the
experts it is routed to, and its activations are those of the experts it visits."""

from __future__ import annotations

from nanotron.config import LlaMoEConfig
from nanotron.models.llama.costs import (
    FeedForwardActivations,
    decoder_costs,
    decoder_layer_activations,
    llama_layer_activations,
)
from nanotron.models.spec import ActivationShape, ModelCosts


def moe_costs(c: LlaMoEConfig, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    """All experts count in the parameters; a token's FLOPs use the router and its ``k`` experts only."""
    expert = 3 * c.hidden_size * c.intermediate_size
    router = c.hidden_size * c.moe_num_experts
    feed_forward = [(c.moe_num_experts * expert + router, c.num_experts_per_tok * expert + router)
                    if c.is_moe_layer(i) else (expert, expert) for i in range(c.num_hidden_layers)]
    return decoder_costs(c, padded_vocab_size, sequence_length, feed_forward)


def moe_layer_activations(c: LlaMoEConfig, layer: int, shape: ActivationShape) -> tuple[int, int]:
    """``ModelSpec.layer_activations``: a dense layer as Llama's; in a mixture-of-experts layer the feed-forward terms
    are those of the experts each token visits (derived from ``models/moe/model.py``, not measured): per token its
    ``k`` copies, the experts' gate|up and SwiGLU outputs and their outputs, and the router's fp32 logits and
    probabilities; the backward holds the gradients of the ``k`` gate|up and SwiGLU outputs."""
    if not c.is_moe_layer(layer):
        return llama_layer_activations(c, layer, shape)
    k, d, ffn = c.num_experts_per_tok, shape.value_bytes, c.intermediate_size // shape.tp
    experts = FeedForwardActivations(kept=k * d * (2 * c.hidden_size + 3 * ffn) + 3 * 4 * c.moe_num_experts,
                                     gradients=k * 3 * d * ffn, recomputed_kept=k * d * ffn)
    return decoder_layer_activations(c, shape, experts)
