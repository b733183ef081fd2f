"""Qwen2's mixture of experts: upstream nanotron's ``moe_config`` mapping of an ``is_qwen2_config`` model and its
rules.

Upstream's keys and defaults (its ``MoEConfig``), plus transformers' ``norm_topk_prob``. The chosen layers' MLPs become
``num_experts`` gated MLP experts of width ``moe_intermediate_size``, each token routed to ``top_k`` of them by the
softmax of a router, with its weights the raw top-k probabilities (upstream's and ``Qwen2MoeForCausalLM``'s default)
or renormalised ones (``norm_topk_prob``); with ``enable_shared_expert`` every token also goes through one shared
gated MLP expert of width ``shared_expert_intermediate_size``, scaled by ``sigmoid(shared_expert_gate(x))``. The other
layers keep the dense MLP of ``intermediate_size``. The blocks are LlaMoE's (``models/moe``), run dropless.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field

from nanotron.config.moe import MoESettings
from nanotron.config.rules import at_least

ALL_LAYERS = [-1]  # upstream's way to write "every layer"


@dataclass
class Qwen2MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    router_aux_loss_coef: float = 0.01  # load-balancing loss, per sequence, averaged over layers (as LlaMoE's)
    layers: list[int] = field(default_factory=lambda: list(ALL_LAYERS))  # [-1]: every layer
    enable_shared_expert: bool = False
    norm_topk_prob: bool = False  # transformers' key: renormalise the top-k probabilities to sum to 1

    def layer_indices(self, num_hidden_layers: int) -> tuple[int, ...]:
        """The MoE layers, in order (``[-1]``: all ``num_hidden_layers``)."""
        if self.layers == ALL_LAYERS:
            return tuple(range(num_hidden_layers))
        return tuple(sorted(set(self.layers)))

    def settings(self, num_hidden_layers: int) -> MoESettings:
        """The blocks these keys describe (dropless, no router z-loss)."""
        return MoESettings(self.num_experts, self.top_k, self.moe_intermediate_size, self.norm_topk_prob, None,
                           self.router_aux_loss_coef, 0.0, self.layer_indices(num_hidden_layers),
                           self.shared_expert_intermediate_size if self.enable_shared_expert else None,
                           "moe_config.num_experts")

    def problems(self, key: str, num_hidden_layers: int) -> Iterator[str]:
        """Rules on the values, ``key`` being where the mapping is (``model.model_config.moe_config``)."""
        yield from at_least(f"{key}.num_experts", self.num_experts, 1)
        if not 1 <= self.top_k <= max(self.num_experts, 1):
            yield (f"{key}.top_k ({self.top_k}) must be in [1, {key}.num_experts] = [1, {self.num_experts}]: each "
                   "token goes to that many distinct experts")
        yield from at_least(f"{key}.moe_intermediate_size", self.moe_intermediate_size, 1)
        if self.enable_shared_expert:
            yield from at_least(f"{key}.shared_expert_intermediate_size", self.shared_expert_intermediate_size, 1)
        yield from at_least(f"{key}.router_aux_loss_coef", self.router_aux_loss_coef, 0)
        if self.layers != ALL_LAYERS and (not self.layers or len(set(self.layers)) != len(self.layers)
                                          or not all(0 <= i < num_hidden_layers for i in self.layers)):
            yield (f"{key}.layers ({self.layers}) must be [-1] (every layer) or list distinct layer indices in "
                   f"[0, num_hidden_layers) = [0, {num_hidden_layers}); set moe_config: null for a dense model")

    def layout_problems(self, tp: int, key: str, tp_key: str) -> Iterator[str]:
        """The experts' widths split over ``tp`` tensor-parallel ranks."""
        widths = ["moe_intermediate_size"] + (["shared_expert_intermediate_size"] if self.enable_shared_expert else [])
        for name in widths:
            width = getattr(self, name)
            if tp >= 1 and width >= 1 and width % tp:
                yield (f"{key}.{name} ({width}) must be divisible by {tp_key} ({tp}): each expert's feed-forward "
                       "width is split over TP ranks")
