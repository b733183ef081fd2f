"""What every section's rules are written with: the error they end in, numeric rules, and `Literal` enumerations.

Each section module holds its dataclasses and, beside their fields, their rules: a ``problems()`` method yielding
one line per broken rule, naming the key and the fix. Enumerations are ``Literal`` types (wrapped in ``Annotated``
with ``Spellings`` where other spellings are accepted), so no section writes a "must be one of" rule: the loader
checks every Literal value as it reads it (``literal_problem``), and ``literal_problems`` checks a ``Config`` that was
built in code rather than read by the loader.
"""

import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

MODEL_CONFIG_KEY = "model.model_config"


class ConfigError(ValueError):
    """A config that cannot be used as written.

    Carries every problem found (one line each, naming the key and the fix) so users fix them all in one go;
    `source` is the file they came from, when there is one.
    """

    def __init__(self, *problems: str, source: str | Path | None = None):
        self.problems = list(problems)
        self.source = source
        where = f"{source}: " if source is not None else ""
        if len(problems) == 1:
            message = where + problems[0]
        else:
            message = f"{where}{len(problems)} problems:\n" + "\n".join(f"  - {problem}" for problem in problems)
        super().__init__(message)


def prefix(key: str | None) -> str:
    """``key.`` to put before a field name, or nothing where fields are named bare (key None)."""
    return f"{key}." if key else ""


def at_least(key: str, value: float, minimum: float) -> Iterator[str]:
    if value < minimum:
        yield f"{key} must be >= {minimum} (got {value})"


def positive(key: str, value: float) -> Iterator[str]:
    if not value > 0:  # also catches NaN
        yield f"{key} must be > 0 (got {value})"


class Spellings:
    """Other ways to write the values of a ``Literal`` field, stored as the canonical value.

    Goes in ``Annotated[Literal[...], Spellings(...)]``: ``fold`` (e.g. ``str.lower``) makes matching
    case-insensitive, ``aliases`` maps other names (``bf16``) to values. The loader applies it before checking
    the value, ``canonical_spellings`` (from ``__post_init__``) to objects built in code, so equal configs compare
    equal however they were written.
    """

    def __init__(self, fold: Callable[[str], str] | None = None, aliases: Mapping[str, str] | None = None):
        self.fold = fold
        self.aliases = dict(aliases or {})

    def canonical(self, raw: str) -> str:
        folded = self.fold(raw) if self.fold else raw
        return self.aliases.get(folded, folded)


def union_members(tp: Any) -> tuple[Any, ...] | None:
    """The members of a union type (`X | Y` or `Optional[X]`), or None when `tp` is not a union."""
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else None


def _unannotated(tp: Any) -> tuple[Any, Spellings | None]:
    if typing.get_origin(tp) is Annotated:
        base, *extras = typing.get_args(tp)
        return base, next((extra for extra in extras if isinstance(extra, Spellings)), None)
    return tp, None


def unannotated(tp: Any) -> Any:
    """``tp`` without its ``Annotated`` wrapper."""
    return _unannotated(tp)[0]


def literal_values(tp: Any) -> tuple[Any, ...] | None:
    """The values of a ``Literal`` type (``Annotated`` or not), or None when ``tp`` is not one."""
    base = unannotated(tp)
    return typing.get_args(base) if typing.get_origin(base) is Literal else None


def canonical(tp: Any, raw: Any) -> Any:
    """``raw`` in the canonical spelling of the Literal type ``tp`` (unchanged where ``tp`` has no ``Spellings``)."""
    spellings = _unannotated(tp)[1]
    return spellings.canonical(raw) if spellings is not None and isinstance(raw, str) else raw


def is_literal_value(tp: Any, raw: Any) -> bool:
    """Whether ``raw``, in any spelling ``tp`` accepts, is one of the Literal type's values (True is not 1 here)."""
    value = canonical(tp, raw)
    return any(value == allowed and type(value) is type(allowed) for allowed in literal_values(tp))


def literal_problem(key: str, tp: Any, raw: Any) -> str | None:
    """One line when ``raw`` is not a value of the Literal type ``tp`` in any accepted spelling, naming the key and
    every accepted spelling (a single one quoted: ``must be 'silu'``); None when it is."""
    if is_literal_value(tp, raw):
        return None
    values = literal_values(tp)
    spellings = _unannotated(tp)[1]
    accepted = [*values, *(spellings.aliases if spellings else ())]
    shown = repr(raw) if len(repr(raw)) <= 60 else repr(raw)[:57] + "..."
    if len(accepted) == 1:
        return f"{key} must be {accepted[0]!r} (got {shown})"
    return f"{key} must be one of {', '.join(str(choice) for choice in accepted)} (got {shown})"


def literal_problems(obj: Any, key: str | None = None) -> list[str]:
    """Every Literal field of the dataclass ``obj`` and of the dataclasses inside it whose value is not allowed.

    The loader checks these as it reads YAML; this covers objects it never read (built in code)."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    problems = []
    for f in fields(obj):
        value, dotted = getattr(obj, f.name), prefix(key) + f.name
        members = [m for m in union_members(hints[f.name]) or (hints[f.name],) if m is not type(None)]
        if len(members) == 1 and literal_values(members[0]) is not None and value is not None:
            problem = literal_problem(dotted, members[0], value)
            problems += [problem] if problem is not None else []
        elif is_dataclass(value):
            problems += literal_problems(value, dotted)
        elif isinstance(value, list):
            problems += [p for i, item in enumerate(value) if is_dataclass(item)
                         for p in literal_problems(item, f"{dotted}[{i}]")]
    return problems


def canonical_spellings(obj: Any) -> None:
    """Store every ``Spellings``-annotated field of ``obj`` in its canonical spelling (for ``__post_init__``)."""
    for name, tp in typing.get_type_hints(type(obj), include_extras=True).items():
        if _unannotated(tp)[1] is not None:
            setattr(obj, name, canonical(tp, getattr(obj, name)))


def model_config_problems(c: Any, tp: int = 1, *, key: str | None = MODEL_CONFIG_KEY, **layout) -> list[str]:
    """Every rule of a model config (any family) at ``tp`` tensor-parallel ranks: its values' rules (``problems``),
    then its shapes (``layout_problems``, which takes the other keyword arguments).

    Generation, evaluation and conversion check the configs they read from files (checkpoint.json, config.json) with
    it, after the loader read them (``loading.model_config_from_dict``: keys, types and Literal values).
    """
    return [*c.problems(key), *c.layout_problems(tp, key=key, **layout)]
