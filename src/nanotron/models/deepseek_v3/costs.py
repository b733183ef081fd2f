"""DeepSeek-V3's costs: a Llama-style decoder (``decoder_costs``) whose attention is multi-head latent attention and
whose feed-forward blocks are LlaMoE's (the router, the experts a token uses, the ungated shared experts), plus the
multi-token prediction modules beside the head (``prediction_costs``, ``prediction_activations``), and what its
layers and those modules keep for the backward (the memory planner)."""

from __future__ import annotations

from dataclasses import replace

from nanotron.config.deepseek_v3 import DeepseekV3Config
from nanotron.models.llama.costs import (
    AttentionActivations,
    context_parallel_bytes,
    decoder_costs,
    decoder_layer_activations,
    swiglu_activations,
)
from nanotron.models.moe.costs import expert_activations, feed_forward_costs
from nanotron.models.spec import ActivationShape, HeadSideActivations, LayerActivations, ModelCosts


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


def prediction_costs(c: DeepseekV3Config, padded_vocab_size: int, sequence_length: int) -> tuple[int, float]:
    """(parameters, training FLOPs per token) of the multi-token prediction modules: per module, a decoder layer of
    the family at index ``num_hidden_layers + k`` (as ``decoder_costs`` counts it), ``eh_proj`` (2 * hidden ->
    hidden), three norms, and one more pass through the shared LM head (its FLOPs, not its weights, which the
    model's count has; the embedding lookup counts nothing, as the model's)."""
    depths = c.num_nextn_predict_layers
    if depths == 0:
        return 0, 0.0
    ahead = replace(c, num_hidden_layers=c.num_hidden_layers + depths, num_nextn_predict_layers=0)
    deeper = decoder_costs(ahead, padded_vocab_size, sequence_length, feed_forward_costs(ahead),
                           attention=latent_attention_costs(ahead))
    base = deepseek_v3_main_costs(c, padded_vocab_size, sequence_length)
    own = 2 * c.hidden_size * c.hidden_size + 3 * c.hidden_size
    layers = deeper.layer_flops[c.num_hidden_layers:]
    return (deeper.parameters - base.parameters + depths * own,
            sum(layers) + depths * (6.0 * 2 * c.hidden_size * c.hidden_size + base.head_flops))


def prediction_activations(c: DeepseekV3Config, shape: ActivationShape,
                           layer_activations: LayerActivations) -> tuple[int, int]:
    """(kept, transient) bytes of the multi-token prediction modules for one micro-batch on the head's stage, given
    the family's ``layer_activations`` for their decoder layers (derived from ``mtp.py``, not measured): per module,
    its layer's, plus per token of the residual stream's share the embedded tokens ahead, the previous depth's
    hidden state (each an input norm's input), the projection's input (both norms' outputs) and the module's final
    norm's input, 5 * d * hidden; its head pass keeps what the model's head keeps, which the planner counts as the
    head's."""
    first, kept, transient = c.num_hidden_layers, 0, 0
    tokens = shape.tokens * shape.residual_share
    for k in range(c.num_nextn_predict_layers):
        layer_kept, layer_transient = layer_activations(c, first + k, shape)
        kept += layer_kept + int(5 * shape.value_bytes * c.hidden_size * tokens)
        transient = max(transient, layer_transient)
    return kept, transient


