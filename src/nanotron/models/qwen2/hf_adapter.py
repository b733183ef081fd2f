"""Qwen2, SmolLM3 and Qwen2-MoE checkpoints in Hugging Face ``transformers`` layout, to and from nanotron's Qwen2:
Llama's tensor mapping (``models/llama/hf_adapter.py``) with each layer's attention type and RoPE switch in the
config, and Qwen2-MoE's experts.

Per layer, exactly, both ways:

- ``Qwen2ForCausalLM`` (always q/k/v biases, RoPE on every layer): layer i slides when ``layer_types[i]`` is
  ``sliding_attention``, or, without ``layer_types``, when ``use_sliding_window`` is true and i >=
  ``max_window_layers``; the window is ``sliding_window`` (ignored unless ``use_sliding_window``).
- ``SmolLM3ForCausalLM`` (no biases): ``no_rope_layers[i]`` is 1 where layer i uses RoPE (without the list, every
  ``no_rope_layer_interval``-th layer skips it); layer i slides when ``use_sliding_window`` is true and
  ``layer_types[i]`` is ``sliding_attention`` (without ``layer_types``: the layers without RoPE).

- ``Qwen2MoeForCausalLM`` (q/k/v biases when ``qkv_bias``, RoPE on every layer): layer i slides when
  ``layer_types[i]`` is ``sliding_attention`` and ``use_sliding_window`` is true (transformers' versions derive
  other layers when the list is absent, so it is then refused); layer i is a mixture of experts unless it is in
  ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``, always with the shared expert and its gate.

The config gets the explicit lists (``nope_layers``, ``sliding_window_layers``), or upstream's ``no_rope_layer``
for SmolLM3's interval, and the experts as upstream's ``moe_config``. A model with a ``moe_config`` exports as
``Qwen2MoeForCausalLM`` (which cannot express layers without RoPE nor experts without the shared one); otherwise one
with q/k/v biases exports as ``Qwen2ForCausalLM`` (which cannot express layers without RoPE), one without as
``SmolLM3ForCausalLM``; all with ``layer_types`` written out. Experts are read from either of transformers' layouts
(per expert, or fused) and written per expert (``models/moe/hf_adapter.py``).
"""

from __future__ import annotations

import torch

from nanotron.config import Qwen2Config
from nanotron.errors import CheckpointError
from nanotron.models.hf_fields import DECODER_FIELDS, Field, Ignored, Read
from nanotron.models.llama.hf_adapter import LLAMA_FIELDS, LlamaHFAdapter
from nanotron.models.moe.hf_adapter import experts_from_hf, experts_to_hf

LAYER_TYPES = ("full_attention", "sliding_attention")
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")

_WINDOWS: dict[str, Field] = {"use_sliding_window": Read("sliding_window_layers"),
                              "sliding_window": Read("sliding_window_size"),
                              "layer_types": Read("sliding_window_layers")}
QWEN2_FIELDS: dict[str, Field] = DECODER_FIELDS | _WINDOWS | {
    "max_window_layers": Read("sliding_window_layers (the first sliding layer, without layer_types)")}
SMOLLM3_FIELDS: dict[str, Field] = DECODER_FIELDS | _WINDOWS | {
    "no_rope_layers": Read("nope_layers"), "no_rope_layer_interval": Read("no_rope_layer"),
    "attention_bias": LLAMA_FIELDS["attention_bias"], "mlp_bias": LLAMA_FIELDS["mlp_bias"]}
QWEN2_MOE_FIELDS: dict[str, Field] = QWEN2_FIELDS | {
    "qkv_bias": Read("attention_bias"), "num_experts_per_tok": Read("moe_config.top_k"),
    **{name: Read(f"moe_config.{name}") for name in ("num_experts", "moe_intermediate_size",
                                                     "shared_expert_intermediate_size", "norm_topk_prob",
                                                     "router_aux_loss_coef")},
    "decoder_sparse_step": Read("moe_config.layers"), "mlp_only_layers": Read("moe_config.layers"),
    "output_router_logits": Ignored("makes transformers' forward return the router logits and add the auxiliary "
                                    "loss to its loss: the same logits (nanotron always adds it while training)"),
}


