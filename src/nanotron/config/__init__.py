"""The typed training config: one module per section (its dataclasses and, beside their fields, their rules), one
per model family (`llama.py`, `moe.py`, `mamba.py`, `qwen2.py`, `qwen3.py`, `deepseek_v3.py`), the rules between
sections (`cross_section.py`), the whole `Config` with `validate_config` (`config.py`), and YAML loading and saving
(`loading.py`).

Users write YAML in nanotron's format (see docs/config.md); code reads it with `load_config` and gets a `Config`.
"""

from nanotron.config.checkpoints import CheckpointsArgs
from nanotron.config.config import Config, validate_config
from nanotron.config.data import (
    DataArgs,
    DatasetArgs,
    DatasetStageArgs,
    HFDatasetArgs,
    SFTDatasetArgs,
    TokenizerArgs,
    TokensArgs,
)
from nanotron.config.deepseek_v3 import DeepseekV3Config
from nanotron.config.evals import EvalsArgs, EvalTaskArgs
from nanotron.config.features import DoReMiArgs, FP8Args
from nanotron.config.general import DEFAULT_RUN_NAME, GeneralArgs, LoggingArgs, ProfilerArgs, WandbArgs
from nanotron.config.llama import ROPE_SCALING_KEYS, LlamaConfig
from nanotron.config.loading import (
    DuplicateKeyWarning,
    LegacyKeyWarning,
    RunLengthWarning,
    apply_overrides,
    closest_key,
    config_from_dict,
    config_to_dict,
    expand_run_name,
    load_config,
    model_config_from_dict,
    save_config,
)
from nanotron.config.mamba import MambaConfig, MambaSSMArgs
from nanotron.config.model import (
    MODEL_CONFIG_CLASSES,
    ExistingCheckpointInit,
    MambaInit,
    ModelArgs,
    RandomInit,
    SpectralMupInit,
)
from nanotron.config.moe import LlaMoEConfig
from nanotron.config.optimizer import LRSchedulerArgs, OptimizerArgs
from nanotron.config.parallelism import ParallelismArgs
from nanotron.config.qwen2 import Qwen2Config
from nanotron.config.qwen3 import Qwen3Config, Qwen3MoEConfig
from nanotron.config.rules import ConfigError, model_config_problems
from nanotron.config.upstream import IGNORED_KEYS

__all__ = [
    "DEFAULT_RUN_NAME",
    "IGNORED_KEYS",
    "MODEL_CONFIG_CLASSES",
    "ROPE_SCALING_KEYS",
    "CheckpointsArgs",
    "Config",
    "ConfigError",
    "DataArgs",
    "DatasetArgs",
    "DatasetStageArgs",
    "DeepseekV3Config",
    "DoReMiArgs",
    "DuplicateKeyWarning",
    "EvalTaskArgs",
    "EvalsArgs",
    "FP8Args",
    "ExistingCheckpointInit",
    "GeneralArgs",
    "HFDatasetArgs",
    "SFTDatasetArgs",
    "LRSchedulerArgs",
    "LegacyKeyWarning",
    "LlaMoEConfig",
    "MambaConfig",
    "MambaInit",
    "MambaSSMArgs",
    "LlamaConfig",
    "LoggingArgs",
    "ModelArgs",
    "OptimizerArgs",
    "ParallelismArgs",
    "ProfilerArgs",
    "Qwen2Config",
    "Qwen3Config",
    "Qwen3MoEConfig",
    "RandomInit",
    "RunLengthWarning",
    "SpectralMupInit",
    "TokenizerArgs",
    "TokensArgs",
    "WandbArgs",
    "apply_overrides",
    "closest_key",
    "config_from_dict",
    "config_to_dict",
    "expand_run_name",
    "load_config",
    "model_config_from_dict",
    "model_config_problems",
    "save_config",
    "validate_config",
]
