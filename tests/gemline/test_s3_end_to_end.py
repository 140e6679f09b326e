"""Whole commands against an object-store lake: generate -> ingest -> build -> validate -> train on S3.

moto_server (a local S3) runs on a free port and the tansu broker is embedded, as in
``test_s3.py`` and ``test_cli.py``. Every table, report and checkpoint lands under
``s3://<bucket>/lake``; nothing is written to a local lake. Clocks are fixed (``NOW_MS``).
"""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest

from gemline.config import GemlineConfig
from gemline.lake import Lake, lake_fs, open_table, read_table
from ingest.broker import EmbeddedBroker
from ingest.config import KafkaConfig
from ingest.datasets.types import RawRecord
from ingest.generate import GenerateConfig, generate_records, stream_records
from tests.conftest import build_args, ingest_args, quality_sections
from trainer.config import TrainerConfig

from .conftest import s3_bucket

pytestmark = pytest.mark.integration

# Noon start: one day of traffic spans two event_date values, so the temporal split has a train
# date and an eval date.
START_MS = 1_767_225_600_000 + 12 * 3_600_000
NOW_MS = START_MS + 3 * 86_400_000
TOPIC, PARTITIONS = "s3e2e", 2


@pytest.fixture(scope="module")
def s3_lake(moto_endpoint):
    """(lake URI, storage options) of a fresh bucket on the module's moto_server."""
    return "s3://bucket/lake", s3_bucket(moto_endpoint, "bucket")


def _files(lake: str, opts: dict[str, str], under: str) -> list[str]:
    """Paths (relative to the lake root) of the objects under ``LAKE/<under>``."""
    fs, root = lake_fs(lake, opts)
    selector = pafs.FileSelector(f"{root}/{under}", recursive=True, allow_not_found=True)
    return sorted(i.path[len(root) + 1:] for i in fs.get_file_info(selector) if i.is_file)


def test_whole_pipeline_on_s3(s3_lake):
    from ingest.pipeline import run_ingest
    from sequences.pipeline import run_build
    from trainer.checkpoint import latest_checkpoint, read_state
    from trainer.train import run_training
    from validation.run import latest_report, validate_table

    lake, opts = s3_lake
    config = GemlineConfig(
        lake=lake, lake_storage_options=opts, kafka=KafkaConfig(topic=TOPIC, partitions=PARTITIONS),
        trainer=TrainerConfig(model="ranker", epochs=1, num_embeddings=1009, batch_size=256),
    )
    records = generate_records(GenerateConfig(num_users=40, num_ads=20, days=1.0, bad_rate=0.05, seed=3,
                                              start_ms=START_MS))
    num_bad = sum(isinstance(r, RawRecord) for r in records)
    assert num_bad > 0
    good_ids = sorted(r.event_id for r in records if not isinstance(r, RawRecord))

    with EmbeddedBroker() as broker:
        stream_records(records, bootstrap=broker.bootstrap, topic=TOPIC, partitions=PARTITIONS, progress=False)
        first = run_ingest(*ingest_args(config), bootstrap=broker.bootstrap, now_ms=NOW_MS)
        again = run_ingest(*ingest_args(config), bootstrap=broker.bootstrap, now_ms=NOW_MS)

    assert (first.events_written, first.dead_letter_written) == (len(good_ids), num_bad)
    events = read_table(lake, "events", storage_options=opts)
    assert sorted(events["event_id"].to_pylist()) == good_ids
    assert read_table(lake, "dead_letter", storage_options=opts).num_rows == num_bad
    # The second ingest finds every offset committed and adds nothing.
    assert again.skipped and again.events_written == 0
    assert read_table(lake, "events", storage_options=opts).num_rows == len(good_ids)
    assert read_table(lake, "dead_letter", storage_options=opts).num_rows == num_bad
    assert not _files(lake, opts, "_staging")

    events_quality = validate_table(Lake.for_config(config), "events", now_ms=NOW_MS, **quality_sections(config))
    built = run_build(*build_args(config), final=True)
    examples = read_table(lake, "examples", built.examples_version, storage_options=opts)
    assert examples.num_rows == built.num_examples > 0
    assert open_table(lake, "examples", storage_options=opts).version() == built.examples_version
    examples_quality = validate_table(Lake.for_config(config), "examples", built.examples_version, now_ms=NOW_MS,
                                      **quality_sections(config))

    reports = _files(lake, opts, "_quality")
    for table, result in (("events", events_quality), ("examples", examples_quality)):
        version = result.table_version
        assert f"_quality/{table}/{version}/report.json" in reports
        assert str(result.report_json) == f"{lake}/_quality/{table}/{version}/report.json"
    fs, root = lake_fs(lake, opts)
    with fs.open_input_stream(f"{root}/_quality/examples/{built.examples_version}/report.json") as src:
        report = json.loads(src.read())
    assert (report["table"], report["num_rows"]) == ("examples", examples.num_rows)
    assert read_table(lake, "quality", storage_options=opts).num_rows > 0
    assert latest_report(Lake(lake, opts), "examples") == (
        "PASSED" if examples_quality.passed else "QUARANTINED",
        f"{lake}/_quality/examples/{built.examples_version}/report.html",
    )
    with pytest.raises(FileNotFoundError, match="no quality report"):
        latest_report(Lake(lake, opts), "sequences")

    assert examples_quality.passed, examples_quality.failures
    trained = run_training(config.trainer, Lake.for_config(config), examples_version=built.examples_version)
    checkpoints = _files(lake, opts, "_checkpoints")
    step_dir = str(trained.checkpoint_path).removeprefix(f"{lake}/")
    assert step_dir.startswith("_checkpoints/step-")
    assert {f"{step_dir}/meta.json", f"{step_dir}/state.pt"} <= set(checkpoints)
    # A resume finds the uploaded step and reads it back from the bucket.
    local = latest_checkpoint(lake, storage_options=opts)
    assert local is not None and local.name == step_dir.split("/")[-1]
    assert read_state(local).examples_version == built.examples_version

    from gemline.demo import _write_summary

    uri = _write_summary(config, "run-1", {"auc": 0.5})
    assert uri == f"{lake}/_runs/run-1/summary.json"
    with fs.open_input_stream(f"{root}/_runs/run-1/summary.json") as src:
        assert json.loads(src.read()) == {"auc": 0.5}
