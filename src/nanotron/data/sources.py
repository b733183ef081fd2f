"""Where a data stage's samples come from: one table from a data-source settings class to the builder of its sample
source, used by training (``training/build.py``) and, for the kinds of folder, by ``nanotron eval``.

Rules:

- A kind of source is a settings class of ``config/data.py`` (``None``: synthetic tokens) and one row of ``SOURCES``;
  nothing else tells the kinds apart. Adding a source is a settings class and a row.
- A builder takes its settings and a ``SourceContext`` and returns a ``SampleSource`` (``dataset.py``) that answers its
  domains' names, what each domain is read from (``domain_sources``: messages, the checkpoint's record of the data) and
  the id that ends its documents (``eos_token_id``), which it refuses to be without when document masking needs it.
- A token folder's kind is what it holds (``folder_kind``): ``metadata.json``, a folder of ``nanotron preprocess``;
  ``*.ds`` files, one of datatrove's tokenizer. A data stage reads one kind; ``nanotron eval --data`` tells its paths
  apart by the same rule.
- Work that a run does once rather than once per rank goes through ``opened_together``: every rank opens the source
  (each checking its share of datatrove's ids), or rank 0 first (tokenizing a Hugging Face dataset into the cache the
  others then read); a problem any rank meets stops every rank with its message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from nanotron.config import ConfigError, DatasetArgs, HFDatasetArgs, SFTDatasetArgs
from nanotron.data.chat import load_chat_template
from nanotron.data.dataset import DataError, PretrainDataset, SampleSource
from nanotron.data.datatrove_folder import DatatroveDataset, briefly, not_a_token_folder
from nanotron.data.hf_dataset import HFDataset
from nanotron.data.preprocess import METADATA_FILE_NAME
from nanotron.data.sft import ChatDataset, ChatSettings
from nanotron.data.synthetic import SyntheticDataset
from nanotron.data.tokenizer import TokenizerError, load_tokenizer
from nanotron.errors import CheckpointError

logger = logging.getLogger(__name__)
Source = TypeVar("Source")
PREPROCESSED, DATATROVE = "nanotron preprocess", "datatrove"  # the kinds of token folder
_MASKING = "model.model_config._use_doc_masking"
# What opening a source may raise for bad input; ``opened_together`` hands it to every rank.
_INPUT_ERRORS = (DataError, TokenizerError, CheckpointError)


def _alone(problem: str | None, world_size: int) -> str | None:
    return problem


@dataclass(frozen=True)
class Ranks:
    """The processes that open a source together: this one's rank, their number, and the collective that hands every
    rank the first problem any of them reported (``checkpoint.manager.first_problem(problem, world_size)``)."""

    rank: int = 0
    world_size: int = 1
    first_problem: Callable[[str | None, int], str | None] = _alone


def opened_together(ranks: Ranks, open_source: Callable[[], Source], rank_0_first: bool = False) -> Source:
    """``open_source()`` on every rank, where a problem any rank met raises the same DataError on all of them instead
    of leaving the others waiting. With ``rank_0_first`` rank 0 opens first, doing the run's one-time work (a cache to
    fill), and the others open once it has."""
    source, problem = None, None
    if ranks.rank == 0 or not rank_0_first:
        try:
            source = open_source()
        except _INPUT_ERRORS as error:
            problem = str(error)
    problem = ranks.first_problem(problem, ranks.world_size)
    if problem is not None:
        raise DataError(problem)
    return source if source is not None else open_source()


def _no_change(weights: list[float] | None) -> list[float] | None:
    return weights


@dataclass(frozen=True)
class SourceContext:
    """What a builder may use besides its settings."""

    sequence_length: int
    seed: int
    vocab_size: int  # the model's: ids must fit it; synthetic tokens are drawn from it
    ranks: Ranks = field(default_factory=Ranks)
    stage: str = ""  # the data stage's name, for messages
    tokenizer: str | None = None  # tokenizer.tokenizer_name_or_path: tokenizes Hugging Face datasets
    # Document masking needs every sample's document ends: recorded by the source, else cut at its eos_token_id (its
    # own, else the tokenizer's; for synthetic tokens, else the model's).
    document_masking: bool = False
    tokenizer_eos_token_id: int | None = None
    model_eos_token_id: int | None = None
    # The stage's mixture as the run's features make it, given the source's (None: the domains' token shares)
    mixture: Callable[[list[float] | None], list[float] | None] = _no_change
    # doremi.domain_names: a single Hugging Face folder then holds one save_to_disk dataset per name (upstream's layout)
    domain_names: Sequence[str] | None = None


def build_source(settings: Any, context: SourceContext) -> SampleSource:
    """The sample source that ``settings`` (a ``data_stages[].data.dataset``) describe."""
    return SOURCES[type(settings)](settings, context)


def folder_kind(folder: Path) -> str | None:
    """Which kind of token folder ``folder`` is, by what it holds (``PREPROCESSED``, ``DATATROVE``); None: neither."""
    if (folder / METADATA_FILE_NAME).exists():
        return PREPROCESSED
    if any(folder.glob("*.ds")):
        return DATATROVE
    return None


def _stage_folder_kind(folders: Sequence[Path]) -> str:
    """The one kind of a stage's folders; a folder of neither kind, and a stage mixing both, are refused."""
    kinds = set()
    for folder in map(Path, folders):
        kind = folder_kind(folder)
        if kind is None and not folder.is_dir():
            raise DataError(f"dataset folder {folder} {'is a file' if folder.exists() else 'does not exist'}; check "
                            "dataset_folder")
        if kind is None:
            raise DataError(not_a_token_folder(folder))
        kinds.add(kind)
    if len(kinds) > 1:
        raise DataError("dataset_folder mixes folders of nanotron preprocess (metadata.json) and of datatrove (.ds "
                        "files); give each kind its own data stage, or tokenize them all one way")
    return kinds.pop()


