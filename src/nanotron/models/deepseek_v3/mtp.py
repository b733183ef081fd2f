"""DeepSeek-V3's multi-token prediction (MTP, the paper's section 2.2): ``num_nextn_predict_layers`` = D modules
beside the LM head, the k-th (k = 1..D, ``mtp.{k-1}``) predicting token i + k + 1 at every position i.

Module k takes the previous depth's hidden state ``h^{k-1}_i`` (``h^0``: the main model's last hidden state, before
its final norm) and the embedding of token i + k (the shared ``embed_tokens``):

    h'_i = eh_proj([hnorm(h^{k-1}_i); enorm(embed(t_{i+k}))])     (a linear of 2 * hidden -> hidden)
    h^k  = layer(h')                                                (one decoder layer of the family)
    logits^k = lm_head(norm(h^k))                                   (its own final norm, the shared head)

The decoder layer is the family's at index ``num_hidden_layers + k - 1`` (latent attention, and experts where
``is_moe_layer`` says: as DeepSeek's released checkpoint has them); its attention sees the same positions, masks and
rotary tables as the main model's layers. The module is pure like the model: it holds a reference to the model's
``embed_tokens`` (on a pipeline's last stage, the stage's copy of it), and tensor parallelism swaps its parts by the
family's plan. Each forward leaves the depths' outputs in ``record`` (logits, or the final norms' outputs where the
loss applies the head itself), for the family's step term (``objective.py``'s ``MultiTokenPredictionLoss``).
Generation does not run these modules: only training hands the model the tokens ahead.
"""

from __future__ import annotations

import torch
from torch import nn

from nanotron.config.deepseek_v3 import DeepseekV3Config
from nanotron.models.init import constant
from nanotron.models.llama.model import LlamaDecoderLayer
from nanotron.models.moe.model import moe_init_rule
from nanotron.models.spec import Initializer
from nanotron.nn.attention import AttentionMasks
from nanotron.nn.linear import Linear
from nanotron.nn.rmsnorm import RMSNorm


class PredictionDepth(nn.Module):
    """One MTP module: the two input norms, the projection of their concatenation, a decoder layer and the final
    norm before the shared head (DeepSeek's ``enorm``, ``hnorm``, ``eh_proj``, the layer, ``shared_head.norm``)."""

    def __init__(self, config: DeepseekV3Config, layer: LlamaDecoderLayer):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.layer = layer
        self.norm = RMSNorm(hidden, eps)

    def forward(self, previous: torch.Tensor, embedded: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                masks: AttentionMasks) -> torch.Tensor:
        """This depth's hidden state ``h^k`` (before its final norm) from ``h^{k-1}`` and the embedded tokens ahead."""
        combined = self.eh_proj(torch.cat([self.hnorm(previous), self.enorm(embedded)], dim=-1))
        return self.layer(combined, rotary, masks.for_window(self.layer.attn.window))


class MultiTokenPrediction(nn.Module):
    """The D prediction depths in order (``depths``, keyed ``"0"``..), the shared embedding, and the last forward's
    outputs (``record``)."""

    def __init__(self, depths: list[PredictionDepth], embed_tokens: nn.Module):
        super().__init__()
        self.depths = nn.ModuleDict({str(index): depth for index, depth in enumerate(depths)})
        self.embed_tokens = embed_tokens
        self.record: list[torch.Tensor] | None = None

    def forward(self, hidden_states: torch.Tensor, ahead_ids: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                masks: AttentionMasks, lm_head: nn.Module | None) -> None:
        """Run every depth from the main model's last hidden states ``hidden_states`` and ``ahead_ids`` [batch, seq,
        D] (depth k's input at position i is token i + k; any id where that is past the sequence), and record each
        depth's final norm's output, through ``lm_head`` where one is given."""
        outputs = []
        for index, depth in self.depths.items():
            hidden_states = depth(hidden_states, self.embed_tokens(ahead_ids[..., int(index)]), rotary, masks)
            normed = depth.norm(hidden_states)
            outputs.append(normed if lm_head is None else lm_head(normed))
        self.record = outputs

    def take_record(self) -> list[torch.Tensor]:
        """The last forward's outputs, once (the step term reads them after each micro-batch's forward)."""
        record, self.record = self.record, None
        if record is None:
            raise RuntimeError("the multi-token prediction modules did not run in this forward: the batch carries no "
                               "tokens ahead (MultiTokenBatches)")
        return record


def deepseek_v3_init_rule(name: str, config: DeepseekV3Config, std: float) -> Initializer:
    """LlaMoE's rules (the latents' norms start at one like every layernorm), and the prediction modules' norms
    (``mtp.depths.k.enorm``, ``hnorm``, ``norm``) start at one too."""
    if name.startswith("mtp.") and name.endswith("norm.weight"):
        return constant(1.0)
    return moe_init_rule(name, config, std)
