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

import copy
import dataclasses
import json
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemline.configtree import build, load_tree
from gemline.configtree import config_overrides as config_overrides  # re-exported: the application's spelling
from gemline.configtree import parse_set_flags as parse_set_flags  # re-exported: the application's spelling
from gemline.errors import BadConfigError
from gemline.lake import is_remote, redact
from ingest.config import IngestConfig, KafkaConfig
from ingest.generate import GenerateConfig
from sequences.config import BuildConfig
from trainer.config import TrainerConfig
from trainer.students import DistillConfig
from validation.config import ValidationConfig


def _refuse_a_file_as_lake(lake: str) -> None:
    """Refuse a local lake root that is, or lies under, an existing file (every command loads its config first, so
    each refuses it before touching the lake; otherwise the first mkdir under it fails with ``NotADirectoryError``).

    Raises:
        BadConfigError: the path, or its nearest existing ancestor, exists and is not a directory.
    """
    if is_remote(lake):
        return
    root = Path(lake)
    existing = next((p for p in (root, *root.parents) if p.exists()), None)
    if existing is None or existing.is_dir():
        return
    where = "is a file" if existing == root else f"is under a file ({existing})"
    raise BadConfigError(f"--lake {lake} {where}, not a directory: pass --lake DIR (an existing lake, or a path to "
                         "create one at) or --set lake=DIR")


@dataclass(frozen=True, kw_only=True)
class GemlineConfig:
    """The whole pipeline's configuration."""

    lake: str = "./lake"
    """Root of the Delta lake: a local directory or an object-store URI (``s3://bucket/prefix``)."""
    lake_storage_options: dict[str, str] = field(default_factory=dict, metadata={"secret": True})
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
    distill: DistillConfig = field(default_factory=DistillConfig)
    """The per-domain students of `gemline distill` (trainer.students, trainer.distill)."""

    def __post_init__(self) -> None:
        # An empty root would put the tables under the working directory itself (`--set lake=` from a script whose
        # variable was unset), mixing them with whatever is there.
        if not self.lake.strip():
            raise BadConfigError(f"lake: expected a directory or an object-store URI, got {self.lake!r}: pass --lake DIR "
                                 "or --set lake=DIR (default ./lake)")
        _refuse_a_file_as_lake(self.lake)
        # Messages name the bad option but never show a secret's value (gemline.lake.redact).
        if not isinstance(self.lake_storage_options, dict):
            raise BadConfigError(f"lake_storage_options: expected a table of strings ([lake_storage_options] in the "
                                 f"TOML, or --set lake_storage_options.KEY=VALUE), got a {type(self.lake_storage_options).__name__}")
        for key, value in self.lake_storage_options.items():
            if not isinstance(value, str):
                shown = redact({key: value})[key]
                raise BadConfigError(f"lake_storage_options.{key}: expected a string (quote it: \"{shown}\"), "
                                     f"got {shown!r}")
        # The trainer judges a click label final by this window: one shorter than the build's would call open clicks final.
        domains = {entry.split(":", 1)[0] for entry in self.build.window_overrides}
        window = max([self.build.click_window_ms, *(self.build.window_ms(d, "click") for d in domains)])
        if self.trainer.final_labels and self.trainer.click_window_ms is not None and self.trainer.click_window_ms < window:
            raise BadConfigError(f"trainer.click_window_ms={self.trainer.click_window_ms} is shorter than the build's longest "
                                 f"click window ({window} ms): set trainer.click_window_ms={window}")

    def __repr__(self) -> str:
        """The dataclass repr with the values of secret storage options hidden (gemline.lake.redact)."""
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        shown["lake_storage_options"] = redact(self.lake_storage_options)
        return f"GemlineConfig({', '.join(f'{name}={value!r}' for name, value in shown.items())})"


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
    return build(GemlineConfig, load_tree(path, overrides))


RUN_SETTINGS = "_config/run.toml"
"""Where ``gemline run`` saves its effective settings under a local lake (:func:`save_run_settings`)."""

LAKE_BOUND_KEYS = ("build.label_mode", "build.publish_delay_ms", "build.publish_delay_overrides",
                   "build.click_window_ms", "build.conversion_window_ms", "build.window_overrides")
