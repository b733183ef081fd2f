"""Qwen2 and SmolLM3 checkpoints in Hugging Face ``transformers`` layout, to and from nanotron's Qwen2: Llama's tensor
mapping (``models/llama/hf_adapter.py``) with each layer's attention type and RoPE switch in the config.

Per layer, exactly, both ways:

- ``Qwen2ForCausalLM`` (always q/k/v biases, RoPE on every layer): layer i slides when ``layer_types[i]`` is
  ``sliding_attention``, or, without ``layer_types``, when ``use_sliding_window`` is true and i >=
  ``max_window_layers``; the window is ``sliding_window`` (ignored unless ``use_sliding_window``).
- ``SmolLM3ForCausalLM`` (no biases): ``no_rope_layers[i]`` is 1 where layer i uses RoPE (without the list, every
  ``no_rope_layer_interval``-th layer skips it); layer i slides when ``use_sliding_window`` is true and
  ``layer_types[i]`` is ``sliding_attention`` (without ``layer_types``: the layers without RoPE).

The config gets the explicit lists (``nope_layers``, ``sliding_window_layers``). A model with q/k/v biases exports
as ``Qwen2ForCausalLM`` (which cannot express layers without RoPE), one without as ``SmolLM3ForCausalLM``; both with
``layer_types`` written out.
"""

from __future__ import annotations

from nanotron.config import Qwen2Config
from nanotron.errors import CheckpointError
from nanotron.models.llama.hf_adapter import LlamaHFAdapter

LAYER_TYPES = ("full_attention", "sliding_attention")


def _per_layer(hf: dict, key: str, values: tuple) -> list | None:
    """config.json's per-layer list ``key`` (None when absent), refused unless it has one allowed value per layer."""
    listed = hf.get(key)
    if listed is None:
        return None
    layers = hf["num_hidden_layers"]
    if not isinstance(listed, list) or len(listed) != layers or any(value not in values for value in listed):
        raise CheckpointError(f"{key} must list one of {', '.join(map(repr, values))} for each of the "
                              f"num_hidden_layers ({layers}) layers (got {str(listed)[:80]})")
    return listed


class Qwen2HFAdapter(LlamaHFAdapter):
    model_types = ("qwen2", "smollm3")
    config_class = Qwen2Config

    def _check_family(self, hf: dict) -> dict:
        layers = hf["num_hidden_layers"]
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        layer_types = _per_layer(hf, "layer_types", LAYER_TYPES)
        if hf.get("model_type") == "smollm3":
            if hf.get("attention_bias") or hf.get("mlp_bias"):
                raise CheckpointError("SmolLM3 models with attention_bias (which biases o_proj too) or mlp_bias are "
                                      "not supported")
            interval = hf.get("no_rope_layer_interval", 4)
            rope = _per_layer(hf, "no_rope_layers", (0, 1)) or [int((i + 1) % interval != 0) for i in range(layers)]
            sliding = ([kind == "sliding_attention" for kind in layer_types] if layer_types is not None
                       else [not uses for uses in rope])
            bias = False
        else:
            rope = [1] * layers
            sliding = ([kind == "sliding_attention" for kind in layer_types] if layer_types is not None
                       else [i >= hf.get("max_window_layers", 28) for i in range(layers)])
            bias = True
        sliding_layers = [i for i, slides in enumerate(sliding) if slides] if window is not None else []
        nope = [i for i, uses in enumerate(rope) if not uses]
        return {"attention_bias": bias, "nope_layers": nope or None,
                "sliding_window_size": window if sliding_layers else None,
                "sliding_window_layers": sliding_layers or None}

    def _family_to_hf(self, config: Qwen2Config) -> dict:
        layers = range(config.num_hidden_layers)
        sliding = [config.attention_window(i) is not None for i in layers]
        window = {"use_sliding_window": any(sliding),
                  "sliding_window": config.sliding_window_size if any(sliding) else None,
                  "layer_types": [LAYER_TYPES[slides] for slides in sliding]}
        rope = [int(config.uses_rope(i)) for i in layers]
        if not config.attention_bias:
            return {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "no_rope_layers": rope,
                    "attention_bias": False, "mlp_bias": False, **window}
        if not all(rope):
            raise CheckpointError("this model has q/k/v biases and layers without RoPE, which no transformers "
                                  "architecture has together (Qwen2ForCausalLM rotates every layer, SmolLM3ForCausalLM "
                                  "has no biases)")
        first_sliding = next((i for i in layers if all(sliding[i:])), config.num_hidden_layers)
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_window_layers": first_sliding,
                **window}
