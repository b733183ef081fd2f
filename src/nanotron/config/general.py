"""The run's name and seed, and how it reports: the ``general``, ``logging`` and ``profiler`` sections."""

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nanotron.config.rules import at_least

DEFAULT_RUN_NAME = "%date_%jobid"

LogLevel = Literal["debug", "info", "warning", "error", "critical"]


@dataclass
class GeneralArgs:
    project: str
    run: str | None = None  # None means DEFAULT_RUN_NAME; placeholders are expanded by `expand_run_name`
    seed: int = 42

    def problems(self) -> Iterator[str]:
        if not self.project:
            yield "general.project must not be empty; name the project the runs belong to"
        yield from at_least("general.seed", self.seed, 0)


@dataclass
class WandbArgs:
    project: str
    entity: str | None = None
    # online, offline (written locally, synced later with `wandb sync`) or disabled
    mode: Literal["online", "offline", "disabled"] = "online"
    name: str | None = None  # None: general.run
    dir: Path | None = None  # None: checkpoints_path


@dataclass
class LoggingArgs:
    log_level: LogLevel = "info"
    log_level_replica: LogLevel = "info"
    iteration_step_info_interval: int = 1
    metrics_path: Path | None = None  # None: <checkpoints_path>/metrics.jsonl
    tensorboard_dir: Path | None = None  # also write every step record as TensorBoard scalars here
    wandb: WandbArgs | None = None  # also log every step record to Weights & Biases

    def problems(self) -> Iterator[str]:
        yield from at_least("logging.iteration_step_info_interval", self.iteration_step_info_interval, 1)
        if self.wandb is not None and not self.wandb.project:
            yield "logging.wandb.project must not be empty; name the W&B project the runs go to"
        for key, module, extra in (("logging.tensorboard_dir", "tensorboard", "tensorboard"),
                                   ("logging.wandb", "wandb", "wandb")):
            if getattr(self, key.split(".")[1]) is not None and importlib.util.find_spec(module) is None:
                yield (f"{key} is set but the {module} package is not installed; pip install -e \".[{extra}]\" or "
                       "unset it")


@dataclass
class ProfilerArgs:
    profiler_export_path: Path | None = None
