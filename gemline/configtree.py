"""Typed config trees: dataclasses built from TOML tables and ``--set KEY=VALUE`` flags, and back.

Generic over frozen dataclasses, so a stage's own section (``trainer.config.TrainerConfig``) loads
without the application's root config (:mod:`gemline.config` builds ``GemlineConfig`` on top of
this): a torchrun rank (``trainer.launch``) rebuilds its ``TrainerConfig`` here from the flags its
launcher wrote with :func:`config_overrides`.

A field declared with ``metadata={"secret": True}`` never becomes a flag (:func:`config_overrides`):
flags end up on command lines, which every user of the machine reads (``ps``).
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gemline.errors import BadConfigError, MissingInputError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T")


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert a TOML or CLI value to the field's declared type; raise BadConfigError naming the key."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        if value is None or value in ("none", "None", ""):
            return None
        raise BadConfigError(f"{key}: expected none, got {value!r}")
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        if value is None or (isinstance(value, str) and value.lower() == "none" and type(None) in args):
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key)
            except ValueError as exc:
                errors.append(str(exc))
        raise BadConfigError("; ".join(errors))
    if origin is typing.Literal:
        if value not in args:
            raise BadConfigError(f"{key}: expected one of {args}, got {value!r}")
        return value
    if origin is tuple:
        # "" is the empty tuple (how config_overrides writes one that differs from its default).
        if not isinstance(value, (str, list, tuple)):
            raise BadConfigError(f"{key}: expected a list, got {value!r}")
        items = [v for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)
        return tuple(coerce(v, args[0], key) for v in items)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise BadConfigError(f"{key}: expected a boolean, got {value!r}")
    if annotation in (int, float, str):
        # TOML's true is a Python int too, and 5 would pass str(): a typed TOML value of the wrong kind is refused.
        if isinstance(value, bool) or (annotation is str and isinstance(value, (int, float))):
            raise BadConfigError(f"{key}: expected {annotation.__name__}, got {value!r}")
        try:
            if annotation is int and isinstance(value, float):
                raise ValueError
            return annotation(value)
        except (TypeError, ValueError):
            raise BadConfigError(f"{key}: expected {annotation.__name__}, got {value!r}") from None
    return value


def build(cls: type[_T], data: dict[str, Any], prefix: str = "") -> _T:
    """``cls`` from a TOML table; keys are checked against its fields, nested sections recursively.

    A section may declare ``MOVED_KEYS`` (old field name -> new dotted name, both relative to the
    section, e.g. ``TrainerConfig.MOVED_KEYS["gem_layers"] == "gem.layers"``): an old key is an
    error naming its new key, never silently ignored or mapped (two spellings of one setting
    would let a file set both).
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(typing.cast(Any, cls))}
    moved: Mapping[str, str] = getattr(cls, "MOVED_KEYS", {})
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields and name in moved:
            new_key = f"{prefix}{moved[name]}"
            section, _, leaf = new_key.rpartition(".")
            raise BadConfigError(f"config key {key!r} moved to {new_key!r}: write {leaf} = ... under [{section}] "
                                 f"in the TOML, or --set {new_key}=...")
        if name not in fields:
            raise BadConfigError(f"unknown config key {key!r}; known: {sorted(fields)}")
        hint = hints[name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise BadConfigError(f"{key}: expected a table, got {value!r}")
            kwargs[name] = build(hint, value, f"{key}.")
        else:
            kwargs[name] = coerce(value, hint, key)
    return cls(**kwargs)


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``dotted`` ``"a.b.c"``, creating tables on the way.

    Raises:
        BadConfigError: a part on the way is a value, not a table.
    """
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise BadConfigError(f"cannot set {dotted!r}: {part!r} is not a table")
    node[parts[-1]] = value


def load_tree(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The raw tree of a TOML file (``{}`` when ``path`` is None) with the dotted ``overrides`` set on it
    (``{"trainer.gem.layers": "3"}``); :func:`build` types it.

    Raises:
        MissingInputError: ``path`` does not exist (a FileNotFoundError).
        BadConfigError: ``path`` is a directory or not TOML (binary included), or an override goes through a value.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                tree = tomllib.load(fh)
        except FileNotFoundError:
            raise MissingInputError(f"no config file at {str(path)!r}; pass --config the path of a TOML file") from None
        except IsADirectoryError:
            raise BadConfigError(f"--config {str(path)!r} is a directory; pass the path of a TOML file") from None
        except UnicodeDecodeError as exc:  # tomllib decodes the bytes as UTF-8 first: a binary file
            raise BadConfigError(f"config file {str(path)!r} is not UTF-8 text, so not TOML: {exc.reason}") from None
        except tomllib.TOMLDecodeError as exc:
            raise BadConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    for dotted, value in (overrides or {}).items():
        set_dotted(tree, dotted, value)
    return tree


def config_overrides(config: DataclassInstance, prefix: str = "") -> list[str]:
    """The leaves of a config dataclass that differ from their defaults, as ``KEY=VALUE`` strings.

    :func:`build` of these strings (:func:`parse_set_flags`, :func:`load_tree`) rebuilds ``config``
    (only non-defaults travel, so a default such as an empty tuple never needs a spelling), except
    fields declared with ``metadata={"secret": True}`` (``GemlineConfig.lake_storage_options``),
    which are left out: they can hold secrets and these strings end up on a command line.
    ``prefix`` is put before every key (``"trainer."`` for a section rebuilt in a root tree).

    Raises:
        TypeError: another table-valued (dict) field, which has no ``KEY=VALUE`` spelling here.
    """
    out: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.metadata.get("secret"):
            continue
        if isinstance(value, dict):
            raise TypeError(f"config_overrides: {prefix}{f.name} is a table; it cannot travel as --set flags")
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if value == default:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += config_overrides(value, f"{key}.")
        elif value is None:
            out.append(f"{key}=none")
        elif isinstance(value, tuple):
            out.append(f"{key}={','.join(str(v) for v in value)}")
        else:
            out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def parse_set_flags(pairs: list[str]) -> dict[str, str]:
    """Turn ``["build.max_seq_len=512", ...]`` into a dict; raise BadConfigError on a pair without '='."""
    out: dict[str, str] = {}
    for pair in pairs:
        if "=" not in pair:
            raise BadConfigError(f"--set expects KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.strip()] = value.strip()
    return out
