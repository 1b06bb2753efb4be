"""Loading TOML config files into msgspec Structs with one-line errors."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import msgspec.inspect

T = TypeVar("T")


# A credential sent as `Authorization: Bearer <value>`: printable ASCII with no
# space at either end. Anything else is refused at start, since the HTTP layer
# would reject the header on every dial and put its value in the error.
BEARER_VALUE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")


class ConfigError(Exception):
    """A config file is unreadable or has a bad key; ``str()`` is one line."""


_PATH = re.compile(r" - at `\$\.?([^`]*)`$")  # (the last: a value may hold the words)


def _one_line(err: msgspec.ValidationError) -> str:
    text = str(err)
    m = _PATH.search(text)
    problem = _PATH.sub("", text)
    problem = problem[0].lower() + problem[1:] if problem else problem
    unknown = re.match(r"object contains unknown field `(.+)`", problem)
    if m:
        key = m.group(1)
        if unknown:
            return f"{key}.{unknown.group(1)}: unknown key" if key else f"{unknown.group(1)}: unknown key"
        return f"{key}: {problem}"
    if unknown:
        return f"{unknown.group(1)}: unknown key"
    return problem


def load(path: str | Path, cls: type[T]) -> T:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    except UnicodeDecodeError as e:  # TOML is UTF-8 (a traceback before)
        raise ConfigError(f"{path}: not UTF-8 (byte {e.start}): a TOML file is UTF-8 text") from e
    return convert(raw, cls, source=str(path))


MAX_INT = 2**53  # larger than any setting means; past 2**64 a value cannot even go on the wire


def _bad_number(raw: Any, ints: bool = False) -> tuple[str, str] | None:
    """The first key holding a number no setting takes, and why: NaN (TOML's
    ``nan``: no setting means "not a number", and NaN passes every ``<=`` check
    a setting has; a NaN timeout reached the run timers' heap), or with ``ints``
    an integer past 2**53 (a node's ``context_window = 10**21`` passed its
    checks, and the node then failed every dial encoding its hello)."""
    stack: list[tuple[str, Any]] = [("", raw)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and value != value:
            return path, "must be a number, not nan"
        if ints and isinstance(value, int) and abs(value) > MAX_INT:
            return path, f"out of range (at most 2**53 = {MAX_INT})"
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


def convert(raw: dict[str, Any], cls: type[T], *, source: str = "config") -> T:
    bad = _bad_number(raw)
    if bad is not None:
        raise ConfigError(f"{source}: {bad[0]}: {bad[1]}")
    try:
        cfg = msgspec.convert(raw, cls)
    except msgspec.ValidationError as e:
        line = _one_line(e)
        at = _PATH.search(str(e))
        if at and str(e).startswith("Invalid enum value"):
            choices = _choices(cls, at.group(1))
            if choices:
                line += f" (one of {', '.join(map(repr, choices))})"
        raise ConfigError(f"{source}: {line}") from e
    check = getattr(cfg, "check", None)
    if check is not None:
        try:
            check()
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from e
    bad = _bad_number(raw, ints=True)  # (after the settings' own checks: theirs say more)
    if bad is not None:
        raise ConfigError(f"{source}: {bad[0]}: {bad[1]}")
    return cfg


def _choices(cls: type, key: str) -> tuple[Any, ...]:
    """The values a Literal setting at ``key`` (``routing``, ``models[0].adapter``) takes; () if none."""
    info: Any = msgspec.inspect.type_info(cls)
    for part in re.findall(r"[^.\[\]]+", key):
        while isinstance(info, (msgspec.inspect.ListType, msgspec.inspect.DictType)):
            info = info.item_type if isinstance(info, msgspec.inspect.ListType) else info.value_type
        if part.isdigit():
            continue
        fields = getattr(info, "fields", ())
        info = next((f.type for f in fields if f.encode_name == part), None)
    return info.values if isinstance(info, msgspec.inspect.LiteralType) else ()
