"""Costs of the decoders with mixtures of experts (LlaMoE, Qwen2 with a ``moe_config``): every expert's weights are
parameters, a token's FLOPs use only the experts it is routed to (and the shared expert, which every token visits),
and its activations are those of the experts it visits."""

from __future__ import annotations

from nanotron.config import LlamaConfig
from nanotron.config.moe import MoESettings
from nanotron.models.llama.costs import (
    AttentionActivations,
    FeedForwardActivations,
    decoder_costs,
    decoder_layer_activations,
    llama_layer_activations,
    swiglu_activations,
)
from nanotron.models.spec import ActivationShape, ModelCosts


def feed_forward_costs(c: LlamaConfig) -> list[tuple[int, int]]:
    """(parameters, parameters each token uses) of every layer's feed-forward block (``decoder_costs``): a dense
    SwiGLU of ``intermediate_size``, or the router, all experts and the shared expert (with its gate, where it has
    one), of which a token uses the router, its ``k`` experts and the shared expert."""
    dense = 3 * c.hidden_size * c.intermediate_size
    s = c.moe
    if s is None:
        return [(dense, dense)] * c.num_hidden_layers
    expert = 3 * c.hidden_size * s.ffn
    always = c.hidden_size * s.num_experts  # the router
    if s.shared_ffn is not None:
        always += 3 * c.hidden_size * s.shared_ffn + (c.hidden_size if s.shared_expert_gated else 0)
    mixture = (s.num_experts * expert + always, s.top_k * expert + always)
    return [mixture if i in s.layers else (dense, dense) for i in range(c.num_hidden_layers)]


def moe_costs(c: LlamaConfig, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    return decoder_costs(c, padded_vocab_size, sequence_length, feed_forward_costs(c))


def moe_layer_activations(c: LlamaConfig, layer: int, shape: ActivationShape,
                          attention: AttentionActivations | None = None) -> tuple[int, int]:
    """``ModelSpec.layer_activations``: a dense layer as Llama's; in a mixture-of-experts layer the feed-forward terms
    are ``expert_activations``' (``attention`` as ``decoder_layer_activations`` takes it)."""
    experts = expert_activations(c, layer, shape)
    if experts is None:
        return llama_layer_activations(c, layer, shape, attention)
    return decoder_layer_activations(c, shape, experts, attention)


def expert_activations(c: LlamaConfig, layer: int, shape: ActivationShape) -> FeedForwardActivations | None:
    """The feed-forward terms of a mixture-of-experts layer (None for a dense one), those of the experts each token
    visits (derived from ``models/moe/model.py``, not measured): per token its ``k`` copies, the experts' gate|up and
    SwiGLU outputs and their outputs, and what the routing keeps (``routing_bytes``); the backward holds the
    gradients of the ``k`` gate|up and SwiGLU outputs. A shared expert adds a SwiGLU MLP's terms, and where it is
    gated its output and its gate's (which multiply each other). Its matmuls' outputs, which pointwise recomputation
    keeps, are the router's logits, the experts' gate|up outputs and outputs (weighted by the router: the backward
    reads them) and the shared expert's and its gate's."""
    s = c.moe
    if s is None or layer not in s.layers:
        return None
    k, d, ffn = s.top_k, shape.value_bytes, s.ffn // shape.tp
    kept = k * d * (2 * c.hidden_size + 3 * ffn) + routing_bytes(s, shape.compiled, d)
    gradients, recomputed_kept = k * 3 * d * ffn, k * d * ffn
    products = d * s.num_experts + k * d * (2 * ffn + c.hidden_size)
    if s.shared_ffn is not None:
        shared = swiglu_activations(s.shared_ffn // shape.tp, d)
        gate = d * (c.hidden_size + 1) if s.shared_expert_gated else 0
        kept += shared.kept + gate
        gradients += shared.gradients
        recomputed_kept += shared.recomputed_kept
        products += shared.products + gate
    return FeedForwardActivations(kept=kept, gradients=gradients, recomputed_kept=recomputed_kept, products=products)


def routing_bytes(s: MoESettings, compiled: bool, value_bytes: int) -> int:
    """What choosing a token's experts keeps for the backward per token, dropless (measured on the CPU, fp32 and
    bf16, eager and compiled, with and without renormalised weights: tests/test_memory.py). Softmax routing: the
    router's output (compiled, in the model dtype; eager, its fp32 copy, which the z-loss's log-sum-exp reads), the
    fp32 probabilities and the logits' log-sum-exp, the int64 indices of the chosen experts, the assignments' int64
    order and inverse order and their weight in the model dtype; renormalised, also the chosen probabilities and,
    eager, their sum. DeepSeek's sigmoid routing (measured in fp32 with renormalised weights): the fp32 logits (the
    z-loss's) and their log-sum-exp, the sigmoid scores, the int64 indices of the chosen experts, the chosen scores,
    and the assignments' int64 order and inverse order and fp32 weight; eager, also the scores' sum and the chosen
    scores' sum (the compiler recomputes those). The choice itself (the groups' best scores, the best groups, their
    mask) runs on detached scores: it keeps nothing. Per-sequence sums of the balance loss are left out."""
    experts, k = s.num_experts, s.top_k
    if s.scoring == "softmax":
        kept = (value_bytes if compiled else 4) * experts + 4 * experts + 4 + (8 + 16 + value_bytes) * k
        if s.normalize_topk:
            kept += 4 * k + (0 if compiled else 4)
        return kept
    kept = 2 * 4 * experts + 4 + (8 + 4 + 8 + 8 + 4) * k
    if not compiled:
        kept += 4 + (4 if s.normalize_topk else 0)
    return kept
