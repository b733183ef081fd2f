"""Held-out loss and perplexity of a checkpoint, per data source (domain), at any tp/pp layout.

A source is any data training reads: a preprocessed folder (``metadata.json``), a datatrove folder (``*.ds`` files),
or a Hugging Face dataset (a ``save_to_disk`` folder, a folder of data files, or a Hub name), tokenized with the
checkpoint's tokenizer into the cache training uses (``hf_dataset.tokenize_hf_dataset``). Its windows are the ones
training cuts, ``sequence_length + 1`` tokens that never cross a segment's end (neighbours share one token; a
datatrove folder's windows are disjoint and cut file by file, as upstream's Nanoset cuts them), read in order without
shuffling, so the same source always gives the same number. Evaluate on data that training did not see (e.g. a
validation split). The loss is the mean over all target tokens; perplexity is its exponential. A source shorter than
one window is an error, not a loss of 0.

Attention is plain causal attention over each window, whatever the checkpoint was trained with: for a model trained
with document masking (``_use_doc_masking: true``) the loss is still the plain causal one, comparable with
``transformers``' on the same windows.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from nanotron.checkpoint.integrity import read_metadata
from nanotron.checkpoint.manager import checkpoint_model, first_problem
from nanotron.checkpoint.run_folder import resolve_checkpoint
from nanotron.config import ConfigError
from nanotron.data.dataset import DataError, TokenShards, TokenStream, unique_domain_names
from nanotron.data.datatrove_folder import DatatroveTokens
from nanotron.data.hf_dataset import tokenize_hf_dataset
from nanotron.data.sources import DATATROVE, PREPROCESSED, Ranks, folder_kind, opened_together
from nanotron.generation.generate import checkpoint_tokenizer, forward_logits, load_model
from nanotron.layout import Axis, Group
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.cross_entropy import vocab_parallel_token_losses


@dataclass(frozen=True)
class HFDatasetOptions:
    """What is read of a Hugging Face dataset (training's ``hf_dataset_splits`` and ``text_column_name``)."""

    splits: tuple[str, ...] = ("train",)
    text_column: str = "text"


@dataclass(frozen=True)
class Source:
    """One source's token stream and the stride of its windows."""

    stream: TokenStream
    disjoint: bool  # windows start every sequence_length + 1 tokens (datatrove's), else every sequence_length

    def window_starts(self, sequence_length: int) -> Iterator[int]:
        """The first token of every window, in order: one each stride inside each segment, none crossing its end."""
        stride, start = sequence_length + 1 if self.disjoint else sequence_length, 0
        for length in self.stream.segment_lengths:
            yield from range(start, start + length - sequence_length, stride)
            start += length


def open_source(path: Path, vocab_size: int, tokenizer: Callable[[], str | Path], hf: HFDatasetOptions,
                checked: bool = False) -> Source:
    """``path`` opened as training opens it: a token folder of the kind it holds (``data/sources.folder_kind``, the
    rule training's ``dataset_folder`` follows), anything else a Hugging Face dataset, tokenized with ``tokenizer()``.
    A path that does not exist is a Hub name, unless it is plainly a local one (absolute, or in a folder that exists).
    A datatrove folder's ids are checked against ``vocab_size``, the model's; ``checked``: another rank checked the
    ids already."""
    path = Path(path)
    kind = folder_kind(path)
    if kind == PREPROCESSED:
        return Source(TokenShards(path, ids_checked=checked), disjoint=False)
    if kind == DATATROVE:
        return Source(DatatroveTokens(path, vocab_size, id_share=None if checked else (0, 1)), disjoint=True)
    if not path.exists() and (path.is_absolute() or path.parent != Path(".") and path.parent.exists()):
        raise DataError(f"--data {path} does not exist; give a preprocessed or datatrove folder, or a Hugging Face "
                        "dataset (a save_to_disk folder, a folder of data files or a Hub name)")
    folder = tokenize_hf_dataset(path, tokenizer(), splits=hf.splits, text_column=hf.text_column)
    return Source(TokenShards(folder, ids_checked=checked), disjoint=False)


def open_sources(paths: Sequence[Path], vocab_size: int, tokenizer: Callable[[], str | Path], hf: HFDatasetOptions,
                 parallel_context: ParallelContext) -> list[Source]:
    """Every source, opened by rank 0 first (which tokenizes Hugging Face datasets into the cache and checks the
    ids), then by the other ranks (which read the cache and skip the checks); a problem on rank 0 stops every rank
    with its message."""
    pc = parallel_context
    ranks = Ranks(pc.rank, pc.world_size, first_problem)
    return opened_together(ranks, lambda: [open_source(path, vocab_size, tokenizer, hf, checked=pc.rank != 0)
                                           for path in paths], rank_0_first=True)


def evaluation_windows(sources: Sequence[Source], sequence_length: int, max_windows: int) -> list[list[int]]:
    """The first token of each window read from each source (at most ``max_windows``); a source shorter than one
    window is refused, since its loss would be a mean over no tokens."""
    windows = []
    for source in sources:
        stream = source.stream
        starts = list(itertools.islice(source.window_starts(sequence_length), max_windows))
        if not starts:
            longest = max(stream.segment_lengths, default=0)
            in_files = f" in files of at most {longest} tokens" if len(stream.segment_lengths) > 1 else ""
            fix = f"pass --sequence-length {longest - 1} or less, or " if longest > 1 else ""
            raise DataError(f"{stream.folder} holds {stream.num_tokens} tokens{in_files}, fewer than one evaluation "
                            f"window (--sequence-length {sequence_length} + 1 tokens), so it has no loss to report; "
                            f"{fix}evaluate more data")
        windows.append(starts)
    return windows


@torch.no_grad()
def evaluate(ckpt_path: Path, data: Sequence[Path], parallel_context: ParallelContext, sequence_length: int,
             max_windows: int, batch_size: int, hf: HFDatasetOptions = HFDatasetOptions()) -> dict[str, dict]:
    """Loss, perplexity and target tokens of the checkpoint on each source of ``data``, by domain name. The sources
    are opened, and refused, before the model is loaded."""
    pc = parallel_context
    if min(sequence_length, max_windows, batch_size) < 1:
        raise ConfigError(f"--sequence-length ({sequence_length}), --max-windows ({max_windows}) and --batch-size "
                          f"({batch_size}) must all be at least 1")
    checkpoint = resolve_checkpoint(Path(ckpt_path))
    _, model_config = checkpoint_model(checkpoint, read_metadata(checkpoint))
    sources = open_sources(data, model_config.vocab_size, lambda: checkpoint_tokenizer(checkpoint), hf, pc)
    names = unique_domain_names(data, [source.stream.name for source in sources])
    windows = evaluation_windows(sources, sequence_length, max_windows)
    model, _ = load_model(checkpoint, pc)
    results = {}
    for source, starts, name in zip(sources, windows, names):
        total, count = torch.zeros((), dtype=torch.float64, device=pc.device), 0
        for first in range(0, len(starts), batch_size):
            rows = [source.stream.read(start, sequence_length + 1) for start in starts[first:first + batch_size]]
            tokens = torch.as_tensor(np.stack(rows), device=pc.device)
            logits = forward_logits(model, pc, tokens[:, :-1], None, None, None, last_only=False, gather=False)
            if pc.is_last_stage:
                total += vocab_parallel_token_losses(logits, tokens[:, 1:], pc.group(Group.TP),
                                                     model.config.vocab_size).double().sum()
            count += tokens[:, 1:].numel()
        if pc.size(Axis.PP) > 1:
            dist.broadcast(total, src=pc.members(Group.PP)[-1], group=pc.group(Group.PP))
        loss = total.item() / count
        results[name] = {"loss": loss, "perplexity": math.exp(loss), "tokens": count}
    return results