def synthetic_tokens(settings: None, context: SourceContext) -> SyntheticDataset:
    """Upstream's ``dataset: null``: random tokens for throughput runs, whose documents end wherever the end id
    falls."""
    end = context.tokenizer_eos_token_id
    end = context.model_eos_token_id if end is None else end
    if context.document_masking and end is None:
        raise ConfigError(f"data stage {context.stage!r} trains on synthetic tokens (dataset: null), which {_MASKING} "
                          "cuts at model.model_config.eos_token_id, but it is null; set eos_token_id, or "
                          "_use_doc_masking: false")
    return SyntheticDataset(context.vocab_size, context.sequence_length, context.seed, eos_token_id=end)


def token_folders(settings: DatasetArgs, context: SourceContext) -> SampleSource:
    """``dataset_folder``: folders of ``nanotron preprocess``, or of datatrove (upstream's Nanoset), blended."""
    weights = context.mixture(settings.dataset_weights)
    if _stage_folder_kind(settings.dataset_folder) == PREPROCESSED:
        return PretrainDataset(settings.dataset_folder, weights, context.sequence_length, context.seed)
    ranks = context.ranks

    def open_folders() -> DatatroveDataset:
        # Each rank checks its share of the ids: datatrove records no id range, so the check reads the data (once
        # per run, not once per rank, which from a network file system took minutes for every rank of every run).
        return DatatroveDataset(settings.dataset_folder, weights, context.sequence_length, context.seed,
                                vocab_size=settings.vocab_size or context.vocab_size,
                                token_size=settings.token_size_in_bytes, id_share=(ranks.rank, ranks.world_size),
                                document_ends=context.document_masking, eos_token_id=context.tokenizer_eos_token_id)

    dataset = opened_together(ranks, open_folders)
    if context.document_masking and not dataset.records_document_ends:
        if dataset.eos_token_id is None:
            raise ConfigError(
                f"data stage {context.stage!r}: {_MASKING} needs the ends of the documents, but files have no "
                f".ds.index ({briefly(dataset.files_without_index)}; datatrove writes one unless save_index=False) "
                "and no end-of-document id is known; set tokenizer.tokenizer_name_or_path to the tokenizer that wrote "
                "them, or tokenize them again with their index")
        logger.warning(f"data stage {context.stage!r}: files without a .ds.index "
                       f"({briefly(dataset.files_without_index)}); document masking cuts the documents at the "
                       f"end-of-document id {dataset.eos_token_id} of {context.tokenizer}")
    return dataset


def hf_datasets(settings: HFDatasetArgs, context: SourceContext) -> HFDataset:
    """``hf_dataset_or_datasets``: Hugging Face datasets, tokenized by rank 0 into the cache the other ranks read."""
    if not context.tokenizer:
        raise ConfigError("a data stage reading hf_dataset_or_datasets needs tokenizer.tokenizer_name_or_path: the "
                          "text is tokenized when the run starts")
    datasets = settings.hf_dataset_or_datasets
    if isinstance(datasets, str) and context.domain_names:
        datasets = {str(Path(datasets) / name): 1.0 for name in context.domain_names}
    weights = context.mixture(list(datasets.values()) if isinstance(datasets, dict) else None)
    if weights is not None:
        datasets = dict(zip(list(datasets) if isinstance(datasets, dict) else [datasets], weights, strict=True))
    return opened_together(context.ranks, lambda: HFDataset(
        datasets, context.tokenizer, context.sequence_length, context.seed, splits=settings.hf_dataset_splits,
        text_column=settings.text_column_name, config_name=settings.hf_dataset_config_name,
        num_proc=settings.dataset_processing_num_proc_per_process, overwrite_cache=settings.dataset_overwrite_cache),
        rank_0_first=True)


def chat_conversations(settings: SFTDatasetArgs, context: SourceContext) -> ChatDataset:
    """Upstream's SFT datasets: conversations rendered with a chat template and packed (``data/sft.py``), on every
    rank."""
    def open_conversations() -> ChatDataset:
        tokenizer = load_tokenizer(context.tokenizer)
        chat = ChatSettings(load_chat_template(context.tokenizer, settings.chat_template), settings.train_on,
                            settings.messages_column_name, settings.hf_dataset_splits, settings.hf_dataset_config_name,
                            settings.debug_max_samples, settings.pack)
        return ChatDataset(settings.hf_dataset_or_datasets, tokenizer, context.tokenizer, context.sequence_length,
                           context.seed, chat)

    return opened_together(context.ranks, open_conversations)


SOURCES: dict[type, Callable[[Any, SourceContext], SampleSource]] = {
    type(None): synthetic_tokens,
    DatasetArgs: token_folders,
    HFDatasetArgs: hf_datasets,
    SFTDatasetArgs: chat_conversations,
}
