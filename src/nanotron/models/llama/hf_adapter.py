"""Llama checkpoints in Hugging Face ``transformers`` layout, to and from nanotron's logical tensors; the mapping
that the Llama-style families (Mixtral, Qwen2) extend.

Layouts (nanotron ← → Hugging Face):

- ``layers.i.attn.qkv_proj.weight`` = rows ``[q_proj | k_proj | v_proj]`` of ``model.layers.i.self_attn``, and
  ``qkv_proj.bias`` likewise of the three biases;
- ``layers.i.mlp.gate_up_proj.weight`` = rows ``[gate_proj | up_proj]`` of ``model.layers.i.mlp``;
- other names map one to one (``model.`` prefix, ``attn`` ↔ ``self_attn``); a tied LM head exists only as
  ``embed_tokens.weight``.
- Rotary embeddings use the same (rotate-half, non-interleaved) convention on both sides: no row permutation.
  RoPE scaling is read from ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x) and written as
  ``rope_scaling``, which both read.

``LLAMA_FIELDS`` says what becomes of every config.json field (``models/hf_fields.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from nanotron.config import ROPE_SCALING_KEYS, LlamaConfig
from nanotron.errors import CheckpointError
from nanotron.models.hf_fields import DECODER_FIELDS, Field, Ignored, Refused

LLAMA_FIELDS: dict[str, Field] = DECODER_FIELDS | {
    "attention_bias": Refused((False,), "it biases o_proj too, which nanotron's attention never does; q/k/v biases "
                                        "alone are Qwen2's"),
    "mlp_bias": Refused((False,), "nanotron's MLP has no biases"),
    "pretraining_tp": Ignored("transformers 4 split the products into that many slices and summed them (the same "
                              "values); transformers 5 does not read it"),
}


YARN_DEFAULTS = {"beta_fast": 32, "beta_slow": 1, "mscale": 0, "mscale_all_dim": 0}


def _first(token_id):
    return token_id[0] if isinstance(token_id, list) and token_id else token_id


def _rope_from_hf(hf: dict) -> dict:
    """``rope_theta`` and nanotron's ``rope_scaling`` (its keys only; their values are checked with the config)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        return {"rope_scaling": rope}  # the config's type check names what it must be
    theta = hf["rope_theta"] if hf.get("rope_theta") is not None else rope.get("rope_theta", 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        return {"rope_theta": theta, "rope_scaling": None}
    if not isinstance(rope_type, str) or rope_type not in ROPE_SCALING_KEYS:
        raise CheckpointError(f"rope type {rope_type!r} (RoPE scaling) is not supported; supported: default, "
                              f"{', '.join(ROPE_SCALING_KEYS)}")
    if rope_type == "yarn" and (rope.get("attention_factor") is not None or rope.get("truncate") is False):
        raise CheckpointError("YaRN with attention_factor or truncate: false is not supported; nanotron computes the "
                              "attention factor from factor, mscale and mscale_all_dim and truncates, as transformers' "
                              "defaults do")
    # transformers' own default for a llama3 config that leaves the pretraining context out, and YaRN's for the keys
    # a yarn config may leave out (an mscale of 0 is none, as transformers reads it)
    defaults = YARN_DEFAULTS if rope_type == "yarn" else {}
    rope = {"original_max_position_embeddings": hf.get("max_position_embeddings"), **defaults,
            **{key: value for key, value in rope.items() if value is not None}}
    return {"rope_theta": theta,
            "rope_scaling": {"rope_type": rope_type, **{key: rope[key] for key in ROPE_SCALING_KEYS[rope_type]
                                                        if key in rope}}}


class LlamaHFAdapter:
    config_class = LlamaConfig
    hf_fields = {"llama": LLAMA_FIELDS}  # per config.json model_type
    # Attention tensors of every layer mapped one to one, ``self_attn.<name>`` <-> ``attn.<name>`` (Qwen3's q/k norms)
    attention_tensors: tuple[str, ...] = ()

    def _check_family(self, hf: dict) -> dict:
        """Config fields of the variant read from ``hf``, after refusing what nanotron does not build (beyond the
        values its ``hf_fields`` refuse)."""
        return {"attention_bias": False}

    def config_fields_from_hf(self, hf: dict) -> dict:
        return {
            "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"],
            "intermediate_size": hf["intermediate_size"], "num_hidden_layers": hf["num_hidden_layers"],
            "num_attention_heads": hf["num_attention_heads"], "num_key_value_heads": hf.get("num_key_value_heads"),
            "max_position_embeddings": hf.get("max_position_embeddings", 2048),
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-6), **_rope_from_hf(hf),
            "hidden_act": hf.get("hidden_act", "silu"),
            "tie_word_embeddings": hf.get("tie_word_embeddings", False),
            "bos_token_id": hf.get("bos_token_id"), "eos_token_id": _first(hf.get("eos_token_id")),
            "pad_token_id": hf.get("pad_token_id"), **self._check_family(hf),
        }

    def config_for_weights(self, config: LlamaConfig, stored: Mapping[str, torch.Tensor]) -> LlamaConfig:
        return config

    def derived_key_problems(self, hf: dict, config: LlamaConfig) -> list[str]:
        head_dim = hf.get("head_dim")  # Mixtral writes null
        if head_dim is None or head_dim == config.head_dim:
            return []
        return [f"head_dim ({head_dim!r}) must equal hidden_size / num_attention_heads = {config.hidden_size} / "
                f"{config.num_attention_heads} = {config.head_dim}: nanotron builds heads of that size only"]

    def _family_to_hf(self, config: LlamaConfig) -> dict:
        if config.attention_bias:
            raise CheckpointError("a Llama model with q/k/v biases only (attention_bias: true) has no transformers "
                                  "architecture (LlamaForCausalLM's attention_bias biases o_proj too); Qwen2 models "
                                  "are the qwen2 family (is_qwen2_config), which exports as Qwen2ForCausalLM")
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
                "mlp_bias": False}

    def config_to_hf(self, config: LlamaConfig, dtype: str) -> dict:
        return self._family_to_hf(config) | {
            "hidden_act": config.hidden_act,
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
            "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
            "tie_word_embeddings": config.tie_word_embeddings,
            "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id, "torch_dtype": dtype,
        }

    def _mlp_from_hf(self, hf: Mapping[str, torch.Tensor], prefix: str, ours: str, config: LlamaConfig,
                     index: int) -> dict[str, torch.Tensor]:
        """Layer ``index``'s feed-forward tensors (``prefix`` is ``model.layers.i.``, ``ours`` is ``layers.i.``)."""
        mlp = prefix + "mlp."
        return {ours + "mlp.gate_up_proj.weight": torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]),
                ours + "mlp.down_proj.weight": hf[mlp + "down_proj.weight"]}

    def _mlp_to_hf(self, read: Callable[[str], torch.Tensor], prefix: str, ours: str, config: LlamaConfig,
                   index: int) -> dict[str, torch.Tensor]:
        gate, up = read(ours + "mlp.gate_up_proj.weight").chunk(2)
        return {prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": read(ours + "mlp.down_proj.weight")}

    def weights_from_hf(self, hf: Mapping[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
        tensors = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
        fused = ("weight", "bias") if config.attention_bias else ("weight",)
        for i in range(config.num_hidden_layers):
            prefix, ours = f"model.layers.{i}.", f"layers.{i}."
            attn = prefix + "self_attn."
            tensors[f"{ours}input_layernorm.weight"] = hf[prefix + "input_layernorm.weight"]
            tensors[f"{ours}post_attention_layernorm.weight"] = hf[prefix + "post_attention_layernorm.weight"]
            for kind in fused:
                tensors[f"{ours}attn.qkv_proj.{kind}"] = torch.cat(
                    [hf[f"{attn}q_proj.{kind}"], hf[f"{attn}k_proj.{kind}"], hf[f"{attn}v_proj.{kind}"]])
            tensors[f"{ours}attn.o_proj.weight"] = hf[attn + "o_proj.weight"]
            tensors |= {f"{ours}attn.{name}": hf[attn + name] for name in self.attention_tensors}
            tensors |= self._mlp_from_hf(hf, prefix, ours, config, i)
        if not config.tie_word_embeddings:
            tensors["lm_head.weight"] = hf["lm_head.weight"]
        return tensors

    def weights_to_hf(self, read: Callable[[str], torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
        q_width = config.num_attention_heads * config.head_dim
        kv_width = config.num_key_value_heads * config.head_dim
        fused = ("weight", "bias") if config.attention_bias else ("weight",)
        hf = {"model.embed_tokens.weight": read("embed_tokens.weight"), "model.norm.weight": read("norm.weight")}
        for i in range(config.num_hidden_layers):
            prefix, ours = f"model.layers.{i}.", f"layers.{i}."
            for kind in fused:
                q, k, v = read(f"{ours}attn.qkv_proj.{kind}").split([q_width, kv_width, kv_width])
                hf |= {f"{prefix}self_attn.q_proj.{kind}": q, f"{prefix}self_attn.k_proj.{kind}": k,
                       f"{prefix}self_attn.v_proj.{kind}": v}
            hf |= {
                prefix + "input_layernorm.weight": read(ours + "input_layernorm.weight"),
                prefix + "post_attention_layernorm.weight": read(ours + "post_attention_layernorm.weight"),
                prefix + "self_attn.o_proj.weight": read(ours + "attn.o_proj.weight"),
                **{f"{prefix}self_attn.{name}": read(f"{ours}attn.{name}") for name in self.attention_tensors},
            } | self._mlp_to_hf(read, prefix, ours, config, i)
        if not config.tie_word_embeddings:
            hf["lm_head.weight"] = read("lm_head.weight")
        return hf


