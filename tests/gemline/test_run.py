"""gemline run: every stage under one supervisor; a stage SIGKILLed mid-stream is restarted and every Kafka
record ends up exactly once in events or dead_letter."""

from __future__ import annotations

import json
import os
import signal
import time

import pyarrow as pa
import pytest

from gemline.config import load_config
from gemline.lake import read_table
from gemline.run import RunPlan, config_flags, run_pipeline, stage_commands


def test_stage_commands_carry_the_config_but_never_a_secret(tmp_path):
    config = load_config(overrides={"lake": "s3://bucket/lake", "lake_storage_options.AWS_SECRET_ACCESS_KEY": "s3cr3t",
                                    "build.max_seq_len": "64"})
    flags = config_flags(config, tmp_path / "options.toml")
    stages = stage_commands(RunPlan(generate_rate=100.0, interval_s=3.0), "127.0.0.1:9092", flags)
    assert [s.name for s in stages] == ["generate", "ingest", "validate", "build", "train"]
    assert [s.restart for s in stages] == ["on-failure", "always", "always", "always", "always"]
    for stage in stages:
        argv = " ".join(stage.argv)
        assert "s3cr3t" not in argv and "--config " + str(tmp_path / "options.toml") in argv
        assert "--set build.max_seq_len=64" in argv and "--set lake=s3://bucket/lake" in argv
    assert "--follow --table events,examples --interval-s 3.0" in " ".join(stages[2].argv)
    assert [s.name for s in stage_commands(RunPlan(train=False), "h:1", [])] == ["ingest", "validate", "build"]


@pytest.mark.slow
def test_a_sigkilled_ingest_under_gemline_run_loses_and_doubles_nothing(tmp_path):
    lake = tmp_path / "lake"
    config = load_config(overrides={"lake": str(lake), "generate.num_users": "40", "generate.days": "0.3",
                                    "ingest.streaming.commit_interval_s": "1"})
    state = {"killed": None, "deadline": time.monotonic() + 300, "checked": 0.0}

    def produced(sup) -> int | None:
        log = sup.stages[[s.command.name for s in sup.stages].index("generate")].log_path
        lines = [line for line in log.read_text().splitlines() if line.startswith("{")] if log.exists() else []
        return json.loads(lines[-1])["produced"] if lines else None

    def rows() -> int:
        tables = [read_table(str(lake), t) for t in ("events", "dead_letter")]
        return sum(t.num_rows for t in tables if t is not None)

    def until(sup) -> bool:
        assert time.monotonic() < state["deadline"], "gemline run did not ingest everything within 300 s"
        ingest = sup.stages[[s.command.name for s in sup.stages].index("ingest")]
        if state["killed"] is None and (lake / "events" / "_delta_log").is_dir() and ingest.pid is not None:
            state["killed"] = ingest.pid  # after its first commit, maybe while a batch is in flight
            os.kill(ingest.pid, signal.SIGKILL)
        if state["killed"] is None or ingest.restarts < 1 or time.monotonic() - state["checked"] < 2:
            return False
        state["checked"] = time.monotonic()
        total = produced(sup)
        return total is not None and rows() >= total

    assert run_pipeline(config, RunPlan(generate_rate=400.0, interval_s=2.0, train=False), live=False,
                        until=until, say=lambda line: None) == 0
    events, dead = read_table(str(lake), "events"), read_table(str(lake), "dead_letter")
    offsets = pa.concat_tables([t.select(["kafka_partition", "kafka_offset"]) for t in (events, dead) if t is not None])
    keys = list(zip(offsets["kafka_partition"].to_pylist(), offsets["kafka_offset"].to_pylist()))
    log = lake / "_run" / "logs" / "generate.log"
    total = json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])["produced"]
    assert len(keys) == len(set(keys)) == total, "every record once: none lost, none doubled"
    assert len(set(events["event_id"].to_pylist())) == events.num_rows
