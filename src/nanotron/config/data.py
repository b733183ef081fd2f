"""What the model reads: the ``tokenizer``, ``tokens`` (sequence length, batch, steps) and ``data_stages``
sections."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nanotron.config.rules import at_least, positive


@dataclass
class TokenizerArgs:
    tokenizer_name_or_path: str | None = None
    tokenizer_revision: str | None = None
    tokenizer_max_length: int | None = None

    def problems(self) -> Iterator[str]:
        if self.tokenizer_max_length is not None:
            yield from at_least("tokenizer.tokenizer_max_length", self.tokenizer_max_length, 1)


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
    dataset_folder: list[Path]
    dataset_weights: list[float] | None = None  # None: sample the folders in proportion to their sizes

    def problems(self, key: str) -> Iterator[str]:
        if not self.dataset_folder:
            yield f"{key}.dataset_folder must name at least one folder"
        if self.dataset_weights is not None:
            if len(self.dataset_weights) != len(self.dataset_folder):
                yield (
                    f"{key}.dataset_weights has {len(self.dataset_weights)} entries but dataset_folder has "
                    f"{len(self.dataset_folder)}; give one weight per folder"
                )
            for i, weight in enumerate(self.dataset_weights):
                yield from positive(f"{key}.dataset_weights[{i}]", weight)


@dataclass
class DataArgs:
    dataset: DatasetArgs
    seed: int = 42
    num_loading_workers: int = 1

    def problems(self, key: str) -> Iterator[str]:
        yield from at_least(f"{key}.seed", self.seed, 0)
        yield from at_least(f"{key}.num_loading_workers", self.num_loading_workers, 0)
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
        # A stage may start after tokens.train_steps: a run trained in parts (train_steps raised on each resume)
        # keeps the whole schedule in its config.
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
