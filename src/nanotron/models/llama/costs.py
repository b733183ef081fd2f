"""Llama's costs: logical parameters and training FLOPs per token of each part (MFU, the pipeline split), and what
a decoder layer keeps for the backward (the memory planner).

``decoder_costs`` and ``decoder_layer_activations`` serve every Llama-style decoder: a mixture of experts passes its
own feed-forward sizes, multi-head latent attention its own attention sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nanotron.config import LlamaConfig
from nanotron.layout import Axis
from nanotron.models.spec import ActivationShape, ModelCosts
from nanotron.parallel.placement import Shard


def llama_costs(c: LlamaConfig, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    """Costs of the dense Llama: every layer's MLP is a SwiGLU of ``intermediate_size`` (see ``decoder_costs``)."""
    dense = 3 * c.hidden_size * c.intermediate_size
    return decoder_costs(c, padded_vocab_size, sequence_length, [(dense, dense)] * c.num_hidden_layers)


def attended_keys(window: int | None, sequence_length: int) -> float:
    """The keys a query attends to on average over a sequence, in the causal count's continuous form (s / 2 without a
    window): with a window of W < s, min(position, W) averaged over the positions, W - W² / 2s."""
    if window is None or window >= sequence_length:
        return sequence_length / 2
    return window - window * window / (2 * sequence_length)


def decoder_costs(c: LlamaConfig, padded_vocab_size: int, sequence_length: int,
                  feed_forward: list[tuple[int, int]], windows: list[int | None] | None = None,
                  head_norms: int = 0, attention: tuple[int, float] | None = None) -> ModelCosts:
    """Costs of a Llama-style decoder whose layer ``i`` has a feed-forward block of ``feed_forward[i]`` = (parameters,
    parameters each token uses): equal for a dense MLP, fewer for a mixture of experts, whose FLOPs count only
    the experts a token is routed to (and the router).

    6 FLOPs per used weight and token (2 forward, 4 backward) for every matmul, plus attention: the scores and the
    weighted sum cost 4 * hidden FLOPs per query and key in the forward, 12 * hidden with the backward, times the
    keys a query attends to: s / 2 on average with the causal mask, so 6 * hidden * s per token and layer, and fewer
    in a layer with a sliding window (``windows[i]``, None: none; ``attended_keys``). As in Megatron-LM's count,
    the LM head's matmul counts and the input-embedding lookup (a gather) does not: a tied matrix counts once, as the
    LM head, and an untied embedding adds parameters but no FLOPs. The norms' weights (``head_norms`` per layer
    inside the attention: Qwen3's q/k norms) and the q|k|v biases count like weights (a negligible overcount of
    their multiplications and additions). ``attention``: another attention block's (weights, training FLOPs per
    (query, key) pair) than grouped-query attention's (DeepSeek-V3's latent attention)."""
    if attention is None:
        qkv_width = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        weights = c.hidden_size * qkv_width + (qkv_width if c.attention_bias else 0)
        attention = (weights + c.num_attention_heads * c.head_dim * c.hidden_size, 12.0 * c.hidden_size)
    attention_weights, pair_flops = attention
    other = attention_weights + 2 * c.hidden_size + head_norms  # attention and the norms
    lm_head = padded_vocab_size * c.hidden_size
    embeddings = lm_head * (1 if c.tie_word_embeddings else 2)
    parameters = sum(other + total for total, _ in feed_forward) + embeddings + c.hidden_size
    active = sum(other + used for _, used in feed_forward) + c.hidden_size + lm_head  # not the lookup
    windows = windows if windows is not None else [None] * c.num_hidden_layers
    attention_flops = [pair_flops * attended_keys(window, sequence_length) for window in windows]
    return ModelCosts(
        parameters=parameters,
        layer_flops=tuple(6.0 * (other + used) + flops
                          for (_, used), flops in zip(feed_forward, attention_flops, strict=True)),
        head_flops=6.0 * lm_head,
        flops_per_token=6.0 * active + sum(attention_flops),
        attention_flops=tuple(attention_flops),
        attention_pair_flops=(pair_flops,) * c.num_hidden_layers,
        attention_windows=tuple(windows),
    )


