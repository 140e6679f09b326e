"""A build that crashes at any point, rerun, leaves the lake a clean run leaves: no row lost or
written twice, in the first build and in an incremental one (state read back by time travel)."""

from __future__ import annotations

import json
import os
import signal

import pyarrow as pa
import pytest

import gemline.lake as lake_mod
from gemline.cli import main
from gemline.config import GemlineConfig
from gemline.lake import open_table, read_table
from sequences.pipeline import _OUTPUTS, APP_ID, run_build
from tests.conftest import build_args, with_layout

from .conftest import event
from .test_pipeline import CONFIG, _events, write_events


def _second_batch(make_event):
    return [make_event("b_imp2", 2_500, "impression", user="u2", item="i3"),
            make_event("b_click2", 2_520, "click", user="u2", item="i3"),
            make_event("c_imp1", 2_600, "impression", user="u3", item="i1")]


def _snapshot(lake: str) -> dict[str, list[str]]:
    out = {}
    for name in _OUTPUTS:
        rows = read_table(lake, name).to_pylist()
        out[name] = sorted(json.dumps(r, sort_keys=True, default=str) for r in rows)
    return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """``clean(layout)``: the tables after two clean builds (the second closes every window) of that
    ``build.examples_layout`` (default: the default's), built on first use."""
    runs: dict[str, dict[str, list[str]]] = {}

    def snapshot(layout: str = CONFIG.examples_layout) -> dict[str, list[str]]:
        if layout not in runs:
            lake = str(tmp_path_factory.mktemp(f"clean-{layout}") / "lake")
            config = GemlineConfig(lake=lake, build=with_layout(CONFIG, layout))
            write_events(lake, _events(event), version=0)
            run_build(*build_args(config))
            write_events(lake, _second_batch(event), version=1)
            run_build(*build_args(config), final=True)
            runs[layout] = _snapshot(lake)
        return runs[layout]

    return snapshot


@pytest.mark.slow
@pytest.mark.parametrize(("build", "where", "at", "layout"), [
    (0, "commit", 4, "fat"), (1, "commit", 0, "fat"), (1, "commit", 8, "fat"), (0, "write", 3, "fat"),
    (1, "write", 5, "fat"), (1, "commit", 0, "pointer"), (0, "write", 3, "pointer")])
def test_crash_then_rerun_equals_a_clean_run(tmp_path, make_event, monkeypatch, clean, build, where, at, layout):
    """Crash build ``build`` at the ``at``-th table commit (0: first, 8: examples, the last) or while
    writing its ``at``-th data-file part inside the Beam pipeline, then rerun it (two of the cases on
    the pointer layout too; its history-then-examples crash has its own test below)."""
    lake = str(tmp_path / "crashed")
    config = GemlineConfig(lake=lake, build=with_layout(CONFIG, layout))
    batches = [_events(make_event), _second_batch(make_event)]
    real = {"commit": lake_mod.commit_files_once, "write": lake_mod.write_data_file}[where]
    calls = []

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) - 1 == at:
            raise RuntimeError(f"injected crash at {where} {at}")
        return real(*args, **kwargs)

    for n, batch in enumerate(batches):
        write_events(lake, batch, version=n)
        final = n == len(batches) - 1
        if n == build:
            monkeypatch.setattr(lake_mod, {"commit": "commit_files_once", "write": "write_data_file"}[where], crashing)
            with pytest.raises(Exception, match="injected crash"):
                run_build(*build_args(config), final=final)
            monkeypatch.undo()
            if where == "commit" and at > 0:
                examples = open_table(lake, "examples")
                assert examples is None or build == 1  # the crashed first build committed no examples
        run_build(*build_args(config), final=final)
    assert _snapshot(lake) == clean(layout)
    ids = read_table(lake, "examples", columns=["example_id"]).column("example_id").to_pylist()
    assert len(ids) == len(set(ids)) == 5  # every impression once; final closes the last windows


