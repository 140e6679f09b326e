"""One typed config tree, loaded from a TOML file with defaults and overridden by CLI flags.

    [kafka]
    bootstrap = "broker:9092"
    [build]
    max_seq_len = 512
    [trainer.gem]
    layers = 3

`--set build.max_seq_len=512` (or `--set trainer.gem.layers=3`) on any command overrides the same key. Nothing else reads the
environment: every stage receives its section of this tree.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemline.errors import BadConfigError, MissingInputError
from gemline.lake import redact
from ingest.config import IngestConfig, KafkaConfig
from ingest.generate import GenerateConfig
from sequences.config import BuildConfig
from trainer.config import TrainerConfig
from validation.config import ValidationConfig


@dataclass(frozen=True, kw_only=True)
class GemlineConfig:
    """The whole pipeline's configuration."""

    lake: str = "./lake"
    """Root of the Delta lake: a local directory or an object-store URI (``s3://bucket/prefix``)."""
    lake_storage_options: dict[str, str] = field(default_factory=dict)
    """delta-rs storage options for a remote lake (``[lake_storage_options]`` table of strings, e.g. AWS_REGION)."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    """Broker and topic."""
    ingest: IngestConfig = field(default_factory=IngestConfig)
    """Parsing and validation of raw events."""
    build: BuildConfig = field(default_factory=BuildConfig)
    """Sequences, labels, examples."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """Quality suites and the gate."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Model and optimisation."""
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    """Synthetic traffic (`gemline generate`)."""

    def __post_init__(self) -> None:
        # Messages name the bad option but never show a secret's value (gemline.lake.redact).
        if not isinstance(self.lake_storage_options, dict):
            raise BadConfigError(f"lake_storage_options: expected a table of strings ([lake_storage_options] in the "
                                 f"TOML, or --set lake_storage_options.KEY=VALUE), got a {type(self.lake_storage_options).__name__}")
        for key, value in self.lake_storage_options.items():
            if not isinstance(value, str):
                shown = redact({key: value})[key]
                raise BadConfigError(f"lake_storage_options.{key}: expected a string (quote it: \"{shown}\"), "
                                     f"got {shown!r}")

    def __repr__(self) -> str:
        """The dataclass repr with the values of secret storage options hidden (gemline.lake.redact)."""
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        shown["lake_storage_options"] = redact(self.lake_storage_options)
        return f"GemlineConfig({', '.join(f'{name}={value!r}' for name, value in shown.items())})"


def _coerce(value: Any, annotation: Any, key: str) -> Any:
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
                return _coerce(value, arg, key)
            except ValueError as exc:
                errors.append(str(exc))
        raise BadConfigError("; ".join(errors))
    if origin is typing.Literal:
        if value not in args:
            raise BadConfigError(f"{key}: expected one of {args}, got {value!r}")
        return value
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(_coerce(v, args[0], key) for v in items)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise BadConfigError(f"{key}: expected a boolean, got {value!r}")
    if annotation in (int, float, str):
        try:
            if annotation is int and isinstance(value, float):
                raise ValueError
            return annotation(value)
        except (TypeError, ValueError):
            raise BadConfigError(f"{key}: expected {annotation.__name__}, got {value!r}") from None
    return value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    """``cls`` from a TOML table; keys are checked against its fields, nested sections recursively.

    A section may declare ``MOVED_KEYS`` (old field name -> new dotted name, both relative to the
    section, e.g. ``TrainerConfig.MOVED_KEYS["gem_layers"] == "gem.layers"``): an old key is an
    error naming its new key, never silently ignored or mapped (two spellings of one setting
    would let a file set both).
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
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
            kwargs[name] = _build(hint, value, f"{key}.")
        else:
            kwargs[name] = _coerce(value, hint, key)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise BadConfigError(f"cannot set {dotted!r}: {part!r} is not a table")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> GemlineConfig:
    """Load the config tree.

    Args:
        path: a TOML file; None uses the defaults only.
        overrides: dotted keys to values (``{"build.max_seq_len": "512"}``), applied after the file;
            strings are converted to the field's type.

    Raises:
        MissingInputError: ``path`` does not exist (a FileNotFoundError).
        BadConfigError: ``path`` is not TOML, an unknown key, a value of the wrong type, or a value a
            section rejects (a ValueError).
    """
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                tree = tomllib.load(fh)
        except FileNotFoundError:
            raise MissingInputError(f"no config file at {str(path)!r}; pass --config the path of a TOML file") from None
        except tomllib.TOMLDecodeError as exc:
            raise BadConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    for dotted, value in (overrides or {}).items():
        _set_dotted(tree, dotted, value)
    return _build(GemlineConfig, tree, "")


def parse_set_flags(pairs: list[str]) -> dict[str, str]:
    """Turn ``["build.max_seq_len=512", ...]`` into a dict; raise BadConfigError on a pair without '='."""
    out: dict[str, str] = {}
    for pair in pairs:
        if "=" not in pair:
            raise BadConfigError(f"--set expects KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.strip()] = value.strip()
    return out
