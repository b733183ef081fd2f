"""Global batches whose domain mixture changes from step to step (DoReMi's proxy training).

A blend (``data/dataset.py``) fixes the mixture for a whole stage, so a sample is a pure function of its index.
Here the mixture is chosen anew for every step, from weights known only once the previous step is done, so the
stream has state: how many samples each domain has given so far (its cursor into its own shuffled stream). The
global batch of a step, identical on every rank:

1. per-domain sample counts by largest-remainder rounding of ``global_batch_size × weights`` (a domain may get
   none);
2. each domain's next samples from its cursor, interleaved evenly (smooth round robin) so that every rank and
   micro-batch sees the mixture;
3. data-parallel rank ``d`` takes the ``d``-th contiguous block, cut into micro-batches, as in ``data/loader.py``.

The cursors are all a checkpoint needs to continue the stream exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from nanotron.data.dataset import PretrainDataset, interleave
from nanotron.data.loader import to_micro_batch


def domain_counts(weights: Sequence[float], total: int) -> list[int]:
    """Integer counts summing to ``total``, proportional to ``weights`` (largest remainder, ties to the lower id)."""
    exact = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * total
    counts = np.floor(exact).astype(np.int64)
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))
    for domain in order[:total - int(counts.sum())]:
        counts[domain] += 1
    return counts.tolist()


def global_batch(counts: Sequence[int], cursors: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Domain and index-in-domain of every sample of one global batch, evenly interleaved."""
    present = [domain for domain, count in enumerate(counts) if count > 0]
    order, rank = interleave(np.asarray([counts[d] for d in present], dtype=np.int64))
    domains = np.asarray(present, dtype=np.int64)[order]
    return domains, np.asarray(cursors, dtype=np.int64)[domains] + rank


class DomainWeightedLoader:
    """This data-parallel rank's micro-batches, step after step, each step's mixture read from ``weights()``.

    ``cursors`` (samples taken from each domain so far) start where a checkpoint left them and advance by each
    step's counts on every rank alike.
    """

    def __init__(self, dataset: PretrainDataset, cursors: Sequence[int] | None,
                 weights: Callable[[], Sequence[float]], *, micro_batch_size: int, accumulation: int, dp_rank: int,
                 dp_size: int):
        self.dataset, self.weights = dataset, weights
        self.cursors = list(cursors) if cursors is not None else [0] * len(dataset.domain_names)
        self.micro_batch_size, self.accumulation = micro_batch_size, accumulation
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """The ``accumulation`` micro-batches of the next step, its global batch drawn by the current weights."""
        per_rank = self.micro_batch_size * self.accumulation
        counts = domain_counts(self.weights(), per_rank * self.dp_size)
        domains, indices = global_batch(counts, self.cursors)
        self.cursors = [cursor + count for cursor, count in zip(self.cursors, counts)]
        start = self.dp_rank * per_rank
        micro_batches = []
        for micro in range(self.accumulation):
            rows = slice(start + micro * self.micro_batch_size, start + (micro + 1) * self.micro_batch_size)
            micro_batches.append(to_micro_batch(self.dataset.domain_samples(domains[rows], indices[rows])))
        return micro_batches
