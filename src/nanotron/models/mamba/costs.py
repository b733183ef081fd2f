"""Mamba's costs: logical parameters and training FLOPs per token (MFU, the pipeline split)."""

from __future__ import annotations

from nanotron.config import MambaConfig
from nanotron.models.spec import ModelCosts


def mamba_costs(c: MambaConfig, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    """6 FLOPs per weight and token for the projections and the depthwise conv (the 6N convention), plus the scan:
    per token, channel and state about 7 FLOPs forward (decay exp and multiply, input term, state update, output
    product), taken as 3x that for forward and backward, i.e. ``21 · d_inner · d_state`` per token and layer. As
    for Llama (``decoder_costs``), the LM head counts and the input-embedding lookup does not."""
    ssm, d_inner = c.ssm_cfg, c.d_inner
    layer = (c.d_model * 2 * d_inner + (2 * d_inner if ssm.bias else 0)
             + d_inner * ssm.d_conv + (d_inner if ssm.conv_bias else 0)
             + d_inner * (c.dt_rank + 2 * ssm.d_state) + c.dt_rank * d_inner + d_inner
             + d_inner * ssm.d_state + d_inner + d_inner * c.d_model + (c.d_model if ssm.bias else 0) + c.d_model)
    lm_head = padded_vocab_size * c.d_model
    parameters = c.num_hidden_layers * layer + lm_head * (1 if c.tie_word_embeddings else 2) + c.d_model
    layer_flops = 6.0 * layer + 21.0 * d_inner * ssm.d_state
    return ModelCosts(parameters=parameters, layer_flops=(layer_flops,) * c.num_hidden_layers,
                      head_flops=6.0 * lm_head,
                      flops_per_token=c.num_hidden_layers * layer_flops + 6.0 * (c.d_model + lm_head))
