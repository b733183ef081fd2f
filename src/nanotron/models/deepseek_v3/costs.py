"""DeepSeek-V3's costs: a Llama-style decoder (``decoder_costs``) whose attention is multi-head latent attention and
whose feed-forward blocks are LlaMoE's (the router, the experts a token uses, the ungated shared experts)."""

from __future__ import annotations

from nanotron.config.deepseek_v3 import DeepseekV3Config
from nanotron.models.llama.costs import decoder_costs
from nanotron.models.moe.costs import feed_forward_costs
from nanotron.models.spec import ModelCosts


def latent_attention_costs(c: DeepseekV3Config) -> tuple[int, float]:
    """(weights, training FLOPs per (query, key) pair) of one MLA block: the query path (one projection, or the
    down projection, its latent's norm and the up projection), the key/value down projection with the shared rotary
    key, the latent's norm, the up projection to every head's no-RoPE key and value, and o_proj; per pair, every
    head's q·k over ``qk_head_dim`` features and its weighted sum of values over ``v_head_dim``, 2 FLOPs per
    multiply-add, three times with the backward."""
    heads, hidden, qk = c.num_attention_heads, c.hidden_size, c.head_dim
    if c.q_lora_rank is None:
        query = hidden * heads * qk
    else:
        query = hidden * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * qk
    key_value = (hidden * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
                 + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim))
    return query + key_value + heads * c.v_head_dim * hidden, 6.0 * heads * (qk + c.v_head_dim)


def deepseek_v3_costs(c: DeepseekV3Config, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    return decoder_costs(c, padded_vocab_size, sequence_length, feed_forward_costs(c),
                         attention=latent_attention_costs(c))