"""Settings the lake's examples are built with: changing one on a lake already built mixes labels of two rules
(published rows are not rebuilt), so a stage given another value than the lake's saved one is refused."""


def save_run_settings(config: GemlineConfig) -> Path | None:
    """Save ``config``'s non-default settings (``--set`` spelling, :func:`config_overrides`; not ``lake``, and
    never the storage options) to ``LAKE/_config/run.toml``, replaced atomically; return its path, or None for
    an object-store lake (not saved there yet).

    A stage started alone on the lake later takes them as its defaults (:func:`load_stage_config`).
    """
    if is_remote(config.lake):
        return None
    pairs = [pair for pair in config_overrides(config) if not pair.startswith("lake=")]
    path = Path(config.lake) / RUN_SETTINGS
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # A JSON string is a TOML basic string, so any value round-trips; the --set spelling is the one the stages of
    # `gemline run` are started with, so the saved settings go through the same typed path (configtree.coerce).
    body = ("# The settings of the last `gemline run` on this lake, as --set KEY=VALUE; stages started alone on the\n"
            "# lake take them as defaults (--config and --set override, except the lake-bound build settings).\n"
            f"set = [{', '.join(json.dumps(pair) for pair in pairs)}]\n")
    tmp.write_text(body, encoding="utf-8")
    os.replace(tmp, path)
    return path


def _read_run_settings(lake: str) -> tuple[Path, dict[str, str]] | None:
    """The path and the ``KEY -> VALUE`` settings :func:`save_run_settings` wrote under ``lake``; None if none.

    Raises:
        BadConfigError: the file is not the list of ``KEY=VALUE`` strings it writes.
    """
    path = Path(lake) / RUN_SETTINGS
    if is_remote(lake) or not path.is_file():
        return None
    try:
        pairs = tomllib.loads(path.read_text(encoding="utf-8"))["set"]
        return path, parse_set_flags([str(p) for p in pairs])
    except (tomllib.TOMLDecodeError, KeyError, TypeError, UnicodeDecodeError, BadConfigError) as exc:
        raise BadConfigError(f"{path} (the settings of `gemline run` on this lake) is unreadable ({exc}): delete it, "
                             "or run `gemline run` again to rewrite it") from None


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s leaves set on it (tables merged key by key, ``over`` winning)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _has(tree: dict[str, Any], dotted: str) -> bool:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _value(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def load_stage_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None, *,
                      say: Callable[[str], None] | None = None) -> GemlineConfig:
    """:func:`load_config`, with the settings the last ``gemline run`` saved with the lake (``LAKE/_config/
    run.toml``, :func:`save_run_settings`) as the defaults under ``path`` and ``overrides``; ``say`` gets one line
    naming the file when there is one.

    So ``gemline build --follow --lake L`` after ``gemline run --lake L --set build.label_mode=defer`` builds with
    ``defer``, not the default ``wait``.

    Raises:
        As :func:`load_config`, and BadConfigError: ``path`` or ``overrides`` set one of :data:`LAKE_BOUND_KEYS` to
            another value than the saved one (the message names both), or the saved file is unreadable.
    """
    explicit = load_tree(path, overrides)
    config = build(GemlineConfig, copy.deepcopy(explicit))
    saved = _read_run_settings(config.lake)
    if saved is None:
        return config
    where, settings = saved
    base = load_tree(None, {**settings, "lake": config.lake})
    config = build(GemlineConfig, _merge(copy.deepcopy(base), explicit))
    lake_config = build(GemlineConfig, base)
    for key in LAKE_BOUND_KEYS:
        ours, lakes = _value(config, key), _value(lake_config, key)
        if _has(explicit, key) and ours != lakes:
            raise BadConfigError(f"{key}={ours!r} conflicts with {key}={lakes!r} that `gemline run` used on this lake "
                                 f"({where}): the lake's build uses it; drop the setting, or use a new lake")
    if say is not None:
        shown = " ".join(f"{key}={value}" for key, value in sorted(settings.items())) or "none (all defaults)"
        say(f"config: defaults from {where} (the last `gemline run` on this lake; --config and --set override): "
            f"{shown}")
    return config
