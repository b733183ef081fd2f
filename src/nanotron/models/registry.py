"""The model families nanotron trains, by name (the ``model.type`` of checkpoint.json) and by config class: the only
place that names them.

A family is a package ``models/<name>/`` whose ``__init__.py`` defines its :class:`ModelSpec`; its config dataclass
lives in ``nanotron/config`` (with its ``is_<name>_config`` marker). docs/design.md walks through adding one.
"""

from __future__ import annotations

from nanotron.config import ConfigError, model_config_problems
from nanotron.errors import CheckpointError
from nanotron.models.deepseek_v3 import DEEPSEEK_V3
from nanotron.models.llama import LLAMA
from nanotron.models.mamba import MAMBA
from nanotron.models.moe import LLAMOE
from nanotron.models.qwen2 import QWEN2
from nanotron.models.qwen3 import QWEN3
from nanotron.models.spec import ModelSpec

MODEL_SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (LLAMA, LLAMOE, MAMBA, QWEN2, QWEN3,
                                                                 DEEPSEEK_V3)}


def spec_named(name: str, source: object) -> ModelSpec:
    """The family called ``name`` by ``source`` (a checkpoint, for the error message)."""
    if name not in MODEL_SPECS:
        raise CheckpointError(f"{source} holds a {name!r} model, which this version cannot build (it has "
                              f"{', '.join(sorted(MODEL_SPECS))})")
    return MODEL_SPECS[name]


def spec_for_config(model_config: object) -> ModelSpec:
    for spec in MODEL_SPECS.values():
        if type(model_config) is spec.config_class:
            return spec
    raise TypeError(f"no model family is registered for {type(model_config).__name__}")


def spec_for_hf_model_type(model_type: str | None, source: object) -> ModelSpec:
    for spec in MODEL_SPECS.values():
        if model_type in spec.hf_adapter.hf_fields:
            return spec
    known = sorted(t for spec in MODEL_SPECS.values() for t in spec.hf_adapter.hf_fields)
    raise CheckpointError(f"{source} describes a {model_type!r} model; supported model_type values: "
                          f"{', '.join(known)}")


def check_model_config(model_config, tp: int, source: object, **keys) -> None:
    """Refuse a model config read from ``source`` (a file) that its family cannot build at ``tp`` ranks, with one
    line per problem, before anything is allocated; ``keys`` name the fields in messages (see
    ``model_config_problems``)."""
    problems = model_config_problems(model_config, tp, **keys)
    if problems:
        raise ConfigError(*problems, source=source)
