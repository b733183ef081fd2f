"""Qwen3 and Qwen3-MoE checkpoints in Hugging Face ``transformers`` layout, to and from nanotron's Qwen3: Qwen2's
mapping (``models/qwen2/hf_adapter.py``) with each layer's q/k norms (``self_attn.q_norm.weight`` and
``k_norm.weight``, one to one), ``head_dim`` read as it is, and Qwen3-MoE's experts.

Per layer, exactly, both ways:

- ``Qwen3ForCausalLM`` (no biases, RoPE on every layer): layer i slides when ``use_sliding_window`` is true and
  ``layer_types[i]`` is ``sliding_attention`` (without ``layer_types``: i >= ``max_window_layers``), with a window of
  ``sliding_window``.
- ``Qwen3MoeForCausalLM``: every layer slides when ``use_sliding_window`` is true; layer i is a mixture of experts
  unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``, without a shared expert. The config
  gets these keys as they are (``Qwen3MoEConfig``).

transformers' ``attention_bias`` biases o_proj too, which nanotron's attention never does: it is refused when true,
and a model with nanotron's q/k/v biases, layers without RoPE, a shared expert (Qwen3-MoE) or windows on some layers
only (Qwen3-MoE) is refused on export by name.
"""

from __future__ import annotations

from nanotron.config import Qwen3Config
from nanotron.errors import CheckpointError
from nanotron.models.hf_fields import DECODER_FIELDS, Field, Ignored, Read
from nanotron.models.llama.hf_adapter import LLAMA_FIELDS
from nanotron.models.qwen2.hf_adapter import (
    LAYER_TYPES,
    QWEN2_FIELDS,
    Qwen2HFAdapter,
    _is_count,
    _per_layer,
    first_of_sliding_layers,
    layers_from_max_window_layers,
    windows_to_hf,
)

_QWEN3_ATTENTION: dict[str, Field] = {"head_dim": Read("head_dim"), "attention_bias": LLAMA_FIELDS["attention_bias"]}
QWEN3_FIELDS: dict[str, Field] = QWEN2_FIELDS | _QWEN3_ATTENTION
QWEN3_MOE_FIELDS: dict[str, Field] = DECODER_FIELDS | _QWEN3_ATTENTION | {
    "use_sliding_window": Read("sliding_window_layers (every layer)"), "sliding_window": Read("sliding_window_size"),
    "num_experts_per_tok": Read("moe_config.top_k"),
    "num_local_experts": Read("moe_config.num_experts (transformers 5's name; the Hub's files write num_experts)"),
    **{name: Read(f"moe_config.{name}") for name in ("num_experts", "moe_intermediate_size", "norm_topk_prob",
                                                     "router_aux_loss_coef", "decoder_sparse_step",
                                                     "mlp_only_layers")},
    "output_router_logits": Ignored("makes transformers' forward return the router logits and add the auxiliary "
                                    "loss to its loss: the same logits (nanotron always adds it while training)"),
}


def _moe_config_from_hf(hf: dict) -> dict | None:
    """Qwen3's ``moe_config`` for a ``Qwen3MoeForCausalLM`` config.json (transformers' defaults for absent keys), or
    None where no layer has experts."""
    layers, experts = hf["num_hidden_layers"], hf.get("num_experts", hf.get("num_local_experts", 128))
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if experts == 0 or (_is_count(layers) and _is_count(step) and isinstance(dense, list)
                        and not any(i not in dense and (i + 1) % step == 0 for i in range(layers))):
        return None
    return {"num_experts": experts, "top_k": hf.get("num_experts_per_tok", 8),
            "moe_intermediate_size": hf.get("moe_intermediate_size", 768),
            "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
            "norm_topk_prob": hf.get("norm_topk_prob", False), "decoder_sparse_step": step, "mlp_only_layers": dense,
            "enable_shared_expert": False}


class Qwen3HFAdapter(Qwen2HFAdapter):
    config_class = Qwen3Config
    hf_fields = {"qwen3": QWEN3_FIELDS, "qwen3_moe": QWEN3_MOE_FIELDS}
    attention_tensors = ("q_norm.weight", "k_norm.weight")

    def _check_family(self, hf: dict) -> dict:
        layers, moe = hf["num_hidden_layers"], hf.get("model_type") == "qwen3_moe"
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        fields = {"attention_bias": False, "head_dim": hf.get("head_dim"), "nope_layers": None, "no_rope_layer": None,
                  "moe_config": _moe_config_from_hf(hf) if moe else None, "sliding_window_size": window,
                  "sliding_window_layers": None}  # every layer slides (all of them use RoPE)
        if window is None or moe:
            return fields
        layer_types = _per_layer(hf, "layer_types", LAYER_TYPES)
        if layer_types is not None:
            sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
        elif _is_count(layers):
            sliding = layers_from_max_window_layers(hf, layers)
        else:
            return fields  # the config's error names num_hidden_layers
        return fields | {"sliding_window_size": window if sliding else None, "sliding_window_layers": sliding or None}

    def derived_key_problems(self, hf: dict, config: Qwen3Config) -> list[str]:
        return []  # head_dim is read, not derived

    def _family_to_hf(self, config: Qwen3Config) -> dict:
        window = windows_to_hf(config)
        moe = config.moe_config
        unsupported = [what for what, present in (
            ("q/k/v biases (transformers' attention_bias biases o_proj too)", config.attention_bias),
            ("layers without RoPE", not all(config.uses_rope(i) for i in range(config.num_hidden_layers))),
            ("a shared expert", moe is not None and moe.enable_shared_expert),
            ("sliding windows on some layers only (Qwen3MoeForCausalLM slides every layer or none)",
             moe is not None and "full_attention" in window["layer_types"] and window["use_sliding_window"]),
        ) if present]
        if unsupported:
            architecture = "Qwen3ForCausalLM" if moe is None else "Qwen3MoeForCausalLM"
            raise CheckpointError(f"this Qwen3 model has {' and '.join(unsupported)}, which {architecture} cannot "
                                  "express")
        if moe is None:
            return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
                    "max_window_layers": first_of_sliding_layers(config), **window}
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
                "use_sliding_window": window["use_sliding_window"], "sliding_window": window["sliding_window"],
                "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "moe_intermediate_size": moe.moe_intermediate_size, "norm_topk_prob": moe.norm_topk_prob,
                "router_aux_loss_coef": moe.router_aux_loss_coef, "output_router_logits": False,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(config.num_hidden_layers) if i not in config.moe.layers]}