def deepseek_v3_main_costs(c: DeepseekV3Config, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    """The decoder's costs without the prediction modules."""
    return decoder_costs(c, padded_vocab_size, sequence_length, feed_forward_costs(c),
                         attention=latent_attention_costs(c))


def latent_attention_activations(c: DeepseekV3Config, shape: ActivationShape) -> AttentionActivations:
    """What multi-head latent attention (``model.py``) keeps for the backward per token on one rank, from its code:

    - the input norm's output, kept by the down projections on the tokens they see (the residual stream's share:
      sequence-parallel ranks project their own part of the sequence) and, without a query latent, by the
      column-parallel ``q_proj`` on its share too;
    - each latent's norm (the query latent's, ``q_lora_rank``; the key/value latent's, ``kv_lora_rank``): eager, its
      fp32 input (in fp32 the key/value latent is a view of the down projection's output, which it keeps whole, the
      shared rotary key included) and its normalised values; compiled, the down projection's whole output; and its
      output, which the up projection keeps (on the share of the tokens a column-parallel linear keeps);
    - the attention op's inputs on this rank's heads: the queries and keys of ``qk_head_dim``, made by concatenating
      the no-RoPE part and the rotated part (the shared key broadcast to every head), and the values, copied out of
      the up projection's output, ``v_head_dim``; its output and SDPA's fp32 logsumexp; and o_proj's input, a copy
      of the output: the heads' inputs are head-major, so the output is too, and putting the heads side by side
      copies it.

    The decompressed keys and values and the rotary key are not kept themselves (rotation and concatenation read only
    the tables). Pointwise recomputation keeps the outputs of the four projections before attention."""
    tp, d, hidden = shape.tp, shape.value_bytes, c.hidden_size
    heads, qk, v = c.num_attention_heads // tp, c.head_dim, c.v_head_dim
    shard, gathered = shape.residual_share, shape.linear_input_share  # a down projection's tokens, an up one's
    norm_output = d * hidden * shard
    if c.q_lora_rank is None and gathered != shard:  # q_proj keeps the gathered sequence, the latent its own part
        norm_output += d * hidden * gathered
    down_output = c.kv_lora_rank + c.qk_rope_head_dim  # the key/value down projection's, whole
    latents = [(c.kv_lora_rank, down_output if d == 4 else c.kv_lora_rank, down_output)]
    latents += [(c.q_lora_rank, c.q_lora_rank, c.q_lora_rank)] if c.q_lora_rank else []
    if shape.compiled:  # the down projection's output, then the norm's
        latent_norms = sum(d * (kept * shard + width * gathered) for width, _, kept in latents)
    else:  # the fp32 input, the normalised values, the output
        latent_norms = sum(shard * (4 * fp32 + d * width) + d * width * gathered for width, fp32, _ in latents)
    outputs = 2 * d * heads * v + 4 * heads
    inputs = d * heads * (2 * qk + v)
    down = (c.q_lora_rank or 0) + c.kv_lora_rank + c.qk_rope_head_dim
    products = d * (down * shard + heads * (qk + c.qk_nope_head_dim + v))
    return AttentionActivations(
        norm_output=norm_output, kept=latent_norms + inputs + outputs, outputs=outputs, products=products,
        rotary_width=c.qk_rope_head_dim,
        context_parallel=context_parallel_bytes(shape, heads * (qk + v)) if shape.cp > 1 else 0)


def deepseek_v3_layer_activations(c: DeepseekV3Config, layer: int, shape: ActivationShape) -> tuple[int, int]:
    """``ModelSpec.layer_activations``: latent attention (``latent_attention_activations``), then a dense SwiGLU MLP
    in the first ``first_k_dense_replace`` layers and the routed and shared experts after
    (``expert_activations``)."""
    feed_forward = expert_activations(c, layer, shape)
    if feed_forward is None:
        feed_forward = replace(swiglu_activations(c.intermediate_size // shape.tp, shape.value_bytes),
                               output_product=shape.value_bytes * c.hidden_size)
    return decoder_layer_activations(c, shape, feed_forward, latent_attention_activations(c, shape))


def multi_token_prediction_activations(c: DeepseekV3Config, shape: ActivationShape) -> HeadSideActivations:
    """``ModelSpec.head_side_activations``: the ``num_nextn_predict_layers`` multi-token prediction modules beside the
    head (``prediction_activations`` with the family's layers), each with one more output of the LM head."""
    kept, transient = prediction_activations(c, shape, deepseek_v3_layer_activations)
    return HeadSideActivations(kept=kept, transient=transient, head_outputs=c.num_nextn_predict_layers)


def deepseek_v3_costs(c: DeepseekV3Config, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    """The decoder's costs, the prediction modules counted beside the head: in the parameters, in the FLOPs per token
    (MFU, Megatron-LM's convention) and in the head's FLOPs, which the pipeline split puts on the last stage."""
    costs = deepseek_v3_main_costs(c, padded_vocab_size, sequence_length)
    parameters, flops = prediction_costs(c, padded_vocab_size, sequence_length)
    return replace(costs, parameters=costs.parameters + parameters, head_flops=costs.head_flops + flops,
                   flops_per_token=costs.flops_per_token + flops)
