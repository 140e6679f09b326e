"""trainer.distill end to end: the students follow the teacher's versions (never a quarantined one), join its logged
predictions point in time, resume after a crash at the parameters of an uninterrupted run, and report per domain
and variant to LAKE/_runs/<run_id>/distill.json."""

from __future__ import annotations

import base64
import json
import math
import shutil
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch

import trainer.distill as distill
from gemline.cli import main
from gemline.config import load_config
from gemline.gate import release
from gemline.lake import Lake
from gemline.progress import DISTILL_CHECKPOINTS, StageProgress, distill_meta, distill_progress
from sequences.schema import SPARSE_FEATURES
from tests.conftest import trainer_args
from trainer.checkpoint import TrainState, latest_checkpoint, read_state, save_checkpoint
from trainer.continuous import run_once
from trainer.students import VARIANTS

from .conftest import synthetic_examples
from .test_continuous import SMALL, _add

SETS = {**SMALL, "trainer.log_teacher_predictions": "true", "distill.batch_size": "64",
        "distill.variants": ",".join(VARIANTS)}  # every mechanism, not the default two
DOMAINS = ("feed", "marketplace", "reels")
_LOAD = distill._load  # the real one: a test counts the calls of distill._load


def _lake(lake: Path, quarantined: int | None = None) -> None:
    """Four days of 90 examples, day d's events a day after day d-1's (the teacher's data time moves on)."""
    for day in (1, 2, 3, 4):
        table = synthetic_examples([f"2026-01-{day:02d}"], 90, seed=day)
        shifted = pc.add(table["event_time_ms"], day * 86_400_000)
        table = table.set_column(table.schema.get_field_index("event_time_ms"), "event_time_ms", shifted)
        _add(lake, day, table=table, passed=day - 1 != quarantined)


def _config(lake: Path):
    return load_config(overrides={"lake": str(lake), **SETS})


def _distill(lake: Path) -> distill.DistillResult:
    config = _config(lake)
    return distill.run_distill_once(trainer_args(config)[0], config.trainer, config.distill)


