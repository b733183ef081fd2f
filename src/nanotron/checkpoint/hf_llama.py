"""Llama checkpoints in Hugging Face ``transformers`` layout, to and from nanotron's logical tensors.

Layouts (nanotron ← → Hugging Face):

- ``layers.i.attn.qkv_proj.weight`` = rows ``[q_proj | k_proj | v_proj]`` of ``model.layers.i.self_attn``;
- ``layers.i.mlp.gate_up_proj.weight`` = rows ``[gate_proj | up_proj]`` of ``model.layers.i.mlp``;
- other names map one to one (``model.`` prefix, ``attn`` ↔ ``self_attn``); a tied LM head exists only as
  ``embed_tokens.weight``.
- Rotary embeddings use the same (rotate-half, non-interleaved) convention on both sides: no row permutation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanotron.checkpoint.logical_tensors import CheckpointError
from nanotron.config import LlamaConfig


def _first(token_id):
    return token_id[0] if isinstance(token_id, list) else token_id


class LlamaHFAdapter:
    model_types = ("llama",)

    def config_from_hf(self, hf: dict) -> LlamaConfig:
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise CheckpointError(f"rope type {rope.get('rope_type', rope.get('type'))!r} (RoPE scaling) is not "
                                  "supported")
        heads = hf["num_attention_heads"]
        if hf.get("head_dim", hf["hidden_size"] // heads) != hf["hidden_size"] // heads:
            raise CheckpointError("head_dim must equal hidden_size / num_attention_heads")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise CheckpointError("Llama models with attention or MLP biases are not supported")
        return LlamaConfig(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048), rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"), eos_token_id=_first(hf.get("eos_token_id")),
            pad_token_id=hf.get("pad_token_id"),
        )

    def config_to_hf(self, config: LlamaConfig, dtype: str) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
            "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "rope_scaling": None,
            "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
            "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id, "torch_dtype": dtype,
        }

    def weights_from_hf(self, hf: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
        tensors = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}."
            attn, mlp = prefix + "self_attn.", prefix + "mlp."
            tensors[f"layers.{i}.input_layernorm.weight"] = hf[prefix + "input_layernorm.weight"]
            tensors[f"layers.{i}.post_attention_layernorm.weight"] = hf[prefix + "post_attention_layernorm.weight"]
            tensors[f"layers.{i}.attn.qkv_proj.weight"] = torch.cat(
                [hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"]])
            tensors[f"layers.{i}.attn.o_proj.weight"] = hf[attn + "o_proj.weight"]
            tensors[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
                [hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
            tensors[f"layers.{i}.mlp.down_proj.weight"] = hf[mlp + "down_proj.weight"]
        if not config.tie_word_embeddings:
            tensors["lm_head.weight"] = hf["lm_head.weight"]
        return tensors

    def weights_to_hf(self, read: Callable[[str], torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
        q_width = config.num_attention_heads * config.head_dim
        kv_width = config.num_key_value_heads * config.head_dim
        hf = {"model.embed_tokens.weight": read("embed_tokens.weight"), "model.norm.weight": read("norm.weight")}
        for i in range(config.num_hidden_layers):
            prefix, ours = f"model.layers.{i}.", f"layers.{i}."
            q, k, v = read(ours + "attn.qkv_proj.weight").split([q_width, kv_width, kv_width])
            gate, up = read(ours + "mlp.gate_up_proj.weight").chunk(2)
            hf |= {
                prefix + "input_layernorm.weight": read(ours + "input_layernorm.weight"),
                prefix + "post_attention_layernorm.weight": read(ours + "post_attention_layernorm.weight"),
                prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v,
                prefix + "self_attn.o_proj.weight": read(ours + "attn.o_proj.weight"),
                prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": read(ours + "mlp.down_proj.weight"),
            }
        if not config.tie_word_embeddings:
            hf["lm_head.weight"] = read("lm_head.weight")
        return hf
