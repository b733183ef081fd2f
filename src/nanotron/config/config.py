"""The whole training config (``Config``) and ``validate_config``, which gathers every section's rules."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nanotron.config.checkpoints import CheckpointsArgs
from nanotron.config.cross_section import cross_section_problems
from nanotron.config.data import DatasetStageArgs, TokenizerArgs, TokensArgs, data_stages_problems
from nanotron.config.evals import EvalsArgs
from nanotron.config.features import DoReMiArgs, FP8Args
from nanotron.config.general import GeneralArgs, LoggingArgs, ProfilerArgs
from nanotron.config.model import ModelArgs
from nanotron.config.optimizer import OptimizerArgs
from nanotron.config.parallelism import ParallelismArgs
from nanotron.config.rules import ConfigError, literal_problems
from nanotron.layout import Layout


@dataclass(kw_only=True)
class Config:
    """A whole training run. Keyword-only because optional sections sit between required ones in YAML order."""

    general: GeneralArgs
    checkpoints: CheckpointsArgs
    parallelism: ParallelismArgs = field(default_factory=ParallelismArgs)
    model: ModelArgs
    tokenizer: TokenizerArgs
    optimizer: OptimizerArgs
    tokens: TokensArgs
    data_stages: list[DatasetStageArgs]
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    profiler: ProfilerArgs | None = None
    doremi: DoReMiArgs | None = None
    fp8: FP8Args | None = None
    evals: EvalsArgs | None = None

    def __post_init__(self) -> None:
        self.data_stages = sorted(self.data_stages, key=lambda stage: stage.start_training_step)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step (``Layout.global_batch_size``)."""
        return Layout.from_config(self).global_batch_size

    @property
    def global_batch_tokens(self) -> int:
        return self.global_batch_size * self.tokens.sequence_length

    def resolved_metrics_path(self) -> Path:
        return self.logging.metrics_path or self.checkpoints.checkpoints_path / "metrics.jsonl"

    def data_stage_at(self, step: int) -> DatasetStageArgs:
        """The stage that feeds optimizer step `step` (1-based): the last one started at or before it."""
        started = [stage for stage in self.data_stages if stage.start_training_step <= step]
        if not started:
            raise ValueError(f"no data stage has started at step {step}; the first stage starts at step 1")
        return max(started, key=lambda stage: stage.start_training_step)


def validate_config(cfg: Config, world_size: int | None = None, machine_problems: Sequence[str] = ()) -> None:
    """Raise ConfigError listing every problem in `cfg`; with `world_size`, also check it matches the launch;
    `machine_problems` are those found by what knows the machine (``nn/flash_attention.py``'s ``device_problems``),
    reported with the rest.

    Runs before anything is allocated. Each section's rules sit beside its fields; the Literal values were checked
    by the loader already and are checked again here only for configs built in code. Whether the trainer
    implements a given parallel degree is not checked here: that is the trainer's business.
    """
    problems = [
        *literal_problems(cfg),
        *cfg.general.problems(),
        *cfg.checkpoints.problems(),
        *cfg.parallelism.problems(),
        *cfg.model.problems(),
        *cfg.tokens.problems(),
        *cfg.optimizer.problems(),
        *data_stages_problems(cfg.data_stages),
        *cfg.logging.problems(),
        *(cfg.doremi.problems() if cfg.doremi is not None else ()),
        *(cfg.fp8.problems() if cfg.fp8 is not None else ()),
        *(cfg.evals.problems() if cfg.evals is not None else ()),
        *cross_section_problems(cfg),
    ]
    if world_size is not None:
        problems += cfg.parallelism.world_size_problems(world_size)
    problems += machine_problems
    if problems:
        raise ConfigError(*problems)
