"""Held-out loss and perplexity of a checkpoint, per dataset folder (domain), at any tp/pp layout.

Each folder is read in order, window after window (the same windows of ``sequence_length + 1`` tokens as in
training, without shuffling), so the same folder always gives the same number. Evaluate on folders that training
did not see (e.g. a validation split preprocessed separately). The loss is the mean over all target tokens;
perplexity is its exponential.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from nanotron.data.dataset import TokenShards
from nanotron.generation.generate import forward_logits, load_model
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.cross_entropy import vocab_parallel_token_losses


@torch.no_grad()
def evaluate(ckpt_path: Path, folders: list[Path], parallel_context: ParallelContext, sequence_length: int,
             max_windows: int, batch_size: int) -> dict[str, dict[str, float]]:
    pc = parallel_context
    model, _ = load_model(ckpt_path, pc)
    vocab = model.config.vocab_size
    results = {}
    for folder in folders:
        shards = TokenShards(Path(folder))
        windows = min(max_windows, (shards.num_tokens - 1) // sequence_length)
        total, count = torch.zeros((), dtype=torch.float64, device=pc.device), 0
        for start in range(0, windows, batch_size):
            rows = [shards.read(i * sequence_length, sequence_length + 1) for i in range(start, min(start + batch_size, windows))]
            tokens = torch.as_tensor(np.stack(rows), device=pc.device)
            logits = forward_logits(model, pc, tokens[:, :-1], None, None, None, last_only=False, gather=False)
            if pc.is_last_stage:
                total += vocab_parallel_token_losses(logits, tokens[:, 1:], pc.groups["tp"], vocab).double().sum()
            count += tokens[:, 1:].numel()
        if pc.size("pp") > 1:
            dist.broadcast(total, src=pc.group_ranks["pp"][-1], group=pc.groups["pp"])
        loss = total.item() / max(count, 1)
        results[shards.name] = {"loss": loss, "perplexity": math.exp(loss), "tokens": count}
    return results
