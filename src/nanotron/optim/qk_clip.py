"""QK-clip (Kimi K2's MuonClip): after each Muon step, the query and key rows of every attention head whose largest
logit went past a threshold are scaled down so that, on the step's batch, it would have been the threshold.

With ``S_h`` the largest pre-softmax logit of query head ``h`` over the step's batch (``q . k / sqrt(head_dim)``
where the mask allows, ``nn/max_logits.py``; the maximum over the micro-batches and the data- and context-parallel
ranks) and ``tau`` = ``optimizer.muon_qk_clip_threshold``, a head with ``S_h > tau`` takes ``gamma_h = tau / S_h``:

- multi-head attention (one key head per query head): its query rows and its key rows each times ``sqrt(gamma_h)``;
- grouped-query attention (a key head shared by several query heads): its query rows times ``gamma_h``, the shared
  key untouched, so that every head's logits shrink by exactly its own ``gamma_h`` and the other heads of the group
  keep theirs.

Rows are those of the fused q|k|v projection and of its bias where the family has one (Qwen2's ``attention_bias``):
``q = W x + b`` scales with both. Multi-head latent attention (DeepSeek-V3) follows Kimi's rule for it: each head's
query and key parts without RoPE (the rows of ``q_b_proj`` or ``q_proj``, and of ``kv_b_proj``) times
``sqrt(gamma_h)``, its rotary query part times ``gamma_h``, and the rotary key, shared by all heads, untouched.

The rescale applies to the optimizer's fp32 masters of this rank's shard (ZeRO), then the weights take them, so a
tensor-parallel rank scales its own heads and nothing is gathered for it. The
statistic is recorded during the step's forwards and consumed by the step; nothing is added to checkpoints (a
resume starts the next step's statistic afresh, as every step does). A step skipped as bad (``divergence.py``) takes
no update and leaves its maxima to count towards the next step's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nanotron.layout import Group
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.placement import get_placement
from nanotron.parallel.statistics import max_over_ranks


def head_factors(maxima: torch.Tensor, threshold: float) -> torch.Tensor:
    """``gamma`` per head: ``threshold / maximum`` where the maximum is past the threshold, else 1."""
    return torch.where(maxima > threshold, threshold / maxima, torch.ones_like(maxima))


def qkv_row_factors(gamma: torch.Tensor, widths: tuple[int, int, int], head_dim: int,
                    shared_keys: bool) -> torch.Tensor:
    """The factor of every row of a fused q|k|v projection (chunk ``widths``, this rank's) for the clip factors
    ``gamma`` of its query heads: the rule of the module docstring (``shared_keys``: grouped-query attention)."""
    _, kv_width, v_width = widths
    if shared_keys:
        query, key = gamma, gamma.new_ones(kv_width // head_dim)
    else:
        query = key = gamma.sqrt()
    return torch.cat([query.repeat_interleave(head_dim), key.repeat_interleave(head_dim), gamma.new_ones(v_width)])


def _per_head(factors: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Rows of heads laid one after the other, each made of parts: (factor per head, rows of the part)."""
    return torch.cat([factor[:, None].expand(-1, rows) for factor, rows in factors], dim=1).reshape(-1)


def block_row_factors(block: nn.Module, gamma: torch.Tensor, shared_keys: bool) -> dict[nn.Parameter, torch.Tensor]:
    """The factors of the rows of attention ``block``'s parameters that carry its heads' queries and keys, for the
    clip factors ``gamma`` of its (local) query heads."""
    if is_latent(block):  # q|k_nope by sqrt(gamma), q_rope by gamma; the shared rope key: 1
        query, root = _latent_queries(block), gamma.sqrt()
        return {query.weight: _per_head([(root, block.nope), (gamma, block.rope)]),
                block.kv_b_proj.weight: _per_head([(root, block.nope), (torch.ones_like(gamma), block.v_dim)])}
    projection = block.qkv_proj
    rows = qkv_row_factors(gamma, projection.output_chunks, block.head_dim, shared_keys)
    return {param: rows for param in (projection.weight, projection.bias) if param is not None}


def local_heads(block: nn.Module) -> int:
    """The query heads of attention ``block`` on this rank."""
    query = _latent_queries(block) if is_latent(block) else block.qkv_proj
    return query.output_chunks[0] // block.head_dim


def is_latent(block: nn.Module) -> bool:
    """Multi-head latent attention (DeepSeek-V3's ``LatentAttention``), told by its key/value up projection: the
    optimizer sits below the model families and does not import them."""
    return hasattr(block, "kv_b_proj")


def _latent_queries(block: nn.Module) -> nn.Module:
    return block.q_proj if block.q_proj is not None else block.q_b_proj


class QKClip:
    """The attention blocks of this rank's stage, whose cores record their heads' maxima (``LogitMaxima``, put there
    by ``record_max_logits``), and the factors of their query and key rows after a step (``row_factors``)."""

    def __init__(self, model: nn.Module, threshold: float, pc: ParallelContext):
        self.threshold, self.pc = threshold, pc
        config = model.config
        self.shared_keys = config.num_key_value_heads != config.num_attention_heads
        self.blocks = [layer.attn for layer in model.layers.values()]
        self.step_maxima: torch.Tensor | None = None  # the last step's, over the replicas

    def row_factors(self) -> dict[str, torch.Tensor]:
        """Per logical parameter name (q|k|v weights and biases of this rank), the factor of each of its local rows;
        a collective over the data-, context- and expert-parallel replicas, which starts every core's record
        afresh."""
        heads = [local_heads(block) for block in self.blocks]
        maxima = torch.cat([block.core.take(count, self.pc.device) for block, count in zip(self.blocks, heads)])
        self.step_maxima = maxima = max_over_ranks(maxima, self.pc, (Group.DENSE_REPLICAS,))
        gamma = head_factors(maxima, self.threshold)
        factors = {}
        for block, block_gamma in zip(self.blocks, gamma.split(heads)):
            for param, rows in block_row_factors(block, block_gamma, self.shared_keys).items():
                factors[get_placement(param).name] = rows
        return factors

    def metrics(self) -> dict:
        """metrics.jsonl fields of the step just taken: ``qk_clip_max_logit``, the largest logit of any head (before
        the clip), and ``qk_clip_heads``, the heads clipped; a collective over every rank, which waits for the step."""
        largest = self.step_maxima.max().reshape(1)
        clipped = (self.step_maxima > self.threshold).sum().reshape(1)
        if self.pc.world_size > 1:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
            dist.all_reduce(clipped)
        # every data-, context- and expert-parallel replica holds the same heads and counted them
        return {"qk_clip_max_logit": largest.item(),
                "qk_clip_heads": clipped.item() // self.pc.size(Group.DENSE_REPLICAS)}

