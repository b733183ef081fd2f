"""The DeepSeek-V3 family's config (``is_deepseek_v3_config``) and its rules.

Llama's fields (vocabulary, hidden size, layers, heads, RoPE theta and scaling, token ids) and the keys of transformers'
``DeepseekV3Config``, named as in its config.json:

- multi-head latent attention: queries through a ``q_lora_rank`` latent (None: one direct projection), keys and values
  through a ``kv_lora_rank`` latent, RMSNorms on both latents; each head's query and key are ``qk_nope_head_dim``
  features without RoPE and ``qk_rope_head_dim`` with it (one rotated key shared by every head), its value
  ``v_head_dim``; ``rope_interleave`` says how the rotary features pair up (adjacent, DeepSeek's and
  transformers' default, or the two halves). ``num_key_value_heads`` is ``num_attention_heads`` (every head has its
  own key and value once they are decompressed). RoPE scaling may be YaRN (``rope_scaling: {rope_type: yarn,
  ...}``), whose ``mscale_all_dim`` also multiplies the softmax scale by its mscale squared, as DeepSeek does;
- the mixture of experts of every layer from ``first_k_dense_replace`` on: ``n_routed_experts`` experts of width
  ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token chosen by sigmoid scores plus a per-expert
  balancing bias (selection only) within the ``topk_group`` best of ``n_group`` groups, weighted by their scores
  (renormalised with ``norm_topk_prob``) times ``routed_scaling_factor``, plus ``n_shared_experts`` shared experts
  (one gated MLP of ``n_shared_experts * moe_intermediate_size``, ungated) that every token visits. The earlier layers
  have a dense MLP of ``intermediate_size``;
- multi-token prediction (``models/deepseek_v3/mtp.py``): ``num_nextn_predict_layers`` modules (0: none), the k-th
  predicting the token k + 1 past the next from the previous depth's hidden state and the embedding of the token k
  ahead, through one decoder layer of the family (MLA, and experts as the last layer has them) and the shared head;
  their mean loss times ``mtp_loss_scaling_factor`` joins the objective (training only);
- training only: ``bias_update_speed``, the step of the auxiliary-loss-free balancing bias (after every optimizer
  step, ``bias += bias_update_speed * sign(mean load - load)`` from the step's global expert load; 0: frozen), and
  ``aux_loss_alpha``, the weight of the sequence-wise balance loss (0: none).

Upstream nanotron has no DeepSeek-V3 config: the marker follows its Llama and Qwen2 configs'.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from nanotron.config.llama import LlamaConfig
from nanotron.config.moe import MoESettings
from nanotron.config.rules import MODEL_CONFIG_KEY, at_least, positive, prefix


@dataclass
class DeepseekV3Config(LlamaConfig):
    """DeepSeek-V3: multi-head latent attention and fine-grained experts with shared experts and sigmoid routing
    balanced by a bias; transformers' defaults (DeepSeek-V3's own sizes) for its keys."""

    is_llama_config: bool = False
    is_deepseek_v3_config: bool = True  # the marker that selects this class in `model.model_config`
    q_lora_rank: int | None = 1536  # None: queries come from one projection of the hidden state
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    routed_scaling_factor: float = 2.5
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    rope_interleave: bool = True  # the rotary features rotate adjacent pairs (DeepSeek's layout); false: halves
    bias_update_speed: float = 0.001  # DeepSeek-V3's gamma; 0: the balancing bias stays as it is
    aux_loss_alpha: float = 0.0001  # the sequence-wise balance loss's weight (DeepSeek-V3's alpha); 0: none
    num_nextn_predict_layers: int = 0  # multi-token prediction modules (DeepSeek-V3: 1); 0: none
    mtp_loss_scaling_factor: float = 0.3  # the MTP loss's weight (DeepSeek-V3's lambda over its first 10T tokens)
    _use_doc_masking: bool = False  # attention stays inside each document packed in a sample (nn/attention.py)

    resume_may_change: ClassVar[frozenset[str]] = LlamaConfig.resume_may_change | {
        "bias_update_speed", "aux_loss_alpha", "mtp_loss_scaling_factor", "_use_doc_masking"}

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """The size of each head's query and key (what the attention kernels see); values have ``v_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def document_masking(self) -> bool:
        return self._use_doc_masking

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` has experts; the multi-token prediction modules' layers are numbered on
        from ``num_hidden_layers`` (as DeepSeek's checkpoint names them) and have them like the last layer."""
        return index >= self.first_k_dense_replace

    @property
    def embedding_on_head_stage(self) -> bool:
        return self.tie_word_embeddings or self.num_nextn_predict_layers > 0

    @property
    def moe(self) -> MoESettings:
        depth = self.num_hidden_layers + self.num_nextn_predict_layers
        layers = tuple(i for i in range(depth) if self.is_moe_layer(i))
        shared = self.n_shared_experts * self.moe_intermediate_size if self.n_shared_experts else None
        return MoESettings(self.n_routed_experts, self.num_experts_per_tok, self.moe_intermediate_size,
                           self.norm_topk_prob, None, self.aux_loss_alpha, 0.0, layers, shared, "n_routed_experts",
                           scoring="sigmoid", n_group=self.n_group, topk_group=self.topk_group,
                           routed_scaling_factor=self.routed_scaling_factor, shared_expert_gated=False,
                           bias_update_speed=self.bias_update_speed)

    def _marker_problems(self, k: str) -> Iterator[str]:
        if self.is_llama_config or not self.is_deepseek_v3_config:
            yield f"{k}is_deepseek_v3_config must be true (and is_llama_config absent) for a DeepSeek-V3 model config"

    def problems(self, key: str | None = MODEL_CONFIG_KEY) -> Iterator[str]:
        """Llama's rules on the values, then the latent attention's and the experts'."""
        yield from super().problems(key)
        k = prefix(key)
        if self.q_lora_rank is not None:
            yield from at_least(f"{k}q_lora_rank", self.q_lora_rank, 1)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "moe_intermediate_size",
                     "n_group", "topk_group"):
            yield from at_least(f"{k}{name}", getattr(self, name), 1)
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            yield (f"{k}qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and >= 2: rotary embeddings rotate "
                   "pairs of features")
        yield from at_least(f"{k}n_shared_experts", self.n_shared_experts, 0)
        yield from positive(f"{k}routed_scaling_factor", self.routed_scaling_factor)
        yield from at_least(f"{k}bias_update_speed", self.bias_update_speed, 0)
        yield from at_least(f"{k}aux_loss_alpha", self.aux_loss_alpha, 0)
        yield from self._routing_problems(k)
        yield from at_least(f"{k}num_nextn_predict_layers", self.num_nextn_predict_layers, 0)
        yield from at_least(f"{k}mtp_loss_scaling_factor", self.mtp_loss_scaling_factor, 0)
        if self.num_hidden_layers >= 1 and not 0 <= self.first_k_dense_replace < self.num_hidden_layers:
            yield (f"{k}first_k_dense_replace ({self.first_k_dense_replace}) must be in [0, {k}num_hidden_layers) "
                   f"= [0, {self.num_hidden_layers}): at least the last layer is a mixture of experts")

    def _routing_problems(self, k: str) -> Iterator[str]:
        experts, groups = self.n_routed_experts, self.n_group
        if experts < 1 or groups < 1:
            return
        if experts % groups or experts // groups < 2:
            yield (f"{k}n_group ({groups}) must divide {k}n_routed_experts ({experts}) into groups of at least 2 "
                   "experts: a group scores by the sum of its two best experts; set n_group: 1 to route without "
                   "groups")
        elif not 1 <= self.topk_group <= groups:
            yield (f"{k}topk_group ({self.topk_group}) must be in [1, {k}n_group] = [1, {groups}]: tokens choose "
                   "their experts within that many groups")
        elif not 1 <= self.num_experts_per_tok <= self.topk_group * experts // groups:
            yield (f"{k}num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, topk_group * "
                   f"n_routed_experts / n_group] = [1, {self.topk_group * experts // groups}]: each token goes to "
                   "that many distinct experts of its chosen groups")

    def layout_problems(self, tp: int, *, key: str | None = MODEL_CONFIG_KEY, tp_key: str = "parallelism.tp",
                        **sequence) -> list[str]:
        """Llama's shape rules (heads split over TP), and the experts' widths split over TP."""
        problems = super().layout_problems(tp, key=key, tp_key=tp_key, **sequence)
        k = prefix(key)
        widths = [("moe_intermediate_size", self.moe_intermediate_size)]
        if self.n_shared_experts > 0:
            widths.append(("n_shared_experts * moe_intermediate_size",
                           self.n_shared_experts * self.moe_intermediate_size))
        for name, width in widths:
            if tp >= 1 and width >= 1 and width % tp:
                problems.append(f"{k}{name} ({width}) must be divisible by {tp_key} ({tp}): each expert's "
                                "feed-forward width is split over TP ranks")
        return problems

    def _head_size_problems(self, k: str) -> list[str]:
        """The head sizes are their own keys (``problems`` checks them), free of ``hidden_size``."""
        return []