CLI_CONFIG = ["--set", "build.max_seq_len=3", "--set", "build.click_window_ms=100", "--set",
              "build.conversion_window_ms=1000", "--set", "build.events_gate=off"]
"""``CONFIG`` as ``gemline build`` flags."""


def _commits_of_build(lake: str, table: str, build: int) -> int:
    """How many commits of ``table`` carry the build's app transaction for build number ``build``."""
    dt = open_table(lake, table)
    metas = [] if dt is None else [json.loads(e["gemline"]) for e in dt.history() if "gemline" in e]
    return sum(m.get("app_id") == APP_ID and m.get("build") == build for m in metas)


@pytest.mark.slow
@pytest.mark.parametrize("build", [0, 1])
def test_ctrl_c_between_two_table_commits_then_the_next_build_finishes_it(tmp_path, make_event, monkeypatch, capsys,
                                                                          clean, build):
    """A real SIGINT after the build's 3rd table commit: ``gemline build`` stops with 130 and says to rerun; the
    rerun commits the other tables, each table holds one commit of that build, and the lake equals a clean run's."""
    lake = str(tmp_path / "lake")
    real, commits = lake_mod.commit_files_once, []

    def commit_then_ctrl_c(*args, **kwargs):
        committed = real(*args, **kwargs)
        commits.append(args[1])
        if len(commits) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # handled between two bytecodes, right here
        return committed

    # A runner started in the background ignores SIGINT; `gemline` run from a terminal has Python's handler.
    handlers = signal.signal(signal.SIGINT, signal.default_int_handler), signal.getsignal(signal.SIGTERM)
    try:
        for n, batch in enumerate([_events(make_event), _second_batch(make_event)]):
            write_events(lake, batch, version=n)
            argv = ["build", "--lake", lake, *CLI_CONFIG, *(["--final"] if n == 1 else [])]
            if n == build:
                monkeypatch.setattr(lake_mod, "commit_files_once", commit_then_ctrl_c)
                assert main(argv) == 130
                monkeypatch.undo()
                assert "interrupted: build stopped; run the same command again to finish" in capsys.readouterr().err
                assert commits == list(_OUTPUTS)[:3]
                assert [_commits_of_build(lake, t, build) for t in list(_OUTPUTS)[3:]] == [0] * (len(_OUTPUTS) - 3)
            assert main(argv) == 0
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    assert {t: _commits_of_build(lake, t, build) for t in _OUTPUTS} == dict.fromkeys(_OUTPUTS, 1)
    assert _snapshot(lake) == clean()
    ids = read_table(lake, "examples", columns=["example_id"]).column("example_id").to_pylist()
    assert len(ids) == len(set(ids)) == 5


@pytest.mark.slow
def test_pointer_build_crashed_between_history_and_examples_reruns_to_a_clean_run(tmp_path, make_event, monkeypatch,
                                                                                 clean):
    """Pointer layout: build 1 crashes at its examples commit, after its history rows were committed; the rerun
    adds no history row twice, and examples + history materialize to the clean fat run's examples."""
    import dataclasses

    from sequences.materialize import materialize_examples, read_history

    lake = str(tmp_path / "pointer")
    config = GemlineConfig(lake=lake, build=dataclasses.replace(CONFIG, examples_layout="pointer"))
    real = lake_mod.commit_files_once

    def crashing(root, name, *args, **kwargs):
        if name == "examples":
            raise RuntimeError("injected crash at the examples commit")
        return real(root, name, *args, **kwargs)

    batches = [_events(make_event), _second_batch(make_event)]
    for n, batch in enumerate(batches):
        write_events(lake, batch, version=n)
        if n == 1:
            monkeypatch.setattr(lake_mod, "commit_files_once", crashing)
            with pytest.raises(RuntimeError, match="injected crash"):
                run_build(*build_args(config), final=True)
            monkeypatch.undo()
            assert _commits_of_build(lake, "history", 1) == 1 and _commits_of_build(lake, "examples", 1) == 0
        run_build(*build_args(config), final=n == 1)
    assert _commits_of_build(lake, "history", 1) == 1
    pointers = read_table(lake, "examples")
    history = read_history(lake, pointers.column("user_id"))
    ids = history.column("event_id").to_pylist()
    assert len(ids) == len(set(ids)) == len({e["event_id"] for b in batches for e in b})
    rows = materialize_examples(pointers, history, CONFIG).to_pylist()
    assert sorted(json.dumps(r, sort_keys=True, default=str) for r in rows) == clean("fat")["examples"]


