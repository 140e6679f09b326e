"""trainer.continuous.run_once: each gate-allowed examples version consumed exactly once, evaluated before it is
trained on; quarantined versions skipped then consumed once released; a crash anywhere and a resume give the
parameters of an uninterrupted run; the same lake and seed give the same checkpoint bit for bit."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

import gemline.polling as polling
import trainer.continuous as continuous
import trainer.loop as loop
from gemline.config import load_config
from gemline.increments import CursorError
from gemline.lake import Lake, read_table
from tests.conftest import trainer_args
from trainer.continuous import lineage, run_once

from .conftest import mark_quality, synthetic_examples, write_examples

SMALL = {"trainer.num_embeddings": "1000", "trainer.batch_size": "64", "trainer.learning_rate": "0.01",
         "trainer.embedding_learning_rate": "0.01", "trainer.seed": "0", "trainer.model": "dlrm",
         "ingest.domains": '["feed", "reels", "marketplace"]'}


def _config(lake):
    return load_config(overrides={"lake": str(lake), **SMALL})


def _add(lake, day: int, rows: int = 200, passed: bool | None = True, table: pa.Table | None = None) -> int:
    """Append ``table`` (default: ``rows`` synthetic examples of 2026-01-DAY) to LAKE/examples and, unless
    ``passed`` is None, mark that version's quality; return the version."""
    if table is None:
        table = synthetic_examples([f"2026-01-{day:02d}"], rows, seed=day)
    version = write_examples(lake, table)
    if passed is not None:
        mark_quality(lake, version, passed=passed)
    return version


def _params(path) -> dict[str, torch.Tensor]:
    return torch.load(f"{path}/state.pt", weights_only=True)["model"]


def test_each_version_once_with_progressive_metrics(tmp_path):
    lake = tmp_path / "lake"
    for day in (1, 2, 3):
        _add(lake, day)
    first = run_once(*trainer_args(_config(lake)))
    assert [(r["version"], r["rows_trained"], r["quality"], r["evaluated"]) for r in first.versions] == [
        (0, 200, "passed", False), (1, 200, "passed", True), (2, 200, "passed", True)]
    assert first.rows_trained_total == 600 and first.step == 3 * 4  # 200 rows in batches of 64: 4 steps each
    assert [p["examples_version"] for p in first.progressive] == [1, 2]
    assert all(0.0 <= p["auc"] <= 1.0 and p["rows"] == 200 for p in first.progressive)
    metrics = read_table(str(lake), "training_metrics")
    # 2 evaluations x 2 tasks x (overall + 3 domains) x 5 metrics, and after each of the 3 versions trained the
    # id mapping's counts: 10 namespaces (trainer.id_mapping) x 5 metrics
    ids = metrics.filter(pc.equal(metrics["task"], "ids"))
    assert metrics.num_rows - ids.num_rows == 2 * 2 * 4 * 5 and ids.num_rows == 3 * 10 * 5
    items = {r["examples_version"]: r["value"] for r in ids.to_pylist() if r["domain"] == "item" and r["metric"] == "distinct_ids"}
    assert sorted(items) == [0, 1, 2] and items[0] <= items[1] <= items[2] <= 40  # synthetic items i0..i39
    counts = {(r["examples_version"], r["domain"]): r["value"] for r in metrics.to_pylist()
              if r["task"] == "click" and r["metric"] == "num_examples"}
    assert counts[(1, "all")] == 200.0 and sum(v for (ver, d), v in counts.items() if ver == 1 and d != "all") == 200.0

    again = run_once(*trainer_args(_config(lake)))
    assert again.versions == [] and again.rows_trained_total == 600, "nothing new: nothing trained twice"
    _add(lake, 4, rows=130)
    third = run_once(*trainer_args(_config(lake)))
    assert [(r["version"], r["rows_trained"]) for r in third.versions] == [(3, 130)]
    assert third.rows_trained_total == 730
    last = lineage(trainer_args(_config(lake))[0])["examples_versions"][-1]
    assert {k: last[k] for k in ("version", "rows_trained", "quality", "evaluated", "step")} == {
        "version": 3, "rows_trained": 130, "quality": "passed", "evaluated": True, "step": 12 + 3}
    assert last["mean_loss"] > 0


