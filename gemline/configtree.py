"""Typed config trees: dataclasses built from TOML tables and ``--set KEY=VALUE`` flags, and back.

Generic over frozen dataclasses, so a stage's own section (``trainer.config.TrainerConfig``) loads
without the application's root config (:mod:`gemline.config` builds ``GemlineConfig`` on top of
this): a torchrun rank (``trainer.launch``) rebuilds its ``TrainerConfig`` here from the flags its
launcher wrote with :func:`config_overrides`.

Two sources, two rules: a TOML value is typed already, so ``batch_size = "64"`` or ``compile = "yes"`` is
refused (a quoted number is a mistake a strict reader catches, not one to guess at); a ``--set KEY=VALUE``
value is text by nature, so :func:`set_dotted` marks it (:class:`FlagText`) and :func:`coerce` parses it into
the field's type: ``64``, ``yes``, ``64,32`` or the TOML list ``[64, 32]``.

A field declared with ``metadata={"secret": True}`` never becomes a flag (:func:`config_overrides`):
flags end up on command lines, which every user of the machine reads (``ps``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gemline.errors import BadConfigError, MissingInputError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T")


class FlagText(str):
    """A config value given as text on a command line (``--set KEY=VALUE``, :func:`set_dotted`), which
    :func:`coerce` parses into its field's type; a plain ``str`` in a tree came from TOML and is taken as a string."""


def _flag_list(text: FlagText, key: str) -> list[Any]:
    """The items of a list-valued flag: ``64,32`` (text items, each parsed as its field's type) or a TOML
    list ``[64, 32]`` (typed items, strings quoted); ``""`` is the empty list.

    Raises:
        BadConfigError: ``text`` starts with ``[`` but is not a TOML list.
    """
    if not text.lstrip().startswith("["):
        return [FlagText(v.strip()) for v in text.split(",") if v.strip()]
    try:
        return list(tomllib.loads(f"v = {text}")["v"])
    except tomllib.TOMLDecodeError:
        raise BadConfigError(f"{key}: expected a list as 64,32 or as TOML [64, 32] (strings quoted: "
                             f'["a", "b"]), got {str(text)!r}') from None


def _wrong_type(key: str, expected: str, value: Any, fix: str = "write it without quotes") -> BadConfigError:
    """The one-line error for ``value`` at ``key``; a quoted TOML value gets ``fix`` as its hint."""
    quoted = isinstance(value, str) and not isinstance(value, FlagText)
    return BadConfigError(f"{key}: expected {expected}, got {value!r}" + (f" (a string in the TOML: {fix})" if quoted else ""))


def _expected(annotation: Any) -> str:
    """How an error names a type: ``int``, or the values of a Literal (``'auto'``)."""
    if typing.get_origin(annotation) is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", str(annotation))


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert a TOML value or a flag's text (:class:`FlagText`) to the field's declared type.

    A TOML value must already have the field's type (an int is taken for a float); only flag text is parsed
    (``"64"`` -> 64, ``"true"`` -> True, ``"64,32"`` or ``"[64, 32]"`` -> (64, 32)).

    Raises:
        BadConfigError: a value of another type, or text that does not parse; the message names ``key``, the
            expected type and the value.
    """
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        if value is None or value in ("none", "None", ""):
            return None
        raise BadConfigError(f"{key}: expected none, got {value!r}")
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        if value is None or (isinstance(value, str) and value.lower() == "none" and type(None) in args):
            return None
        arms = [arg for arg in args if arg is not type(None)]
        errors = []
        for arg in arms:
            try:
                return coerce(value, arg, key)
            except ValueError as exc:
                errors.append(str(exc))
        if len(errors) == 1:
            raise BadConfigError(errors[0])
        # One line for the whole union ("int or 'auto'"), not one per arm, each naming the key again.
        raise BadConfigError(f"{key}: expected {' or '.join(_expected(arg) for arg in arms)}, got {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise BadConfigError(f"{key}: expected one of {args}, got {value!r}")
        return args[args.index(value)]  # the declared value, not the flag's FlagText
    if origin is dict and isinstance(value, dict):  # a table of flags (lake_storage_options.KEY=VALUE): plain strings
        return {k: str(v) if isinstance(v, FlagText) else v for k, v in value.items()}
    if origin is tuple:
        # "" is the empty tuple (how config_overrides writes one that differs from its default).
        if isinstance(value, FlagText):
            items = _flag_list(value, key)
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise _wrong_type(key, "a list", value, fix="write a TOML list such as [64, 32]")
        return tuple(coerce(v, args[0], key) for v in items)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        # true/false only, as TOML spells them: yes/on/1 would be a second spelling that a config file refuses
        if isinstance(value, FlagText) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise _wrong_type(key, "a boolean (true or false)", value)
    if annotation in (int, float, str):
        # TOML's true is a Python int too, and 5 would pass str(): a typed TOML value of the wrong kind is refused.
        if annotation is str:
            if not isinstance(value, (str, os.PathLike)):  # a Path from a Python caller's overrides; TOML has none
                raise _wrong_type(key, "str", value)
            return os.fspath(value) if isinstance(value, os.PathLike) else str(value)
        if isinstance(value, bool) or (isinstance(value, str) and not isinstance(value, FlagText)):
            raise _wrong_type(key, annotation.__name__, value)
        try:
            if annotation is int and isinstance(value, float):
                raise ValueError
            converted = annotation(value)
        except (TypeError, ValueError):
            raise BadConfigError(f"{key}: expected {annotation.__name__}, got {value!r}") from None
        # nan, inf and 1e400 (which parses as inf) pass float() but no setting means them: a learning rate of nan
        # reached the optimiser as a traceback.
        if annotation is float and not math.isfinite(converted):
            raise BadConfigError(f"{key}: expected a finite float, got {value!r}")
        return converted
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
    """Set ``tree[a][b][c] = value`` for ``dotted`` ``"a.b.c"``, creating tables on the way; a ``str`` value is
    a flag's text (``--set``), marked :class:`FlagText` so that :func:`build` parses it into its field's type.

    Raises:
        BadConfigError: a part on the way is a value, not a table.
    """
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise BadConfigError(f"cannot set {dotted!r}: {part!r} is not a table")
    node[parts[-1]] = FlagText(value) if isinstance(value, str) else value


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