def _per_layer(hf: dict, key: str, values: tuple) -> list | None:
    """config.json's per-layer list ``key`` (None when absent), refused unless it has one allowed value per layer
    (its length is checked once ``num_hidden_layers`` is a count; the config's rules name a wrong one)."""
    listed, layers = hf.get(key), hf["num_hidden_layers"]
    if listed is None:
        return None
    if (not isinstance(listed, list) or any(value not in values for value in listed)
            or (_is_count(layers) and len(listed) != layers)):
        raise CheckpointError(f"{key} must list one of {', '.join(map(repr, values))} for each of the "
                              f"num_hidden_layers ({layers}) layers (got {str(listed)[:80]})")
    return listed


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _moe_config_from_hf(hf: dict) -> dict | None:
    """Upstream's ``moe_config`` for a ``Qwen2MoeForCausalLM`` config.json (transformers' defaults for absent keys),
    or None where no layer has experts (``num_experts`` 0). ``layers`` is ``[-1]`` when every layer has them."""
    layers, experts = hf["num_hidden_layers"], hf.get("num_experts", 60)
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not _is_count(step):
        raise CheckpointError(f"decoder_sparse_step must be an integer >= 1 (got {step!r})")
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise CheckpointError(f"mlp_only_layers must be a list of layer indices (got {str(dense)[:80]})")
    if experts == 0:
        return None
    chosen = [-1]  # a wrong num_hidden_layers gets the config's error
    if _is_count(layers):
        chosen = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        if not chosen:
            return None
        chosen = [-1] if len(chosen) == layers else chosen
    return {"num_experts": experts, "top_k": hf.get("num_experts_per_tok", 4),
            "moe_intermediate_size": hf.get("moe_intermediate_size", 1408),
            "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 5632),
            "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001), "layers": chosen,
            "enable_shared_expert": True, "norm_topk_prob": hf.get("norm_topk_prob", False)}


def layers_from_max_window_layers(hf: dict, layers: int) -> list[int]:
    """The sliding layers of a Qwen2 or Qwen3 config.json without ``layer_types``: from ``max_window_layers`` on."""
    first = hf.get("max_window_layers", 28)  # transformers' default
    if not isinstance(first, int) or isinstance(first, bool):
        raise CheckpointError(f"max_window_layers must be an integer (got {first!r})")
    return list(range(first, layers))


def windows_to_hf(config: Qwen2Config) -> dict:
    """config.json's ``use_sliding_window``, ``sliding_window`` and ``layer_types`` of the model's layers."""
    sliding = [config.attention_window(i) is not None for i in range(config.num_hidden_layers)]
    return {"use_sliding_window": any(sliding), "sliding_window": config.sliding_window_size if any(sliding) else None,
            "layer_types": [LAYER_TYPES[slides] for slides in sliding]}


def first_of_sliding_layers(config: Qwen2Config) -> int:
    """``max_window_layers``: the first layer from which every layer slides (``num_hidden_layers`` if none)."""
    sliding = [config.attention_window(i) is not None for i in range(config.num_hidden_layers)]
    return next((i for i in range(len(sliding)) if all(sliding[i:])), len(sliding))


