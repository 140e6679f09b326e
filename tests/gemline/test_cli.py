"""The CLI: flags reach the config, bad flags exit 2, and generate -> ingest loses nothing."""

import json

import pyarrow as pa
import pytest

from gemline.cli import main
from gemline.lake import read_table
from ingest.broker import EmbeddedBroker
from ingest.datasets.types import RawRecord
from ingest.generate import GenerateConfig, generate_records


def test_bad_override_exits_2(capsys, tmp_path):
    assert main(["build", "--lake", str(tmp_path), "--set", "build.max_seq_len=abc"]) == 2
    assert "build.max_seq_len: expected int" in capsys.readouterr().err


def test_kafka_commands_need_a_cluster(tmp_path):
    with pytest.raises(SystemExit, match="--bootstrap"):
        main(["ingest", "--lake", str(tmp_path)])


def test_unknown_flags_rejected_where_nothing_passes_through():
    with pytest.raises(SystemExit):
        main(["train", "--runner", "DirectRunner"])


@pytest.mark.integration
@pytest.mark.parametrize("cap", [None, 40])
def test_generate_then_ingest_twice(tmp_path, capsys, cap):
    """Uncapped: one batch; capped at 40 offsets per partition (of about 118): several bounded batches, same rows.

    (A cap of 7 made 17 batches, each a Beam pipeline: 165 s of CI under load for the same assertion.)"""
    sets = ["--set", "generate.num_users=40", "--set", "generate.num_ads=20", "--set", "generate.days=1",
            "--set", "generate.bad_rate=0.05", "--set", "generate.seed=3"]
    expected = generate_records(GenerateConfig(num_users=40, num_ads=20, days=1.0, bad_rate=0.05, seed=3))
    num_bad = sum(isinstance(r, RawRecord) for r in expected)
    assert num_bad > 0
    with EmbeddedBroker() as broker:
        common = ["--lake", str(tmp_path), "--bootstrap", broker.bootstrap, "--topic", "syn"]
        assert main(["generate", *common, *sets]) == 0
        capsys.readouterr()
        capped = [] if cap is None else ["--set", f"ingest.max_offsets_per_partition={cap}"]
        assert main(["ingest", *common, *capped]) == 0
        batches = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
        assert len(batches) == 1 if cap is None else len(batches) > 1
        events = read_table(tmp_path, "events")
        dead = read_table(tmp_path, "dead_letter")
        if cap is not None:  # one JSON line per batch, and the lines add up to the tables
            results = [json.loads(line) for line in batches]
            assert sum(r["events_written"] for r in results) == events.num_rows
            assert sum(r["dead_letter_written"] for r in results) == dead.num_rows
            assert [r["batch_version"] for r in results] == list(range(len(results)))
        assert events.num_rows == len(expected) - num_bad
        assert dead.num_rows == num_bad
        assert sorted(events["event_id"].to_pylist()) == sorted(r.event_id for r in expected if not isinstance(r, RawRecord))
        assert main(["ingest", *common, *capped]) == 0  # nothing new: nothing added
        assert read_table(tmp_path, "events").num_rows == events.num_rows
        assert read_table(tmp_path, "dead_letter").num_rows == num_bad


def test_quality_release_lifts_a_quarantine(tmp_path, capsys):
    from gemline.gate import append_quality_rows, gate_decision

    append_quality_rows(tmp_path, [dict(table="examples", table_version=0, run_id="r1", run_ts_ms=1,
                                        expectation="leakage", severity="critical", success=False,
                                        observed="1 leaked", report_path="")])
    assert not gate_decision(tmp_path, "examples", 0).allowed
    assert main(["quality", "release", "0", "--reason", "checked by hand", "--lake", str(tmp_path)]) == 0
    assert "released by hand: checked by hand" in capsys.readouterr().out
    assert gate_decision(tmp_path, "examples", 0).allowed


