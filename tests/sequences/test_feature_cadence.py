"""The feature views are materialised every ``build.features_interval_ms`` of event time, not every pass.

Twin lakes get the same events in the same passes: one writes the views every build (interval 0), one every 60 s
of watermark. Every other table is the same row for row after every pass; the views are the same on the passes that
write them, and untouched (same version, as of the last one written) on the others; a crash between two of the
views' commits leaves the next run writing the one left behind.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import gemline.lake as lake_mod
from gemline.config import GemlineConfig
from gemline.lake import commit_metadata, open_table, read_table
from sequences.config import BuildConfig
from sequences.pipeline import _OUTPUTS, APP_ID, feature_views_due, run_build
from sequences.vectorized import FEATURE_VIEW_OUTPUTS
from tests.conftest import build_args

from .test_pipeline import write_events

CONFIG = BuildConfig(max_seq_len=3, click_window_ms=5_000, conversion_window_ms=20_000, events_gate="off",
                     engine="inprocess", shards=2, label_mode="defer", publish_delay_ms=2_000)
STEP_MS = 25_000
"""Event time between two passes: the 60 s interval is due every third pass."""


def _batch(make_event, n: int) -> list[dict]:
    """Pass ``n``'s events, ``n * STEP_MS`` on: 4 users, 3 items, 2 domains, impressions and clicks."""
    rows = []
    for i in range(4):
        user, domain = f"u{i}", f"d{i % 2}"
        for k in range(2):
            t = n * STEP_MS + 1_000 * k + 10 * i
            rows.append(make_event(f"p{n}_{user}_imp{k}", t, "impression", user=user, item=f"i{(i + k + n) % 3}",
                                   domain=domain))
        rows.append(make_event(f"p{n}_{user}_click", n * STEP_MS + 500 + 10 * i, "click", user=user,
                               item=f"i{(i + n) % 3}", domain=domain))
    return rows


def _rows(lake: str, name: str) -> list[str]:
    return sorted(json.dumps(r, sort_keys=True, default=str) for r in read_table(lake, name).to_pylist())


@pytest.mark.slow
def test_views_written_every_interval_and_every_other_table_as_every_pass(tmp_path, make_event):
    lakes = {"every": str(tmp_path / "every"), "interval": str(tmp_path / "interval")}
    configs = {"every": dataclasses.replace(CONFIG, features_interval_ms=0),
               "interval": dataclasses.replace(CONFIG, features_interval_ms=60_000)}
    written_at = []
    for n in range(7):
        for kind, lake in lakes.items():
            write_events(lake, _batch(make_event, n), version=n)
            run_build(*build_args(GemlineConfig(lake=lake, build=configs[kind])))
        for name in _OUTPUTS:
            if name not in FEATURE_VIEW_OUTPUTS:
                assert _rows(lakes["interval"], name) == _rows(lakes["every"], name), (n, name)
        watermark = commit_metadata(lakes["every"], "examples", APP_ID)["watermark_ms"]
        as_of = {name: commit_metadata(lakes["interval"], name, APP_ID)["watermark_ms"] for name in FEATURE_VIEW_OUTPUTS}
        assert len(set(as_of.values())) == 1  # the three move together
        if as_of[FEATURE_VIEW_OUTPUTS[0]] == watermark:
            written_at.append(n)
            for name in FEATURE_VIEW_OUTPUTS:
                assert _rows(lakes["interval"], name) == _rows(lakes["every"], name), (n, name)
                assert set(read_table(lakes["interval"], name, columns=["as_of_ms"]).column("as_of_ms").to_pylist()) \
                    <= {watermark}
        else:  # the last ones written stay, as of their own watermark
            assert watermark - as_of[FEATURE_VIEW_OUTPUTS[0]] < 60_000
    # Watermarks 3_030, 28_030, ...: written first, then whenever 60 s passed since the last written.
    assert written_at == [0, 3, 6]
    # A final build writes them whatever the interval.
    for kind, lake in lakes.items():
        run_build(*build_args(GemlineConfig(lake=lake, build=configs[kind])), final=True)
    for name in _OUTPUTS:
        assert _rows(lakes["interval"], name) == _rows(lakes["every"], name), name


@pytest.mark.slow
def test_a_crash_between_the_views_commits_is_finished_by_the_rerun(tmp_path, make_event, monkeypatch):
    lake = str(tmp_path / "lake")
    config = GemlineConfig(lake=lake, build=dataclasses.replace(CONFIG, features_interval_ms=60_000))
    for n in range(3):
        write_events(lake, _batch(make_event, n), version=n)
        run_build(*build_args(config))
    write_events(lake, _batch(make_event, 3), version=3)
    real = lake_mod.commit_files_once
    first, second = [name for name in _OUTPUTS if name in FEATURE_VIEW_OUTPUTS][:2]  # in commit order

    def crashing(lake_root, table, *args, **kwargs):
        if table == second:
            raise RuntimeError("injected crash between the feature views' commits")
        return real(lake_root, table, *args, **kwargs)

    monkeypatch.setattr(lake_mod, "commit_files_once", crashing)
    with pytest.raises(RuntimeError, match="injected crash"):
        run_build(*build_args(config))
    monkeypatch.setattr(lake_mod, "commit_files_once", real)
    watermarks = {name: commit_metadata(lake, name, APP_ID)["watermark_ms"] for name in FEATURE_VIEW_OUTPUTS}
    assert watermarks[first] > watermarks[second]  # the first written, the second not
    # The newest view is 0 ms old, the oldest 75 s: still due.
    last_commits = {name: commit_metadata(lake, name, APP_ID) or {} for name in FEATURE_VIEW_OUTPUTS}
    assert feature_views_due(config.build, watermarks[first], last_commits, final=False)
    first_version = open_table(lake, first).version()
    run_build(*build_args(config))
    after = {name: commit_metadata(lake, name, APP_ID)["watermark_ms"] for name in FEATURE_VIEW_OUTPUTS}
    assert len(set(after.values())) == 1 and after[second] == watermarks[first]
    assert open_table(lake, first).version() == first_version  # not written twice


def test_the_interval_must_not_be_negative():
    from gemline.errors import BadConfigError

    with pytest.raises(BadConfigError, match="features_interval_ms"):
        BuildConfig(features_interval_ms=-1)
