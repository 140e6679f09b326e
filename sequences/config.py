"""Typed configuration of the sequence, label and example build."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Literal, get_args

from gemline.errors import BadConfigError
from gemline.hygiene import HygieneConfig

MS_PER_DAY = 24 * 3600 * 1000

NOTHING_PUBLISHED = ("nothing published yet (build.label_mode=wait publishes an impression when its longest attribution "
                     "window closes; fnw/defer after build.publish_delay_ms)")
"""Why an examples version can hold no rows although its build ran: the clause the build's and the trainer's
messages share (the build's hint adds the counts and the flags that publish sooner)."""

LabelMode = Literal["wait", "fnw", "defer"]
"""``build.label_mode``: when an impression is published and how late labels reach the trainer
(:mod:`sequences.publish`)."""

ExamplesLayout = Literal["fat", "pointer"]
"""``build.examples_layout``: example rows carry their sequences as lists ("fat") or point into the
``history`` table ("pointer", :mod:`sequences.materialize`)."""

Engine = Literal["auto", "inprocess", "beam"]
"""``build.engine``: where the build's computation runs (``sequences.pipeline.uses_beam``)."""

ShardStep = Literal["vectorized", "reference"]
"""``build.shard_step``: the vectorised shard build or the per-user reference (same tables)."""


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """How sequences, labels and examples are built from `events`."""

    max_seq_len: int = 256
    """Newest N events kept per user sequence (and per example's history)."""
    click_window_ms: int = MS_PER_DAY
    """Attribution window of a click after its impression (ms)."""
    conversion_window_ms: int = 7 * MS_PER_DAY
    """Attribution window of a conversion after its impression (ms)."""
    label_mode: LabelMode = "wait"
    """"wait": an impression is published once, when its longest attribution window has closed (labels
    final, up to a week old). "fnw": published after ``publish_delay_ms`` with the labels seen by then;
    a label that arrives later is published again as a positive correction row (Ktena et al., RecSys
    2019). "defer": as fnw, and a still-negative label is published again as a real negative once its
    window closes (Gu et al., KDD 2021). The trainer weights fnw/defer rows so that what it sees matches
    the true label distribution (:mod:`trainer.delayed`)."""
    publish_delay_ms: int = 60_000
    """fnw/defer: the waiting window, ms after the impression (event time) before it is published
    (capped at its longest attribution window; at or beyond it fnw/defer publish what wait publishes)."""
    publish_delay_overrides: tuple[str, ...] = ()
    """Per-domain waiting windows, ``"DOMAIN:MS"`` entries (others: ``publish_delay_ms``)."""
    ctr_prior_clicks: float = 1.0
    """Smoothed CTR pseudo-clicks a in (clicks + a) / (impressions + a + b)."""
    ctr_prior_non_clicks: float = 1.0
    """Smoothed CTR pseudo-non-clicks b in (clicks + a) / (impressions + a + b)."""
    window_overrides: tuple[str, ...] = ()
    """Per-domain attribution windows, ``"DOMAIN:click|conversion:MS"`` entries (others: the defaults)."""
    max_same_domain_seq_len: int | None = None
    """Newest N kept of the example's-domain-only sequence; None: ``max_seq_len``."""
    hygiene: HygieneConfig = field(default_factory=HygieneConfig)
    """Checkpoints, compaction and vacuum of the build tables (``[build.hygiene]``). Vacuum's
    retention must outlast a crashed build, which time-travels to its predecessor; compaction
    starts at no fewer than 2 x ``shards`` + 1 files (a build writes up to one file per shard
    into a partition; a lower ``compact_min_files`` is raised at run time, with a warning)."""
    state_lookback_ms: int = 30 * MS_PER_DAY
    """How far behind the watermark raw events stay in the build state (ms); >= every window and TTL."""
    shard_step: ShardStep = "vectorized"
    """How a shard is built: "vectorized" (polars/numpy over all its users) or "reference" (a loop
    of the per-user functions of sequences.incremental; same tables, slower)."""
    shards: int | Literal["auto"] = "auto"
    """Users (and items) are hashed into this many shards, built one after the other in process (one
    Beam element each on Beam): a shard's working set is about its share of the build's rows, so more
    shards bound the memory, and give a distributed runner more parallelism; fewer write fewer, larger
    files. "auto": per build, the fewest that keep one shard's working set within
    ``memory_budget_bytes`` (``sequences.pipeline.shards_for``)."""
    memory_budget_bytes: int = 2**30
    """With ``shards = "auto"``: bytes the shard steps running at once may hold together (their working
    sets; the build process adds its own ~0.3-0.6 GB: the default keeps a million-user build at max length
    4096 under 2 GB)."""
    parallelism: int | Literal["auto"] = "auto"
    """In-process build: shard steps computed at once, each in its own thread (polars, Arrow and numpy
    release the GIL while they work); "auto": the cores this process may run on. With
    ``shards = "auto"`` a build large enough gets at least this many shards, and the memory budget is
    shared by the shards running at once (``sequences.pipeline.shards_for``). 1: one after the other. The
    tables are the same whatever the value. A Beam build ignores it (its runner's flags set its workers)."""
    events_gate: Literal["required", "off"] = "required"
    """Which ``events`` versions the build reads: "required" only those the quality gate allows
    (validated and passed, or released; a quarantined or never-validated version stops the build,
    see gemline.gate.require_allowed); "off" any version (raw lakes in tests and benchmarks)."""
    examples_layout: ExamplesLayout = "pointer"
    """"pointer" (the default): the ``examples`` rows keep every column but the sequence lists
    (lengths and truncation counts included) and readers rebuild the lists from the ``history``
    table, where each event is stored once (:func:`sequences.materialize.materialize_examples`).
    "fat": every row stores its sequences (list columns, cost grows with ``max_seq_len``; a lake
    built before pointer became the default is fat: build it with ``build.examples_layout=fat``).
    Fixed for the life of a lake."""
    engine: Engine = "auto"
    """"inprocess": the shard steps and part writes run in the building process, without Beam (the
    fast path of a one-machine build). "beam": as a Beam pipeline (DirectRunner unless the Beam flags
    name another runner: Dask, Flink, Dataflow). "auto": Beam when Beam flags are given
    (``gemline build --runner dask``, ``-- --direct_num_workers=2``), else in process. Both write the
    same tables (the Beam path is the tested reference twin)."""
    interval_s: float = 10.0
    """The longest wait between two passes of ``gemline build --follow`` (seconds; its ``--interval-s`` flag sets
    it too): a pass runs at least this often, and sooner when a new events version is validated."""

    watch_s: float | None = 1.0
    """Seconds between two looks of ``build --follow`` for a new verdict on ``events`` in the ``quality`` table
    (one file-existence check; ``--watch-s``); None: no looking, a pass every ``interval_s``."""

    min_gap_s: float = 10.0
    """The shortest time (seconds) from the start of a ``build --follow`` pass to the start of the next one woken by
    a new verdict (0: none): a pass reads the build's whole state whatever it adds, and each pass makes an examples
    version that validation, the trainer and distill each pay a fixed cost for; with none, a 3-minute freshness run
    made 22 build passes instead of 13 and spent 19% more CPU per event for the same freshness (README "Followers
    wake")."""

    features_interval_ms: int = 60_000
    """Event time (ms) between two materialisations of the feature views (``features/user``,
    ``features/user_category``, ``features/item``: every key's counters as of the watermark, rewritten whole). A
    build writes them when its watermark is at least this far past the watermark of the oldest of the three as last
    written, when none is written yet, and on a ``final`` build; other passes leave them as they are (their
    ``as_of_ms`` says how old they are). 0: every build. The examples' features do not depend on it: they are taken
    point in time when each impression is first built. In the spirit of Feast's scheduled materialisation
    (https://docs.feast.dev, "Materialization"): a ``build --follow`` pass every ~10 s rewrote about 35 MB of feature
    rows each time, a sixth of the pass's CPU, for views an online store refreshes on its own schedule."""

    MOVED_KEYS: ClassVar[Mapping[str, str]] = MappingProxyType({
        "checkpoint_every": "hygiene.checkpoint_every", "vacuum_retention_hours": "hygiene.retention_hours",
        "compact_min_files": "hygiene.compact_min_files",
    })
    """Keys of this section that moved into ``[build.hygiene]`` (old name -> new name, relative to
    ``build.``): the config loader names the new key when a file or ``--set`` still uses an old one."""

    def __post_init__(self) -> None:
        for entry in self.window_overrides:
            _parse_override(entry)
        if self.max_same_domain_seq_len is not None and self.max_same_domain_seq_len < 1:
            raise BadConfigError(f"build.max_same_domain_seq_len must be >= 1 or None, got {self.max_same_domain_seq_len}")
        # 30 d: the feature views' TTL (features.definitions), 7 d: the longest counter window.
        longest = max([self.click_window_ms, self.conversion_window_ms, 30 * MS_PER_DAY]
                      + [_parse_override(e)[2] for e in self.window_overrides])
        if self.state_lookback_ms < longest:
            raise BadConfigError(
                f"build.state_lookback_ms must be >= the longest attribution or feature window ({longest} ms), "
                f"got {self.state_lookback_ms}; raise it so pending impressions and 7 d counters stay in the state"
            )
        if self.label_mode not in get_args(LabelMode):
            raise BadConfigError(f"build.label_mode must be one of {get_args(LabelMode)}, got {self.label_mode!r}")
        if self.publish_delay_ms < 0:
            raise BadConfigError(f"build.publish_delay_ms must be >= 0 ms, got {self.publish_delay_ms}")
        for entry in self.publish_delay_overrides:
            _parse_delay_override(entry)
        if self.examples_layout not in get_args(ExamplesLayout):
            raise BadConfigError(f"build.examples_layout must be one of {get_args(ExamplesLayout)}, "
                                 f"got {self.examples_layout!r}")
        if self.engine not in get_args(Engine):
            raise BadConfigError(f"build.engine must be one of {get_args(Engine)}, got {self.engine!r}")
        if self.shard_step not in get_args(ShardStep):
            raise BadConfigError(f"build.shard_step must be one of {get_args(ShardStep)}, got {self.shard_step!r}")
        if self.events_gate not in ("required", "off"):
            raise BadConfigError(f"build.events_gate must be 'required' or 'off', got {self.events_gate!r}")
        if not self.interval_s >= 0:
            raise BadConfigError(f"build.interval_s must be >= 0 seconds, got {self.interval_s}")
        if self.watch_s is not None and not self.watch_s > 0:
            raise BadConfigError(f"build.watch_s must be > 0 seconds (or unset: no watching), got {self.watch_s}")
        if self.features_interval_ms < 0:
            raise BadConfigError(f"build.features_interval_ms must be >= 0 ms, got {self.features_interval_ms}")
        if not self.min_gap_s >= 0:
            raise BadConfigError(f"build.min_gap_s must be >= 0 seconds, got {self.min_gap_s}")
        if self.shards != "auto" and (not isinstance(self.shards, int) or self.shards < 1):
            raise BadConfigError(f"build.shards must be 'auto' or an integer >= 1, got {self.shards!r}")
        if self.parallelism != "auto" and (not isinstance(self.parallelism, int) or self.parallelism < 1):
            raise BadConfigError(f"build.parallelism must be 'auto' or an integer >= 1, got {self.parallelism!r}")
        if self.memory_budget_bytes < 2**20:
            raise BadConfigError(f"build.memory_budget_bytes must be >= 1 MiB (1048576 bytes), got {self.memory_budget_bytes}")
        if self.max_seq_len < 1:
            raise BadConfigError(f"build.max_seq_len must be >= 1, got {self.max_seq_len}")
        for name in ("click_window_ms", "conversion_window_ms"):
            if getattr(self, name) <= 0:
                raise BadConfigError(f"build.{name} must be > 0, got {getattr(self, name)}")
        for name in ("ctr_prior_clicks", "ctr_prior_non_clicks"):
            value = getattr(self, name)
            if not (value >= 0.0 and value < float("inf")):
                raise BadConfigError(f"build.{name} must be a finite number >= 0, got {value}")
        if self.ctr_prior_clicks + self.ctr_prior_non_clicks <= 0.0:
            raise BadConfigError(
                "build.ctr_prior_clicks + build.ctr_prior_non_clicks must be > 0 "
                f"(else the CTR of an unseen entity is 0/0), got {self.ctr_prior_clicks} + {self.ctr_prior_non_clicks}"
            )

    @property
    def shard_count(self) -> int:
        """``shards`` as a number.

        Raises:
            ValueError: ``shards`` is "auto" (``sequences.pipeline.run_build`` resolves it per build).
        """
        if self.shards == "auto":
            raise ValueError('build.shards = "auto" is resolved per build (sequences.pipeline.shards_for)')
        return self.shards

    @property
    def parallel_shards(self) -> int:
        """``parallelism`` as a number: "auto" is the cores this process may run on (``os.sched_getaffinity``
        where the platform has it, else ``os.cpu_count()``; 1 where Python cannot tell)."""
        if self.parallelism != "auto":
            return self.parallelism
        if hasattr(os, "sched_getaffinity"):
            return len(os.sched_getaffinity(0)) or 1
        return os.cpu_count() or 1

    @property
    def same_domain_seq_len(self) -> int:
        """N of the same-domain sequence (``max_same_domain_seq_len`` or ``max_seq_len``)."""
        return self.max_seq_len if self.max_same_domain_seq_len is None else self.max_same_domain_seq_len

    def window_ms(self, domain: str, label: str) -> int:
        """Attribution window (ms) of ``label`` ("click" or "conversion") after an impression in ``domain``."""
        for entry in self.window_overrides:
            o_domain, o_label, ms = _parse_override(entry)
            if (o_domain, o_label) == (domain, label):
                return ms
        return self.click_window_ms if label == "click" else self.conversion_window_ms

    def publish_delay(self, domain: str) -> int:
        """ms after an impression in ``domain`` until its first publication: the waiting window of
        fnw/defer (capped at the longest attribution window), the longest window for wait."""
        if self.label_mode == "wait":
            return self.close_delay_ms(domain)
        delay = self.publish_delay_ms
        for entry in self.publish_delay_overrides:
            o_domain, ms = _parse_delay_override(entry)
            if o_domain == domain:
                delay = ms
        return min(delay, self.close_delay_ms(domain))

    def close_delay_ms(self, domain: str) -> int:
        """How long after an impression in ``domain`` its labels are final: the longest of its windows."""
        return max(self.window_ms(domain, "click"), self.window_ms(domain, "conversion"))


def _parse_delay_override(entry: str) -> tuple[str, int]:
    domain, sep, ms = entry.partition(":")
    if not sep or not domain:
        raise BadConfigError(f"build.publish_delay_overrides entries must look like 'DOMAIN:MS', got {entry!r}")
    try:
        value = int(ms)
    except ValueError:
        raise BadConfigError(f"build.publish_delay_overrides {entry!r}: delay must be an integer of ms, got {ms!r}") from None
    if value < 0:
        raise BadConfigError(f"build.publish_delay_overrides {entry!r}: delay must be >= 0 ms, got {value}")
    return domain, value


def _parse_override(entry: str) -> tuple[str, str, int]:
    parts = entry.split(":")
    if len(parts) != 3 or parts[1] not in ("click", "conversion") or not parts[0]:
        raise BadConfigError(
            f"build.window_overrides entries must look like 'DOMAIN:click:MS' or 'DOMAIN:conversion:MS', got {entry!r}"
        )
    try:
        ms = int(parts[2])
    except ValueError:
        raise BadConfigError(f"build.window_overrides {entry!r}: window must be an integer of ms, got {parts[2]!r}") from None
    if ms <= 0:
        raise BadConfigError(f"build.window_overrides {entry!r}: window must be > 0 ms, got {ms}")
    return parts[0], parts[1], ms
