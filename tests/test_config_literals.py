"""Enumerations in the config are `Literal` fields, and the loader refuses any other value naming the key and the
values it accepts; no string field is left as an unchecked enumeration."""

import types
import typing
from dataclasses import fields, is_dataclass, replace
from typing import Any, Literal

import pytest
import yaml

from nanotron.config import (
    MODEL_CONFIG_CLASSES,
    Config,
    ConfigError,
    config_from_dict,
    validate_config,
)
from support import ROOT

EXAMPLE = ROOT / "examples" / "config_tiny_llama.yaml"

# String fields that hold free text (names, regexes), not a choice among values; every other string field of the
# schema must be a Literal. A new enumeration written as a plain `str` fails test_no_string_field_is_an_unchecked_*.
FREE_TEXT = {
    "general.project", "general.run", "tokenizer.tokenizer_name_or_path", "tokenizer.tokenizer_revision",
    "optimizer.weight_decay_exclude_named_params", "data_stages[0].name", "logging.wandb.project",
    "logging.wandb.entity", "logging.wandb.name", "doremi.domain_names", "fp8.exclude_modules",
    "optimizer.muon_named_params", "evals.tasks[0].name", "evals.tasks[0].target_delimiter",
    "evals.tasks[0].fewshot_delimiter",
}
EXPECTED_LITERALS = {
    "parallelism.pp_engine", "parallelism.tp_mode", "model.dtype", "model.model_config.hidden_act",
    "model.model_config.ssm_cfg.dt_init", "optimizer.learning_rate_scheduler.lr_warmup_style",
    "optimizer.learning_rate_scheduler.lr_decay_style", "logging.log_level", "logging.log_level_replica",
    "logging.wandb.mode", "fp8.recipe", "fp8.gradient_format", "parallelism.recompute",
    "optimizer.adam_moments_dtype", "model.attention_backend", "optimizer.name", "optimizer.muon_update_scale",
    "model.model_config.moe_config.load_balancing_scope",
}


def _without_none(tp: Any) -> list[Any]:
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return [member for member in members if member is not type(None)]


def _literal(tp: Any) -> tuple | None:
    """The values of a Literal type, also one wrapped in Annotated (with its accepted spellings)."""
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def _schema_fields(cls: type, key: str = "") -> list[tuple[str, str, Any]]:
    """(dotted key, family marker or "", type) of every leaf field under ``cls``, each model family's fields under
    ``model.model_config``."""
    found = []
    for f in fields(cls):
        dotted = f"{key}.{f.name}" if key else f.name
        members = _without_none(typing.get_type_hints(cls, include_extras=True)[f.name])
        if dotted == "model.model_config":
            found += [(f"{dotted}.{name}", marker, tp) for marker, family in MODEL_CONFIG_CLASSES.items()
                      for name, _, tp in _schema_fields(family)]
        elif len(members) == 1 and is_dataclass(members[0]):
            found += _schema_fields(members[0], dotted)
        elif len(members) == 1 and typing.get_origin(members[0]) is list and is_dataclass(
                typing.get_args(members[0])[0]):
            found += _schema_fields(typing.get_args(members[0])[0], f"{dotted}[0]")
        else:
            found += [(dotted, "", members[0] if len(members) == 1 else members)]
    return found


FIELDS = _schema_fields(Config)
LITERALS = {(key, marker): tp for key, marker, tp in FIELDS if _literal(tp) is not None}


def test_every_enumeration_is_a_literal_field():
    assert {key for key, _ in LITERALS} == EXPECTED_LITERALS


def test_no_string_field_is_an_unchecked_enumeration():
    strings = {key for key, _, tp in FIELDS if tp in (str, list[str])}
    assert strings == FREE_TEXT


def _example_with_fp8() -> dict:
    d = yaml.safe_load(EXAMPLE.read_text())
    d["fp8"] = {"enabled": True}
    return d


def _with_every_section() -> dict:
    """The example config with every optional section that holds Literal fields (read by the loader only: W&B
    need not be installed)."""
    d = _example_with_fp8()
    d["logging"]["wandb"] = {"project": "p"}
    return d


def _set(d: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.replace("[0]", ".0").split(".")
    for part in parents:
        d = d[int(part)] if isinstance(d, list) else d.setdefault(part, {})
    d[leaf] = value


@pytest.mark.parametrize("key, marker", sorted(LITERALS), ids=[key for key, _ in sorted(LITERALS)])
def test_the_loader_refuses_a_value_outside_a_literal_naming_the_key_and_the_allowed_values(key, marker):
    d = _with_every_section()
    if marker:  # a field of one model family: that family's config, defaults elsewhere
        d["model"]["model_config"] = {marker: True}
    _set(d, key, "not-a-choice")
    with pytest.raises(ConfigError) as info:
        config_from_dict(d)
    (problem,) = info.value.problems
    allowed = _literal(LITERALS[key, marker])
    assert problem.startswith(f"{key} must be ") and problem.endswith("(got 'not-a-choice')"), problem
    assert all(str(value) in problem for value in allowed), problem


def test_a_literal_inside_a_union_is_checked_and_named():
    d = _with_every_section()
    d["model"]["model_config"] = {"is_mamba_config": True, "ssm_cfg": {"dt_rank": "big"}}
    with pytest.raises(ConfigError, match=r"^model\.model_config\.ssm_cfg\.dt_rank: expected an integer or 'auto', "
                                          r"got 'big'"):
        config_from_dict(d)


def test_accepted_spellings_are_stored_canonically_and_listed_in_the_error():
    d = _example_with_fp8()
    d["parallelism"] |= {"pp_engine": "AFAB", "tp_mode": "reduce_scatter"}
    d["model"]["dtype"] = "BF16"
    cfg = config_from_dict(d)
    assert (cfg.parallelism.pp_engine, cfg.parallelism.tp_mode, cfg.model.dtype) == ("afab", "REDUCE_SCATTER",
                                                                                      "bfloat16")
    d["model"]["dtype"] = "float8"
    with pytest.raises(ConfigError, match=r"^model\.dtype must be one of float32, bfloat16, float16, fp32, bf16, fp16 "
                                          r"\(got 'float8'\)$"):
        config_from_dict(d)


def test_literals_of_configs_built_in_code_are_checked_too():
    """Configs the loader never read: built in Python."""
    cfg = config_from_dict(_example_with_fp8())
    bad = replace(cfg, parallelism=replace(cfg.parallelism, pp_engine="LoopedBFS"),
                  fp8=replace(cfg.fp8, recipe="blockwise"))
    with pytest.raises(ConfigError) as info:
        validate_config(bad)
    assert info.value.problems == ["parallelism.pp_engine must be one of afab, 1f1b, interleaved_1f1b, zb_h1, zbv, "
                                   "gpipe, interleaved1f1b, interleavedzerobubble, zbvzerobubble (got 'loopedbfs')",
                                   "fp8.recipe must be one of tensorwise, rowwise, delayed (got 'blockwise')"]