def test_release_of_a_never_validated_version_is_refused(tmp_path, capsys):
    from gemline.gate import gate_decision
    from gemline.lake import commit_once

    assert main(["quality", "release", "3", "--reason", "x", "--lake", str(tmp_path)]) == 2
    assert "examples@3 was never validated" in capsys.readouterr().err
    for version in range(4):
        commit_once(tmp_path, "examples", pa.table({"x": [version]}), app_id="build", version=version)
    assert main(["quality", "release", "3", "--reason", "x", "--lake", str(tmp_path)]) == 2
    assert "examples@3 was never validated" in capsys.readouterr().err
    decision = gate_decision(tmp_path, "examples", 3)
    assert (decision.allowed, decision.validated) == (False, False)
    # A version that does not exist is named as such, not as never validated.
    for argv in (["quality", "release", "99", "--reason", "x"], ["train", "--version", "99"]):
        assert main([*argv, "--lake", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: examples has versions 0..3, not 99") and "Traceback" not in err, err


def test_train_on_a_quarantined_version_is_a_one_line_error(tmp_path, capsys):
    from gemline.gate import append_quality_rows

    append_quality_rows(tmp_path, [dict(table="examples", table_version=0, run_id="r1", run_ts_ms=1,
                                        expectation="empty", severity="critical", success=False,
                                        observed="0 rows", report_path="")])
    assert main(["train", "--lake", str(tmp_path), "--version", "0"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: examples@0 is quarantined") and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["train"], ["train", "--nproc", "2"], ["report", "--table", "nosuch"],
    ["build", "--config", "/nonexistent/gemline.toml"]])
def test_missing_tables_and_files_are_one_line_errors(tmp_path, capsys, argv):
    assert main([*argv, "--lake", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_sharded_train_of_a_never_validated_version_is_one_line(tmp_path, capsys):
    from gemline.lake import commit_once

    commit_once(tmp_path, "examples", pa.table({"x": [1]}), app_id="build", version=0)
    assert main(["train", "--nproc", "2", "--lake", str(tmp_path)]) == 3  # refused before torchrun starts
    err = capsys.readouterr().err
    assert err.startswith("error: examples@0 was never validated") and "Traceback" not in err


def test_holdout_last_day_is_the_one_shot_mode_and_excludes_the_continuous_ones(tmp_path, capsys):
    from gemline.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["train", "--holdout-last-day", "--lake", str(tmp_path)])
    assert args.holdout_last_day and not args.once and not args.follow
    for other in ("--once", "--follow"):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["train", "--holdout-last-day", other])
        assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_nproc_below_one_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["train", "--nproc", "0", "--lake", str(tmp_path)])


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: connections to it are refused


def test_ingest_against_a_closed_port_fails_at_once_in_one_line(tmp_path, capsys):
    bootstrap = f"127.0.0.1:{_closed_port()}"
    assert main(["ingest", "--lake", str(tmp_path), "--bootstrap", bootstrap]) == 2
    err = capsys.readouterr().err
    assert f"error: connection refused by {bootstrap}: nothing listens there" in err
    assert "Traceback" not in err


def test_all_refused_only_when_nothing_listens():
    import socket

    from ingest.kafka_clients import all_refused

    closed = f"127.0.0.1:{_closed_port()}"
    assert all_refused(closed)
    assert all_refused(f"PLAINTEXT://{closed}, {closed}")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert not all_refused(f"{closed},127.0.0.1:{port}"), "one live server is enough"
    assert not all_refused("not an address")



def test_train_output_cuts_the_loss_curve_to_its_ends():
    import json

    from gemline.cli import _train_summary
    from trainer.train import TrainResult

    curve = [1.0 - i / 2000 for i in range(1000)]
    result = TrainResult(examples_version=3, train_examples=10, eval_examples=4, eval_date="2026-01-02",
                         metrics={"click": {}}, checkpoint_path="/lake/_checkpoints/step-1000", steps=1000,
                         loss_curve=curve)
    out = json.loads(_train_summary(result))
    assert out["loss_curve"] == {"steps": 1000, "first": 1.0, "last": curve[-1],
                                 "plot": "/lake/_checkpoints/step-1000/loss_curve.png"}
    assert out["steps"] == 1000 and out["examples_version"] == 3
    assert result.loss_curve == curve, "the result itself keeps the whole curve"


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path):
    import gemline.cli as cli

    def interrupted(args, extra):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_build", interrupted)
    assert cli.main(["build", "--lake", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "interrupted: build stopped; run the same command again to finish" in err
    assert "Traceback" not in err
    # generate commits nothing: running it again is not how it "finishes"
    monkeypatch.setattr(cli, "cmd_generate", interrupted)
    assert cli.main(["generate", "--bootstrap", "127.0.0.1:1"]) == 130
    err = capsys.readouterr().err
    assert "interrupted: generate stopped; the records it sent stay in the topic" in err and "generate.start_ms" in err
    assert "run the same command again to finish" not in err
    # neither does replay: a rerun sends the dataset again, and ingest drops the repeated event ids
    monkeypatch.setattr(cli, "cmd_replay", interrupted)
    assert cli.main(["replay", "--dataset", "movielens", "--bootstrap", "127.0.0.1:1"]) == 130
    err = capsys.readouterr().err
    assert "interrupted: replay stopped; the records it sent stay in the topic" in err and "dedup_window_ms" in err
    assert "run the same command again to finish" not in err
    # gemline run handles Ctrl-C itself (it stops its stages in order) and returns 130: the same advice, now true
    # with the embedded broker too (a rerun starts ingest over on the new broker's topic: tests/gemline/test_run.py)
    import gemline.run

    monkeypatch.setattr(gemline.run, "run_pipeline", lambda config, plan: 130)
    assert cli.main(["run", "--lake", str(tmp_path)]) == 130
    assert "interrupted: run stopped; run the same command again to finish" in capsys.readouterr().err


def test_report_on_a_table_without_a_quality_suite_says_so(tmp_path, capsys):
    assert main(["report", "--table", "dead_letter", "--lake", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no quality suite (so no report) for table 'dead_letter'" in err
    assert "gemline validate --table dead_letter" not in err


def test_ctrl_c_inside_a_beam_step_is_recognised(monkeypatch, capsys, tmp_path):
    """Beam re-raises a KeyboardInterrupt from a step as ``RuntimeError: KeyboardInterrupt [while
    running ...]`` whose context is the interrupt; main follows that link, not the message text."""
    import gemline.cli as cli

    monkeypatch.setattr(cli, "cmd_build", _beam_step_raising(KeyboardInterrupt()))
    assert cli.main(["build", "--lake", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "interrupted: build stopped; run the same command again to finish" in err
    assert "Traceback" not in err
    assert cli._reportable(RuntimeError("KeyboardInterrupt [while running 'ParseBatches/ParseBatch']")) is None, \
        "a message that merely reads like an interrupt is not one"


def test_a_second_ingest_on_a_busy_lake_is_one_line(tmp_path, capsys):
    from gemline.locks import exclusive

    with exclusive(tmp_path, "ingest"):
        assert main(["ingest", "--lake", str(tmp_path), "--bootstrap", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: another ingest is running on this lake (pid ") and "Traceback" not in err


def test_a_kafka_timeout_inside_a_beam_step_is_one_line(monkeypatch, capsys, tmp_path):
    import gemline.cli as cli
    from ingest.kafka_clients import OffsetRange, _check_progress

    def read_range(x):  # the read's own timeout check, with a deadline already past
        _check_progress(OffsetRange("t", 0, 5, 9), 5, deadline=0.0)

    monkeypatch.setattr(cli, "cmd_ingest", _beam_step_running(read_range))
    assert cli.main(["ingest", "--lake", str(tmp_path), "--bootstrap", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: t[0]: no record at offset >= 5 within the read timeout")
    assert "[while running 'Step']" in err and "Traceback" not in err


def test_a_lost_commit_race_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    import gemline.cli as cli
    from gemline.lake import CommitConflictError

    def conflicting(args, extra):
        raise CommitConflictError("s3://b/lake/events: another writer committed to this table while this one "
                                  "committed (app 'ingest:t', version 1)")

    monkeypatch.setattr(cli, "cmd_ingest", conflicting)
    assert cli.main(["ingest", "--lake", str(tmp_path), "--bootstrap", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == ("error: s3://b/lake/events: another writer committed to this table while this "
                                       "one committed (app 'ingest:t', version 1)\n")


def _beam_step_running(fn, *beam_args):
    """A CLI command that runs a one-element Beam pipeline (gemline's local runner) whose step
    ``Step`` calls ``fn``."""

    def command(args, extra):
        import apache_beam as beam
        from apache_beam.options.pipeline_options import PipelineOptions

        from gemline.beam_runner import local_runner_args

        with beam.Pipeline(options=PipelineOptions(local_runner_args(list(beam_args)))) as p:
            _ = p | beam.Create([0]) | "Step" >> beam.Map(fn)
        return 0

    return command


def _beam_step_raising(exc, *beam_args):
    """A CLI command whose Beam step raises ``exc``."""

    def step(_):
        raise exc

    return _beam_step_running(step, *beam_args)


def _raising(exc):
    def command(args, extra):
        raise exc

    return command


def _gate_closed():
    from gemline.gate import GateClosedError, GateDecision

    refused = GateDecision("events", 2, False, "events@2 is quarantined: critical expectations failed: unique:event_id")
    return GateClosedError(refused, "build")


def _topic_changed():
    from ingest.kafka_source import TopicChangedError

    return TopicChangedError("topic 't' was recreated: its id is id-1, the lake's offsets are of id-2")


def _quarantined():
    from trainer.train import QuarantinedError

    return QuarantinedError("examples@0 is quarantined: critical expectations failed: leakage")


def _lake_busy():
    from gemline.locks import LakeBusyError

    return LakeBusyError("another build is running on this lake (pid 1 on h since 2026-01-01T00:00:00Z)")


def _commit_conflict():
    from gemline.lake import CommitConflictError

    return CommitConflictError("s3://b/lake/events: another writer committed to this table first")


def _gemline_error(name, message):
    import gemline.errors

    return lambda: getattr(gemline.errors, name)(message)


EXIT_CODES = [  # (id, the error, the exit code main returns for it)
    ("bad-config", _gemline_error("BadConfigError", "build.max_seq_len must be >= 1, got 0"), 2),
    ("missing-input", _gemline_error("MissingInputError", "no events table under '/l'; run the ingest job first"), 2),
    ("broker-unreachable", _gemline_error("BrokerUnreachableError", "connection refused by 127.0.0.1:1"), 2),
    ("broker-timeout", _gemline_error("BrokerTimeoutError", "t[0]: no record at offset >= 5 within the read timeout"), 2),
    ("lake-busy", _lake_busy, 2),
    ("commit-conflict", _commit_conflict, 2),
    ("topic-changed", _topic_changed, 2),
    ("gate-closed", _gate_closed, 3),
    ("quarantined", _quarantined, 3),
    ("retention-gap", _gemline_error("RetentionGapError", "10 record(s) of t were deleted by retention"), 4),
]


@pytest.mark.parametrize("make, code", [case[1:] for case in EXIT_CODES], ids=[case[0] for case in EXIT_CODES])
def test_each_gemline_error_is_one_line_with_its_exit_code(monkeypatch, capsys, tmp_path, make, code):
    import gemline.cli as cli

    exc = make()
    assert exc.exit_code == code
    monkeypatch.setattr(cli, "cmd_build", _raising(exc))
    assert cli.main(["build", "--lake", str(tmp_path)]) == code
    assert capsys.readouterr().err == f"error: {exc}\n"


@pytest.mark.parametrize("bug", [ZeroDivisionError("division by zero"), ValueError("a real bug"),
                                 RuntimeError("records (0, 1) were staged to both tables"),
                                 FileNotFoundError("[Errno 2] No such file or directory: 'x'")],
                         ids=lambda bug: type(bug).__name__)
def test_an_unexpected_exception_propagates_with_its_traceback(monkeypatch, capsys, tmp_path, bug):
    """Not a GemlineError: main does not catch it (the console script prints the traceback, exit 1)."""
    import gemline.cli as cli

    monkeypatch.setattr(cli, "cmd_build", _raising(bug))
    with pytest.raises(type(bug)) as info:
        cli.main(["build", "--lake", str(tmp_path)])
    assert info.value is bug and info.traceback[-1].name == "command"
    assert capsys.readouterr().err == ""


def test_a_bug_while_handling_a_gemline_error_is_not_reported_as_that_error(monkeypatch, tmp_path):
    import gemline.cli as cli

    def command(args, extra):
        try:
            raise _lake_busy()
        except RuntimeError:
            return 1 // 0  # its __context__ is the busy lake; it is still a bug

    monkeypatch.setattr(cli, "cmd_build", command)
    with pytest.raises(ZeroDivisionError):
        cli.main(["build", "--lake", str(tmp_path)])


IN_BEAM = [  # (id, the error, Beam flags, the exit code)
    ("lake-busy", _lake_busy, (), 2),
    ("gate-closed", _gate_closed, (), 3),  # no one-message constructor: Beam wraps it in a RuntimeError
    ("retention-gap", _gemline_error("RetentionGapError", "10 record(s) of t were deleted by retention"), (), 4),
    ("lake-busy-2-workers", _lake_busy, ("--direct_num_workers=2", "--direct_running_mode=multi_threading"), 2),
    ("gate-closed-2-workers", _gate_closed, ("--direct_num_workers=2", "--direct_running_mode=multi_threading"), 3),
]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # 2 workers: Beam's gRPC teardown
@pytest.mark.parametrize("make, beam_args, code", [case[1:] for case in IN_BEAM], ids=[case[0] for case in IN_BEAM])
def test_a_gemline_error_inside_a_beam_step_is_one_line_with_its_exit_code(monkeypatch, capsys, tmp_path,
                                                                           make, beam_args, code):
    import gemline.cli as cli

    exc = make()
    monkeypatch.setattr(cli, "cmd_build", _beam_step_raising(exc, *beam_args))
    assert cli.main(["build", "--lake", str(tmp_path)]) == code
    err = capsys.readouterr().err
    if beam_args:  # the worker thread's Beam prints its traceback itself (sdk_worker._execute), then main's line
        err = err.rstrip("\n").rpartition("\n")[2] + "\n"
    assert err.startswith(f"error: {exc}") and err.count("\n") == 1, err
    assert "Traceback" not in err


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # 2 workers: Beam's gRPC teardown
@pytest.mark.parametrize("beam_args", [(), ("--direct_num_workers=2", "--direct_running_mode=multi_threading")],
                         ids=["1-worker", "2-workers"])
def test_a_bug_inside_a_beam_step_keeps_its_traceback(monkeypatch, tmp_path, beam_args):
    import gemline.cli as cli

    monkeypatch.setattr(cli, "cmd_build", _beam_step_raising(ZeroDivisionError("bug in a step"), *beam_args))
    with pytest.raises((ZeroDivisionError, RuntimeError), match="bug in a step") as info:
        cli.main(["build", "--lake", str(tmp_path)])
    if not beam_args:
        assert isinstance(info.value, ZeroDivisionError), "one worker: Beam keeps the class"


def test_a_worker_traceback_counts_only_for_an_exact_gemline_class_name():
    from gemline.cli import _from_worker
    from gemline.gate import GateClosedError
    from gemline.locks import LakeBusyError

    head = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
    assert _from_worker(RuntimeError(head + "gemline.locks.LakeBusyError: busy [while running 'S']")) == \
        (LakeBusyError, "busy [while running 'S']")
    assert _from_worker(RuntimeError(head + "RuntimeError: gemline.gate.GateClosedError: refused [while running 'S']")) \
        == (GateClosedError, "refused [while running 'S']")
    assert _from_worker(RuntimeError(head + "LakeBusyError: busy")) is None, "the qualified name only"
    assert _from_worker(RuntimeError(head + "gemline.locks.LakeBusyError: busy\n\nDuring handling of the above "
                                     "exception, another exception occurred:\n\n" + head + "ZeroDivisionError: x")) is None
    assert _from_worker(RuntimeError("gemline.locks.LakeBusyError: busy")) is None, "not a worker's traceback"
    assert _from_worker(ValueError(head + "gemline.locks.LakeBusyError: busy")) is None


def test_beam_logs_of_a_gemline_error_are_dropped_and_of_a_bug_kept(caplog):
    import logging

    from gemline import cli

    cli._quiet_interrupts()
    beam_log = logging.getLogger("apache_beam.runners.common")
    try:
        raise _lake_busy()
    except RuntimeError:
        beam_log.exception("another build is running on this lake [while running 'Step']")
    try:
        raise ZeroDivisionError("bug")
    except ZeroDivisionError:
        beam_log.exception("bug [while running 'Step']")
    assert [r.getMessage() for r in caplog.records if r.name == "apache_beam.runners.common"] == \
        ["bug [while running 'Step']"]


@pytest.mark.parametrize(("argv", "called"), [
    ([], ("progressive", {"models": ("gem", "dlrm", "lr"), "resamples": 1000, "seed": 0, "ablations": (),
                          "max_versions": None, "seeds": None})),
    (["--models", "gem,lr", "--resamples", "50", "--bootstrap-seed", "4", "--ablate", "collisions,sequence_len",
      "--max-versions", "3", "--seeds", "0,2,1"],
     ("progressive", {"models": ("gem", "lr"), "resamples": 50, "seed": 4, "ablations": ("collisions", "sequence_len"),
                      "max_versions": 3, "seeds": (0, 2, 1)})),
    (["--holdout-last-day"], ("holdout", {"examples_version": None, "models": ("gem", "dlrm", "lr")})),
    (["--version", "3"], ("holdout", {"examples_version": 3, "models": ("gem", "dlrm", "lr")})),
])
def test_compare_is_progressive_unless_a_held_out_day_is_asked_for(monkeypatch, capsys, tmp_path, argv, called):
    import types

    import trainer.compare as compare

    report = tmp_path / "compare.md"
    report.write_text("| table |\n")
    calls = []

    def fake(kind):
        def run(lake, tc, **kwargs):
            calls.append((kind, kwargs))
            return types.SimpleNamespace(paths={"md": str(report)})
        return run

    monkeypatch.setattr(compare, "run_compare", fake("progressive"))
    monkeypatch.setattr(compare, "run_holdout_compare", fake("holdout"))
    assert main(["compare", "--lake", str(tmp_path), *argv]) == 0
    assert calls == [called]
    assert capsys.readouterr().out.startswith("| table |")


@pytest.mark.parametrize("argv", [["build"], ["train", "--once"], ["train", "--version", "3"]])
def test_a_stage_run_on_a_mistyped_lake_leaves_no_lake_behind(tmp_path, capsys, argv):
    missing = tmp_path / "no-such-lake"
    assert main([*argv, "--lake", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "first" in err and "Traceback" not in err, err
    assert not missing.exists()


def test_the_lock_keeps_a_lake_it_created_once_something_was_written(tmp_path):
    from gemline.locks import exclusive

    lake = tmp_path / "new-lake"
    with exclusive(lake, "ingest"):
        (lake / "events").mkdir()
    assert sorted(p.name for p in lake.iterdir()) == ["_locks", "events"]


@pytest.mark.parametrize("argv", [["--resamples", "0"], ["--resamples", "-5"], ["--max-versions", "0"]])
def test_compare_refuses_counts_below_one_as_a_usage_error(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", *argv])
    assert exit_.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_build_of_an_events_version_that_does_not_exist_is_one_line(tmp_path, capsys):
    import pyarrow as pa
    from deltalake import write_deltalake

    write_deltalake(str(tmp_path / "events"), pa.table({"event_id": ["e1"]}))
    assert main(["build", "--events-version", "99", "--lake", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: events has versions 0..0, not 99") and "Traceback" not in err


def test_report_of_a_version_that_does_not_exist_names_the_versions(tmp_path, capsys):
    from gemline.lake import commit_once

    for version in (0, 1):
        commit_once(tmp_path, "examples", pa.table({"x": [version]}), app_id="build", version=version)
    assert main(["report", "--version", "99", "--lake", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: examples has versions 0..1, not 99\n"
    # An existing version without a report: validating it is the way on, as the message says.
    assert main(["report", "--version", "1", "--lake", str(tmp_path)]) == 2
    assert "run `gemline validate --table examples --version 1`" in capsys.readouterr().err


def test_report_on_a_lake_without_the_table_says_what_writes_it(tmp_path, capsys):
    lake = tmp_path / "lake"
    for argv in ([], ["--version", "3"]):
        assert main(["report", "--lake", str(lake), *argv]) == 2
        assert capsys.readouterr().err == (f"error: no examples table in {lake} yet, so no report: `gemline ingest` "
                                           "writes events, `gemline build` the others\n")


NOISE_SCRIPT = """
import logging, sys
import torch.fx._symbolic_trace as fx_trace
from gemline.cli import main

logging.basicConfig()
# A Beam worker leaves the root logger at INFO (apache_beam.runners.worker.logger), which shows GX's INFO line:
logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.INFO)
assert main(["lineage", "--lake", sys.argv[1]]) == 2  # a cheap command: no checkpoint
# The three sources, as a demo or `gemline run` meets them after the command started:
fx_trace.is_fx_tracing()  # TorchRec's forward
import great_expectations as gx
gx.get_context(mode="ephemeral")  # validation.suites
import apache_beam.io.gcp.internal.clients.bigquery  # any Beam pipeline
for name in ("torch.fx._symbolic_trace", "great_expectations.data_context.types.base", "root"):
    logging.getLogger(name).warning("control line of %s", name)  # other messages of the same loggers still show
"""


def test_known_harmless_log_lines_are_gone_and_other_lines_stay(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", NOISE_SCRIPT, str(tmp_path / "lake")], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == f"error: no continuous checkpoint under {tmp_path / 'lake' / '_continuous'}: run `gemline train --once`"
    for name in ("torch.fx._symbolic_trace", "great_expectations.data_context.types.base", "root"):
        assert sum(f"control line of {name}" in line for line in lines) == 1, proc.stderr
    assert len(lines) == 4, proc.stderr  # nothing else


@pytest.mark.parametrize(("seeds", "message"), [
    ("0,x", "argument --seeds: seeds are comma-separated integers >= 0, got '0,x'"),
    ("-1", "argument --seeds: seeds must be >= 0, got '-1'"),
    ("1,1", "argument --seeds: seeds must be distinct, got 1,1"),
])
def test_compare_seeds_are_distinct_non_negative_integers(tmp_path, capsys, seeds, message):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--lake", str(tmp_path / "lake"), f"--seeds={seeds}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.rstrip().endswith(message) and "_seed_list" not in err, err


@pytest.mark.parametrize("rate", ["-5", "0", "nan", "inf", "x"])
def test_a_rate_that_is_not_positive_is_one_usage_line(rate, capsys):
    for argv in (["generate", "--rate", rate], ["run", "--generate-rate", rate]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert "expected events/s > 0" in capsys.readouterr().err


def test_train_once_names_a_quarantined_version_as_quarantined(tmp_path, capsys):
    from tests.conftest import trainer_args  # noqa: F401 - the trainer tests' lake helpers
    from tests.trainer.test_continuous import SMALL, _add

    lake = tmp_path / "lake"
    _add(lake, 1, passed=False)
    sets = [arg for key, value in SMALL.items() for arg in ("--set", f"{key}={value}")]
    assert main(["train", "--once", "--lake", str(lake), *sets]) == 0
    err = capsys.readouterr().err
    assert "examples@0 is quarantined" in err and "quality release 0" in err and "not validated" not in err, err
