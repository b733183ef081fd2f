"""Held-out loss and perplexity of a checkpoint, per data source (domain), and its multiple-choice tasks'
accuracies (``tasks.py``, ``scoring.py``), at any tp/pp layout: ``nanotron eval``.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from nanotron.checkpoint.integrity import read_metadata
from nanotron.checkpoint.manager import checkpoint_model, first_problem
from nanotron.checkpoint.run_folder import resolve_checkpoint
from nanotron.config import ConfigError, EvalTaskArgs
from nanotron.data.dataset import DataError, TokenShards, TokenStream, unique_domain_names
from nanotron.data.datatrove_folder import DatatroveTokens
from nanotron.data.hf_dataset import tokenize_hf_dataset
from nanotron.data.sources import DATATROVE, PREPROCESSED, Ranks, folder_kind, opened_together
from nanotron.data.tokenizer import eos_token_id
from nanotron.generation.generate import checkpoint_tokenizer, load_checkpoint_tokenizer, load_model
from nanotron.generation.scoring import evaluation_results, stage_row_sums, window_rows
from nanotron.generation.tasks import Row, TaskRows, task_rows
from nanotron.parallel.context import ParallelContext


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


def held_out_rows(data: Sequence[Path], sources: Sequence[Source], sequence_length: int,
                  max_windows: int) -> dict[str, list[Row]]:
    """The evaluation windows of every source as rows, by domain name."""
    names = unique_domain_names(data, [source.stream.name for source in sources])
    windows = evaluation_windows(sources, sequence_length, max_windows)
    return {name: window_rows(source.stream.read, starts, sequence_length)
            for source, starts, name in zip(sources, windows, names)}


def check_distinct_names(tasks: Sequence[TaskRows], held_out: dict[str, list[Row]], source: str) -> None:
    """Tasks and held-out sources share the results' names: one name for two of them is refused."""
    clash = sorted({task.name for task in tasks} & set(held_out))
    if clash:
        raise ConfigError(f"{clash[0]!r} names both a task and {source}; give the task another name")


def evaluate(ckpt_path: Path, data: Sequence[Path], parallel_context: ParallelContext, sequence_length: int,
             max_windows: int, batch_size: int, hf: HFDatasetOptions = HFDatasetOptions(),
             tasks: Sequence[EvalTaskArgs] = ()) -> dict[str, dict]:
    """Loss, perplexity and target tokens of the checkpoint on each source of ``data``, by domain name, and the
    metrics of each multiple-choice task (``generation/scoring.py``), by task name. The sources and tasks are
    opened, and refused, before the model is loaded."""
    pc = parallel_context
    if min(sequence_length, max_windows, batch_size) < 1:
        raise ConfigError(f"--sequence-length ({sequence_length}), --max-windows ({max_windows}) and --batch-size "
                          f"({batch_size}) must all be at least 1")
    checkpoint = resolve_checkpoint(Path(ckpt_path))
    _, model_config = checkpoint_model(checkpoint, read_metadata(checkpoint))
    sources = open_sources(data, model_config.vocab_size, lambda: checkpoint_tokenizer(checkpoint), hf, pc)
    held_out = held_out_rows(data, sources, sequence_length, max_windows)
    tokenizer = load_checkpoint_tokenizer(checkpoint) if tasks else None
    task_sets = [task_rows(task, tokenizer, sequence_length, eos_token_id(tokenizer)) for task in tasks]
    check_distinct_names(task_sets, held_out, "a --data source")
    model, _ = load_model(checkpoint, pc)
    row_sums = stage_row_sums(model, pc, (batch_size, sequence_length, model.config.hidden_size))
    return evaluation_results(task_sets, held_out, row_sums, pc, batch_size, sequence_length)
