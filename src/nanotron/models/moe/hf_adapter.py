"""Mixtral checkpoints in Hugging Face ``transformers`` layout, to and from nanotron's LlaMoE: Llama's mapping
(``models/llama/hf_adapter.py``) with the experts and the router in place of the MLP."""

from __future__ import annotations

import torch

from nanotron.config import LlaMoEConfig
from nanotron.errors import CheckpointError
from nanotron.models.llama.hf_adapter import LlamaHFAdapter


class MixtralHFAdapter(LlamaHFAdapter):
    """Mixtral: nanotron's LlaMoE with every layer a mixture of experts and renormalised top-k weights.

    Experts are read from either layout ``transformers`` uses: per expert (``block_sparse_moe.experts.j.w1/w3/w2``,
    gate/up/down, and ``block_sparse_moe.gate`` the router; the Hub checkpoints and transformers 4) or fused
    (``mlp.experts.gate_up_proj`` [E, 2 * ffn, hidden] and ``down_proj``, ``mlp.gate``; transformers 5 in memory).
    Exports use the per-expert layout, which both versions load. The router's jitter noise (training only) is not
    implemented and is ignored.
    """

    model_types = ("mixtral",)
    config_class = LlaMoEConfig

    def _check_family(self, hf: dict) -> dict:
        if hf.get("sliding_window") is not None:
            raise CheckpointError("Mixtral models with a sliding_window are not supported (nanotron attends to the "
                                  "whole context); set sliding_window to null if the model was trained without one")
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
        if fused + "experts.gate_up_proj" in hf:
            return {ours + "mlp.router.weight": hf[fused + "gate.weight"],
                    ours + "mlp.experts.gate_up_proj": hf[fused + "experts.gate_up_proj"],
                    ours + "mlp.experts.down_proj": hf[fused + "experts.down_proj"]}
        moe = prefix + "block_sparse_moe."
        experts = range(config.moe_num_experts)
        return {ours + "mlp.router.weight": hf[moe + "gate.weight"],
                ours + "mlp.experts.gate_up_proj": torch.stack(
                    [torch.cat([hf[f"{moe}experts.{j}.w1.weight"], hf[f"{moe}experts.{j}.w3.weight"]])
                     for j in experts]),
                ours + "mlp.experts.down_proj": torch.stack([hf[f"{moe}experts.{j}.w2.weight"] for j in experts])}

    def _mlp_to_hf(self, read, prefix, ours, config, index):
        moe = prefix + "block_sparse_moe."
        tensors = {moe + "gate.weight": read(ours + "mlp.router.weight")}
        gate_up, down = read(ours + "mlp.experts.gate_up_proj"), read(ours + "mlp.experts.down_proj")
        for j in range(config.moe_num_experts):
            gate, up = gate_up[j].chunk(2)
            tensors |= {f"{moe}experts.{j}.w1.weight": gate, f"{moe}experts.{j}.w3.weight": up,
                        f"{moe}experts.{j}.w2.weight": down[j]}
        return tensors
