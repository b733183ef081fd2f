"""DeepSeek-V3's auxiliary-loss-free balancing: after every optimizer step, each mixture-of-experts block's
``expert_bias`` (added to the router's sigmoid scores to choose experts, never to weigh them) moves by
``bias_update_speed`` towards balance: ``bias += speed * sign(mean load - load)`` over the layer's experts.

The load is the step's global one: the router step term's ``moe_tokens_per_expert`` statistic, the assignments of
every token of the global batch, which the step's statistics reduction already sums over the micro-batches, the
ranks that see the tokens (data, context and expert parallel; tensor-parallel ranks route the same tokens and count
once) and the pipeline stages (each fills its layers' rows). Every rank reads the same sums, so every rank writes the
same bias, with no collective of its own. A skipped (bad) step leaves the bias. The bias is a persistent buffer:
checkpoints store it as a logical tensor and a resume reads it back.
"""

from __future__ import annotations

import torch

from nanotron.config.moe import MoESettings
from nanotron.models.moe.model import decoder_layers
from nanotron.parallel.statistics import Statistics
from nanotron.training.hooks import Feature, Run


class ExpertBalance(Feature):
    def __init__(self, settings: MoESettings):
        self.settings = settings
        self.blocks: dict[int, torch.nn.Module] = {}  # this stage's biased blocks by their row in the statistics

    def start(self, run: Run) -> None:
        rows = {index: row for row, index in enumerate(self.settings.layers)}
        self.blocks = {rows[index]: layer.mlp for index, layer in decoder_layers(run.model)
                       if getattr(layer.mlp, "expert_bias", None) is not None}

    def after_step(self, step: int, statistics: Statistics, skipped: bool) -> None:
        if skipped:
            return
        load = statistics["moe_tokens_per_expert"]
        with torch.no_grad():
            for row, block in self.blocks.items():
                layer = load[row].to(block.expert_bias)
                block.expert_bias += self.settings.bias_update_speed * torch.sign(layer.mean() - layer)