def context_parallel_bytes(shape: ActivationShape, key_value_width: int) -> int:
    """What a context-parallel attention core (``parallel/context_parallel.py``) keeps for the backward beyond a
    single rank's attention: the gathered keys and values of the whole sequences (``key_value_width`` features of
    this rank's keys and values together, d bytes each, per token of the micro-batch) and the boolean mask of the
    rank's queries over every key (derived from the code, not measured)."""
    queries = shape.sequence_length // shape.cp
    return int(shape.tokens * shape.cp * key_value_width * shape.value_bytes + queries * shape.sequence_length)


@dataclass(frozen=True)
class AttentionActivations:
    """Bytes per token on one rank of a decoder layer's attention block, for ``decoder_layer_activations``; and the
    rotary tables and context-parallel buffers it keeps per micro-batch."""

    norm_output: float  # what the matmuls that read the input norm's output keep of it
    kept: float  # the rest it keeps for the backward (its outputs included)
    outputs: float  # the attention op's outputs (part of ``kept``): what selective recomputation keeps
    products: float  # its matmuls' outputs that a pointwise-recomputed layer keeps (part of ``kept``; o_proj's aside)
    rotary_width: int  # the rotated features of each head (the cos/sin tables')
    context_parallel: int = 0  # per micro-batch, under context parallelism (``context_parallel_bytes``)


def attention_widths(c: LlamaConfig, tp: int) -> tuple[int, int]:
    """The query and the key (or value) features of one token on a rank: whole heads on each rank, the kv heads
    replicated when tp exceeds them."""
    kv_width = c.num_key_value_heads * c.head_dim
    kv = Shard(Axis.TP, 0, (kv_width,), (c.head_dim,)).local_size(kv_width, tp)
    return c.num_attention_heads * c.head_dim // tp, kv


