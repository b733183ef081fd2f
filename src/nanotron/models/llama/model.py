"""Llama as a pure PyTorch model: no collectives, no knowledge of the process grid.

Parallelism is applied from outside (``nanotron.parallel``): tensor parallelism swaps the linear layers for
sharded ones, and pipeline parallelism deletes the parts a stage does not own (``embed_tokens``, ``norm``,
``lm_head`` become ``None`` and layers are removed from ``layers``, which is keyed by the global layer index so that
parameter names never depend on the layout). To stay layout-agnostic, attention takes its numbers of local heads
from the chunk widths its (possibly sharded) fused projection reports (``output_chunks``): whole heads split over
tensor-parallel ranks, or a kv head replicated over the ranks that share it.

The rotary cos/sin tables are computed once per forward, outside the decoder layers, and handed to each of them:
inside a compiled layer the compiler would otherwise fuse the trigonometry into the rotation and recompute it for
every batch row and head (docs/benchmarks.md, "Where the step time went"). The attention masks are built
there too, once per forward and window (``nn/attention.py``), so that compiled layers receive them ready.
"""

from __future__ import annotations

import torch
from torch import nn

from nanotron.config import LlamaConfig
from nanotron.models.init import constant, normal
from nanotron.models.spec import Initializer, tie_embeddings
from nanotron.nn.attention import AttentionCore, AttentionMasks, BlockMask
from nanotron.nn.glu import glu
from nanotron.nn.linear import Linear
from nanotron.nn.rmsnorm import RMSNorm
from nanotron.nn.rotary import RotaryEmbedding, apply_rotary


