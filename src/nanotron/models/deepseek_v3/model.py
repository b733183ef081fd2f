"""DeepSeek-V3: Llama's decoder with multi-head latent attention (MLA) in every layer and, from
``first_k_dense_replace`` on, LlaMoE's mixture-of-experts block with DeepSeek's routing (sigmoid scores, the
balancing bias, expert groups, shared experts: ``models/moe``).

MLA (``LatentAttention``), per token:

- queries: ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` through a ``q_lora_rank`` latent, or ``q_proj(x)`` without one;
  each head's query is ``qk_nope_head_dim`` features without RoPE, then ``qk_rope_head_dim`` with it;
- keys and values: ``kv_a_proj_with_mqa(x)`` is a ``kv_lora_rank`` latent and one key of ``qk_rope_head_dim`` that
  every head shares; ``kv_b_proj(kv_a_layernorm(latent))`` gives each head its key's no-RoPE part and its value
  (``v_head_dim``);
- the RoPE parts are rotated (the tables of ``qk_rope_head_dim``, YaRN-scaled where the config says so), each head's
  key is its no-RoPE part beside the shared rotated key, and attention runs through the attention core (so every
  backend, document masking and context parallelism apply) with the softmax scale ``qk_head_dim^-1/2`` times
  YaRN's ``mscale(factor, mscale_all_dim)^2`` (the queries are multiplied by the second factor, the kernels apply
  the first).

Weights keep transformers' layout (each head's rows side by side in ``q_b_proj`` and ``kv_b_proj``); with
``rope_interleave`` the rotary features rotate adjacent pairs (DeepSeek's layout; transformers computes it the same
way, the even features then the odd ones rotated as halves), else the two halves. The shared
key passes through ``shared_key``, a seam that tensor parallelism fills with its collective (every rank's heads use
the one key).

Generation caches what MLA compresses (``LatentCache``): per position the kv latent after its norm and the rotated
shared key, ``kv_lora_rank + qk_rope_head_dim`` values, not every head's decompressed key and value
(``heads * (qk_head_dim + v_head_dim)``), and attends over the latents with ``kv_b_proj`` absorbed into the queries
and the output (``LatentAttention.attend_latents``), as DeepSeek's inference does.
"""

from __future__ import annotations

import torch
from torch import nn

from nanotron.config.deepseek_v3 import DeepseekV3Config
from nanotron.models.deepseek_v3.mtp import MultiTokenPrediction, PredictionDepth
from nanotron.models.llama.model import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from nanotron.models.moe.model import MoEFeedForward
from nanotron.nn.attention import AttentionCore, AttentionMasks, BlockMask
from nanotron.nn.linear import Linear
from nanotron.nn.rmsnorm import RMSNorm
from nanotron.nn.rotary import RotaryEmbedding, apply_rotary, yarn_mscale

LATENT_NORM_EPS = 1e-6  # the latents' RMSNorms take DeepSeek's (and transformers') default, not rms_norm_eps


def softmax_scale_factor(config: DeepseekV3Config) -> float:
    """What DeepSeek multiplies the softmax scale ``qk_head_dim^-1/2`` by: YaRN's mscale for ``mscale_all_dim``,
    squared (1 without YaRN or without that key)."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "yarn" or not scaling["mscale_all_dim"]:
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


class LatentCache:
    """MLA's inference cache for one layer: per position seen so far, the kv latent after ``kv_a_layernorm``
    [batch, positions, kv_lora_rank] and the rotated key every head shares [batch, positions, qk_rope_head_dim].
    The cache is the size of the latents whatever the heads (on every tensor-parallel rank: the latents are
    replicated)."""

    def __init__(self):
        self.latent: torch.Tensor | None = None
        self.rotary_key: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """The positions held."""
        return 0 if self.latent is None else self.latent.shape[1]

    def append(self, latent: torch.Tensor, rotary_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new positions' latents and rotated keys after those held; returns every position's."""
        if self.latent is not None:
            latent, rotary_key = torch.cat([self.latent, latent], dim=1), torch.cat([self.rotary_key, rotary_key], 1)
        self.latent, self.rotary_key = latent, rotary_key
        return latent, rotary_key


class SharedKey(nn.Module):
    """The rotary key every head shares, as it is on one process; tensor parallelism swaps this seam for the module
    that makes it the whole sequence's and sums its gradient over the ranks' heads."""

    def forward(self, key: torch.Tensor) -> torch.Tensor:
        return key


