"""The Qwen3 family's config (``is_qwen3_config``: Qwen3 and Qwen3-MoE) and its rules.

Qwen2's fields and rules (``qwen2.py``: per-layer sliding windows, the logit z-loss, document masking, experts in
``moe_config``), with three differences:

- every attention layer normalises each head's queries and keys (an RMSNorm over the head dimension, one weight of
  ``head_dim`` shared by the heads: ``q_norm`` and ``k_norm``) before RoPE;
- the head size is ``head_dim``, free of ``hidden_size / num_attention_heads`` (Qwen3-0.6B: 16 heads of 128 over a
  hidden size of 1024); unset, it is that quotient;
- the experts take Qwen3-MoE's keys (``Qwen3MoEConfig``): ``decoder_sparse_step`` and ``mlp_only_layers`` choose
  the layers as transformers does, the top-k probabilities are renormalised unless ``norm_topk_prob: false``, and
  ``router_z_loss_coef`` weighs the router's z-loss; ``load_balancing_scope: global_batch`` pools the load-balancing
  loss's expert counts over the global batch, as Qwen3-MoE trains. The shared expert (``enable_shared_expert``)
  stays available.

Upstream nanotron has no Qwen3 config: the marker and the keys follow its Qwen2 config's (``is_qwen2_config``).
"""

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

from nanotron.config.moe import MoESettings
from nanotron.config.qwen2 import Qwen2Config
from nanotron.config.qwen2_moe import Qwen2MoEConfig
from nanotron.config.rules import MODEL_CONFIG_KEY, at_least


@dataclass
class Qwen3MoEConfig(Qwen2MoEConfig):
    """Qwen2's ``moe_config`` keys with Qwen3-MoE's defaults and layer choice, and the router z-loss: layer i is a
    mixture of experts if ``layers`` has it, ``(i + 1) % decoder_sparse_step == 0`` and ``mlp_only_layers`` lacks
    it."""

    router_aux_loss_coef: float = 0.001
    norm_topk_prob: bool = True  # Qwen3-MoE's models renormalise (transformers' config defaults to false)
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_z_loss_coef: float = 0.0  # ST-MoE's z-loss: the mean over tokens of logsumexp(router logits)^2
    # the load-balancing loss's expert shares over each sequence, or over the global batch (Qwen3-MoE's training;
    # Megatron's ``global_aux_loss``): ``models/moe/model.py``
    load_balancing_scope: Literal["sequence", "global_batch"] = "sequence"

    def layer_indices(self, num_hidden_layers: int) -> tuple[int, ...]:
        step = max(self.decoder_sparse_step, 1)
        return tuple(i for i in super().layer_indices(num_hidden_layers)
                     if (i + 1) % step == 0 and i not in self.mlp_only_layers)

    def settings(self, num_hidden_layers: int) -> MoESettings:
        return replace(super().settings(num_hidden_layers), z_loss_coef=self.router_z_loss_coef,
                       balance_scope=self.load_balancing_scope)

    def problems(self, key: str, num_hidden_layers: int) -> Iterator[str]:
        yield from super().problems(key, num_hidden_layers)
        yield from at_least(f"{key}.decoder_sparse_step", self.decoder_sparse_step, 1)
        yield from at_least(f"{key}.router_z_loss_coef", self.router_z_loss_coef, 0)
        dense = self.mlp_only_layers
        if len(set(dense)) != len(dense) or not all(0 <= i < num_hidden_layers for i in dense):
            yield (f"{key}.mlp_only_layers ({dense}) must list distinct layer indices in [0, num_hidden_layers) = "
                   f"[0, {num_hidden_layers})")
        elif self.decoder_sparse_step >= 1 and num_hidden_layers >= 1 and not self.layer_indices(num_hidden_layers):
            yield (f"{key}: layers, decoder_sparse_step ({self.decoder_sparse_step}) and mlp_only_layers ({dense}) "
                   "leave no layer with experts; choose at least one, or set moe_config: null for a dense model")


@dataclass
class Qwen3Config(Qwen2Config):
    """Qwen2 with per-head q/k RMSNorm before RoPE and its own head size (``head_dim``), no q/k/v biases by default,
    and Qwen3-MoE's experts."""

    is_qwen2_config: bool = False
    is_qwen3_config: bool = True  # the marker that selects this class in `model.model_config`
    head_dim: int | None = None  # each head's size; None: hidden_size / num_attention_heads
    moe_config: Qwen3MoEConfig | None = None  # Qwen3-MoE's experts; None: dense

    def __post_init__(self) -> None:
        super().__post_init__()
        heads = self.num_attention_heads
        if self.head_dim is None and heads >= 1 and self.hidden_size % heads == 0:
            self.head_dim = self.hidden_size // heads

    def qk_clip_refusal(self, key: str | None = MODEL_CONFIG_KEY) -> str | None:
        return (f"a Qwen3 model ({key} with is_qwen3_config: true) normalises each head's queries and keys after "
                "their projections (q_norm, k_norm), which undoes any scaling of the projections' rows")

    def _marker_problems(self, k: str) -> Iterator[str]:
        if self.is_llama_config or self.is_qwen2_config or not self.is_qwen3_config:
            yield (f"{k}is_qwen3_config must be true (and is_llama_config, is_qwen2_config absent) for a Qwen3 "
                   "model config")

    def _head_size_problems(self, k: str) -> list[str]:
        if self.head_dim is None:
            return [f"{k}hidden_size ({self.hidden_size}) is not divisible by {k}num_attention_heads "
                    f"({self.num_attention_heads}): set {k}head_dim, the size of each head"]
        if self.head_dim < 2 or self.head_dim % 2:
            return [f"{k}head_dim ({self.head_dim}) must be an even number >= 2: rotary embeddings rotate pairs of "
                    "head dimensions"]
        return []
