"""Qwen2 and SmolLM3 checkpoints in Hugging Face ``transformers`` layout, to and from nanotron's Qwen2: Llama's tensor
mapping (``models/llama/hf_adapter.py``) with each layer's attention type and RoPE switch in the config.

Per layer, exactly, both ways:

- ``Qwen2ForCausalLM`` (always q/k/v biases, RoPE on every layer): layer i slides when ``layer_types[i]`` is
  ``sliding_attention``, or, without ``layer_types``, when ``use_sliding_window`` is true and i >=
  ``max_window_layers``; the window is ``sliding_window`` (ignored unless ``use_sliding_window``).
- ``SmolLM3ForCausalLM`` (no biases): ``no_rope_layers[i]`` is 1 where layer i uses RoPE (without the list, every
  ``no_rope_layer_interval``-th layer skips it); layer i slides when ``use_sliding_window`` is true and
  ``layer_types[i]`` is ``sliding_attention`` (without ``layer_types``: the layers without RoPE).

The config gets the explicit lists (``nope_layers``, ``sliding_window_layers``), or upstream's ``no_rope_layer``
for SmolLM3's interval. A model with q/k/v biases exports
as ``Qwen2ForCausalLM`` (which cannot express layers without RoPE), one without as ``SmolLM3ForCausalLM``; both with
``layer_types`` written out.
"""

from __future__ import annotations

from nanotron.config import Qwen2Config
from nanotron.errors import CheckpointError
from nanotron.models.llama.hf_adapter import LlamaHFAdapter

LAYER_TYPES = ("full_attention", "sliding_attention")


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


class Qwen2HFAdapter(LlamaHFAdapter):
    model_types = ("qwen2", "smollm3")
    config_class = Qwen2Config

    def _check_family(self, hf: dict) -> dict:
        """The biases and each layer's RoPE switch and window. Per-layer lists are derived (from a count or an
        interval) only where config.json has none: transformers writes them out, and a config.json whose
        ``num_hidden_layers`` is not a count gets the config's error for it instead."""
        layers = hf["num_hidden_layers"]
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        smollm3 = hf.get("model_type") == "smollm3"
        if smollm3 and (hf.get("attention_bias") or hf.get("mlp_bias")):
            raise CheckpointError("SmolLM3 models with attention_bias (which biases o_proj too) or mlp_bias are not "
                                  "supported")
        fields = {"attention_bias": not smollm3, "nope_layers": None, "no_rope_layer": None}
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
        elif smollm3:  # transformers' default for SmolLM3: the layers without RoPE slide
            nope, interval = fields["nope_layers"] or [], fields["no_rope_layer"]
            sliding = [i for i in range(layers) if i in nope or (interval and (i + 1) % interval == 0)]
        else:
            first = hf.get("max_window_layers", 28)  # transformers' default
            if not isinstance(first, int) or isinstance(first, bool):
                raise CheckpointError(f"max_window_layers must be an integer (got {first!r})")
            sliding = list(range(first, layers))
        return fields | {"sliding_window_size": window if sliding else None, "sliding_window_layers": sliding or None}

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
