"""Synthetic tokens (upstream's ``dataset: null``), for throughput runs that need no data.

Token ``t`` of sample ``g`` is a hash of ``(seed, g, t)`` reduced to the vocabulary: a pure function, so the samples
behave like a real data stage's (exact resume, the same global batch at any layout, the same on every machine) at the
cost of a few hash rounds per token, without reading anything.
"""

from collections.abc import Sequence

import numpy as np
import torch

from nanotron.data.dataset import DataError, check_sequence_length
from nanotron.data.permutation import _mix64, _splitmix64

__all__ = ["SyntheticDataset"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment: consecutive positions get unrelated hashes


class SyntheticDataset:
    """An infinite stream of samples of ``sequence_length + 1`` uniformly random ids in ``[0, vocab_size)``."""

    def __init__(self, vocab_size: int, sequence_length: int, seed: int, eos_token_id: int | None = None):
        check_sequence_length(sequence_length)
        if vocab_size < 1:
            raise DataError(f"vocab_size must be at least 1 for synthetic data, got {vocab_size}")
        self.vocab_size = vocab_size
        self.sequence_length = sequence_length
        self.seed = seed
        self.domain_names = ["synthetic"]
        self.domain_sources = ["synthetic tokens"]
        self.weights = [1.0]
        self.num_windows = self.window_stride = None  # an endless stream
        self.tokenizer_fingerprints = [None]
        self.tokenizer_names = [None]
        self.records_document_ends = False
        self.eos_token_id = eos_token_id  # random ids: documents end wherever this id falls
        self._key = np.uint64(_splitmix64(seed & ((1 << 64) - 1)))
        self._positions = (np.arange(1, sequence_length + 2, dtype=np.uint64) * _GOLDEN)[None, :]

    def samples(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The samples ``indices`` stacked: ``tokens`` [n, sequence_length + 1] and ``domain_ids`` [n], int64."""
        g = np.asarray(indices, dtype=np.int64).reshape(-1)
        if g.size and g.min() < 0:
            raise IndexError(f"sample indices start at 0, got {g.min()}")
        per_sample = _mix64(g.astype(np.uint64) ^ self._key)[:, None]
        tokens = (_mix64(per_sample + self._positions) % np.uint64(self.vocab_size)).astype(np.int64)
        return {"tokens": torch.from_numpy(tokens), "domain_ids": torch.zeros(len(g), dtype=torch.int64)}

    def sample(self, g: int) -> tuple[np.ndarray, int]:
        """Global sample ``g``: its ``sequence_length + 1`` tokens (int64) and its domain id (0)."""
        return self.samples([g])["tokens"][0].numpy(), 0
