"""Mixtral checkpoints in Hugging Face ``transformers`` layout, to and from nanotron's LlaMoE: Llama's mapping
(``models/llama/hf_adapter.py``) with the experts and the router in place of the MLP."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nanotron.config import LlaMoEConfig
from nanotron.errors import CheckpointError
from nanotron.models.hf_fields import DECODER_FIELDS, Field, Ignored, Read, Refused
from nanotron.models.llama.hf_adapter import LlamaHFAdapter

MIXTRAL_FIELDS: dict[str, Field] = DECODER_FIELDS | {
    "num_local_experts": Read("moe_num_experts"), "num_experts_per_tok": Read("num_experts_per_tok"),
    "router_aux_loss_coef": Read("moe_aux_loss_coef"),
    "sliding_window": Refused((None,), "nanotron's Mixtral attends to the whole context; set it to null if the model "
                                       "was trained without one"),
    "output_router_logits": Ignored("makes transformers' forward return the router logits and add the auxiliary "
                                    "loss to its loss: the same logits (nanotron always adds it while training)"),
    "router_jitter_noise": Ignored("noise on the router's input in transformers' training, never at inference; "
                                   "nanotron trains without it"),
}


class MixtralHFAdapter(LlamaHFAdapter):
    """Mixtral: nanotron's LlaMoE with every layer a mixture of experts and renormalised top-k weights.

    Experts are read from either layout ``transformers`` uses: per expert (``block_sparse_moe.experts.j.w1/w3/w2``,
    gate/up/down, and ``block_sparse_moe.gate`` the router; the Hub checkpoints and transformers 4) or fused
    (``mlp.experts.gate_up_proj`` [E, 2 * ffn, hidden] and ``down_proj``, ``mlp.gate``; transformers 5 in memory).
    Exports use the per-expert layout, which both versions load. The router's jitter noise (training only) is not
    implemented and is ignored (``MIXTRAL_FIELDS``).
    """

    config_class = LlaMoEConfig
    hf_fields = {"mixtral": MIXTRAL_FIELDS}

    def _check_family(self, hf: dict) -> dict:
        return {"moe_num_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
                "moe_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001), "moe_normalize_topk": True}

    def _family_to_hf(self, config: LlaMoEConfig) -> dict:
        unsupported = [what for what, present in (
            ("q/k/v biases", config.attention_bias), ("dense first layers", config.moe_first_dense_layers > 0),
            ("raw (not renormalised) top-k weights", not config.moe_normalize_topk),
            ("a capacity factor", config.moe_capacity_factor is not None)) if present]
        if unsupported:
            raise CheckpointError(f"this MoE model has {', '.join(unsupported)}, which Mixtral cannot express")
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "sliding_window": None,
                "num_local_experts": config.moe_num_experts, "num_experts_per_tok": config.num_experts_per_tok,
                "router_aux_loss_coef": config.moe_aux_loss_coef, "output_router_logits": False,
                "router_jitter_noise": 0.0}

    def _mlp_from_hf(self, hf, prefix, ours, config, index):
        fused = prefix + "mlp."
        router = fused if fused + "experts.gate_up_proj" in hf else prefix + "block_sparse_moe."
        gate_up, down = experts_from_hf(hf, fused, prefix + "block_sparse_moe.", MIXTRAL_EXPERT_NAMES,
                                        config.moe_num_experts)
        return {ours + "mlp.router.weight": hf[router + "gate.weight"], ours + "mlp.experts.gate_up_proj": gate_up,
                ours + "mlp.experts.down_proj": down}

    def _mlp_to_hf(self, read, prefix, ours, config, index):
        moe = prefix + "block_sparse_moe."
        return {moe + "gate.weight": read(ours + "mlp.router.weight")} | experts_to_hf(
            read(ours + "mlp.experts.gate_up_proj"), read(ours + "mlp.experts.down_proj"), moe, MIXTRAL_EXPERT_NAMES)


MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")  # each expert's gate, up and down projections in Mixtral's checkpoints


def experts_from_hf(hf: Mapping[str, torch.Tensor], fused: str, per_expert: str, names: tuple[str, str, str],
                    num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nanotron's ``gate_up_proj`` [E, 2 * ffn, hidden] and ``down_proj`` [E, hidden, ffn] of one layer's experts, from
    transformers' fused tensors (``{fused}experts.gate_up_proj`` and ``down_proj``, our layout) where the checkpoint
    has them, else from the per-expert matrices ``{per_expert}experts.j.{name}.weight`` of ``names`` (gate, up,
    down)."""
    if fused + "experts.gate_up_proj" in hf:
        return hf[fused + "experts.gate_up_proj"], hf[fused + "experts.down_proj"]
    gate, up, down = (f"{per_expert}experts.{{}}.{name}.weight" for name in names)
    experts = range(num_experts)
    return (torch.stack([torch.cat([hf[gate.format(j)], hf[up.format(j)]]) for j in experts]),
            torch.stack([hf[down.format(j)] for j in experts]))


def experts_to_hf(gate_up: torch.Tensor, down: torch.Tensor, per_expert: str,
                  names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """One layer's experts as per-expert matrices (the layout of the Hub's checkpoints, which every transformers
    version loads)."""
    tensors = {}
    for j in range(gate_up.shape[0]):
        gate, up = gate_up[j].chunk(2)
        tensors |= {f"{per_expert}experts.{j}.{name}.weight": tensor
                    for name, tensor in zip(names, (gate, up, down[j]), strict=True)}
    return tensors