def test_quarantined_version_is_skipped_then_consumed_once_released(tmp_path):
    from gemline.gate import release

    lake = tmp_path / "lake"
    _add(lake, 1)
    _add(lake, 2, passed=False)
    _add(lake, 3)
    res = run_once(*trainer_args(_config(lake)))
    assert [(r["version"], r["quality"], r["rows_trained"]) for r in res.versions] == [
        (0, "passed", 200), (1, "quarantined", 0), (2, "passed", 200)]
    release(str(lake), "examples", 1, "checked by hand")
    res = run_once(*trainer_args(_config(lake)))
    assert [(r["version"], r["quality"], r["rows_trained"]) for r in res.versions] == [(1, "released", 200)]
    assert run_once(*trainer_args(_config(lake))).versions == []


def test_an_unvalidated_version_waits(tmp_path):
    lake = tmp_path / "lake"
    _add(lake, 1)
    _add(lake, 2, passed=None)
    res = run_once(*trainer_args(_config(lake)))
    assert [r["version"] for r in res.versions] == [0] and res.waiting_for == 1
    mark_quality(lake, 1, passed=True)
    assert [r["version"] for r in run_once(*trainer_args(_config(lake))).versions] == [1]


def _three_versions(lake):
    for day in (1, 2, 3):
        _add(lake, day)


def test_resume_and_crash_give_the_parameters_of_an_uninterrupted_run(tmp_path, monkeypatch):
    straight, resumed, crashed = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _three_versions(straight)
    shutil.copytree(straight, resumed)
    shutil.copytree(straight, crashed)
    reference = _params(run_once(*trainer_args(_config(straight))).checkpoint_path)

    run_once(*trainer_args(_config(resumed)), max_versions=1)
    out = run_once(*trainer_args(_config(resumed)))
    assert [r["version"] for r in out.versions] == [1, 2] and out.rows_trained_total == 600
    assert all(torch.equal(reference[k], v) for k, v in _params(out.checkpoint_path).items())

    real_step, calls = loop.train_step, {"n": 0}

    def dies_mid_version(*args, **kwargs):  # a SIGKILL in the middle of version 1
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt("killed")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", dies_mid_version)
    with pytest.raises(KeyboardInterrupt):
        run_once(*trainer_args(_config(crashed)))
    monkeypatch.setattr(loop, "train_step", real_step)
    out = run_once(*trainer_args(_config(crashed)))
    assert [r["version"] for r in out.versions] == [1, 2], "version 1 is retrained from the checkpoint of version 0"
    assert out.rows_trained_total == 600
    params = _params(out.checkpoint_path)
    assert all(torch.allclose(reference[k], v, atol=1e-6, rtol=0) for k, v in params.items())
    metrics = read_table(str(crashed), "training_metrics")
    assert sorted({r["examples_version"] for r in metrics.to_pylist() if r["task"] != "ids"}) == [1, 2]
    ids = metrics.filter(pc.equal(metrics["task"], "ids"))
    assert metrics.num_rows - ids.num_rows == 2 * 2 * 4 * 5, "the evaluation of version 1 is written once"
    assert ids.num_rows == 3 * 10 * 5, "the id counts of each version are written once"


