"""The mixture-of-experts Llama's config (nanotron's ``is_llamoe_config``; Mixtral's architecture) and its rules, and
``MoESettings``: what the mixture-of-experts blocks read of any family's config."""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal

from nanotron.config.llama import LlamaConfig
from nanotron.config.rules import MODEL_CONFIG_KEY, at_least, positive, prefix


@dataclass(frozen=True)
class MoESettings:
    """The mixture-of-experts blocks of a model (``models/moe``), whatever its family calls the keys: LlaMoE's flat
    ``moe_*`` fields and Qwen2's ``moe_config`` mapping both give one (their config's ``moe`` property)."""

    num_experts: int
    top_k: int
    ffn: int  # each routed expert's gated MLP width
    normalize_topk: bool  # renormalise the top-k probabilities to sum to 1
    capacity_factor: float | None  # None: dropless
    aux_loss_coef: float
    z_loss_coef: float
    layers: tuple[int, ...]  # the indices of the layers whose feed-forward block is a mixture of experts
    shared_ffn: int | None  # the width of the shared expert every token visits (Qwen2's), None: no shared expert
    num_experts_key: str  # where the config writes num_experts, for error messages
    # DeepSeek-V3's routing (``sigmoid``): per-token sigmoid scores plus a per-expert balancing bias choose the
    # experts (the bias for the choice only) within the ``topk_group`` best of ``n_group`` expert groups, and the
    # chosen scores (renormalised with ``normalize_topk``) times ``routed_scaling_factor`` weigh them; the bias moves
    # by ``bias_update_speed`` after every step (``features/expert_balance.py``). ``softmax``: Mixtral's and Qwen's.
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True  # Qwen2's sigmoid gate on the shared expert; DeepSeek-V3's has none
    bias_update_speed: float = 0.0
    # The load-balancing loss's statistic: per sequence (``sequence``), or the expert counts of the whole global
    # batch (``global_batch``, Qwen3-MoE's training), which needs every forward of a step before its first backward
    balance_scope: Literal["sequence", "global_batch"] = "sequence"


@dataclass
class LlaMoEConfig(LlamaConfig):
    """Llama with mixture-of-experts feed-forward layers (nanotron's ``is_llamoe_config``; Mixtral's architecture).

    Each MoE layer routes every token to ``num_experts_per_tok`` of ``moe_num_experts`` gated MLP experts of width
    ``intermediate_size``. The first ``moe_first_dense_layers`` layers keep a dense MLP.
    """

    is_llama_config: bool = False
    is_llamoe_config: bool = True
    moe_num_experts: int = 1
    num_experts_per_tok: int = 1
    moe_capacity_factor: float | None = None  # None: dropless; else each expert takes at most factor * tokens * k / E
    moe_aux_loss_coef: float = 0.01  # load-balancing loss (Switch Transformer), per sequence, averaged over layers
    moe_z_loss_coef: float = 0.0  # router z-loss (ST-MoE): mean squared log-sum-exp of the router logits
    moe_normalize_topk: bool = True  # renormalise the top-k probabilities to sum to 1 (Mixtral); False: raw softmax
    moe_first_dense_layers: int = 0

    resume_may_change: ClassVar[frozenset[str]] = LlamaConfig.resume_may_change | {
        "moe_capacity_factor", "moe_aux_loss_coef", "moe_z_loss_coef"}

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.moe_first_dense_layers

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def moe(self) -> MoESettings:
        return MoESettings(self.moe_num_experts, self.num_experts_per_tok, self.intermediate_size,
                           self.moe_normalize_topk, self.moe_capacity_factor, self.moe_aux_loss_coef,
                           self.moe_z_loss_coef, tuple(self.moe_layers), None, "moe_num_experts")

    def _marker_problems(self, k: str) -> Iterator[str]:
        if self.is_llama_config or not self.is_llamoe_config:
            yield f"{k}is_llamoe_config must be true (and is_llama_config absent) for a mixture-of-experts config"

    def problems(self, key: str | None = MODEL_CONFIG_KEY) -> Iterator[str]:
        """Llama's rules on the values, then the experts' (the shapes are Llama's: experts split over ranks of
        ``parallelism.expert_parallel_size``, a rule between sections)."""
        yield from super().problems(key)
        k = prefix(key)
        yield from at_least(f"{k}moe_num_experts", self.moe_num_experts, 1)
        if not 1 <= self.num_experts_per_tok <= max(self.moe_num_experts, 1):
            yield (f"{k}num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, {k}moe_num_experts] = "
                   f"[1, {self.moe_num_experts}]: each token goes to that many distinct experts")
        if self.moe_capacity_factor is not None:
            yield from positive(f"{k}moe_capacity_factor", self.moe_capacity_factor)
        yield from at_least(f"{k}moe_aux_loss_coef", self.moe_aux_loss_coef, 0)
        yield from at_least(f"{k}moe_z_loss_coef", self.moe_z_loss_coef, 0)
        if self.num_hidden_layers >= 1 and not 0 <= self.moe_first_dense_layers < self.num_hidden_layers:
            yield (f"{k}moe_first_dense_layers ({self.moe_first_dense_layers}) must be in [0, {k}num_hidden_layers) "
                   f"= [0, {self.num_hidden_layers}): at least the last layer is a mixture of experts")
