"""Held-out loss and perplexity of a checkpoint, per dataset folder (domain), at any tp/pp layout.

Each folder is read in order, window after window (the same windows of ``sequence_length + 1`` tokens as in
training, without shuffling), so the same folder always gives the same number. Evaluate on folders that training
did not see (e.g. a validation split preprocessed separately). The loss is the mean over all target tokens;
perplexity is its exponential. A folder shorter than one window is an error, not a loss of 0.

Attention is plain causal attention over each window, whatever the checkpoint was trained with: for a model trained
with document masking (``_use_doc_masking: true``) the loss is still the plain causal one, comparable with
``transformers``' on the same windows.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from nanotron.config import ConfigError
from nanotron.data.dataset import DataError, TokenShards, unique_domain_names
from nanotron.generation.generate import forward_logits, load_model
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.cross_entropy import vocab_parallel_token_losses


def evaluation_windows(folders: list[Path], sequence_length: int, max_windows: int,
                       batch_size: int) -> list[tuple[TokenShards, int]]:
    """Each folder's shards and the number of windows read from it; a folder shorter than one window is refused,
    since its loss would be a mean over no tokens."""
    if min(sequence_length, max_windows, batch_size) < 1:
        raise ConfigError(f"--sequence-length ({sequence_length}), --max-windows ({max_windows}) and --batch-size "
                          f"({batch_size}) must all be at least 1")
    sources = []
    for folder in folders:
        shards = TokenShards(Path(folder))
        windows = min(max_windows, (shards.num_tokens - 1) // sequence_length)
        if windows < 1:
            fix = f"pass --sequence-length {shards.num_tokens - 1} or less, or " if shards.num_tokens > 1 else ""
            raise DataError(f"{folder} holds {shards.num_tokens} tokens, fewer than one evaluation window "
                            f"(--sequence-length {sequence_length} + 1 tokens), so it has no loss to report; {fix}"
                            "evaluate more data")
        sources.append((shards, windows))
    return sources


@torch.no_grad()
def evaluate(ckpt_path: Path, folders: list[Path], parallel_context: ParallelContext, sequence_length: int,
             max_windows: int, batch_size: int) -> dict[str, dict[str, float]]:
    pc = parallel_context
    sources = evaluation_windows(folders, sequence_length, max_windows, batch_size)
    names = unique_domain_names(folders)
    model, _ = load_model(ckpt_path, pc)
    vocab = model.config.vocab_size
    results = {}
    for (shards, windows), name in zip(sources, names):
        total, count = torch.zeros((), dtype=torch.float64, device=pc.device), 0
        for start in range(0, windows, batch_size):
            rows = [shards.read(i * sequence_length, sequence_length + 1)
                    for i in range(start, min(start + batch_size, windows))]
            tokens = torch.as_tensor(np.stack(rows), device=pc.device)
            logits = forward_logits(model, pc, tokens[:, :-1], None, None, None, last_only=False, gather=False)
            if pc.is_last_stage:
                total += vocab_parallel_token_losses(logits, tokens[:, 1:], pc.groups["tp"], vocab).double().sum()
            count += tokens[:, 1:].numel()
        if pc.size("pp") > 1:
            dist.broadcast(total, src=pc.group_ranks["pp"][-1], group=pc.groups["pp"])
        loss = total.item() / count
        results[name] = {"loss": loss, "perplexity": math.exp(loss), "tokens": count}
    return results