def test_a_managed_id_mapping_resumes_exactly(tmp_path):
    """trainer.ids.mapping=managed: a run stopped after version 0 and resumed ends with the mapping (saved with
    each checkpoint) and the parameters of an uninterrupted run; rows given by version 0 are kept."""
    from trainer.id_mapping import MAPPING_FILE, IdMapping

    straight, resumed = tmp_path / "a", tmp_path / "b"
    _three_versions(straight)
    shutil.copytree(straight, resumed)
    managed = {"trainer.ids.mapping": "managed", "trainer.ids.min_count": 2}

    def config(lake):
        return load_config(overrides={"lake": str(lake), **SMALL, **managed})

    reference = run_once(*trainer_args(config(straight))).checkpoint_path
    first = run_once(*trainer_args(config(resumed)), max_versions=1).checkpoint_path
    out = run_once(*trainer_args(config(resumed)))
    assert [r["version"] for r in out.versions] == [1, 2]
    mapping = (Path(out.checkpoint_path) / MAPPING_FILE).read_bytes()
    assert mapping == (Path(reference) / MAPPING_FILE).read_bytes()
    after_first = IdMapping.from_bytes((Path(first) / MAPPING_FILE).read_bytes()).vocabularies["item"].assigned
    final = IdMapping.from_bytes(mapping).vocabularies["item"]
    assert after_first and all(final.assigned[i] == row for i, row in after_first.items())
    assert final.stats()["collision_share"] == 0.0, "40 synthetic items, each seen twice by version 2"
    params = _params(out.checkpoint_path)
    assert all(torch.equal(_params(reference)[k], v) for k, v in params.items())
    assert next(v for k, v in params.items() if k.endswith("t_item_id.weight")).shape[0] == final.rows


def test_cardinality_widths_are_fixed_at_the_start_and_kept_by_a_resume(tmp_path):
    """trainer.ids.widths=cardinality (hashed ids): the widths come from the ids of every version the run may
    consume when it starts, are saved with the mapping, and a resumed run keeps them (its parameters are the
    uninterrupted run's)."""
    from trainer.id_mapping import MAPPING_FILE, IdMapping, cardinality_width

    straight, resumed = tmp_path / "a", tmp_path / "b"
    _three_versions(straight)
    shutil.copytree(straight, resumed)

    def config(lake):
        return load_config(overrides={"lake": str(lake), **SMALL, "trainer.embedding_dim": "16",
                                      "trainer.ids.widths": "cardinality"})

    reference = run_once(*trainer_args(config(straight))).checkpoint_path
    run_once(*trainer_args(config(resumed)), max_versions=1)
    out = run_once(*trainer_args(config(resumed)))
    vocabularies = IdMapping.from_bytes((Path(out.checkpoint_path) / MAPPING_FILE).read_bytes()).vocabularies
    examples = read_table(str(straight), "examples")
    domains = len(set(examples["domain"].to_pylist()))
    assert domains == 3 and vocabularies["domain"].width == cardinality_width(domains, most=16) == 8  # 6 * 3 ** 0.25 = 7.9
    params = _params(out.checkpoint_path)
    assert all(torch.equal(_params(reference)[k], v) for k, v in params.items())
    assert next(v for k, v in params.items() if k.endswith("t_domain.weight")).shape[1] == vocabularies["domain"].width


