"""What every config section shares: a dataclass schema filled from a YAML file (after the files its
`base:` key names) and `key=value` overrides (OmegaConf), choices as `Literal` fields, ranges as one
table per section, and the one error format: `config: KEY=VALUE is not accepted; accepted: a, b`.
Imports nothing of the project: the run config, the `eval:` section and the tasks' sections use it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import typing
from typing import Any, Literal

from omegaconf import OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

YAML_BOOLEANS = ("yes", "no", "on", "off", "true", "false")  # words an unquoted YAML 1.1 value turns to bool


class ConfigError(ValueError):
    """A config mistake, described in one line that names the field."""


def not_accepted(key: str, value: Any, accepted: typing.Iterable[Any], prefix: str = "config: ") -> ConfigError:
    """The one error of a choice: `config: KEY=VALUE is not accepted; accepted: a, b, c`."""
    accepted = list(accepted)
    listed = ", ".join(repr(a) if a == "" else str(a) for a in accepted)
    hint = ""
    if isinstance(value, bool) and any(str(a).lower() in YAML_BOOLEANS for a in accepted):
        hint = " (YAML reads an unquoted yes/no/on/off as a boolean: quote the word, e.g. 'no')"
    return ConfigError(f"{prefix}{key}={value!r} is not accepted; accepted: {listed}{hint}")


# ----------------------------------------------------------------------------- choices (Literal fields)
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def choices(cls: type, name: str) -> tuple:
    """The values a `Literal` field of dataclass `cls` accepts (() for any other field)."""
    annotation = _hints(cls).get(name)
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else ()


def check_choices(cfg: Any, prefix: str = "") -> None:
    """Every `Literal` field of the dataclass `cfg`, and of the dataclasses it holds, against its values.
    OmegaConf refuses a bad one as a file or override is read; this also covers a config built in Python."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_choices(value, f"{prefix}{f.name}.")
            continue
        accepted = choices(type(cfg), f.name)
        if accepted and (value not in accepted or isinstance(value, bool)):
            raise not_accepted(prefix + f.name, value, accepted)


# ----------------------------------------------------------------------------- ranges
_RANGE = re.compile(r"(>=|>) (-?[\d.e+-]+)|([\[(])(-?[\d.]+), (-?[\d.]+)([\])])")


def check_ranges(cfg: Any, ranges: dict[str, str | tuple[str, str]], prefix: str = "") -> None:
    """`ranges`: dotted key (below `cfg`) -> `>= 1`, `> 0`, `[0, 1)` or `(0, 1)`, or (that rule, a note
    on what the field means). The first key out of its range: `config: KEY must be RULE, got VALUE (NOTE)`."""
    for key, rule in ranges.items():
        rule, note = (rule, "") if isinstance(rule, str) else rule
        value = functools.reduce(getattr, key.split("."), cfg)
        match = _RANGE.fullmatch(rule)
        if match is None:
            raise AssertionError(f"range rule {rule!r} of {key}: write `>= x`, `> x`, `[a, b)` or `(a, b)`")
        if match.group(1):
            low = float(match.group(2))
            inside = value >= low if match.group(1) == ">=" else value > low
            said = rule
        else:
            low, high = float(match.group(4)), float(match.group(5))
            inside = (low <= value if match.group(3) == "[" else low < value) and (
                value <= high if match.group(6) == "]" else value < high
            )
            said = f"in {rule}"
        if not inside:
            raise ConfigError(f"config: {prefix}{key} must be {said}, got {value}" + (f" ({note})" if note else ""))


# ----------------------------------------------------------------------------- the loader
def load_structured(schema: Any, path: str | None = None, overrides: typing.Sequence[str] = ()) -> Any:
    """`schema` (a dataclass, or an instance whose values are the defaults) <- the YAML file `path`, after
    the files its `base:` key names <- `key=value` overrides, in order (a later one wins; `key=` empties a
    text field). Returns the dataclass instance, not yet validated; every mistake is one ConfigError line."""
    cls = schema if isinstance(schema, type) else type(schema)
    try:
        merged = OmegaConf.structured(schema)
        if path is not None:
            for layer in _file_layers(path):
                merged = OmegaConf.merge(merged, layer)
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"config: overrides must look like key=value, got {bad[0]!r}")
        for override in overrides:
            key, value = override.split("=", 1)
            if value == "":  # `key=` empties a text field (data.val= trains without held-out data)
                _empty(merged, key, cls)
            else:
                merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([override]))
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e, cls)) from None


def _empty(merged, key: str, cls: type) -> None:
    """`key=`: set a text field to ""; any other field needs a value, and an unknown key is unknown."""
    try:
        OmegaConf.update(merged, key, "", merge=True)
    except ConfigAttributeError:
        raise ConfigError(_unknown_key(key, cls)) from None
    except ValidationError:
        accepted = _field_choices(cls, key)
        if accepted:
            raise not_accepted(key, "", accepted) from None
        raise ConfigError(
            f"config: {key}= is empty; {key} is not a text field and needs a value "
            f"(text fields such as data.val= may be emptied)"
        ) from None


def _file_layers(path: str, seen: tuple[str, ...] = ()) -> list:
    """A YAML file and, first, the files its `base:` key names (relative to it), recursively."""
    if not os.path.exists(path):
        raise ConfigError(
            f"config file {path} does not exist (`prunepipe configs` prints the folder of the shipped ones)"
        )
    if os.path.abspath(path) in seen:
        raise ConfigError(f"config file {path}: `base:` chain loops back to itself")
    layer = OmegaConf.load(path)
    base = layer.pop("base", None)
    if base is None:
        return [layer]
    return _file_layers(os.path.join(os.path.dirname(path), str(base)), seen + (os.path.abspath(path),)) + [layer]


def _one_line(e: OmegaConfBaseException, cls: type) -> str:
    key = getattr(e, "full_key", None) or "?"
    if isinstance(e, MissingMandatoryValue):
        return f"config: {key} is required"
    if isinstance(e, ConfigKeyError):
        return _unknown_key(key, cls)
    accepted = _field_choices(cls, key)
    if isinstance(e, ValidationError) and accepted:  # a Literal field: the choice's own format
        return str(not_accepted(key, getattr(e, "value", None), accepted))
    message = str(e).splitlines()[0]
    return f"config: {key}: {message}"


def _section(cls: type, parent: str) -> type | None:
    """The dataclass at dotted `parent` below `cls` (None where it is not one)."""
    for part in filter(None, parent.split(".")):
        hint = _hints(cls).get(part)
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            return None
        cls = hint
    return cls


def _field_choices(cls: type, key: str) -> tuple:
    parent, _, name = key.rpartition(".")
    section = _section(cls, parent)
    return choices(section, name) if section is not None else ()


def _unknown_key(key: str, cls: type) -> str:
    parent = key.rpartition(".")[0]
    section = _section(cls, parent)
    accepted = [f.name for f in dataclasses.fields(section)] if section is not None else []
    return f"config: unknown key {key!r}; accepted keys{' in ' + parent if parent else ''}: {', '.join(accepted)}"
