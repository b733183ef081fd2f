"""What the model reads: the ``tokenizer``, ``tokens`` (sequence length, batch, steps) and ``data_stages``
sections."""

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nanotron.config.rules import at_least, positive


@dataclass
class TokenizerArgs:
    tokenizer_name_or_path: str | None = None
    tokenizer_revision: str | None = None


@dataclass
class TokensArgs:
    sequence_length: int
    train_steps: int
    micro_batch_size: int
    batch_accumulation_per_replica: int

    def problems(self) -> Iterator[str]:
        for name in ("sequence_length", "train_steps", "micro_batch_size", "batch_accumulation_per_replica"):
            yield from at_least(f"tokens.{name}", getattr(self, name), 1)


@dataclass
class DatasetArgs:
    """Token folders: written by ``nanotron preprocess``, or by datatrove's tokenizer (upstream's Nanoset)."""

    dataset_folder: list[Path]
    dataset_weights: list[float] | None = None  # None: sample the folders in proportion to their sizes
    # Upstream's Nanoset fields, for datatrove folders. The token size of files without .metadata (None: the one
    # datatrove picks for the vocabulary); the tokenizer the folders' metadata must name, and the vocabulary their
    # ids must fit (None: model_config.vocab_size).
    token_size_in_bytes: int | None = None
    tokenizer_name: str | None = None
    vocab_size: int | None = None
    # Upstream's switch for per-document positions in the samples, which document masking reads
    # (model_config._use_doc_masking); without document masking positions run on through a sample either way.
    return_positions: bool = True

    @property
    def num_domains(self) -> int:
        return len(self.dataset_folder)

    def problems(self, key: str) -> Iterator[str]:
        if not self.dataset_folder:
            yield f"{key}.dataset_folder must name at least one folder"
        if self.token_size_in_bytes not in (None, 2, 4):
            yield (f"{key}.token_size_in_bytes must be 2 (uint16 ids) or 4 (uint32 ids), as datatrove writes them "
                   f"(got {self.token_size_in_bytes})")
        if self.vocab_size is not None:
            yield from at_least(f"{key}.vocab_size", self.vocab_size, 1)
        if self.dataset_weights is not None:
            if len(self.dataset_weights) != len(self.dataset_folder):
                yield (
                    f"{key}.dataset_weights has {len(self.dataset_weights)} entries but dataset_folder has "
                    f"{len(self.dataset_folder)}; give one weight per folder"
                )
            for i, weight in enumerate(self.dataset_weights):
                yield from positive(f"{key}.dataset_weights[{i}]", weight)


@dataclass
class HFDatasetArgs:
    """A Hugging Face dataset (upstream's ``hf_dataset_or_datasets``), tokenized once into a cached folder
    (``data/hf_dataset.py``): a local ``save_to_disk`` folder, a folder of data files, or a Hub name; or several,
    ``{name: weight}``, blended by weight."""

    hf_dataset_or_datasets: str | dict
    hf_dataset_splits: list[str] = field(default_factory=lambda: ["train"])  # concatenated in this order
    hf_dataset_config_name: str | None = None
    dataset_processing_num_proc_per_process: int = 1  # tokenizing processes
    dataset_overwrite_cache: bool = False  # tokenize again even when the cache holds the tokens
    text_column_name: str = "text"

    @property
    def num_domains(self) -> int:
        datasets = self.hf_dataset_or_datasets
        return len(datasets) if isinstance(datasets, dict) else 1

    def problems(self, key: str) -> Iterator[str]:
        datasets = self.hf_dataset_or_datasets
        if not datasets:
            yield f"{key}.hf_dataset_or_datasets must name a dataset"
        for name, weight in (datasets.items() if isinstance(datasets, dict) else ()):
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                yield f"{key}.hf_dataset_or_datasets[{name!r}]: the weight must be a number > 0 (got {weight!r})"
        if not self.hf_dataset_splits:
            yield f"{key}.hf_dataset_splits must name at least one split"
        yield from at_least(f"{key}.dataset_processing_num_proc_per_process",
                            self.dataset_processing_num_proc_per_process, 1)
        if not self.text_column_name:
            yield f"{key}.text_column_name must not be empty"


