"""Qwen3's costs: Qwen2's (windows bound the attended keys, experts count their used parameters), with each layer's
q and k norms (``2 * head_dim`` weights) and what they keep for the backward."""

from __future__ import annotations

from dataclasses import replace

from nanotron.config import Qwen3Config
from nanotron.models.llama.costs import AttentionActivations, attention_widths, grouped_query_attention_activations
from nanotron.models.moe.costs import moe_layer_activations
from nanotron.models.qwen2.costs import qwen2_costs
from nanotron.models.spec import ActivationShape, ModelCosts


def qwen3_costs(c: Qwen3Config, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    return qwen2_costs(c, padded_vocab_size, sequence_length, head_norms=2 * c.head_dim)


def qwen3_attention_activations(c: Qwen3Config, shape: ActivationShape) -> AttentionActivations:
    """Llama's attention (``grouped_query_attention_activations``) and, kept by the q and k norms for their backward
    (measured on the CPU in fp32 and bf16, eager and compiled: tests/test_memory.py), per token on a rank with d the
    model dtype's bytes: compiled, their inputs, which are views of the q|k|v output and keep it alive whole,
    d·(q + 2kv); eager, the fp32 copies of q and k (in an fp32 model the inputs themselves, so again the whole q|k|v
    output) and the normalised values d·(q + k); either way each head's fp32 reciprocal root (4 bytes per q and kv
    head). Recomputed layers rebuild all of it (pointwise from the q|k|v output they keep)."""
    attention = grouped_query_attention_activations(c, shape)
    d = shape.value_bytes
    q, kv = attention_widths(c, shape.tp)
    qkv_output = d * (q + 2 * kv)
    if shape.compiled:
        norms = qkv_output
    else:
        norms = (qkv_output if d == 4 else 4 * (q + kv)) + d * (q + kv)
    norms += 4 * (q + kv) // c.head_dim
    return replace(attention, kept=attention.kept + norms)


def qwen3_layer_activations(c: Qwen3Config, layer: int, shape: ActivationShape) -> tuple[int, int]:
    """``ModelSpec.layer_activations``: Qwen2's layer, dense or with experts (``moe_layer_activations``), with
    ``qwen3_attention_activations``."""
    return moe_layer_activations(c, layer, shape, qwen3_attention_activations(c, shape))
