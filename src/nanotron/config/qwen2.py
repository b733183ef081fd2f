"""The Qwen2 family's config (upstream nanotron's ``is_qwen2_config``: Qwen2 and SmolLM3) and its rules.

Llama's fields and rules, plus what each layer's attention is and the logit z-loss. Every layer has its own
attention type (full, or a sliding window of ``sliding_window_size`` positions, its own included) and its own RoPE
on or off. Upstream's two keys give them by a rule: ``no_rope_layer: k`` takes RoPE off the layers with
``(index + 1) % k == 0``, and ``sliding_window_size`` slides on the layers that keep RoPE (upstream's flash-attention
path drops the window on its NoPE layers). ``nope_layers`` and ``sliding_window_layers`` list the layers instead,
for the patterns of Hugging Face models that the rule cannot give (Qwen2's ``max_window_layers``, SmolLM3's free
``no_rope_layers``).

``_use_doc_masking`` keeps attention inside each document packed in a sample (``data/loader.py`` finds the
documents, ``nn/attention.py`` applies the rule). ``moe_config`` (upstream's keys, ``qwen2_moe.py``) makes chosen
layers mixtures of experts with a shared expert.

Upstream's implementation keys (``_attn_implementation``, ``flex_attention_mask``, ``_fused_*``, ``_use_qkv_packed``,
...) choose kernels, not results: the upstream translation (``upstream.py``) drops them and nanotron picks its own.
Features not built yet are refused there by name when switched on.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from nanotron.config.llama import LlamaConfig
from nanotron.config.moe import MoESettings
from nanotron.config.qwen2_moe import Qwen2MoEConfig
from nanotron.config.rules import MODEL_CONFIG_KEY, at_least, prefix


@dataclass
class Qwen2Config(LlamaConfig):
    """Llama with q/k/v biases (``attention_bias``), sliding-window and NoPE layers, and the logit z-loss."""

    is_llama_config: bool = False
    is_qwen2_config: bool = True  # the marker that selects this class in `model.model_config`
    sliding_window_size: int | None = None  # W: a sliding layer attends to the W latest positions, its own included
    no_rope_layer: int | None = None  # layers with (index + 1) % no_rope_layer == 0 skip RoPE (upstream's rule)
    nope_layers: list[int] | None = None  # instead of no_rope_layer: the indices of the layers without RoPE
    sliding_window_layers: list[int] | None = None  # the indices of the sliding layers; None: every RoPE layer
    z_loss_enabled: bool = False  # adds z_loss_coefficient * mean over tokens of logsumexp(logits)^2 to the loss
    z_loss_coefficient: float = 0.0001
    _use_doc_masking: bool = False  # attention stays inside each document packed in a sample (nn/attention.py)
    moe_config: Qwen2MoEConfig | None = None  # Qwen2's mixture of experts (upstream's MoEConfig keys); None: dense

    # The z-loss and document masking shape the objective, not the weights: a run may switch them when it continues.
    resume_may_change: ClassVar[frozenset[str]] = LlamaConfig.resume_may_change | {
        "z_loss_enabled", "z_loss_coefficient", "_use_doc_masking"}

    @property
    def moe(self) -> MoESettings | None:
        """The mixture-of-experts blocks ``moe_config`` describes, or None: dense."""
        return None if self.moe_config is None else self.moe_config.settings(self.num_hidden_layers)

    def uses_rope(self, index: int) -> bool:
        """Whether layer ``index`` rotates its queries and keys."""
        if self.nope_layers is not None:
            return index not in self.nope_layers
        return self.no_rope_layer is None or (index + 1) % self.no_rope_layer != 0

    def attention_window(self, index: int) -> int | None:
        """The sliding window of layer ``index`` (positions, the query's own included), or None: full attention."""
        if self.sliding_window_size is None:
            return None
        if self.sliding_window_layers is not None:
            return self.sliding_window_size if index in self.sliding_window_layers else None
        return self.sliding_window_size if self.uses_rope(index) else None

    @property
    def logit_z_loss(self) -> float:
        return self.z_loss_coefficient if self.z_loss_enabled else 0.0

    @property
    def document_masking(self) -> bool:
        return self._use_doc_masking

    def _marker_problems(self, k: str) -> Iterator[str]:
        if self.is_llama_config or not self.is_qwen2_config:
            yield f"{k}is_qwen2_config must be true (and is_llama_config absent) for a Qwen2 model config"

    def problems(self, key: str | None = MODEL_CONFIG_KEY) -> Iterator[str]:
        """Llama's rules on the values, then the experts', the layers' attention and the z-loss."""
        yield from super().problems(key)
        k = prefix(key)
        if self.moe_config is not None:
            yield from self.moe_config.problems(f"{k}moe_config", self.num_hidden_layers)
        if self.sliding_window_size is not None:
            yield from at_least(f"{k}sliding_window_size", self.sliding_window_size, 1)
        elif self.sliding_window_layers:
            yield f"{k}sliding_window_layers needs sliding_window_size, the window of those layers"
        if self.no_rope_layer is not None:
            yield from at_least(f"{k}no_rope_layer", self.no_rope_layer, 1)
            if self.nope_layers is not None:
                yield f"{k}no_rope_layer and {k}nope_layers both say which layers skip RoPE; keep one of them"
        for name in ("nope_layers", "sliding_window_layers"):
            layers = getattr(self, name)
            if layers is not None and (len(set(layers)) != len(layers)
                                       or not all(0 <= i < self.num_hidden_layers for i in layers)):
                yield (f"{k}{name} ({layers}) must list distinct layer indices in [0, {k}num_hidden_layers) = "
                       f"[0, {self.num_hidden_layers})")
        yield from at_least(f"{k}z_loss_coefficient", self.z_loss_coefficient, 0)

    def layout_problems(self, tp: int, *, key: str | None = MODEL_CONFIG_KEY, tp_key: str = "parallelism.tp",
                        **sequence) -> list[str]:
        """Llama's shape rules, and the experts' widths split over TP."""
        problems = super().layout_problems(tp, key=key, tp_key=tp_key, **sequence)
        if self.moe_config is not None:
            problems += self.moe_config.layout_problems(tp, f"{prefix(key)}moe_config", tp_key)
        return problems