class KVCache:
    """Keys and values of the positions seen so far, for one attention layer: [batch, kv_heads, positions, head_dim]."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """The positions held."""
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class LlamaAttention(nn.Module):
    """Causal self-attention with grouped-query heads and a fused q|k|v projection (biased with
    ``attention_bias``, as in Qwen2); ``window`` positions (the query's own included) on sliding layers. The softmax
    attention itself is the ``core`` child, which parallel mechanisms may swap (context parallelism)."""

    def __init__(self, config: LlamaConfig, window: int | None = None):
        super().__init__()
        self.head_dim = config.head_dim
        self.window = window
        q_width, kv_width = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_width + 2 * kv_width, bias=config.attention_bias,
                               chunks=(q_width, kv_width, kv_width))
        self.core = AttentionCore()
        self.o_proj = Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | BlockMask | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Attention where ``mask`` allows: this layer's ``AttentionMasks.for_window(self.window)`` (None: plain
        causal). ``rotary`` holds the fp32 cos and sin tables ([..., positions, head_dim], at least as many positions
        as the sequence; the first ones are used), and ``kv_cache`` the keys and values of earlier positions
        (generation)."""
        qkv = self.qkv_proj(hidden_states)
        batch, seq, _ = qkv.shape
        widths = self.qkv_proj.output_chunks
        q_heads, kv_heads = widths[0] // self.head_dim, widths[1] // self.head_dim
        q, k, v = qkv.split(list(widths), dim=-1)
        v = v.contiguous()  # attention keeps v for its backward: as a view it would keep all of q|k|v alive
        q = q.view(batch, seq, q_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, kv_heads, self.head_dim).transpose(1, 2)

        q, k = self.encode_positions(q, k, rotary)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
        out = self.core(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, q_heads * self.head_dim))

    def encode_positions(self, q: torch.Tensor, k: torch.Tensor,
                         rotary: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys [batch, heads, positions, head_dim] rotated by RoPE; variants override this."""
        cos, sin = (table[..., :q.shape[2], :].to(q.dtype) for table in rotary)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class LlamaMLP(nn.Module):
    """Gated feed-forward ``down(act(gate) * up)`` with a fused gate|up projection; ``act`` is the config's
    ``hidden_act`` (silu: SwiGLU)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.activation = config.hidden_act
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.gate_up_proj(x), self.activation))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward blocks with residual connections; ``attn`` is a ``LlamaAttention`` (or a
    variant of it), ``mlp`` any module mapping hidden states to hidden states (a dense SwiGLU, or a mixture of
    experts)."""

    def __init__(self, config: LlamaConfig, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | BlockMask | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        attended = self.attn(self.input_layernorm(hidden_states), rotary, mask, kv_cache)
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaForCausalLM(nn.Module):
    """Token embedding, decoder layers, final norm and LM head; returns logits over the padded vocabulary.
    ``flash_attention``: attention runs FlashAttention-4 where it expresses the mask (``model.attention_backend``,
    set when the model is built)."""

    flash_attention = False

    def __init__(self, config: LlamaConfig, padded_vocab_size: int):
        super().__init__()
        self.config = config
        self.padded_vocab_size = padded_vocab_size
        self.embed_tokens: nn.Embedding | None = nn.Embedding(padded_vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(config, self.attention(config, i),
                                                               self.feed_forward(config, i))
                                     for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: Linear | None = Linear(config.hidden_size, padded_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.tie_weights()

    @staticmethod
    def attention(config: LlamaConfig, index: int) -> nn.Module:
        """The attention block of layer ``index``; variants of the architecture override this."""
        return LlamaAttention(config)

    @staticmethod
    def feed_forward(config: LlamaConfig, index: int) -> nn.Module:
        """The feed-forward block of layer ``index``; variants of the architecture override this."""
        return LlamaMLP(config)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head. Call again after ``to_empty``, which breaks sharing."""
        tie_embeddings(self)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        caches: dict[str, KVCache] | None = None,
        head: bool = True,
        document_ids: torch.Tensor | None = None,
        masks: AttentionMasks | None = None,
    ) -> torch.Tensor:
        """Run the parts this module holds: ids -> hidden states -> logits, or any contiguous piece of that;
        ``head=False`` stops before the LM head (see ``CausalLM.forward``).

        ``caches`` maps layer indices to their KV caches during generation, where ``attention_mask`` [batch, 1,
        queries, keys] hides the padding keys. ``document_ids`` [batch, seq] (document masking) keep each token's
        attention inside its document, and ``position_ids`` [batch, seq] then restart in each. Without
        ``position_ids`` the sequence starts at position 0 and its tables are computed once per length
        (``RotaryEmbedding.first_positions``). Its length is the ids': a later pipeline stage, whose hidden states
        sequence parallelism may split, is handed the ids for it; without them its tables cover
        ``max_position_embeddings`` positions and each layer takes the first ones it needs, and its attention masks
        cover the hidden states' length (which is then the whole sequence's). ``masks`` replaces the masks built
        from the sequence: a rank holding parts of a sequence (context parallelism) states where its queries and keys
        sit in it.
        """
        hidden_states, _, _ = self.decode(input_ids, hidden_states, position_ids, attention_mask, caches,
                                          document_ids, masks)
        return self.finish(hidden_states, head)

    def decode(self, input_ids: torch.Tensor | None, hidden_states: torch.Tensor | None,
               position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
               caches: dict[str, KVCache] | None, document_ids: torch.Tensor | None, masks: AttentionMasks | None,
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], AttentionMasks]:
        """``forward`` up to the final norm: the hidden states after this module's decoder layers, with the rotary
        tables and the attention masks they used (modules beside the head reuse them)."""
        if position_ids is None:
            length = input_ids.shape[1] if input_ids is not None else max(
                self.config.max_position_embeddings, hidden_states.shape[1])
            device = input_ids.device if input_ids is not None else hidden_states.device
            rotary = self.rotary.first_positions(length, device)
        else:
            rotary = self.rotary(position_ids)
        if masks is None:
            tokens = input_ids if input_ids is not None else hidden_states
            past = next(iter(caches.values())).length if caches else 0
            masks = AttentionMasks.of_sequence(tokens.shape[1], tokens.device, past, document_ids, attention_mask,
                                               self.flash_attention)
        if self.embed_tokens is not None:
            hidden_states = self.embed_tokens(input_ids)
        for index, layer in self.layers.items():
            cache = caches[index] if caches is not None else None
            hidden_states = layer(hidden_states, rotary, masks.for_window(layer.attn.window), cache)
        return hidden_states, rotary, masks

    def finish(self, hidden_states: torch.Tensor, head: bool = True) -> torch.Tensor:
        """The final norm and, with ``head``, the LM head, where this module holds them."""
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        if self.lm_head is not None and head:
            hidden_states = self.lm_head(hidden_states)
        return hidden_states


def llama_init_rule(name: str, config: LlamaConfig, std: float) -> Initializer:
    """Norm weights start at one, biases at zero, matrices normal(0, std). Residual output projections are scaled
    by 1/sqrt(2 * num_layers) (GPT-2 style) so that the residual stream's variance does not grow with depth."""
    if name.endswith("layernorm.weight") or name == "norm.weight":
        return constant(1.0)
    if name.endswith(".bias"):
        return constant(0.0)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return normal(std / (2 * config.num_hidden_layers) ** 0.5)
    return normal(std)