class LatentAttention(nn.Module):
    """Multi-head latent attention (see the module's docstring); heads are counted from the query projection's
    (possibly sharded) width, so tensor parallelism may split them."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        heads, hidden = config.num_attention_heads, config.hidden_size
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.head_dim, self.kv_lora_rank, self.window = self.nope + self.rope, config.kv_lora_rank, None
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if config.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * self.head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(config.q_lora_rank, heads * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, heads * (self.nope + self.v_dim), bias=False)
        self.shared_key = SharedKey()
        self.core = AttentionCore()
        self.o_proj = Linear(heads * self.v_dim, hidden, bias=False)
        self.query_scale, self.interleaved = softmax_scale_factor(config), config.rope_interleave

    def queries(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(hidden_states)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))

    def forward(self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | BlockMask | None = None, kv_cache: LatentCache | None = None) -> torch.Tensor:
        """As ``LlamaAttention.forward``: ``rotary`` holds the tables of ``qk_rope_head_dim``, and ``kv_cache`` the
        latents and rotated shared keys of earlier positions (then attention runs over the latents)."""
        q = self.queries(hidden_states)
        batch, seq, _ = q.shape
        heads = q.shape[-1] // self.head_dim
        q_nope, q_rope = q.view(batch, seq, heads, self.head_dim).transpose(1, 2).split([self.nope, self.rope], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.rope], -1)
        latent, k_rope = self.kv_a_layernorm(latent), self.shared_key(k_rope)  # k_rope: [batch, seq, rope]
        cos, sin = (table[..., :seq, :].to(q.dtype) for table in rotary)
        if self.interleaved:  # adjacent features pair up: the even ones, then the odd ones, rotate as halves
            q_rope, k_rope = (torch.cat([x[..., 0::2], x[..., 1::2]], -1) for x in (q_rope, k_rope))
        q = torch.cat([q_nope, apply_rotary(q_rope, cos, sin)], -1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin).squeeze(1)
        if kv_cache is None:
            out = self.attend_decompressed(q, latent, k_rope, mask)
        else:
            out = self.attend_latents(q, *kv_cache.append(latent, k_rope), mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, heads * self.v_dim))

    def attend_decompressed(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                            mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
        """Training's form: every head's key (its no-RoPE part beside the shared rotary key) and value decompressed
        from the latents by ``kv_b_proj``, then the attention core; [batch, heads, queries, v_head_dim]."""
        batch, heads = q.shape[:2]
        kv = self.kv_b_proj(latent).view(batch, -1, heads, self.nope + self.v_dim)  # gathered in sequence-parallel mode
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], -1)
        k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, heads, -1, -1)], -1)
        return self.core(q, k, v.contiguous(), mask)

    def attend_latents(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                       mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
        """DeepSeek's absorbed form, for generation: nothing is decompressed. Each head's key rows of ``kv_b_proj``
        (``W_k``) fold into its query, since ``q_nope · (W_k c) = (q_nope W_k) · c``, and its value rows (``W_v``)
        apply after attention, since the weighted sum of ``W_v c`` is ``W_v`` times the weighted sum of ``c``; the
        latents ``c`` beside the rotary keys are then one key every head shares, and the latents its value
        (multi-query attention over ``kv_lora_rank + qk_rope_head_dim`` features). The scores and the output are
        the decompressed form's, up to rounding; [batch, heads, queries, v_head_dim]."""
        heads = q.shape[1]
        latent, weight, _ = self.kv_b_proj.operands(latent)  # this rank's heads' rows under tensor parallelism
        w_k, w_v = weight.view(heads, self.nope + self.v_dim, self.kv_lora_rank).split([self.nope, self.v_dim], 1)
        q_nope, q_rope = q.split([self.nope, self.rope], -1)
        q = torch.cat([q_nope @ w_k, q_rope], -1)
        q = q * (q.shape[-1] / self.head_dim) ** 0.5  # the core scales by its keys' width^-1/2, not qk_head_dim's
        out = self.core(q, torch.cat([latent, k_rope], -1).unsqueeze(1), latent.unsqueeze(1), mask)
        return out @ w_v.transpose(1, 2)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """Llama with ``LatentAttention`` in every layer, rotary tables of ``qk_rope_head_dim``, and DeepSeek's
    mixture-of-experts blocks from ``first_k_dense_replace`` on; with ``num_nextn_predict_layers``, the multi-token
    prediction modules beside the head (``mtp``, ``mtp.py``; None without them, and on pipeline stages without the
    head)."""

    def __init__(self, config: DeepseekV3Config, padded_vocab_size: int):
        super().__init__(config, padded_vocab_size)
        self.rotary = RotaryEmbedding(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)
        self.mtp: MultiTokenPrediction | None = None
        if config.num_nextn_predict_layers:
            first = config.num_hidden_layers
            depths = [PredictionDepth(config, LlamaDecoderLayer(config, self.attention(config, index),
                                                                self.feed_forward(config, index)))
                      for index in range(first, first + config.num_nextn_predict_layers)]
            self.mtp = MultiTokenPrediction(depths, self.embed_tokens)

    def tie_weights(self) -> None:
        """Llama's, and the prediction modules read the model's embedding (again after tensor parallelism swapped
        it)."""
        super().tie_weights()
        mtp = getattr(self, "mtp", None)  # Llama's constructor ties before this one adds the modules
        if mtp is not None and self.embed_tokens is not None:
            mtp.embed_tokens = self.embed_tokens

    head_modules = ("norm", "lm_head", "mtp")  # what a pipeline's last stage holds besides its layers

    def layers_beside_head(self) -> list[tuple[int, LlamaDecoderLayer]]:
        """The prediction modules' decoder layers by their global index (``num_hidden_layers`` on), where this
        module holds them."""
        if self.mtp is None:
            return []
        return [(self.config.num_hidden_layers + int(index), depth.layer) for index, depth in self.mtp.depths.items()]

    def forward(self, input_ids: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                caches: dict[str, LatentCache] | None = None, head: bool = True,
                document_ids: torch.Tensor | None = None, masks: AttentionMasks | None = None,
                ahead_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Llama's forward; where this module holds the prediction modules and is handed ``ahead_ids`` (training's
        tokens ahead, ``MultiTokenBatches``), they run on the last hidden states and record their outputs."""
        hidden_states, rotary, masks = self.decode(input_ids, hidden_states, position_ids, attention_mask, caches,
                                                   document_ids, masks)
        if self.mtp is not None and ahead_ids is not None:
            self.mtp(hidden_states, ahead_ids, rotary, masks, self.lm_head if head else None)
        return self.finish(hidden_states, head)

    @staticmethod
    def attention(config: DeepseekV3Config, index: int) -> LatentAttention:
        return LatentAttention(config)

    @staticmethod
    def feed_forward(config: DeepseekV3Config, index: int) -> nn.Module:
        return MoEFeedForward(config) if config.is_moe_layer(index) else LlamaMLP(config)