@pytest.mark.slow
def test_new_events_read_in_chunks_build_what_one_read_builds(tmp_path, make_event, monkeypatch, clean):
    """New events enter the build in chunks (sequences.pipeline.NEW_EVENTS_CHUNK_ROWS, the build's memory
    at a million users); at 2 rows a chunk, both builds, first and incremental, leave a clean run's lake."""
    import sequences.pipeline as pipeline
    from sequences.pipeline import new_event_chunks, new_event_rows

    monkeypatch.setattr(pipeline, "NEW_EVENTS_CHUNK_ROWS", 2)
    lake = str(tmp_path / "chunked")
    config = GemlineConfig(lake=lake, build=CONFIG)
    for n, batch in enumerate([_events(make_event), _second_batch(make_event)]):
        write_events(lake, batch, version=n)
        old = None if n == 0 else n - 1
        chunks = list(new_event_chunks(lake, old, n, chunk_rows=2))
        assert len(chunks) >= 2 and all(c.num_rows >= 1 for c in chunks)
        assert sorted(pa.concat_tables(chunks).to_pylist(), key=str) == sorted(
            new_event_rows(lake, old, n).to_pylist(), key=str)
        run_build(*build_args(config), final=n == 1)
    assert _snapshot(lake) == clean()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fat", "pointer"])
def test_beam_build_writes_what_the_in_process_build_writes(tmp_path, make_event, clean, layout):
    """``build.engine``: the Beam pipeline, the in-process path's reference twin, leaves the same tables, table
    for table, after a first build and an incremental one (the clean run is in process, the default)."""
    import dataclasses

    lake = str(tmp_path / "beam")
    config = GemlineConfig(lake=lake, build=dataclasses.replace(with_layout(CONFIG, layout), engine="beam"))
    for n, batch in enumerate([_events(make_event), _second_batch(make_event)]):
        write_events(lake, batch, version=n)
        run_build(*build_args(config), final=n == 1)
    assert _snapshot(lake) == clean(layout)
    assert len(clean(layout)["examples"]) == 5 and len(clean(layout)["sequences"]) == 3


def test_the_engine_follows_build_engine_and_the_beam_flags():
    import dataclasses

    from gemline.errors import BadConfigError
    from sequences.pipeline import uses_beam

    flags = ["--runner=DirectRunner", "--direct_num_workers=2"]
    assert [uses_beam(dataclasses.replace(CONFIG, engine=e), a) for e in ("auto", "beam") for a in (None, flags)] == [
        False, True, True, True]
    assert CONFIG.engine == "auto" and uses_beam(dataclasses.replace(CONFIG, engine="inprocess"), []) is False
    with pytest.raises(BadConfigError, match="build.engine='inprocess' runs no Beam pipeline"):
        uses_beam(dataclasses.replace(CONFIG, engine="inprocess"), flags)


def _files(lake: str) -> dict[str, list[str]]:
    """Every build table's rows per data file of its latest snapshot, keyed by the file's path in the lake."""
    out = {}
    for name in _OUTPUTS:
        dt = open_table(lake, name)
        assert dt is not None
        for fragment in dt.to_pyarrow_dataset().get_fragments():
            rows = fragment.to_table().to_pylist()
            out[f"{name}/{fragment.path.lstrip('/')}"] = [
                json.dumps(r, sort_keys=True, default=str) for r in rows]
    return out