class Qwen2HFAdapter(LlamaHFAdapter):
    config_class = Qwen2Config
    hf_fields = {"qwen2": QWEN2_FIELDS, "smollm3": SMOLLM3_FIELDS, "qwen2_moe": QWEN2_MOE_FIELDS}

    def _check_family(self, hf: dict) -> dict:
        """The biases and each layer's RoPE switch and window. Per-layer lists are derived (from a count or an
        interval) only where config.json has none: transformers writes them out, and a config.json whose
        ``num_hidden_layers`` is not a count gets the config's error for it instead."""
        layers = hf["num_hidden_layers"]
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        smollm3, moe = hf.get("model_type") == "smollm3", hf.get("model_type") == "qwen2_moe"
        fields = {"attention_bias": hf.get("qkv_bias", True) if moe else not smollm3, "nope_layers": None,
                  "no_rope_layer": None, "moe_config": _moe_config_from_hf(hf) if moe else None}
        rope = _per_layer(hf, "no_rope_layers", (0, 1)) if smollm3 else None
        if rope is not None:
            fields["nope_layers"] = [i for i, uses in enumerate(rope) if not uses] or None
        elif smollm3:
            fields["no_rope_layer"] = hf.get("no_rope_layer_interval", 4)  # upstream's rule, SmolLM3's default
        layer_types = _per_layer(hf, "layer_types", LAYER_TYPES) if window is not None else None
        if window is None or (layer_types is None and not _is_count(layers)):
            return fields | {"sliding_window_size": None, "sliding_window_layers": None}
        if layer_types is not None:
            sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
        elif moe:
            raise CheckpointError("a qwen2_moe config.json with use_sliding_window: true must list layer_types "
                                  "(transformers' versions choose different sliding layers without it)")
        elif smollm3:  # transformers' default for SmolLM3: the layers without RoPE slide
            nope, interval = fields["nope_layers"] or [], fields["no_rope_layer"]
            sliding = [i for i in range(layers) if i in nope or (interval and (i + 1) % interval == 0)]
        else:
            sliding = layers_from_max_window_layers(hf, layers)
        return fields | {"sliding_window_size": window if sliding else None, "sliding_window_layers": sliding or None}

    def _family_to_hf(self, config: Qwen2Config) -> dict:
        layers = range(config.num_hidden_layers)
        window = windows_to_hf(config)
        rope = [int(config.uses_rope(i)) for i in layers]
        first_sliding = first_of_sliding_layers(config)
        if config.moe_config is not None:
            return self._moe_to_hf(config, all(rope)) | {"max_window_layers": first_sliding, **window}
        if not config.attention_bias:
            return {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "no_rope_layers": rope,
                    "attention_bias": False, "mlp_bias": False, **window}
        if not all(rope):
            raise CheckpointError("this model has q/k/v biases and layers without RoPE, which no transformers "
                                  "architecture has together (Qwen2ForCausalLM rotates every layer, SmolLM3ForCausalLM "
                                  "has no biases)")
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_window_layers": first_sliding,
                **window}

    @staticmethod
    def _moe_to_hf(config: Qwen2Config, rope_everywhere: bool) -> dict:
        m = config.moe_config
        unsupported = [what for what, present in (
            ("layers without RoPE", not rope_everywhere),
            ("no shared expert (moe_config.enable_shared_expert: false)", not m.enable_shared_expert)) if present]
        if unsupported:
            raise CheckpointError(f"this mixture-of-experts model has {' and '.join(unsupported)}, which "
                                  "Qwen2MoeForCausalLM cannot express")
        moe_layers = config.moe.layers
        return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "qkv_bias": config.attention_bias,
                "num_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                "moe_intermediate_size": m.moe_intermediate_size,
                "shared_expert_intermediate_size": m.shared_expert_intermediate_size,
                "norm_topk_prob": m.norm_topk_prob, "router_aux_loss_coef": m.router_aux_loss_coef,
                "decoder_sparse_step": 1, "output_router_logits": False,
                "mlp_only_layers": [i for i in range(config.num_hidden_layers) if i not in moe_layers]}

    def _mlp_from_hf(self, hf, prefix, ours, config, index):
        """Layer ``index``'s experts, router, shared expert and its gate where it is a mixture of experts."""
        moe = config.moe
        if moe is None or index not in moe.layers:
            return super()._mlp_from_hf(hf, prefix, ours, config, index)
        mlp, shared = prefix + "mlp.", prefix + "mlp.shared_expert."
        gate_up, down = experts_from_hf(hf, mlp, mlp, EXPERT_NAMES, moe.num_experts)
        tensors = {ours + "mlp.router.weight": hf[mlp + "gate.weight"], ours + "mlp.experts.gate_up_proj": gate_up,
                   ours + "mlp.experts.down_proj": down}
        if moe.shared_ffn is not None:
            tensors |= {
                ours + "mlp.shared_expert.gate_up_proj": torch.cat(
                    [hf[shared + "gate_proj.weight"], hf[shared + "up_proj.weight"]]).unsqueeze(0),
                ours + "mlp.shared_expert.down_proj": hf[shared + "down_proj.weight"].unsqueeze(0),
                ours + "mlp.shared_expert_gate.weight": hf[mlp + "shared_expert_gate.weight"]}
        return tensors

    def _mlp_to_hf(self, read, prefix, ours, config, index):
        moe = config.moe
        if moe is None or index not in moe.layers:
            return super()._mlp_to_hf(read, prefix, ours, config, index)
        mlp, shared = prefix + "mlp.", prefix + "mlp.shared_expert."
        tensors = {mlp + "gate.weight": read(ours + "mlp.router.weight")} | experts_to_hf(
            read(ours + "mlp.experts.gate_up_proj"), read(ours + "mlp.experts.down_proj"), mlp, EXPERT_NAMES)
        if moe.shared_ffn is not None:
            gate, up = read(ours + "mlp.shared_expert.gate_up_proj")[0].chunk(2)
            tensors |= {shared + "gate_proj.weight": gate, shared + "up_proj.weight": up,
                        shared + "down_proj.weight": read(ours + "mlp.shared_expert.down_proj")[0],
                        mlp + "shared_expert_gate.weight": read(ours + "mlp.shared_expert_gate.weight")}
        return tensors
