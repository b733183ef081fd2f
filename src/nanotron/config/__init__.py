"""The typed training config: schema (`schema.py`), YAML loading and saving (`loading.py`), checks (`validation.py`).

Users write YAML in nanotron's format (see docs/config.md); code reads it with `load_config` and gets a `Config`.
"""

from nanotron.config.loading import (
    LEGACY_KEYS,
    LegacyKeyWarning,
    config_from_dict,
    config_to_dict,
    expand_run_name,
    load_config,
    save_config,
)
from nanotron.config.schema import (
    DEFAULT_RUN_NAME,
    MODEL_CONFIG_CLASSES,
    CheckpointsArgs,
    Config,
    ConfigError,
    DataArgs,
    DatasetArgs,
    DatasetStageArgs,
    ExistingCheckpointInit,
    GeneralArgs,
    LlamaConfig,
    LoggingArgs,
    LRSchedulerArgs,
    ModelArgs,
    OptimizerArgs,
    ParallelismArgs,
    ProfilerArgs,
    RandomInit,
    TokenizerArgs,
    TokensArgs,
)
from nanotron.config.validation import validate_config

__all__ = [
    "DEFAULT_RUN_NAME",
    "LEGACY_KEYS",
    "MODEL_CONFIG_CLASSES",
    "CheckpointsArgs",
    "Config",
    "ConfigError",
    "DataArgs",
    "DatasetArgs",
    "DatasetStageArgs",
    "ExistingCheckpointInit",
    "GeneralArgs",
    "LRSchedulerArgs",
    "LegacyKeyWarning",
    "LlamaConfig",
    "LoggingArgs",
    "ModelArgs",
    "OptimizerArgs",
    "ParallelismArgs",
    "ProfilerArgs",
    "RandomInit",
    "TokenizerArgs",
    "TokensArgs",
    "config_from_dict",
    "config_to_dict",
    "expand_run_name",
    "load_config",
    "save_config",
    "validate_config",
]