def _params(lake: Path) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the newest checkpoint's students, and their optimisers' tensors (the tables
    and moments whole, as the students train with them)."""
    path = latest_checkpoint(f"{lake}/_distill")
    assert path is not None
    extra, config = read_state(path).extra, _config(lake)
    students = _LOAD(path, extra, config.distill, config.trainer, len(extra["normalizer"]["names"]))
    tensors = dict(students.modules.state_dict())
    for key, opt in students.optimizers.items():
        for i, state in opt.state_dict()["state"].items():
            tensors.update({f"{key}.{i}.{name}": torch.as_tensor(value) for name, value in state.items()})
    return tensors


def test_students_wait_for_the_teacher_and_need_an_examples_table(tmp_path, capsys):
    assert main(["distill", "--once", "--lake", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no examples table") and "Traceback" not in err
    lake = tmp_path / "lake"
    _lake(lake)
    out = _distill(lake)
    assert out.versions == [] and out.waiting_for == 0 and out.cursor == 0


def test_follow_says_once_that_it_waits(tmp_path, caplog):
    caplog.set_level("INFO", logger="gemline.polling")
    config = _config(tmp_path / "lake")
    lake = trainer_args(config)[0]
    results = []
    assert distill.follow(lake, config.trainer, config.distill, poll_interval_s=0, max_polls=2,
                          on_result=results.append) == 2
    _lake(tmp_path / "lake")  # the examples arrive; the teacher has not consumed any
    assert distill.follow(lake, config.trainer, config.distill, poll_interval_s=0, max_polls=3,
                          on_result=results.append) == 3
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("distill waits")]
    assert said == [("WARNING", f"distill waits: no examples table in {lake.root}: run `gemline build` first"),
                    ("INFO", "distill waits: the teacher has not consumed examples@0 yet")], \
        "each reason once, not per poll; a stage behind the one before it is the usual lag, not a warning"
    assert [r.waiting_for for r in results] == [0, 0, 0]
    assert [r.report_path for r in results] == [None, None, None]
    assert not (tmp_path / "lake" / "_runs").exists() or not list((tmp_path / "lake" / "_runs").glob("distill-*")), \
        "a poll that distilled nothing leaves no report folder"


def test_students_distill_each_teacher_version_once_and_a_quarantined_one_once_released(tmp_path, monkeypatch):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    _lake(straight, quarantined=2)
    run_once(*trainer_args(_config(straight)))
    shutil.copytree(straight, crashed)

    assert distill_progress(Lake(str(straight))) == StageProgress("", None, 4), "four teacher versions with rows wait"
    before_ms = time.time() * 1000
    out = _distill(straight)
    # Each version says when it was distilled, in order (gemline.waits reads it from the checkpoint).
    stamps = [v["distilled_ms"] for v in out.versions]
    assert before_ms <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= time.time() * 1000
    assert [v["distilled_ms"] for v in distill_meta(Lake(str(straight)))["extra"]["versions"]] == stamps
    assert [(v["version"], v["quality"], v["rows"]) for v in out.versions] == [
        (0, "passed", 90), (1, "passed", 90), (2, "quarantined", 0), (3, "passed", 90)]
    # gemline run's status and the freshness benchmark read the students' cursor from their newest checkpoint.
    assert distill_progress(Lake(str(straight))) == StageProgress("examples@3", 270, 0)
    counts = [v["counts"].get("with_teacher") for v in out.versions]
    assert counts == [0, 90, None, 90], "version 0 was the teacher's first (not evaluated): labels alone"
    assert out.versions[0]["counts"]["label_only"] == 90

    report = json.loads((straight / "_runs" / out.run_id / "distill.json").read_text())
    page = (straight / "_runs" / out.run_id / "distill.html").read_text()
    png = base64.b64decode(page.split("src='data:image/png;base64,")[1].split("'")[0])
    assert png.startswith(b"\x89PNG\r\n\x1a\n"), "the staleness plot is inlined"
    assert distill.staleness_plot_png([{"domain": "feed", "staleness_ms_p50": 5.0, "adapter_ne_gain": None}]) is None
    click = [r for r in report["rows"] if r["task"] == "click"]
    # Versions 1 and 3 evaluated (0 trained the new students first), 3 domains, 4 variants and the teacher.
    assert len(click) == 2 * 3 * (len(VARIANTS) + 1)
    assert all(r["rows"] == 30 and 0 <= r["auc"] <= 1 and r["ne"] > 0 and r["calibration"] > 0 for r in click)
    summary = {(r["domain"], r["variant"]): r for r in report["summary"] if r["task"] == "click"}
    assert {d for d, _ in summary} == set(DOMAINS)
    for domain in DOMAINS:
        alone, teacher = summary[(domain, "alone")], summary[(domain, "teacher")]
        assert alone["rows"] == teacher["rows"] == 60
        if alone["ne"] <= teacher["ne"]:  # nothing to transfer: undefined
            assert all(summary[(domain, v)]["transfer_ratio"] is None for v in (*VARIANTS, "teacher"))
            continue
        assert alone["transfer_ratio"] == 0.0 and teacher["transfer_ratio"] == pytest.approx(1.0)
        for variant in VARIANTS[1:]:
            got = summary[(domain, variant)]
            assert got["transfer_ratio"] == pytest.approx((alone["ne"] - got["ne"]) / (alone["ne"] - teacher["ne"]))
    assert any(summary[(d, "teacher")]["transfer_ratio"] is not None for d in DOMAINS), "a teacher that teaches"
    rates = report["inference"]
    measured = [v["inference"] for v in out.versions if v.get("inference")]
    # measured on the first version with rows and every distill.INFERENCE_EVERY-th after it: the newest shown
    assert len(measured) == 1 and out.versions[0]["inference"] and rates == measured[-1], "the newest measured rates"
    assert rates["rows"] == 90 and rates["teacher_model"] == _config(straight).trainer.model and set(rates["students"]) == set(VARIANTS)
    assert all(math.isfinite(r) and r > 0 for r in [rates["teacher"], *rates["students"].values()])
    assert "CPU inference, examples/s" in page and f"{rates['teacher']:,.0f}" in page

    by_key = {(r["examples_version"], r["domain"], r["variant"]): r for r in click}
    staleness = report["staleness"]
    assert sorted((s["examples_version"], s["domain"]) for s in staleness) == [(v, d) for v in (1, 3) for d in DOMAINS]
    for s in staleness:
        # Version 1's teacher had trained on version 0 (a day earlier); version 3's on version 1 (2 was skipped).
        days = 1 if s["examples_version"] == 1 else 2
        assert days * 86_400_000 - 1_000 < s["staleness_ms_p50"] < days * 86_400_000
        aux, adapted = (by_key[(s["examples_version"], s["domain"], v)]["ne"] for v in ("aux_head", "adapter"))
        assert s["adapter_ne_gain"] == pytest.approx(aux - adapted)

    loads: list[str] = []
    real_load = distill._load
    monkeypatch.setattr(distill, "_load", lambda path, *a, **k: loads.append(str(path)) or real_load(path, *a, **k))
    again = _distill(straight)
    assert again.versions == [] and again.cursor == 4, "nothing new: nothing distilled twice"
    assert loads == [] and again.report == out.report, "a poll with nothing to distill loads no student"

    calls = {"n": 0}
    real = distill._train

    def crash_in_version_1(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3 * len(VARIANTS) + 5:  # version 0 trains 3 domains x 4 variants; this is in version 1
            raise RuntimeError("crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(distill, "_train", crash_in_version_1)
    with pytest.raises(RuntimeError, match="crash"):
        _distill(crashed)
    # Version 0 distilled; 1 and 3 wait, and 2, quarantined, still counts until the cursor passes it (as the
    # trainer's lag counts it).
    assert distill_progress(Lake(str(crashed))) == StageProgress("examples@0", 90, 3)
    monkeypatch.setattr(distill, "_train", real)
    resumed = _distill(crashed)
    assert [v["version"] for v in resumed.versions] == [1, 2, 3], "resumed after the last finished version"
    want, got = _params(straight), _params(crashed)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[name], got[name]) for name in want), "each example trained exactly once"
    report_crashed = json.loads((crashed / "_runs" / resumed.run_id / "distill.json").read_text())
    assert report_crashed["rows"] == report["rows"]

    release(str(straight), "examples", 2, "checked by hand")
    assert _distill(straight).versions == [], "released, but the teacher has not consumed it yet"
    run_once(*trainer_args(_config(straight)))
    late = _distill(straight)
    # The teacher predicted version 2 after training on version 3: those predictions would leak the future.
    assert [(v["version"], v["quality"], v["rows"]) for v in late.versions] == [(2, "released", 90)]
    assert late.versions[0]["counts"] == {"with_teacher": 0, "label_only": 90, "dropped_quarantined": 0,
                                          "dropped_nonfinite": 0, "dropped_future": 90}
    assert late.report is not None and late.report["rows"] == report["rows"], "a released version is not evaluated"
    assert [p for p in loads if p.startswith(str(straight))] and len(loads) == 2, \
        "loaded to resume the crashed run, and for the released version"
    assert _distill(straight).versions == []


def test_the_progress_reader_looks_where_distill_keeps_its_checkpoints(tmp_path):
    from trainer.checkpoint import CHECKPOINTS_DIR

    lake = Lake(str(tmp_path))
    assert f"{distill.distill_root(lake)}/{CHECKPOINTS_DIR}" == f"{lake.root}/{DISTILL_CHECKPOINTS}"


def test_cli_distill_once_prints_one_json_line(tmp_path, capsys):
    lake = tmp_path / "lake"
    # An empty first version, as the demo's table creation: the teacher passes it without a lineage record.
    _add(lake, 1, table=synthetic_examples(["2026-01-01"], 1, seed=0).slice(0, 0))
    _lake(lake)
    run_once(*trainer_args(_config(lake)))
    sets = [arg for key, value in SETS.items() if key != "distill.variants" for arg in ("--set", f"{key}={value}")]
    assert main(["distill", "--once", "--lake", str(lake), *sets]) == 0, "the default variants"
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["cursor"] == 5 and [(v["version"], v["rows"]) for v in line["versions"]] == [
        (0, 0), (1, 90), (2, 90), (3, 90), (4, 90)]
    assert Path(line["report_path"]).is_file()
    assert main(["distill", "--once", "--lake", str(lake), *sets, "--set", "distill.variants=alone"]) == 2
    assert "resume them with --set distill.variants=alone,aux_head," in capsys.readouterr().err


def _distill_kept(lake: Path, memory: distill.Memory) -> distill.DistillResult:
    """One version, as a ``--follow`` poll with its kept students."""
    config = _config(lake)
    return distill.run_distill_once(trainer_args(config)[0], config.trainer, config.distill, max_versions=1,
                                    memory=memory)


def test_kept_students_and_compact_checkpoints_train_as_loaded_ones(tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    _lake(straight)
    run_once(*trainer_args(_config(straight)))
    kept, old_format = tmp_path / "kept", tmp_path / "old_format"
    shutil.copytree(straight, kept)
    shutil.copytree(straight, old_format)
    want = _distill(straight)  # one call: every version, the students loaded by none
    assert [v["version"] for v in want.versions] == [0, 1, 2, 3]

    memory, loads = distill.Memory(), []
    monkeypatch.setattr(distill, "_load", lambda path, *a, **k: loads.append(Path(path).name) or _LOAD(path, *a, **k))
    real, calls = distill._train, {"n": 0}

    def crash_once_in_version_2(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2 * 3 * len(VARIANTS) + 2:
            raise RuntimeError("crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(distill, "_train", crash_once_in_version_2)
    got = [_distill_kept(kept, memory).versions for _ in range(2)]
    assert loads == [], "version 1 trained the students version 0 left in memory"
    with pytest.raises(RuntimeError, match="crash"):
        _distill_kept(kept, memory)  # version 2 dies part-way: the students in memory are half-trained
    got += [_distill_kept(kept, memory).versions for _ in range(2)]
    assert loads == ["step-2"], "after the failure, version 2 starts again from its checkpoint, then keeps"
    assert [v[0]["version"] for v in got] == [0, 1, 2, 3]
    assert _distill_kept(kept, memory).versions == [] and loads == ["step-2"]
    params, got_kept = _params(straight), _params(kept)
    assert params.keys() == got_kept.keys()
    assert all(torch.equal(value, got_kept[name]) for name, value in params.items())

    # A checkpoint of the format before the compact one (every table row saved) resumes exactly too.
    monkeypatch.setattr(distill, "_train", real)
    config = _config(old_format)
    lake = trainer_args(config)[0]
    distill.run_distill_once(lake, config.trainer, config.distill, max_versions=2)
    path = latest_checkpoint(f"{old_format}/_distill")
    assert path is not None
    state = read_state(path)
    students = _LOAD(path, state.extra, config.distill, config.trainer, len(state.extra["normalizer"]["names"]))
    compact = (Path(path) / distill.STUDENTS_FILE).read_bytes()
    extra = {k: v for k, v in state.extra.items() if k != "format"}
    shutil.rmtree(path)
    save_checkpoint(f"{old_format}/_distill", TrainState(step=state.step, examples_seen=0,
                                                         examples_version=state.examples_version, extra=extra),
                    students.modules, students.optimizers)
    whole = (Path(path) / "state.pt").stat().st_size
    assert whole > 20 * len(compact), "format 1: every row of every table"
    distill.run_distill_once(lake, config.trainer, config.distill)
    got_old = _params(old_format)
    assert params.keys() == got_old.keys()
    assert all(torch.equal(value, got_old[name]) for name, value in params.items())

    # What the compact checkpoint holds: the rows the examples met. Each domain's rows share one domain id, so its
    # students' domain tables hold one row; no table holds every row.
    newest = latest_checkpoint(f"{kept}/_distill")
    assert newest is not None
    saved = torch.load(Path(newest) / distill.STUDENTS_FILE, weights_only=True)
    assert sorted(saved["rows"]) == sorted(DOMAINS)
    for rows in saved["rows"].values():
        assert len(rows[SPARSE_FEATURES.index("domain")]) == 1
        assert all(0 < len(r) < config.distill.num_embeddings for r in rows)
    assert sum(f.stat().st_size for f in Path(newest).iterdir()) < 0.05 * whole


def test_a_call_without_the_report_draws_no_page_and_the_next_page_covers_every_version(tmp_path):
    lake = tmp_path / "lake"
    _lake(lake)
    config = _config(lake)
    run_once(*trainer_args(config))
    args = (trainer_args(config)[0], config.trainer, config.distill)
    quiet = distill.run_distill_once(*args, max_versions=2, report=False)
    assert [v["version"] for v in quiet.versions] == [0, 1] and quiet.report_path is None
    assert not (lake / "_runs" / quiet.run_id / "distill.html").exists()
    drawn = distill.run_distill_once(*args, report=True)
    assert [v["version"] for v in drawn.versions] == [2, 3] and drawn.run_id == quiet.run_id
    report = json.loads((lake / "_runs" / drawn.run_id / "distill.json").read_text())
    assert sorted({r["examples_version"] for r in report["rows"]}) == [1, 2, 3], "version 0 trained, not evaluated"


def test_follow_redraws_the_report_at_most_every_report_every_s(tmp_path, monkeypatch):
    import types

    clock = {"s": 1000.0}
    asked = []

    def fake_once(lake, tc, dc, *, report, **_):
        asked.append(report)
        return distill.DistillResult(run_id="r", cursor=len(asked), versions=[{"version": len(asked) - 1}],
                                     report_path="page" if report else None)

    monkeypatch.setattr(distill, "time", types.SimpleNamespace(monotonic=lambda: clock["s"]))
    monkeypatch.setattr(distill, "run_distill_once", fake_once)
    config = _config(tmp_path / "lake")
    assert distill.follow(trainer_args(config)[0], config.trainer, config.distill, poll_interval_s=0, max_polls=4,
                          watch_s=None, report_every_s=60.0, report_cpu_share=1.0, on_result=lambda _: clock.update(s=clock["s"] + 40)) == 4
    # t = 1000 (the first call: drawn), 1040 (too soon), 1080 (80 s after the last: drawn), 1120 (too soon)
    assert asked == [True, False, True, False]


def test_follow_draws_a_throttled_report_when_it_stops(tmp_path, monkeypatch):
    """The last call distilled without drawing (throttled): the page is drawn from its report at the stop, once; a
    call that drew leaves nothing to draw."""
    import types

    clock = {"s": 1000.0}
    drawn: list[tuple[str, dict]] = []

    def fake_once(lake, tc, dc, *, report, **_):
        n = clock["s"]
        return distill.DistillResult(run_id="r", cursor=1, versions=[{"version": 0}], report={"at": n},
                                     report_path="page" if report else None)

    monkeypatch.setattr(distill, "time", types.SimpleNamespace(monotonic=lambda: clock["s"]))
    monkeypatch.setattr(distill, "run_distill_once", fake_once)
    monkeypatch.setattr(distill, "write_report", lambda lake, run_id, report: drawn.append((run_id, report)))
    config = _config(tmp_path / "lake")
    args = (trainer_args(config)[0], config.trainer, config.distill)
    step = {"poll_interval_s": 0, "watch_s": None, "report_every_s": 60.0, "report_cpu_share": 1.0,
            "on_result": lambda _: clock.update(s=clock["s"] + 40)}
    distill.follow(*args, max_polls=2, **step)  # t = 1000 drawn by the call, 1040 throttled
    assert drawn == [("r", {"at": 1040.0})], "drawn at the stop from the last call's report"
    drawn.clear()
    distill.follow(*args, max_polls=1, **step)  # the only call drew: nothing left
    assert drawn == []
