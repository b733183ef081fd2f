"""The sample stream of supervised fine-tuning: chat conversations rendered with a chat template (``data/chat.py``),
packed into samples of ``sequence_length + 1`` tokens, with the tokens the loss is trained on.

Rules:

- Conversations are read from a ``.jsonl`` file (one JSON object a line) or a Hugging Face dataset (a
  ``save_to_disk`` folder, a folder of data files or a Hub name; its ``splits`` in the order given), from the
  ``messages`` column of every row, in that order (the first ``max_conversations`` only, where given).
- Packing: conversations are placed in that order, each in the current sample if it fits in what is left of its
  ``sequence_length + 1`` tokens, else at the start of the next one; a conversation is never split over two samples.
  Without packing, every sample holds one conversation. The rest of a sample is padding (the end-of-document id, a
  document of its own per token), never trained on.
- A conversation longer than ``sequence_length + 1`` tokens is cut to its first ``sequence_length + 1`` tokens and
  fills a sample alone; the run logs how many were cut.
- Every conversation is a document of its own: the samples record its end (``document_ends``), so that attention
  stays inside it and its positions start at 0 (``data/loader.py``), whatever the model's document masking.
- Sample ``g`` is packed sample ``permute(g mod n)`` of epoch ``g div n`` (``n`` samples an epoch, each epoch in a
  fresh order): a function of ``g`` and the seed, so a resume at any step replays the same samples.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nanotron.data.chat import ChatTemplate, checked_messages, tokenized_conversation
from nanotron.data.dataset import check_sequence_length, domain_name
from nanotron.data.documents import DataError, iter_json_values
from nanotron.data.hf_dataset import _load_splits
from nanotron.data.permutation import permute
from nanotron.data.tokenizer import _end_of_document_id, tokenizer_fingerprint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatSettings:
    """How conversations become samples (``SFTDatasetArgs``' fields, by meaning)."""

    template: ChatTemplate
    train_on: str = "assistant"  # data/chat.py's TRAIN_ON
    messages_column: str = "messages"
    splits: Sequence[str] = ("train",)
    config_name: str | None = None
    max_conversations: int | None = None
    pack: bool = True


def read_conversations(dataset: str | Path, settings: ChatSettings) -> Iterator[tuple[object, str]]:
    """The raw ``messages`` of every conversation of ``dataset`` and where it stands (file and row), in order."""
    path, column = Path(dataset), settings.messages_column
    if path.suffix == ".jsonl" and path.is_file():
        yield from iter_json_values(path, column, "set messages_column_name to the key of the conversations")
        return
    for split, part in zip(settings.splits, _load_splits(dataset, settings.splits, settings.config_name)):
        if column not in part.column_names:
            raise DataError(f"the Hugging Face dataset {dataset} has no column {column!r} (it has "
                            f"{', '.join(part.column_names)}); set messages_column_name to its conversations")
        for row, messages in enumerate(part.data.column(column).to_pylist()):
            yield messages, f"the Hugging Face dataset {dataset}, split {split}, row {row}"


def pack(lengths: np.ndarray, capacity: int, packing: bool = True) -> np.ndarray:
    """The first conversation of every sample, and the end (``len(lengths)``): conversations of ``lengths`` tokens
    (each at most ``capacity``) placed in order, each in the current sample if it fits, else in the next."""
    if not packing:
        return np.arange(len(lengths) + 1)
    firsts, used = [0], 0
    for index, length in enumerate(lengths.tolist()):
        if used + length > capacity:
            firsts.append(index)
            used = 0
        used += length
    return np.array(firsts + [len(lengths)])


class ChatDataset:
    """The packed conversations of one dataset as a ``SampleSource`` (``data/dataset.py``) that records the ends of
    its documents and the tokens trained on (``samples``' ``trained``)."""

    records_document_ends = True

    def __init__(self, dataset: str | Path, tokenizer, tokenizer_name: str, sequence_length: int, seed: int,
                 settings: ChatSettings):
        check_sequence_length(sequence_length)
        self.sequence_length, self.seed = sequence_length, seed
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos_token_id = _end_of_document_id(tokenizer)
        self.domain_names, self.domain_sources, self.weights = [domain_name(dataset)], [str(dataset)], [1.0]
        self.tokenizer_names, self.tokenizer_fingerprints = [tokenizer_name], [tokenizer_fingerprint(tokenizer)]
        self.window_stride = None
        tokens, trained = self._tokenized(dataset, tokenizer, settings)
        lengths = np.array([len(ids) for ids in tokens], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)])
        self._tokens, self._trained = np.concatenate(tokens), np.concatenate(trained)
        self._firsts = pack(lengths, sequence_length + 1, settings.pack)
        self.num_windows = [len(self._firsts) - 1]
        logger.info(f"{dataset}: {len(lengths)} conversations, {int(lengths.sum())} tokens "
                    f"({int(self._trained.sum())} trained on) in {self.num_windows[0]} samples")

    def _tokenized(self, dataset: str | Path, tokenizer,
                   settings: ChatSettings) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Every conversation's ids and trained tokens, cut to one sample."""
        tokens, trained, cut = [], [], 0
        for messages, where in read_conversations(dataset, settings):
            if settings.max_conversations is not None and len(tokens) == settings.max_conversations:
                break
            conversation = checked_messages(messages, where)
            try:
                ids, mask = tokenized_conversation(tokenizer, settings.template, conversation, settings.train_on)
            except DataError as error:
                raise DataError(f"{where}: {error}") from None
            cut += len(ids) > self.sequence_length + 1
            tokens.append(ids[:self.sequence_length + 1])
            trained.append(mask[:self.sequence_length + 1])
        if not tokens:
            raise DataError(f"{dataset} holds no conversation; give a dataset with a {settings.messages_column!r} "
                            "column of conversations")
        if cut:
            logger.warning(f"{dataset}: {cut} of {len(tokens)} conversations are longer than sequence_length + 1 = "
                           f"{self.sequence_length + 1} tokens and were cut to that length")
        return tokens, trained

    def samples(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The samples ``indices``: ``tokens`` [n, sequence_length + 1] and ``domain_ids`` [n] (int64),
        ``document_ends`` and ``trained`` (bool, like ``tokens``)."""
        width, count = self.sequence_length + 1, self.num_windows[0]
        g = np.asarray(indices, dtype=np.int64).reshape(-1)
        tokens = np.full((len(g), width), 0 if self.eos_token_id is None else self.eos_token_id, dtype=np.int64)
        ends, trained = np.ones((len(g), width), dtype=bool), np.zeros((len(g), width), dtype=bool)
        for row, index in enumerate(g.tolist()):
            epoch, position = divmod(index, count)
            sample = int(permute(position, count, self.seed, stream=epoch))
            first, last = self._firsts[sample], self._firsts[sample + 1]
            start, stop = self._starts[first], self._starts[last]
            tokens[row, :stop - start] = self._tokens[start:stop]
            trained[row, :stop - start] = self._trained[start:stop]
            ends[row, :stop - start] = False
            ends[row, self._starts[first + 1:last + 1] - start - 1] = True
        return {"tokens": torch.from_numpy(tokens), "domain_ids": torch.zeros(len(g), dtype=torch.int64),
                "document_ends": torch.from_numpy(ends), "trained": torch.from_numpy(trained)}