def grouped_query_attention_activations(c: LlamaConfig, shape: ActivationShape) -> AttentionActivations:
    """Llama's attention: the q|k|v matmul keeps the norm's output (on the share of the tokens a column-parallel
    linear keeps); then the rotated q and k and v, d·(q + 2kv): v is copied out of the fused q|k|v output, whose
    storage a view would keep alive as a whole; the attention output, the o_proj input (d·q), and SDPA's fp32
    logsumexp (4 bytes per head), with ``attention_widths``' features on each rank."""
    d = shape.value_bytes
    q, kv = attention_widths(c, shape.tp)
    outputs = d * q + 4 * (c.num_attention_heads // shape.tp)
    return AttentionActivations(
        norm_output=d * c.hidden_size * shape.linear_input_share, kept=d * (q + 2 * kv) + outputs, outputs=outputs,
        products=d * (q + 2 * kv), rotary_width=c.head_dim,
        context_parallel=context_parallel_bytes(shape, 2 * kv) if shape.cp > 1 else 0)


@dataclass(frozen=True)
class FeedForwardActivations:
    """Bytes per token on one rank of a decoder layer's feed-forward block, for ``decoder_layer_activations``."""

    kept: float  # kept for the backward
    gradients: float  # the gradients its backward holds at once, on top of what the layer keeps
    recomputed_kept: float  # what a compiled layer still keeps when it is recomputed (the compiler saves it)
    # The outputs of its matmuls that the layer's backward reads (part of ``kept``): what a pointwise-recomputed layer
    # keeps of the block.
    products: float
    # The block's output where a matmul makes it: an eager pointwise-recomputed layer keeps it too (the checkpoint
    # caches every matmul's output, although no backward reads this one; the compiler drops it).
    output_product: float = 0.0


def swiglu_activations(ffn: int, value_bytes: int) -> FeedForwardActivations:
    """A SwiGLU MLP ``ffn`` wide on this rank keeps its gate|up output, which the SwiGLU backward reads, and the SwiGLU
    output, the down_proj input (3d·ffn); its backward adds their gradients (3d·ffn). The gated MLPs of the other
    activations (``hidden_act``) keep and add the same (``nn/glu.py``)."""
    d = value_bytes
    return FeedForwardActivations(kept=3 * d * ffn, gradients=3 * d * ffn, recomputed_kept=d * ffn,
                                  products=2 * d * ffn)


def llama_layer_activations(c: LlamaConfig, layer: int, shape: ActivationShape,
                            attention: AttentionActivations | None = None) -> tuple[int, int]:
    """``ModelSpec.layer_activations`` of the dense Llama (``decoder_layer_activations`` with its SwiGLU MLP, whose
    output is the down projection's; ``attention`` as that function takes it)."""
    mlp = swiglu_activations(c.intermediate_size // shape.tp, shape.value_bytes)
    return decoder_layer_activations(c, shape, replace(mlp, output_product=shape.value_bytes * c.hidden_size),
                                     attention)


def decoder_layer_activations(c: LlamaConfig, shape: ActivationShape, feed_forward: FeedForwardActivations,
                              attention: AttentionActivations | None = None) -> tuple[int, int]:
    """(kept, transient): bytes one decoder layer keeps for the backward per micro-batch, and the most it adds while
    its backward runs, on one rank.

    Per token, with d the model dtype's bytes and widths on this rank, a compiled layer keeps:

    - its input and the residual after attention (d·hidden each, on the residual stream's share of the tokens; the
      compiler recomputes the norms from them),
    - both norms' outputs, the inputs of the q|k|v and gate|up matmuls (d·hidden each, on the share of the tokens a
      column-parallel linear keeps),
    - what the attention block keeps (``attention``; by default Llama's, ``grouped_query_attention_activations``),
    - what the feed-forward block keeps (``feed_forward``),

    plus the rotary cos/sin tables cast to the model dtype (2·sequence·head_dim·d per micro-batch) and, under
    context parallelism, what its attention core keeps (``context_parallel_bytes``). Eager, each
    norm keeps instead its fp32 input copy, the normalised values (for the weight's gradient) and its output:
    8·hidden more bytes per token. Measured per layer on an H200 (1B and 8B shapes, eager and compiled, tp=1 and
    tp=2 in both modes) within 0.1% of these counts while v was a view, which kept the whole q|k|v output (d·(q + kv)
    more); with v copied, measured on CPU, eager and compiled (tests/test_memory.py), not yet on a GPU. A recomputed
    layer keeps its input (and, compiled, what ``feed_forward.recomputed_kept`` says; measured) and rebuilds the rest
    during its backward; selectively
    recomputed (``nn/recompute.py``) it also keeps its attention output and log-sum-exp, which the backward does not
    rebuild (derived from the code: those are the outputs of the attention op the policy saves; not measured).
    Pointwise-recomputed it keeps its input, its attention outputs and its matmuls' outputs: the fused q|k|v output,
    o_proj's (on every token of the micro-batch: the row-parallel partial sums, from which the residual after
    attention is rebuilt) and ``feed_forward.products``, eagerly also ``feed_forward.output_product``; measured on
    CPU, eager and compiled (tests/test_pointwise_recompute.py), not on a GPU. The backward adds
    the feed-forward block's gradients on top of what the layer keeps.
    """
    d, tokens = shape.value_bytes, shape.tokens
    if attention is None:
        attention = grouped_query_attention_activations(c, shape)
    residual, linear_input = d * c.hidden_size * shape.residual_share, d * c.hidden_size * shape.linear_input_share
    norms = 2 * residual + attention.norm_output + linear_input
    if not shape.compiled:
        norms += 2 * 4 * c.hidden_size * shape.residual_share
    attention_outputs = attention.outputs
    rotary_tables = 2 * shape.sequence_length * attention.rotary_width * d
    if shape.cp > 1:  # tables of the rank's own positions, per sequence
        rotary_tables = 2 * tokens * attention.rotary_width * d + attention.context_parallel
    full = int(tokens * (norms + attention.kept + feed_forward.kept) + rotary_tables)
    transient = int(tokens * feed_forward.gradients)
    if shape.recompute == "none":
        return full, transient
    if shape.recompute == "pointwise":
        # The outputs of q|k|v, of the attention op and the feed-forward block's products: kept without recomputation
        # too, and not rebuilt by the backward. o_proj's output and, eagerly, the block's are kept only here.
        shared = attention.products + attention_outputs + feed_forward.products
        own = d * c.hidden_size + (0 if shape.compiled else feed_forward.output_product)
        return int(tokens * (residual + shared + own)), int(full + transient - tokens * shared)
    kept = tokens * (residual + (feed_forward.recomputed_kept if shape.compiled else 0))
    if shape.recompute == "selective":
        return int(kept + tokens * attention_outputs), int(full + transient - tokens * attention_outputs)
    return int(kept), full + transient
