"""Costs of Llama with mixtures of experts: every expert's weights are parameters, a token's FLOPs use only the
experts it is routed to."""

from __future__ import annotations

from nanotron.config import LlaMoEConfig
from nanotron.models.llama.costs import decoder_costs
from nanotron.models.spec import ModelCosts


def moe_costs(c: LlaMoEConfig, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    """All experts count in the parameters; a token's FLOPs use the router and its ``k`` experts only."""
    expert = 3 * c.hidden_size * c.intermediate_size
    router = c.hidden_size * c.moe_num_experts
    feed_forward = [(c.moe_num_experts * expert + router, c.num_experts_per_tok * expert + router)
                    if c.is_moe_layer(i) else (expert, expert) for i in range(c.num_hidden_layers)]
    return decoder_costs(c, padded_vocab_size, sequence_length, feed_forward)
