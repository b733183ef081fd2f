"""DeepSeek-V3 checkpoints in Hugging Face ``transformers`` layout (``DeepseekV3ForCausalLM``), to and from nanotron's
DeepSeek-V3.

Tensors map one to one (``model.`` prefix, ``self_attn`` <-> ``attn``), except:

- the dense layers' ``gate_proj`` and ``up_proj`` are fused as Llama's (``mlp.gate_up_proj``);
- a mixture-of-experts layer's router is ``mlp.gate.weight`` <-> ``mlp.router.weight`` and its balancing bias
  ``mlp.gate.e_score_correction_bias`` <-> ``mlp.expert_bias``; its experts are read from the per-expert
  (``mlp.experts.j.gate_proj/up_proj/down_proj``, what ``save_pretrained`` writes) or the fused layout and written
  per expert; the shared experts (``mlp.shared_experts.*``) are one ungated expert (``mlp.shared_expert``);
- nothing is permuted: ``rope_interleave`` is a field of the config, and the model rotates the rows it says.

``head_dim`` (transformers' rotary size), ``qk_head_dim`` and ``num_key_value_heads`` are derived, and checked.
Multi-token prediction (``num_nextn_predict_layers``): each module is stored as DeepSeek's released checkpoint
stores it, as decoder layer ``num_hidden_layers + k`` with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``
and copies of the embedding (``embed_tokens``) and head (``shared_head.head``), which must equal the model's (nanotron
shares them). transformers' ``DeepseekV3ForCausalLM`` builds no such modules and leaves those tensors unread; a folder
whose weights lack them (what its ``save_pretrained`` writes, whatever its config.json says) imports without them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from nanotron.config.deepseek_v3 import DeepseekV3Config
from nanotron.errors import CheckpointError
from nanotron.models.hf_fields import DECODER_FIELDS, Field, Ignored, Read, Refused
from nanotron.models.llama.hf_adapter import LLAMA_FIELDS, LlamaHFAdapter
from nanotron.models.moe.hf_adapter import experts_from_hf, experts_to_hf

# The keys of transformers' DeepseekV3Config read as they are, nanotron's fields of the same names
ARCHITECTURE_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob", "first_k_dense_replace",
                     "rope_interleave")
DEEPSEEK_V3_FIELDS: dict[str, Field] = DECODER_FIELDS | {name: Read(name) for name in ARCHITECTURE_KEYS} | {
    "head_dim": Read("checked against qk_rope_head_dim (transformers' rotary size)"),
    "qk_head_dim": Read("checked against qk_nope_head_dim + qk_rope_head_dim"),
    "num_key_value_heads": Read("checked against num_attention_heads: latent attention gives every head its own key "
                                "and value"),
    "num_local_experts": Read("n_routed_experts (transformers' other name)"),
    "rope_interleave": Read("rope_interleave"),
    "attention_bias": Refused((False,), "it biases q_a_proj, kv_a_proj_with_mqa and o_proj, which nanotron's latent "
                                        "attention does not have"),
    "pretraining_tp": LLAMA_FIELDS["pretraining_tp"],
    "output_router_logits": Ignored("makes transformers' forward return the router logits: the same logits"),
    "num_nextn_predict_layers": Read("num_nextn_predict_layers, where the weights hold the modules (else 0)"),
    "num_mtp_layers": Read("num_nextn_predict_layers (transformers' other name)"),
}
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MTP_INPUTS = ("enorm.weight", "hnorm.weight", "eh_proj.weight")  # a prediction module's tensors besides its layer
LAYER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


class DeepseekV3HFAdapter(LlamaHFAdapter):
    config_class = DeepseekV3Config
    hf_fields = {"deepseek_v3": DEEPSEEK_V3_FIELDS}

    def _check_family(self, hf: dict) -> dict:
        defaults = DeepseekV3Config()
        fields = {name: hf.get(name, getattr(defaults, name)) for name in ARCHITECTURE_KEYS}
        if "n_routed_experts" not in hf and "num_local_experts" in hf:
            fields["n_routed_experts"] = hf["num_local_experts"]
        fields["num_nextn_predict_layers"] = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
        return fields | {"attention_bias": False}

    def derived_key_problems(self, hf: dict, config: DeepseekV3Config) -> list[str]:
        derived = {"head_dim": (config.qk_rope_head_dim, "qk_rope_head_dim"),
                   "qk_head_dim": (config.head_dim, "qk_nope_head_dim + qk_rope_head_dim"),
                   "num_key_value_heads": (config.num_attention_heads, "num_attention_heads")}
        return [f"{key} ({hf[key]!r}) must equal {rule} = {value}: nanotron builds latent attention that way only"
                for key, (value, rule) in derived.items() if hf.get(key) is not None and hf[key] != value]

    def _family_to_hf(self, config: DeepseekV3Config) -> dict:
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
                "output_router_logits": False, "num_nextn_predict_layers": config.num_nextn_predict_layers,
                **{name: getattr(config, name) for name in ARCHITECTURE_KEYS}}

    def config_to_hf(self, config: DeepseekV3Config, dtype: str) -> dict:
        return super().config_to_hf(config, dtype) | {"head_dim": config.qk_rope_head_dim,
                                                      "qk_head_dim": config.head_dim}

    def _attention(self, tensors: Mapping[str, torch.Tensor], source: str, target: str,
                   config: DeepseekV3Config) -> dict[str, torch.Tensor]:
        """One layer's attention tensors named ``{source}<name>`` in ``tensors``, as ``{target}<name>``."""
        query = ("q_proj.weight",) if config.q_lora_rank is None else (
            "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight")
        names = (*query, "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight")
        return {target + name: tensors[source + name] for name in names}

    def weights_from_hf(self, hf: Mapping[str, torch.Tensor], config: DeepseekV3Config) -> dict[str, torch.Tensor]:
        tensors = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
        for i in range(config.num_hidden_layers):
            tensors |= self._layer_from_hf(hf, f"model.layers.{i}.", f"layers.{i}.", config, i)
        if not config.tie_word_embeddings:
            tensors["lm_head.weight"] = hf["lm_head.weight"]
        for i in range(config.num_nextn_predict_layers):
            index = config.num_hidden_layers + i
            prefix, ours = f"model.layers.{index}.", f"mtp.depths.{i}."
            tensors |= {ours + name: hf[prefix + name] for name in MTP_INPUTS}
            tensors[ours + "norm.weight"] = hf[prefix + "shared_head.norm.weight"]
            tensors |= self._layer_from_hf(hf, prefix, ours + "layer.", config, index)
            head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
            for copy, shared in ((prefix + "embed_tokens.weight", "model.embed_tokens.weight"),
                                 (prefix + "shared_head.head.weight", head)):
                _check_shared_copy(hf[copy], hf[shared], copy, shared)
        return tensors

    def _layer_from_hf(self, hf, prefix: str, ours: str, config: DeepseekV3Config, index: int) -> dict:
        """Decoder layer ``index``'s tensors named ``{prefix}<name>`` in ``hf``, by nanotron's names under ``ours``."""
        tensors = {ours + name: hf[prefix + name] for name in LAYER_NORMS}
        tensors |= self._attention(hf, prefix + "self_attn.", ours + "attn.", config)
        return tensors | self._mlp_from_hf(hf, prefix, ours, config, index)

    def weights_to_hf(self, read: Callable[[str], torch.Tensor], config: DeepseekV3Config) -> dict[str, torch.Tensor]:
        hf = {"model.embed_tokens.weight": read("embed_tokens.weight"), "model.norm.weight": read("norm.weight")}
        for i in range(config.num_hidden_layers):
            hf |= self._layer_to_hf(read, f"model.layers.{i}.", f"layers.{i}.", config, i)
        head = read("embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
        if not config.tie_word_embeddings:
            hf["lm_head.weight"] = head
        for i in range(config.num_nextn_predict_layers):
            index = config.num_hidden_layers + i
            prefix, ours = f"model.layers.{index}.", f"mtp.depths.{i}."
            hf |= {prefix + name: read(ours + name) for name in MTP_INPUTS}
            hf |= {prefix + "shared_head.norm.weight": read(ours + "norm.weight"),
                   prefix + "embed_tokens.weight": hf["model.embed_tokens.weight"].clone(),  # files store copies
                   prefix + "shared_head.head.weight": head.clone()}
            hf |= self._layer_to_hf(read, prefix, ours + "layer.", config, index)
        return hf

    def _layer_to_hf(self, read, prefix: str, ours: str, config: DeepseekV3Config, index: int) -> dict:
        hf = {prefix + name: read(ours + name) for name in LAYER_NORMS}
        hf |= self._attention(_Reader(read), ours + "attn.", prefix + "self_attn.", config)
        return hf | self._mlp_to_hf(read, prefix, ours, config, index)

    def config_for_weights(self, config: DeepseekV3Config, stored: Mapping[str, torch.Tensor]) -> DeepseekV3Config:
        """config.json's ``num_nextn_predict_layers`` where the weights hold the modules, 0 where they hold none:
        transformers' ``save_pretrained`` writes its default (1) but never their weights."""
        if config.num_nextn_predict_layers and f"model.layers.{config.num_hidden_layers}.eh_proj.weight" not in stored:
            return dataclasses.replace(config, num_nextn_predict_layers=0)
        return config

    def _mlp_from_hf(self, hf, prefix, ours, config, index):
        if not config.is_moe_layer(index):
            return super()._mlp_from_hf(hf, prefix, ours, config, index)
        mlp, shared = prefix + "mlp.", prefix + "mlp.shared_experts."
        gate_up, down = experts_from_hf(hf, mlp, mlp, EXPERT_NAMES, config.n_routed_experts)
        tensors = {ours + "mlp.router.weight": hf[mlp + "gate.weight"],
                   ours + "mlp.expert_bias": hf[mlp + "gate.e_score_correction_bias"],
                   ours + "mlp.experts.gate_up_proj": gate_up, ours + "mlp.experts.down_proj": down}
        if config.n_shared_experts:
            tensors |= {ours + "mlp.shared_expert.gate_up_proj": torch.cat(
                            [hf[shared + "gate_proj.weight"], hf[shared + "up_proj.weight"]]).unsqueeze(0),
                        ours + "mlp.shared_expert.down_proj": hf[shared + "down_proj.weight"].unsqueeze(0)}
        return tensors

    def _mlp_to_hf(self, read, prefix, ours, config, index):
        if not config.is_moe_layer(index):
            return super()._mlp_to_hf(read, prefix, ours, config, index)
        mlp, shared = prefix + "mlp.", prefix + "mlp.shared_experts."
        tensors = {mlp + "gate.weight": read(ours + "mlp.router.weight"),
                   mlp + "gate.e_score_correction_bias": read(ours + "mlp.expert_bias")} | experts_to_hf(
            read(ours + "mlp.experts.gate_up_proj"), read(ours + "mlp.experts.down_proj"), mlp, EXPERT_NAMES)
        if config.n_shared_experts:
            gate, up = read(ours + "mlp.shared_expert.gate_up_proj")[0].chunk(2)
            tensors |= {shared + "gate_proj.weight": gate, shared + "up_proj.weight": up,
                        shared + "down_proj.weight": read(ours + "mlp.shared_expert.down_proj")[0]}
        return tensors


def _check_shared_copy(copy: torch.Tensor, shared: torch.Tensor, copy_name: str, shared_name: str) -> None:
    """A prediction module's copy of the embedding or head (DeepSeek's checkpoint stores one per module) must be the
    model's: nanotron shares them. Shapes are checked like every tensor's; values where they are read."""
    if copy.shape != shared.shape or (not copy.is_meta and not torch.equal(copy, shared)):
        raise CheckpointError(f"{copy_name} differs from {shared_name}: nanotron's multi-token prediction modules "
                              "share the model's embedding and head")


class _Reader:
    """``read`` (a checkpoint's logical tensors by name) indexed like a mapping."""

    def __init__(self, read: Callable[[str], torch.Tensor]):
        self.read = read

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name)