@dataclass
class SFTDatasetArgs:
    """Chat conversations for supervised fine-tuning (upstream's ``SFTDatasetsArgs``, told from a pretraining
    Hugging Face dataset by its own keys; ``data/sft.py``, docs/sft.md): a ``.jsonl`` file or a Hugging Face dataset
    with a column of conversations, rendered with a chat template and packed into samples."""

    hf_dataset_or_datasets: str  # a .jsonl file, a save_to_disk folder, a folder of data files or a Hub name
    hf_dataset_splits: list[str] = field(default_factory=lambda: ["train"])  # concatenated in this order
    hf_dataset_config_name: str | None = None
    sft_dataloader: bool = True  # upstream's marker of an SFT dataset
    debug_max_samples: int | None = None  # the first conversations only
    messages_column_name: str = "messages"  # a list of {role, content} per row
    chat_template: Literal["chatml"] | None = None  # null: the tokenizer's; or a built-in one by name
    # The tokens the loss is trained on: every assistant turn's, the last assistant turn's, or every token
    train_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    pack: bool = True  # several conversations per sample, each a document of its own

    num_domains = 1

    def problems(self, key: str) -> Iterator[str]:
        if not self.hf_dataset_or_datasets:
            yield f"{key}.hf_dataset_or_datasets must name a .jsonl file or a dataset of conversations"
        if not self.sft_dataloader:
            yield f"{key}.sft_dataloader is false; remove the SFT keys to train on text, or set it to true"
        if not self.hf_dataset_splits:
            yield f"{key}.hf_dataset_splits must name at least one split"
        if self.debug_max_samples is not None:
            yield from at_least(f"{key}.debug_max_samples", self.debug_max_samples, 1)
        if not self.messages_column_name:
            yield f"{key}.messages_column_name must not be empty"


@dataclass
class DataArgs:
    # Token folders, a Hugging Face dataset, chat conversations, or None: synthetic tokens (upstream's dataset: null,
    # for throughput)
    dataset: DatasetArgs | HFDatasetArgs | SFTDatasetArgs | None
    seed: int = 42
    num_loading_workers: int = 1

    @property
    def num_domains(self) -> int:
        return 1 if self.dataset is None else self.dataset.num_domains

    def problems(self, key: str) -> Iterator[str]:
        yield from at_least(f"{key}.seed", self.seed, 0)
        yield from at_least(f"{key}.num_loading_workers", self.num_loading_workers, 0)
        if self.dataset is not None:
            yield from self.dataset.problems(f"{key}.dataset")


@dataclass
class DatasetStageArgs:
    name: str
    start_training_step: int
    data: DataArgs

    def problems(self) -> Iterator[str]:
        key = f"data_stages[{self.name!r}]"
        if not self.name:
            yield f"{key}.name must not be empty"
        # A stage may start after tokens.train_steps (a warning): a run trained in parts (train_steps raised on
        # each resume) keeps the whole schedule in its config.
        if self.start_training_step < 1:
            yield f"{key}.start_training_step ({self.start_training_step}) must be >= 1 (steps count from 1)"
        yield from self.data.problems(f"{key}.data")


def data_stages_problems(stages: list[DatasetStageArgs]) -> Iterator[str]:
    """The schedule of stages (one starts at step 1, names and starts unique), then each stage's own rules."""
    if not stages:
        yield "data_stages must list at least one stage (one of them with start_training_step: 1)"
        return
    names = [stage.name for stage in stages]
    starts = [stage.start_training_step for stage in stages]
    for name in sorted({name for name in names if names.count(name) > 1}):
        yield f"data_stages: the name {name!r} is used by more than one stage; give each stage its own name"
    for start in sorted({start for start in starts if starts.count(start) > 1}):
        yield f"data_stages: more than one stage has start_training_step {start}; give each stage its own start"
    if 1 not in starts:
        yield "data_stages: one stage must have start_training_step: 1 (the first training step)"
    for stage in stages:
        yield from stage.problems()
