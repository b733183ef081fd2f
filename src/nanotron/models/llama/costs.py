"""Llama's costs: logical parameters and training FLOPs per token of each part (MFU, the pipeline split).

``decoder_costs`` serves every Llama-style decoder: a mixture of experts passes its own feed-forward sizes.
"""

from __future__ import annotations

from nanotron.config import LlamaConfig
from nanotron.models.spec import ModelCosts


def llama_costs(c: LlamaConfig, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    """Costs of the dense Llama: every layer's MLP is a SwiGLU of ``intermediate_size`` (see ``decoder_costs``)."""
    dense = 3 * c.hidden_size * c.intermediate_size
    return decoder_costs(c, padded_vocab_size, sequence_length, [(dense, dense)] * c.num_hidden_layers)


def decoder_costs(c: LlamaConfig, padded_vocab_size: int, sequence_length: int,
                  feed_forward: list[tuple[int, int]]) -> ModelCosts:
    """Costs of a Llama-style decoder whose layer ``i`` has a feed-forward block of ``feed_forward[i]`` = (parameters,
    parameters each token uses): equal for a dense MLP, fewer for a mixture of experts, whose FLOPs count only
    the experts a token is routed to (and the router).

    6 FLOPs per used weight and token (2 forward, 4 backward) for every matmul, plus attention: the scores and the
    weighted sum cost 4 * hidden * s FLOPs per token and layer in the forward over a full s x s matrix, half of that
    with the causal mask, so 6 * hidden * s per token and layer for forward and backward. As in Megatron-LM's count,
    the LM head's matmul counts and the input-embedding lookup (a gather) does not: a tied matrix counts once, as the
    LM head, and an untied embedding adds parameters but no FLOPs. The norms' weights and the q|k|v biases count
    like weights (a negligible overcount of their multiplications and additions)."""
    qkv_width = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    attention = c.hidden_size * qkv_width + (qkv_width if c.attention_bias else 0)
    attention += c.num_attention_heads * c.head_dim * c.hidden_size
    other = attention + 2 * c.hidden_size  # attention and the two norms
    lm_head = padded_vocab_size * c.hidden_size
    embeddings = lm_head * (1 if c.tie_word_embeddings else 2)
    parameters = sum(other + total for total, _ in feed_forward) + embeddings + c.hidden_size
    active = sum(other + used for _, used in feed_forward) + c.hidden_size + lm_head  # not the lookup
    attention_flops = 6.0 * c.hidden_size * sequence_length
    return ModelCosts(
        parameters=parameters,
        layer_flops=tuple(6.0 * (other + used) + attention_flops for _, used in feed_forward),
        head_flops=6.0 * lm_head,
        flops_per_token=6.0 * active + c.num_hidden_layers * attention_flops,
    )
