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