def test_same_lake_and_seed_give_the_same_checkpoint_bit_for_bit(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _three_versions(a)
    shutil.copytree(a, b)
    pa_, pb = _params(run_once(*trainer_args(_config(a))).checkpoint_path), _params(run_once(*trainer_args(_config(b))).checkpoint_path)
    assert pa_.keys() == pb.keys() and all(torch.equal(pa_[k], pb[k]) for k in pa_)


def test_a_recreated_examples_table_is_refused(tmp_path):
    lake = tmp_path / "lake"
    _add(lake, 1)
    run_once(*trainer_args(_config(lake)))
    shutil.rmtree(lake / "examples")
    _add(lake, 2)
    with pytest.raises(CursorError, match="recreated.*--from-scratch"):
        run_once(*trainer_args(_config(lake)))
    fresh = run_once(*trainer_args(_config(lake)), from_scratch=True)
    assert [r["version"] for r in fresh.versions] == [0] and fresh.rows_trained_total == 200


def test_after_from_scratch_the_new_run_is_the_one_that_goes_on(tmp_path):
    lake = tmp_path / "lake"
    _three_versions(lake)
    old = run_once(*trainer_args(_config(lake)))
    fresh = run_once(*trainer_args(_config(lake)), from_scratch=True, max_versions=1)
    assert (old.step, fresh.step) == (12, 4) and fresh.run_id != old.run_id
    # The old run's checkpoint has the higher step; the lake's CURRENT run is the new one all the same.
    after = run_once(*trainer_args(_config(lake)))
    assert after.run_id == fresh.run_id and [r["version"] for r in after.versions] == [1, 2]
    assert after.rows_trained_total == 600 and lineage(trainer_args(_config(lake))[0])["run_id"] == fresh.run_id
    assert Path(old.checkpoint_path).is_dir(), "the old run's checkpoints stay in its own folder"


def test_the_run_report_shows_curves_verdicts_and_lineage(tmp_path):
    from pathlib import Path

    lake = tmp_path / "lake"
    _add(lake, 1)
    _add(lake, 2, passed=False)
    _add(lake, 3)
    _add(lake, 4)
    res = run_once(*trainer_args(_config(lake)))
    page = Path(res.report_path).read_text()
    assert res.report_path == f"{lake}/_runs/{res.run_id}/report.html"
    assert page.count("data:image/png;base64,") == 6
    assert "<td>1</td><td>quarantined</td><td>0</td>" in page and "<td>3</td><td>passed</td><td>200</td>" in page
    from trainer.run_report import progressive_series

    series = progressive_series(read_table(str(lake), "training_metrics").to_pylist(), res.run_id, "click", "auc")
    assert [v for v, _ in series["all"]] == [2, 3]  # evaluated before training on 2 and 3; 0 bootstraps, 1 skipped


def test_tensorboard_scalars_equal_the_metrics_table_and_a_resumed_run_rewrites_them(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.run_report import TENSORBOARD_FILE

    lake = tmp_path / "lake"
    for day in (1, 2, 3):
        _add(lake, day)
    first = run_once(*trainer_args(_config(lake)))
    _add(lake, 4)
    second = run_once(*trainer_args(_config(lake)))  # resumes the same run: the event file is rewritten, not appended to
    folder = lake / "_runs" / second.run_id / "tensorboard"
    assert second.run_id == first.run_id and [p.name for p in folder.iterdir()] == [TENSORBOARD_FILE]
    events = EventAccumulator(str(folder))
    events.Reload()
    auc = [(s.step, s.value) for s in events.Scalars("progressive/click/auc/all")]
    table = sorted((r["examples_version"], r["value"]) for r in read_table(str(lake), "training_metrics").to_pylist()
                   if (r["task"], r["metric"], r["domain"]) == ("click", "auc", "all"))
    assert [v for v, _ in auc] == [v for v, _ in table] == [1, 2, 3]
    assert [a for _, a in auc] == pytest.approx([b for _, b in table], abs=1e-6)  # stored as float32
    assert [(s.step, s.value) for s in events.Scalars("train/rows_trained")] == [(0, 200.0), (1, 200.0), (2, 200.0),
                                                                                 (3, 200.0)]


def test_lineage_names_the_events_versions_and_kafka_offsets_behind_each_version(tmp_path):
    import pyarrow as pa

    from gemline.lake import commit_once

    lake = tmp_path / "lake"
    events = pa.table({"event_id": ["a"], "event_date": ["2026-01-01"]})
    ranges = [[{"topic": "t", "partition": 0, "start": 0, "end": 5}],
              [{"topic": "t", "partition": 0, "start": 5, "end": 9}, {"topic": "t", "partition": 1, "start": 0, "end": 2}],
              [{"topic": "t", "partition": 0, "start": 9, "end": 12}]]
    # Three ingest batches: events@0..2; the third read generation 1 of the topic (after a --reset-topic).
    identity = [{}, {}, {"generation": 1, "topic_identity": {"topic_id": "id-2", "partitions": 2, "last": {}}}]
    for i, r in enumerate(ranges):
        commit_once(str(lake), "events", events, app_id="ingest:t", version=i,
                    metadata={"offset_ranges": r, **identity[i]})
    for i, built in enumerate([1, 2]):  # examples@0 built from events 0-1, examples@1 from events 2
        commit_once(str(lake), "examples", synthetic_examples([f"2026-01-0{i + 1}"], 50, seed=i), app_id="build",
                    version=i, partition_by=["event_date"], metadata={"events_version": built})
        mark_quality(lake, i, passed=True)
    run_once(*trainer_args(_config(lake)))
    records = lineage(trainer_args(_config(lake))[0])["examples_versions"]
    assert [(r["version"], r["events_versions"]) for r in records] == [(0, [0, 1]), (1, [2])]
    assert records[0]["kafka_offsets"] == [{"events_version": 0, **ranges[0][0]},
                                           *[{"events_version": 1, **r} for r in ranges[1]]]
    assert records[1]["kafka_offsets"] == [{"events_version": 2, **ranges[2][0], "generation": 1, "topic_id": "id-2"}]


def test_cli_train_once_lineage_and_a_second_trainer_refused(tmp_path, capsys):
    import json

    from gemline.cli import main
    from gemline.locks import exclusive

    lake = tmp_path / "lake"
    _add(lake, 1)
    _add(lake, 2)
    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]
    assert main(["train", "--once", "--lake", str(lake), *sets]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [v["version"] for v in out["versions"]] == [0, 1] and out["rows_trained_total"] == 400
    assert main(["lineage", "--json", "--lake", str(lake), *sets]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["rows_trained_total"] == 400 and record["run_id"] == out["run_id"]
    assert [v["rows_trained"] for v in record["examples_versions"]] == [200, 200]
    with exclusive(str(lake), "train"):  # a --follow trainer holds the lake
        assert main(["train", "--once", "--lake", str(lake), *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another train is running on this lake" in err[0]
    assert main(["train", "--once", "--version", "1", "--lake", str(lake), *sets]) == 2
    assert "--version is for one-shot runs" in capsys.readouterr().err


def test_follow_consumes_what_arrives_between_polls(tmp_path, monkeypatch):
    lake = tmp_path / "lake"
    _add(lake, 1)
    seen = []

    def on_result(result):
        seen.append([v["version"] for v in result.versions])
        if len(seen) == 1:
            _add(lake, 2)  # a build publishes a version while the trainer waits

    calls = continuous.follow(*trainer_args(_config(lake)), poll_interval_s=0, on_result=on_result, max_polls=3)
    assert calls == 3 and seen == [[0], [1], []]


def test_follow_rewrites_the_run_report_at_most_every_report_every_s(tmp_path, monkeypatch):
    import time
    import types

    lake = tmp_path / "lake"
    _add(lake, 1)
    clock = {"s": 1000.0}
    monkeypatch.setattr(continuous, "time", types.SimpleNamespace(time=time.time, process_time=time.process_time,
                                                                  monotonic=lambda: clock["s"]))
    reports = []

    def on_result(result):
        reports.append(result.report_path)
        _add(lake, len(reports) + 1)  # a new version for every next poll
        clock["s"] += 40.0

    continuous.follow(*trainer_args(_config(lake)), poll_interval_s=0, on_result=on_result, max_polls=4,
                      report_every_s=60.0, report_cpu_share=1.0)
    page = reports[0]
    # t = 1000 (the first call), 1040 (too soon), 1080 (80 s after the last), 1120 (too soon)
    assert [r is not None for r in reports] == [True, False, True, False] and reports[2] == page


def test_follow_waits_for_the_first_examples_version(tmp_path, caplog):
    from tests.conftest import FakeClock

    lake = tmp_path / "lake"
    seen, clock = [], FakeClock()
    clock.at(1.5, lambda: _add(lake, 1, passed=None))  # the build publishes a first version: not validated yet
    clock.at(2.5, lambda: mark_quality(lake, 0, passed=True))  # validation passes it: the trainer wakes
    calls = continuous.follow(*trainer_args(_config(lake)), poll_interval_s=5, watch_s=1,
                              on_result=lambda r: seen.append((clock.now, r.versions)),
                              max_polls=3, sleep=clock.sleep, clock=clock)
    # 0: no examples table (a wait); 3: the first look after the verdict trains version 0; 8: idle, the interval's.
    assert calls == 3 and clock.sleeps == [1, 1, 1] + [1] * 5
    assert [(t, [v["version"] for v in versions]) for t, versions in seen] == [(3.0, [0]), (8.0, [])]
    assert sum("train waits: no examples table" in r.getMessage() for r in caplog.records) == 1, "said once"


def test_follow_without_watching_polls_every_interval(tmp_path, monkeypatch):
    import time
    import types

    lake = tmp_path / "lake"
    naps = []

    def nap(seconds):  # the build publishes and validation passes the first version while the trainer waits
        naps.append(seconds)
        if len(naps) == 2:
            _add(lake, 1)

    monkeypatch.setattr(polling, "time", types.SimpleNamespace(time=time.time, monotonic=time.monotonic, sleep=nap))
    seen = []
    calls = continuous.follow(*trainer_args(_config(lake)), poll_interval_s=5, watch_s=None, max_polls=4,
                              on_result=lambda r: seen.append([v["version"] for v in r.versions]))
    assert calls == 4 and naps == [5, 5, 5] and seen == [[0], []], "two polls waited, then trained"


def test_resuming_with_another_model_or_without_a_run_is_one_line(tmp_path, capsys):
    from gemline.cli import main

    lake = tmp_path / "lake"
    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]
    assert main(["lineage", "--lake", str(lake), *sets]) == 2  # no continuous run yet
    assert "no continuous checkpoint" in capsys.readouterr().err
    _add(lake, 1)
    assert main(["train", "--once", "--lake", str(lake), *sets]) == 0
    capsys.readouterr()
    assert main(["train", "--once", "--lake", str(lake), *sets, "--set", "trainer.model=lr"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trains trainer.model='dlrm', not 'lr'" in err[0] and "--from-scratch" in err[0]


def test_run_once_trains_with_trainer_torch_threads_and_restores_torch_s_setting(tmp_path, monkeypatch):
    seen = []

    def fake_consume(lake, tc, make_engine, **kwargs):
        seen.append(torch.get_num_threads())
        return continuous.ContinuousResult("r", 0, 0, None)

    monkeypatch.setattr(continuous, "consume", fake_consume)
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        cfg = load_config(overrides={"lake": str(tmp_path)})
        run_once(Lake.for_config(cfg), replace(cfg.trainer, torch_threads=1))
        assert (seen, torch.get_num_threads()) == ([1], 3)
        run_once(Lake.for_config(cfg), replace(cfg.trainer, torch_threads=None))
        assert (seen, torch.get_num_threads()) == ([1, 3], 3), "None keeps torch's setting"
    finally:
        torch.set_num_threads(previous)


def test_a_poll_with_nothing_new_builds_no_model_and_the_next_version_trains_as_before(tmp_path, monkeypatch):
    lake = tmp_path / "lake"
    _add(lake, 1)
    built = []

    def counting(*args, **kwargs):
        built.append(1)
        return loop.local_engine(*args, **kwargs)

    monkeypatch.setattr(continuous, "local_engine", counting)
    first = run_once(*trainer_args(_config(lake)))
    assert len(built) == 1 and first.report_path is not None
    idle = run_once(*trainer_args(_config(lake)))
    _add(lake, 2, passed=None)  # published, not validated yet: still nothing to consume
    waiting = run_once(*trainer_args(_config(lake)))
    assert len(built) == 1, "no model built for a poll with nothing to consume"
    assert (idle.versions, idle.step, idle.cursor, idle.checkpoint_path, idle.report_path) == (
        [], first.step, first.cursor, None, None)
    assert (waiting.versions, waiting.step, waiting.waiting_for) == ([], first.step, 1)
    mark_quality(lake, 1, passed=True)
    after = run_once(*trainer_args(_config(lake)))
    assert len(built) == 2 and [v["version"] for v in after.versions] == [1] and after.step > first.step


def test_train_once_says_when_nothing_was_validated_or_every_label_was_masked(tmp_path, capsys, caplog):
    """A never-validated version: exit 0 with one hint naming the command to run. A version whose labels are all
    open (a `build --final` of less than a click window): trained, and one warning naming trainer.final_labels."""
    from gemline.cli import main

    lake = tmp_path / "lake"
    table = synthetic_examples(["2026-01-01"], 100, seed=1)  # one day: no click window (1 day) passed within it
    table = table.set_column(table.schema.get_field_index("label_window_closed"), "label_window_closed",
                             pa.array([False] * table.num_rows))
    _add(lake, 1, table=table, passed=None)
    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]
    assert main(["train", "--once", "--lake", str(lake), *sets]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["train: nothing trained: examples@0 is not validated yet; run `gemline validate --table examples`, "
                   "then this command again"]
    mark_quality(lake, 0, passed=True)
    with caplog.at_level("WARNING", logger="trainer.continuous"):
        res = run_once(*trainer_args(_config(lake)))
    assert res.versions[0]["rows_trained"] == 100
    said = [r.getMessage() for r in caplog.records if r.name == "trainer.continuous"]
    assert len(said) == 1 and "every label of its 100 rows is still open" in said[0] and \
        "trainer.final_labels=false" in said[0], said
    caplog.clear()
    _add(lake, 2, table=table.set_column(table.schema.get_field_index("label_window_closed"), "label_window_closed",
                                         pa.array([True] * table.num_rows)))
    with caplog.at_level("WARNING", logger="trainer.continuous"):
        run_once(*trainer_args(_config(lake)))
    assert not [r for r in caplog.records if r.name == "trainer.continuous"], "closed labels: nothing to say"


def test_train_once_says_when_the_validated_versions_hold_no_rows(tmp_path, capsys):
    """Versions that passed validation but hold no rows (a `label_mode=wait` build whose windows are all open): exit 0,
    nothing trained, and one line naming the versions and the cause; the first version with rows starts the run."""
    from gemline.cli import main

    lake = tmp_path / "lake"
    for day in (1, 2):
        _add(lake, day, rows=0)
    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]
    capsys.readouterr()
    assert main(["train", "--once", "--lake", str(lake), *sets]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["versions"] == []
    assert err.strip().splitlines() == [
        "train: nothing trained: examples@0..1 hold no rows: nothing published yet (build.label_mode=wait publishes an "
        "impression when its longest attribution window closes; fnw/defer after build.publish_delay_ms)"]
    _add(lake, 3)
    res = run_once(*trainer_args(_config(lake)))
    assert [v["version"] for v in res.versions] == [2] and res.versions[0]["rows_trained"] == 200
    assert res.empty_versions == [0, 1]


def test_a_changed_model_switch_is_refused_by_a_poll_with_nothing_new(tmp_path):
    """Issue 20: a poll with nothing to train built no model, so it returned 'nothing new' under a switch that the
    checkpoint cannot resume with, and the refusal came only with the next version. The checkpoint's model
    signature is compared first."""
    from gemline.errors import BadConfigError

    lake = tmp_path / "lake"
    _add(lake, 1)
    lake_, tc = trainer_args(_config(lake))
    first = run_once(lake_, tc)
    saved = json.loads((Path(first.checkpoint_path) / "meta.json").read_text())["extra"]["model_signature"]
    assert saved["parameters"] == sorted(torch.load(Path(first.checkpoint_path) / "state.pt",
                                                    weights_only=True)["model"]), "the names the checkpoint holds"
    assert run_once(lake_, tc).versions == [], "unchanged: an idle poll as before"
    with pytest.raises(BadConfigError, match=r"holds another model: .*--from-scratch") as err:
        run_once(lake_, replace(tc, hidden_dims=(64,)))  # one hidden layer fewer: other parameters
    assert "\n" not in str(err.value)


def test_the_signature_names_a_gem_checkpoints_ema_decay_and_this_runs():
    from trainer.checkpoint import model_mismatch

    tc = load_config(overrides={"trainer.num_embeddings": "100"}).trainer
    with_ema = continuous.model_signature(replace(tc, gem=replace(tc.gem, ema_decay=0.9)), 3, ("feed",))
    without = continuous.model_signature(tc, 3, ("feed",))
    assert with_ema["param_average_decays"] == {"param_average": 0.9} and without["param_average_decays"] == {}
    refusal = model_mismatch("ckpt", set(without["parameters"]), set(with_ema["parameters"]),
                             with_ema["param_average_decays"], without["param_average_decays"])
    assert refusal is not None and ("written with trainer.gem.ema_decay=0.9, this run has none: it resumes with "
                                    "--set trainer.gem.ema_decay=0.9") in str(refusal)
    assert model_mismatch("ckpt", set(without["parameters"]), set(without["parameters"]), {}, {}) is None