def _sharded_batches(make_event) -> tuple[list, list]:
    """Two batches of events over 12 users: enough that every one of 4 shards gets some."""
    users = [f"u{i}" for i in range(12)]
    first = [make_event(f"{u}_imp{k}", 1_000 + 10 * k + i, "impression", user=u, item=f"i{(i + k) % 5}")
             for i, u in enumerate(users) for k in range(3)]
    first += [make_event(f"{u}_click", 1_030 + i, "click", user=u, item=f"i{(i + 1) % 5}") for i, u in enumerate(users)]
    second = [make_event(f"{u}_late{k}", 2_000 + 7 * k + i, "impression" if k else "conversion", user=u,
                         item=f"i{(i + k) % 5}") for i, u in enumerate(users) for k in range(2)]
    return first, second


@pytest.mark.slow
def test_a_failed_parallel_step_commits_nothing_and_the_rerun_writes_what_a_clean_run_writes(tmp_path, make_event,
                                                                                            monkeypatch):
    """3 shard steps at once over 4 shards: user shard 2 fails in the incremental build; the error reaches the
    caller, no table gets a commit of that build, and the rerun leaves the rows of an uncrashed run."""
    import dataclasses

    import sequences.pipeline as pipeline

    batches = _sharded_batches(make_event)
    snapshots = {}
    for name in ("crashed", "clean"):
        lake = str(tmp_path / name)
        config = GemlineConfig(lake=lake, build=dataclasses.replace(CONFIG, shards=4, parallelism=3,
                                                                    engine="inprocess"))
        for n, batch in enumerate(batches):
            write_events(lake, batch, version=n)
            if name == "crashed" and n == 1:
                real = pipeline._user_shard_step

                def failing(keyed, *args, real=real):
                    if keyed[0] == 2:
                        raise RuntimeError("injected failure in user shard 2")
                    yield from real(keyed, *args)

                monkeypatch.setattr(pipeline, "_user_shard_step", failing)
                with pytest.raises(RuntimeError, match="injected failure in user shard 2"):
                    run_build(*build_args(config), final=True)
                monkeypatch.undo()
                assert all(_commits_of_build(lake, table, 1) == 0 for table in _OUTPUTS)
            run_build(*build_args(config), final=n == 1)
        snapshots[name] = _snapshot(lake)
    assert snapshots["crashed"] == snapshots["clean"]
    assert len(snapshots["clean"]["examples"]) == 12 * 3 + 12


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fat", "pointer"])
def test_parallel_shard_steps_write_what_sequential_steps_write(tmp_path, make_event, layout):
    """``build.parallelism``: 3 shard steps at once leave the same data files, row for row and in the same
    order, as one at a time, after a first build and an incremental one over 4 shards; both equal a
    one-shard build's tables (rows sorted), the clean run's twin."""
    import dataclasses

    first, second = _sharded_batches(make_event)
    snapshots, files = {}, {}
    for parallelism, shards in ((1, 4), (3, 4), (1, 1)):
        lake = str(tmp_path / f"p{parallelism}-s{shards}")
        config = GemlineConfig(lake=lake, build=dataclasses.replace(with_layout(CONFIG, layout), shards=shards,
                                                                    parallelism=parallelism, engine="inprocess"))
        for n, batch in enumerate([first, second]):
            write_events(lake, batch, version=n)
            run_build(*build_args(config), final=n == 1)
        snapshots[parallelism, shards], files[parallelism, shards] = _snapshot(lake), _files(lake)
    assert files[3, 4] == files[1, 4]
    # Every user shard wrote: each one's examples file of the second build is there.
    assert {path.rsplit("-", 1)[-1] for path in files[1, 4] if path.startswith("examples/")} == {
        f"{shard:05d}.parquet" for shard in range(4)}
    assert snapshots[3, 4] == snapshots[1, 4] == snapshots[1, 1]
    assert len(snapshots[1, 1]["examples"]) == 12 * 3 + 12
