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
@pytest.mark.parametrize("cap", [None, 7])
def test_generate_then_ingest_twice(tmp_path, capsys, cap):
    """Uncapped: one batch; capped at 7 offsets per partition: several bounded batches, same rows."""
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
    from validation.gate import append_quality_rows, gate_decision

    append_quality_rows(tmp_path, [dict(table="examples", table_version=0, run_id="r1", run_ts_ms=1,
                                        expectation="leakage", severity="critical", success=False,
                                        observed="1 leaked", report_path="")])
    assert not gate_decision(tmp_path, "examples", 0).allowed
    assert main(["quality", "release", "0", "--reason", "checked by hand", "--lake", str(tmp_path)]) == 0
    assert "released by hand: checked by hand" in capsys.readouterr().out
    assert gate_decision(tmp_path, "examples", 0).allowed


def test_release_of_a_never_validated_version_is_refused(tmp_path, capsys):
    from validation.gate import gate_decision

    assert main(["quality", "release", "3", "--reason", "x", "--lake", str(tmp_path)]) == 2
    assert "examples@3 was never validated" in capsys.readouterr().err
    decision = gate_decision(tmp_path, "examples", 3)
    assert (decision.allowed, decision.validated) == (False, False)


def test_train_on_a_quarantined_version_is_a_one_line_error(tmp_path, capsys):
    from validation.gate import append_quality_rows

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


def test_report_on_a_table_without_a_quality_suite_says_so(tmp_path, capsys):
    assert main(["report", "--table", "dead_letter", "--lake", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no quality suite (so no report) for table 'dead_letter'" in err
    assert "gemline validate --table dead_letter" not in err


def test_ctrl_c_inside_a_beam_step_is_recognised():
    from gemline.cli import _is_interrupt

    assert _is_interrupt(RuntimeError("KeyboardInterrupt [while running 'ParseBatches/ParseBatch']"))
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = KeyboardInterrupt()
    assert _is_interrupt(wrapped)
    assert not _is_interrupt(RuntimeError("records (0, 1) were staged to both tables"))


def test_a_second_ingest_on_a_busy_lake_is_one_line(tmp_path, capsys):
    from gemline.locks import exclusive

    with exclusive(tmp_path, "ingest"):
        assert main(["ingest", "--lake", str(tmp_path), "--bootstrap", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: another ingest is running on this lake (pid ") and "Traceback" not in err


def test_a_kafka_timeout_inside_a_beam_step_is_one_line(monkeypatch, capsys, tmp_path):
    import gemline.cli as cli

    def timed_out(args, extra):
        raise RuntimeError("TimeoutError: t[0]: no record at offset >= 5 within the read timeout; is the broker up? "
                           "[while running 'ReadKafka/ReadRange']")

    monkeypatch.setattr(cli, "cmd_ingest", timed_out)
    assert cli.main(["ingest", "--lake", str(tmp_path), "--bootstrap", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.startswith("error: t[0]: no record at offset >= 5 within the read timeout")


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
