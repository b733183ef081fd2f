"""YAML <-> `Config`: strict keys, checked types and enumerations, upstream keys, atomic saves.

Loading never guesses: an unknown key is an error with the valid name it is a typo of (if any), a value of the wrong
type is an error naming the expected type, a value outside a `Literal` field's values is an error naming them (after
the field's accepted `Spellings`). Upstream nanotron's keys are translated first (`upstream.py`): renamed, ignored
with one warning, or refused naming the feature. All problems in a file are reported together.
"""

import math
import os
import typing
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import MISSING, Field, fields, is_dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from nanotron.config.config import Config, validate_config
from nanotron.config.data import DatasetArgs, HFDatasetArgs, SFTDatasetArgs
from nanotron.config.general import DEFAULT_RUN_NAME
from nanotron.config.model import MISPLACED_KEYS, MODEL_CONFIG_CLASSES, ExistingCheckpointInit, ModelArgs
from nanotron.config.rules import (
    ConfigError,
    canonical,
    is_literal_value,
    literal_problem,
    literal_values,
    unannotated,
    union_members,
)
from nanotron.config.upstream import V04_DATA_STAGE_NAME, other_spellings, translate, translate_model_config
from nanotron.files import atomic_write_text

_SCALAR_NAMES: dict[type, tuple[str, str]] = {
    bool: ("a boolean (true/false)", "booleans"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
    Path: ("a path", "paths"),
    dict: ("a mapping", "mappings"),
}


class LegacyKeyWarning(UserWarning):
    """Keys of upstream nanotron that are accepted for compatibility but have no effect (all named in one)."""


class DuplicateKeyWarning(UserWarning):
    """A key written twice in one mapping: the last value wins, as in upstream nanotron."""


class RunLengthWarning(UserWarning):
    """A warmup or a data stage that reaches past ``tokens.train_steps``: fine for a run trained in parts."""


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that warns about duplicate keys, which PyYAML would otherwise resolve silently to the last one
    (upstream's own examples repeat keys, and the last one wins there too), and refuses documents that expand past
    MAX_YAML_VALUES values through aliases (see `_check_expansion`)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                warnings.warn(f"line {key_node.start_mark.line + 1}: the key {key!r} is written more than once in "
                              "one mapping; the last value is used", DuplicateKeyWarning, stacklevel=2)
            seen.add(key)
        return super().construct_mapping(node, deep)

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_expansion(node, "", {}, set())
        return self.construct_document(node)


# Values (scalars, lists, mappings) a YAML document may hold once its aliases are expanded. A config holds a few
# hundred, a blend of thousands of folders a few ten thousand; nested aliases ("billion laughs") reach billions
# in a few lines, and every later step (type checks, error messages) walks the expanded values.
MAX_YAML_VALUES = 100_000


class _YAMLExpansionError(Exception):
    """Raised by `_check_expansion` inside PyYAML's loader; `_read_yaml` turns it into a ConfigError."""


def _check_expansion(node: yaml.Node, key: str, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """The number of values under `node` once aliases are expanded (an alias counts the values it stands for
    again). Raises at the first key whose values pass MAX_YAML_VALUES, or whose alias refers to a value that
    contains it, before PyYAML builds anything: the composed nodes share what aliases refer to, so counting
    takes one visit per distinct node."""
    if id(node) in sizes:
        return sizes[id(node)]
    where = f"'{key}'" if key else "the document"
    if id(node) in open_nodes:
        raise _YAMLExpansionError(f"{where} is an alias of a value that contains it; write the value out")
    if isinstance(node, yaml.MappingNode):  # keys are values too (and may be aliases)
        children = [(_join(key, name.value if isinstance(name, yaml.ScalarNode) else "?"), part)
                    for name, value in node.value for part in (name, value)]
    elif isinstance(node, yaml.SequenceNode):
        children = [(f"{key}[{i}]", item) for i, item in enumerate(node.value)]
    else:
        children = []
    open_nodes.add(id(node))
    total = 1
    for child_key, child in children:
        total += _check_expansion(child, child_key, sizes, open_nodes)
        if total > MAX_YAML_VALUES:
            raise _YAMLExpansionError(
                f"{where} holds more than {MAX_YAML_VALUES:,} values once its YAML aliases (*name) are expanded; "
                "write the values out instead of nesting aliases")
    open_nodes.discard(id(node))
    sizes[id(node)] = total
    return total


def _read_yaml(text: str) -> Any:
    """Plain data from YAML text; raises ConfigError (without the file name) on invalid, duplicate-key or
    exploding documents."""
    try:
        return yaml.load(text, Loader=_ConfigLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{where}invalid YAML: {e.problem}") from None
    except _YAMLExpansionError as e:
        raise ConfigError(str(e)) from None
    except RecursionError:
        raise ConfigError("the YAML is nested too deeply to read; a config is a few levels deep") from None


_INVALID = object()  # returned (after recording a problem) where a value could not be read


def _join(parent: str, name: Any) -> str:
    return f"{parent}.{name}" if parent else str(name)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _is_required(f: Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _describe(tp: Any, plural: bool = False) -> str:
    tp = unannotated(tp)
    members = union_members(tp)
    if members is not None:
        return " or ".join("null" if m is type(None) else _describe(m, plural) for m in members)
    if typing.get_origin(tp) is list:
        return ("lists" if plural else "a list") + " of " + _describe(typing.get_args(tp)[0], plural=True)
    if is_dataclass(tp):
        return "mappings" if plural else "a mapping"
    values = literal_values(tp)
    if values is not None:
        return " or ".join(repr(value) for value in values)
    singular, plural_name = _SCALAR_NAMES[tp]
    return plural_name if plural else singular


def _shape(cls: type) -> str:
    """`{std: <a number>}`: the required keys of a dataclass, to tell users which form of a union to write."""
    hints = typing.get_type_hints(cls)
    return "{" + ", ".join(f"{f.name}: <{_describe(hints[f.name])}>" for f in fields(cls) if _is_required(f)) + "}"


def _scalar(tp: type, raw: Any) -> Any:
    """`raw` as type `tp`, or _INVALID. Bools are not ints here, NaN is not a number, and a float may be a
    string: YAML 1.1 reads `1e-3` (no dot) as a string, and that is how people write learning rates. A `Literal`
    value comes back in its canonical spelling."""
    if literal_values(tp) is not None:
        return canonical(tp, raw) if is_literal_value(tp, raw) else _INVALID
    if tp is bool:
        return raw if isinstance(raw, bool) else _INVALID
    if tp is int:
        return raw if isinstance(raw, int) and not isinstance(raw, bool) else _INVALID
    if tp is float:
        try:
            number = float(raw) if isinstance(raw, (int, float, str)) and not isinstance(raw, bool) else math.nan
        except ValueError:
            return _INVALID
        return _INVALID if math.isnan(number) else number
    if tp is str:
        return raw if isinstance(raw, str) else _INVALID
    if tp is Path:
        return Path(raw) if isinstance(raw, str) and raw else _INVALID
    if tp is dict:
        return raw if isinstance(raw, dict) else _INVALID
    raise TypeError(f"the config loader cannot read fields of type {tp!r}")


class _Reader:
    """Builds schema objects from plain YAML values, recording one message per problem instead of stopping."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def _fail(self, key: str, expected: str, raw: Any) -> object:
        self.problems.append(f"{key}: expected {expected}, got {_show(raw)}")
        return _INVALID

    def config(self, raw: Any) -> Config | object:
        if not isinstance(raw, dict):
            return self._fail("the config", "a mapping of sections (general, checkpoints, model, ...)", raw)
        return self.dataclass(Config, raw, "")

    def value(self, tp: Any, raw: Any, key: str) -> Any:
        members = union_members(tp) or (tp,)
        if raw is None and type(None) in members:
            return None
        choices = [m for m in members if m is not type(None)]
        if len(choices) > 1 and not any(is_dataclass(choice) for choice in choices):  # e.g. int | str: first fit
            read = (_scalar(choice, raw) for choice in choices)
            value = next((value for value in read if value is not _INVALID), _INVALID)
            return self._fail(key, _describe(tp), raw) if value is _INVALID else value
        if len(choices) > 1:
            return self.dataclass_union(choices, raw, key)
        (kind,) = choices
        if is_dataclass(kind):
            return self.dataclass(kind, raw, key) if isinstance(raw, dict) else self._fail(key, _describe(tp), raw)
        if typing.get_origin(kind) is list:
            if not isinstance(raw, list):
                return self._fail(key, _describe(tp), raw)
            start = len(self.problems)
            items = [self.value(typing.get_args(kind)[0], item, f"{key}[{i}]") for i, item in enumerate(raw)]
            return items if len(self.problems) == start else _INVALID
        if literal_values(kind) is not None:  # one line naming the values (and spellings) it accepts
            problem = literal_problem(key, kind, raw)
            if problem is not None:
                self.problems.append(problem)
                return _INVALID
        value = _scalar(kind, raw)
        return self._fail(key, _describe(tp), raw) if value is _INVALID else value

    def dataclass(self, cls: type, raw: dict, key: str) -> Any:
        start = len(self.problems)
        hints = typing.get_type_hints(cls, include_extras=True)  # with the Spellings of Literal fields
        names = [f.name for f in fields(cls)]  # not the class variables (a family's facts)
        for name in raw:
            if name not in names:
                self._unknown_key(cls, _join(key, name), str(name), names)
        values = {}
        for f in fields(cls):
            dotted = _join(key, f.name)
            if f.name in raw:
                read = _FIELD_READERS.get((cls, f.name), _Reader.value)
                values[f.name] = read(self, hints[f.name], raw[f.name], dotted)
            elif _is_required(f):
                what = "section" if not key else "key"
                self.problems.append(f"missing required {what} '{dotted}'; add it (see docs/config.md)")
        return cls(**values) if len(self.problems) == start else _INVALID

    def _unknown_key(self, cls: type, dotted: str, name: str, valid: list[str]) -> None:
        keys, hint = MISPLACED_KEYS.get(cls, ((), ""))
        if name in keys:
            self.problems.append(f"unknown key '{dotted}': {hint}")
            return
        close = closest_key(name, valid)
        hint = f"did you mean '{close}'?" if close else f"valid keys are: {', '.join(valid)}"
        self.problems.append(f"unknown key '{dotted}'; {hint}")

    def dataclass_union(self, choices: list[type], raw: Any, key: str) -> Any:
        """Pick the member whose required keys `raw` has: `{std: ...}` is a RandomInit, `{path: ...}` a checkpoint;
        its other keys are then checked by that member (an unknown one gets its own line). Where several members have
        them (upstream's SFT datasets and pretraining's both need `hf_dataset_or_datasets`), the first that knows
        every key of `raw` is picked; where none does, the forms are named."""
        if isinstance(raw, dict):
            fitting = [cls for cls in choices if {f.name for f in fields(cls) if _is_required(f)} <= raw.keys()]
            if len(fitting) > 1:
                fitting = [cls for cls in fitting if raw.keys() <= {f.name for f in fields(cls)}][:1] or fitting
            if len(fitting) == 1:
                return self.dataclass(fitting[0], raw, key)
        return self._fail(key, " or ".join(_shape(cls) for cls in choices), raw)

    def model_config(self, tp: Any, raw: Any, key: str) -> Any:
        """The architecture is named by a marker key, e.g. `is_llama_config: true`, as in nanotron."""
        if not isinstance(raw, dict):
            return self._fail(key, "a mapping", raw)
        markers = [marker for marker in MODEL_CONFIG_CLASSES if raw.get(marker) is True]
        if len(markers) != 1:
            supported = ", ".join(f"'{marker}: true'" for marker in MODEL_CONFIG_CLASSES)
            found = f"found {', '.join(markers)}" if markers else "found none"
            self.problems.append(f"{key}: add exactly one model type marker, one of {supported} ({found})")
            return _INVALID
        return self.dataclass(MODEL_CONFIG_CLASSES[markers[0]], raw, key)

    def one_or_list(self, tp: Any, raw: Any, key: str) -> Any:
        """One folder (or split) may be written as a plain string; it is stored as a one-item list."""
        return self.value(tp, [raw] if isinstance(raw, str) else raw, key)


# Fields whose YAML form is not just their type.
_FIELD_READERS = {
    (ModelArgs, "model_config"): _Reader.model_config,
    (DatasetArgs, "dataset_folder"): _Reader.one_or_list,
    (HFDatasetArgs, "hf_dataset_splits"): _Reader.one_or_list,
    (SFTDatasetArgs, "hf_dataset_splits"): _Reader.one_or_list,
}


def _edit_distance(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of neighbours that turn ``a`` into ``b``."""
    previous, current = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        before, previous, current = previous, current, [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                current[j] = min(current[j], before[j - 2] + 1)
    return current[-1]


def closest_key(name: str, valid: Sequence[str]) -> str | None:
    """The valid key ``name`` is a typo of, or None: at most one edit per five characters (at least one), ignoring
    case. Keys that merely share words (``context_parallel_size``, ``expert_parallel_size``) are not typos of each
    other, and a wrong hint misleads more than none."""
    allowed = max(1, len(name) // 5)
    distances = sorted((_edit_distance(name.lower(), key.lower()), key) for key in valid)
    return distances[0][1] if distances and distances[0][0] <= allowed else None


def _run_length_warnings(cfg: Config) -> None:
    """Upstream lets a warmup or a data stage reach past ``train_steps`` (a run trained in parts raises it on each
    resume); here too, with a warning in case it is a mistake."""
    train_steps, warmup = cfg.tokens.train_steps, cfg.optimizer.learning_rate_scheduler.lr_warmup_steps
    if warmup > train_steps:
        warnings.warn(f"optimizer.learning_rate_scheduler.lr_warmup_steps ({warmup}) is longer than "
                      f"tokens.train_steps ({train_steps}): this run ends inside the warmup", RunLengthWarning,
                      stacklevel=3)
    for stage in cfg.data_stages:
        if stage.start_training_step > train_steps:
            warnings.warn(f"data_stages[{stage.name!r}].start_training_step ({stage.start_training_step}) is after "
                          f"tokens.train_steps ({train_steps}): this run never reaches the stage", RunLengthWarning,
                          stacklevel=3)


def _context_at_least_the_sequences(cfg: Config) -> None:
    """Upstream trains a model with fresh weights on sequences longer than ``max_position_embeddings`` (without RoPE
    scaling nothing in training reads it); here the model then records the length it is trained on, with a warning,
    so that generation later allows those positions. With RoPE scaling, or weights from a checkpoint, the value
    means something and a shorter one stays an error."""
    model_config, sequence_length = cfg.model.model_config, cfg.tokens.sequence_length
    limit = getattr(model_config, "max_position_embeddings", None)
    if (limit is None or sequence_length <= limit or getattr(model_config, "rope_scaling", None) is not None
            or isinstance(cfg.model.init_method, ExistingCheckpointInit)):
        return
    warnings.warn(f"model.model_config.max_position_embeddings ({limit}) is below tokens.sequence_length "
                  f"({sequence_length}): the model is trained on {sequence_length} positions and records "
                  f"max_position_embeddings: {sequence_length}", RunLengthWarning, stacklevel=3)
    model_config.max_position_embeddings = sequence_length


def config_from_dict(d: dict) -> Config:
    """Build and validate a Config from plain data (e.g. parsed YAML); raises ConfigError listing every problem.

    Upstream nanotron's keys are translated first (``upstream.translate``); the keys it ignores are named in one
    ``LegacyKeyWarning``."""
    raw, translation = translate(d)
    reader = _Reader()
    cfg = reader.config(raw)
    ignored = translation.ignored_warning()
    if ignored is not None:
        warnings.warn(ignored, LegacyKeyWarning, stacklevel=2)
    problems = translation.problems + reader.problems
    if translation.problems and not reader.problems:
        try:  # a refused upstream feature is reported together with what the rules find in the rest
            validate_config(cfg)
        except ConfigError as error:
            problems += error.problems
    if problems:
        raise ConfigError(*problems)
    _context_at_least_the_sequences(cfg)
    validate_config(cfg)
    _run_length_warnings(cfg)
    return cfg


def model_config_from_dict(config_class: type, raw: dict, source: str | Path | None = None) -> Any:
    """A model config of ``config_class`` from plain data that is not a YAML config (the ``model.config`` of
    checkpoint.json, a Hugging Face config.json mapped to nanotron's fields), read like ``model.model_config`` in a
    YAML file: the one way a model config is built from data. ConfigError lists every problem. The values are
    checked by the family's rules afterwards (``model_config_problems``). Upstream's keys are translated first, as in
    a YAML file."""
    raw, translation = translate_model_config(raw)
    ignored = translation.ignored_warning()
    if ignored is not None:
        warnings.warn(ignored, LegacyKeyWarning, stacklevel=2)
    reader = _Reader()
    config = reader.dataclass(config_class, raw, "")
    if translation.problems or reader.problems:
        raise ConfigError(*translation.problems, *reader.problems, source=source)
    return config


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Set ``section.key=value`` entries (values parsed as YAML) on plain config data, e.g. ``parallelism.tp=2``.

    Lets one example file serve several layouts from the command line; the result is validated like any config. A
    setting the file also gives under another spelling (upstream's ``optimizer.optimizer_factory.adam_eps`` beside
    ``optimizer.adam_eps``) is set under both, so the override wins. A key of the other form of the data section than
    the file's (v0.4's ``data``, or ``data_stages``) is refused, naming the key to override instead.
    """
    for override in overrides:
        dotted, sep, value = override.partition("=")
        if not sep or not dotted:
            raise ConfigError(f"override {override!r} is not of the form section.key=value (e.g. parallelism.tp=2)")
        problem = _other_data_form(raw, dotted, value)
        if problem is not None:
            raise ConfigError(f"override {override!r}: {problem}")
        try:
            parsed = _read_yaml(value)
        except ConfigError as e:
            raise ConfigError(f"override {override!r}: {e}") from None
        for key in (dotted, *(other for other in other_spellings(dotted) if _holds(raw, other))):
            _set_key(raw, key, parsed, override)
    return raw


def _set_key(raw: dict, dotted: str, value: Any, override: str) -> None:
    *parents, leaf = dotted.split(".")
    node: Any = raw
    for part in parents:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: '{part}' is not inside a section")
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
    if isinstance(node, list) and leaf.isdigit() and int(leaf) < len(node):
        node[int(leaf)] = value
    elif isinstance(node, dict):
        node[leaf] = value
    else:
        raise ConfigError(f"override {override!r}: '{leaf}' is not inside a section")


def _holds(raw: dict, dotted: str) -> bool:
    *parents, leaf = dotted.split(".")
    node: Any = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return isinstance(node, dict) and leaf in node


def _other_data_form(raw: dict, dotted: str, value: str) -> str | None:
    """Why an override of ``data_stages.*`` on a file with v0.4's ``data`` section (or of ``data.*`` on a file with
    ``data_stages``) cannot apply, and what to override instead; None when the key is of the file's form."""
    section, _, rest = dotted.partition(".")
    if section == "data_stages" and "data_stages" not in raw and isinstance(raw.get("data"), dict):
        index, _, key = rest.partition(".")
        instead = (f"override data.{key.removeprefix('data.')}={value}" if index == "0" and key.startswith("data.")
                   else "override its keys as data.<key>")
        return (f"this file has v0.4's data section (one stage, {V04_DATA_STAGE_NAME!r}, from step 1), not "
                f"data_stages; {instead} instead")
    if section == "data" and "data" not in raw and isinstance(raw.get("data_stages"), list) and rest:
        return (f"this file has data_stages, not v0.4's data section; override data_stages.<index>.data.{rest}="
                f"{value} instead (index 0: the first stage)")
    return None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read, type-check and validate a YAML config; every ConfigError message starts with the file name.

    ``overrides`` (``section.key=value``) are applied to the YAML before it is checked.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist; pass the path of a YAML config") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file '{path}': {e}; pass a readable UTF-8 YAML file") from None
    try:
        raw = _read_yaml(text)
        return config_from_dict(apply_overrides(raw, overrides) if overrides else raw)
    except ConfigError as e:
        raise ConfigError(*e.problems, source=path) from None


def _plain(value: Any) -> Any:
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {name: _plain(item) for name, item in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def config_to_dict(cfg: Config) -> dict:
    """Plain data in schema order (sections and fields), paths as strings: what `save_config` writes."""
    return _plain(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write `cfg` as YAML that `load_config` reads back to an equal Config.

    The file is written next to its destination and renamed into place, so a crash never leaves half a config
    (checkpoints rely on theirs being complete).
    """
    atomic_write_text(Path(path), yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False))


def expand_run_name(cfg: Config, now: datetime | None = None) -> Config:
    """A copy of `cfg` whose `general.run` has `%date` (YYYYMMDD_HHMMSS) and `%jobid` (SLURM_JOB_ID or "local")
    filled in; an unset run name becomes "%date_%jobid" first.

    Kept out of `load_config` so loading stays a pure function of the file (a saved config reloads equal).
    Every rank must use the same name, so pass `now` from one rank (e.g. broadcast from rank 0).
    """
    now = now or datetime.now()
    run = (cfg.general.run or DEFAULT_RUN_NAME).replace("%date", now.strftime("%Y%m%d_%H%M%S"))
    run = run.replace("%jobid", os.environ.get("SLURM_JOB_ID", "local"))
    return replace(cfg, general=replace(cfg.general, run=run))
