"""Beam on Dask (gemline.cluster): the runner's pure pieces, TestPipeline on a LocalCluster, and the
ingest/build jobs giving the DirectRunner's tables, also when a worker process dies mid-job.

One LocalCluster (2 worker processes, 1 thread each) and one embedded broker serve the module.
Seeds are fixed (``GenerateConfig.seed``) and the ingest clock is ``NOW_MS``.
"""

from __future__ import annotations

import hashlib
import os
import sys

import apache_beam as beam
import cloudpickle
import pytest
from apache_beam.io.restriction_trackers import OffsetRange as BeamOffsetRange
from apache_beam.io.restriction_trackers import OffsetRestrictionTracker
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing import test_pipeline  # module import: pytest would collect class TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms.core import RestrictionProvider
from apache_beam.transforms.window import GlobalWindows
from apache_beam.utils.windowed_value import WindowedValue
from distributed.diagnostics.plugin import WorkerPlugin

from gemline import cluster as gemline_cluster
from gemline.cluster import (
    RUNNER,
    GemlineDaskRunnerResult,
    dask_beam_args,
    group_partition,
    run_dofn_bundle,
    select_tag,
    stable_key_hash,
)
from gemline.config import GemlineConfig
from gemline.errors import ClusterJobTimeoutError
from gemline.lake import read_table
from tests.conftest import build_args, ingest_args

NOW_MS = 1_800_000_000_000  # fixed ingest clock, later than every generated event
TOPIC = "cluster-events"
PARTITIONS = 3
JOB_BOUND_S = 240  # a clean ingest job of this module takes seconds; under load 8 on 2 cores, under a minute


# --- pure pieces ---------------------------------------------------------------------------------

@pytest.mark.parametrize("address, expected", [
    (None, [f"--runner={RUNNER}"]),
    ("127.0.0.1:8786", [f"--runner={RUNNER}", "--dask_client_address=tcp://127.0.0.1:8786"]),
    ("tcp://sched:1", [f"--runner={RUNNER}", "--dask_client_address=tcp://sched:1"]),
])
def test_dask_beam_args(address, expected):
    assert dask_beam_args(address) == expected


@pytest.mark.parametrize("address", ["127.0.0.1", ":8786", "host:port", "tcp://"])
def test_dask_beam_args_rejects_bad_addresses(address):
    with pytest.raises(ValueError, match="expected HOST:PORT of a Dask scheduler"):
        dask_beam_args(address)


def _wv(value):
    return GlobalWindows.windowed_value(value)


def test_select_tag_keeps_order_and_only_its_tag():
    items = [(None, _wv(1)), ("bad", _wv(2)), (None, _wv(3)), ("other", _wv(4))]
    assert [wv.value for wv in select_tag(items, None)] == [1, 3]
    assert [wv.value for wv in select_tag(items, "bad")] == [2]
    assert select_tag([], "bad") == []


def test_stable_key_hash_is_blake2b_and_non_negative():
    for key in (b"", b"user-1", bytes(range(256))):
        ref = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1
        assert stable_key_hash(key) == ref and 0 <= ref < 2**63


def test_group_partition_splits_colliding_hash_groups_by_key_bytes():
    # Two keys forced into one hash group (as a collision would) stay separate groups.
    members = [(7, b"a", _wv(("a", 1))), (7, b"b", _wv(("b", 2))), (7, b"a", _wv(("a", 3)))]
    out = group_partition([(7, members), (9, [(9, b"c", _wv(("c", 4)))])])
    assert all(tag is None for tag, _ in out)
    assert sorted(wv.value for _, wv in out) == [("a", [1, 3]), ("b", [2]), ("c", [4])]


class _SplitFn(beam.DoFn):
    """Even numbers to the main output, odd ones tagged 'odd'; the bundle's count from finish_bundle."""

    def start_bundle(self):
        self.n = 0

    def process(self, x):
        self.n += 1
        yield x if x % 2 == 0 else beam.pvalue.TaggedOutput("odd", x)

    def finish_bundle(self):
        yield WindowedValue(("count", self.n), 0, (beam.transforms.window.GlobalWindow(),))


def test_run_dofn_bundle_keeps_tags_and_finish_bundle_outputs():
    items = [(None, _wv(x)) for x in range(5)] + [("elsewhere", _wv(100))]
    out = run_dofn_bundle(items, None, _SplitFn(), [], {}, "Split", None, [])
    assert [wv.value for wv in select_tag(out, None)] == [0, 2, 4, ("count", 5)]
    assert [wv.value for wv in select_tag(out, "odd")] == [1, 3]


class _RangeProvider(RestrictionProvider):
    def initial_restriction(self, element):
        return BeamOffsetRange(0, element)

    def create_tracker(self, restriction):
        return OffsetRestrictionTracker(restriction)

    def restriction_size(self, element, restriction):
        return restriction.size()


class _DeferringFn(beam.DoFn):
    """SDF emitting each offset of [0, n), deferring its remainder every 3 claims."""

    def process(self, n, tracker=beam.DoFn.RestrictionParam(_RangeProvider())):
        pos = tracker.current_restriction().start
        for done in range(3):
            if not tracker.try_claim(pos + done):
                return
            yield (n, pos + done)
        tracker.defer_remainder()


def test_run_dofn_bundle_runs_a_splittable_dofn_over_its_whole_restriction():
    out = run_dofn_bundle([(None, _wv(7)), (None, _wv(0))], None, _DeferringFn(), [], {}, "Sdf", None, [])
    assert [wv.value for _, wv in out] == [(7, i) for i in range(7)]


class _Unbounded(OffsetRestrictionTracker):
    def is_bounded(self):
        return False


class _UnboundedProvider(_RangeProvider):
    def create_tracker(self, restriction):
        return _Unbounded(restriction)


class _UnboundedFn(beam.DoFn):
    def process(self, n, tracker=beam.DoFn.RestrictionParam(_UnboundedProvider())):
        yield n


def test_run_dofn_bundle_refuses_an_unbounded_restriction():
    with pytest.raises(ValueError, match="runs bounded pipelines only"):
        run_dofn_bundle([(None, _wv(3))], None, _UnboundedFn(), [], {}, "Unbounded", None, [])


# --- the bounded wait on a job (fake client and futures: no cluster) -----------------------------------

class _FakeFuture:
    def __init__(self, status, error=None):
        self.status, self.error = status, error

    def result(self):
        raise self.error


class _FakeClient:
    def __init__(self, workers):
        self.workers, self.cancelled, self.closed = workers, None, False
        self.scheduler = type("Rpc", (), {"address": "tcp://fake:1"})()

    def nthreads(self):
        return {f"w{i}": 1 for i in range(self.workers)}

    def cancel(self, futures):
        self.cancelled = list(futures)

    def close(self, timeout=None):
        self.closed = True


@pytest.fixture
def fast_polls(monkeypatch):
    monkeypatch.setattr(gemline_cluster, "POLL_S", 0.01)


def test_a_job_that_never_finishes_fails_at_its_timeout_and_is_cancelled(fast_polls):
    client, futures = _FakeClient(workers=2), [_FakeFuture("finished"), _FakeFuture("pending")]
    result = GemlineDaskRunnerResult(client, futures, job_timeout_s=0.05)
    with pytest.raises(ClusterJobTimeoutError, match=r"did not finish in \d+ s \(1 of 2 sinks unfinished\).*--dask_job_timeout"):
        result.wait_until_finish()
    assert result.state == "FAILED" and client.cancelled == futures and client.closed
    assert result.wait_until_finish() == "FAILED"  # a second wait returns at once


def test_a_scheduler_without_workers_fails_the_job_before_its_timeout(fast_polls):
    client = _FakeClient(workers=0)
    result = GemlineDaskRunnerResult(client, [_FakeFuture("pending")], job_timeout_s=3600, no_worker_timeout_s=0.05)
    with pytest.raises(ClusterJobTimeoutError, match="has had no worker for .*gemline cluster up"):
        result.wait_until_finish()
    assert client.cancelled and client.closed


def test_a_task_error_is_raised_and_a_finished_job_is_done(fast_polls):
    client = _FakeClient(workers=1)
    failed = GemlineDaskRunnerResult(client, [_FakeFuture("pending"), _FakeFuture("error", KeyError("boom"))])
    with pytest.raises(KeyError, match="boom"):
        failed.wait_until_finish()
    assert failed.state == "FAILED" and client.closed
    done = GemlineDaskRunnerResult(_FakeClient(workers=1), [_FakeFuture("finished")] * 3, job_timeout_s=0.05)
    assert done.wait_until_finish() == "DONE"


def test_the_wait_bounds_are_beam_flags():
    from apache_beam.options.pipeline_options import PipelineOptions

    from gemline.cluster import GemlineDaskOptions

    bounds = PipelineOptions(["--dask_job_timeout=90", "--dask_no_worker_timeout=7.5"]).view_as(GemlineDaskOptions)
    assert (bounds.dask_job_timeout, bounds.dask_no_worker_timeout) == (90.0, 7.5)
    defaults = PipelineOptions([]).view_as(GemlineDaskOptions)
    assert (defaults.dask_job_timeout, defaults.dask_no_worker_timeout) == (6 * 3600.0, 120.0)
    with pytest.raises(ValueError, match="must be > 0 s"):
        GemlineDaskRunnerResult(_FakeClient(workers=1), [], job_timeout_s=0)


# --- on a LocalCluster -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    import distributed

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as c:
        yield c


@beam.typehints.with_output_types(tuple[str, int])
class _KeyFn(beam.DoFn):
    def process(self, x, factor):
        if x % 4 == 0:
            yield beam.pvalue.TaggedOutput("dropped", x)
        else:
            yield (f"k{x % 3}", x * factor)


@pytest.mark.integration
def test_test_pipeline_with_tags_side_input_and_group_by_key(cluster):
    options = PipelineOptions(dask_beam_args(cluster.scheduler_address))
    xs = list(range(40))
    with test_pipeline.TestPipeline(options=options) as p:
        factor = p | "Factor" >> beam.Create([10])
        parts = (p | beam.Create(xs)
                 | beam.ParDo(_KeyFn(), beam.pvalue.AsSingleton(factor)).with_outputs("dropped", main="kept"))
        grouped = parts["kept"] | beam.GroupByKey() | beam.MapTuple(lambda k, vs: (k, sorted(vs)))
        expected = {}
        for x in xs:
            if x % 4:
                expected.setdefault(f"k{x % 3}", []).append(x * 10)
        assert_that(grouped, equal_to(sorted(expected.items())), label="Grouped")
        assert_that(parts["dropped"], equal_to([x for x in xs if x % 4 == 0]), label="Dropped")


# --- the gemline jobs ----------------------------------------------------------------------------

def _sorted_rows(lake, table):
    data = read_table(lake, table)
    return None if data is None else sorted(repr(sorted(r.items())) for r in data.to_pylist())


@pytest.fixture(scope="module")
def produced(cluster):
    from ingest.broker import EmbeddedBroker
    from ingest.generate import GenerateConfig, generate_records, stream_records

    with EmbeddedBroker() as broker:
        records = generate_records(GenerateConfig(num_users=30, num_ads=20, days=0.5, bad_rate=0.05, seed=11))
        stream_records(records, bootstrap=broker.bootstrap, topic=TOPIC, partitions=PARTITIONS, progress=False)
        yield broker.bootstrap, len(records)


def _config(lake) -> GemlineConfig:
    from ingest.config import KafkaConfig
    from sequences.config import BuildConfig

    # Runner equivalence, not the quality gate: the build reads the raw ingested events.
    return GemlineConfig(lake=str(lake), kafka=KafkaConfig(topic=TOPIC, partitions=PARTITIONS),
                         build=BuildConfig(events_gate="off"))


@pytest.fixture(scope="module")
def ingested(produced, cluster, tmp_path_factory):
    """Lakes ingested from the same snapshot by the DirectRunner and by the Dask runner."""
    from ingest.pipeline import run_ingest

    bootstrap, _ = produced
    lakes = {}
    for name, args in (("direct", []), ("dask", dask_beam_args(cluster.scheduler_address))):
        lakes[name] = tmp_path_factory.mktemp(name)
        run_ingest(*ingest_args(_config(lakes[name])), bootstrap=bootstrap, beam_args=args, now_ms=NOW_MS)
    return lakes


INGEST_TABLES = ("events", "dead_letter", "late_events")


@pytest.mark.integration
def test_dask_ingest_equals_direct_ingest(produced, ingested):
    _, num_records = produced
    direct = {t: _sorted_rows(ingested["direct"], t) for t in INGEST_TABLES}
    dask = {t: _sorted_rows(ingested["dask"], t) for t in INGEST_TABLES}
    assert dask == direct
    # Non-trivial: both tables hold rows, and every produced record landed once.
    assert direct["events"] and direct["dead_letter"]
    assert len(direct["events"]) + len(direct["dead_letter"]) + len(direct["late_events"] or []) == num_records
    assert not any((ingested["dask"] / "_staging" / "ingest").glob("*/*/*.parquet"))


@pytest.mark.integration
@pytest.mark.slow
def test_dask_build_equals_direct_build(ingested, cluster):
    from sequences.pipeline import _OUTPUTS, run_build

    for name, args in (("direct", []), ("dask", dask_beam_args(cluster.scheduler_address))):
        run_build(*build_args(_config(ingested[name])), beam_args=args, final=True)
    for table in _OUTPUTS:
        assert _sorted_rows(ingested["dask"], table) == _sorted_rows(ingested["direct"], table), table
    assert _sorted_rows(ingested["direct"], "examples")


class _DieOnceInParse(WorkerPlugin):
    """Dask worker plugin: the first ParseBatches call in any worker kills that worker process.

    A marker file created with O_EXCL makes it exactly one death across workers and restarts.
    """

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def setup(self, worker) -> None:
        from ingest import vectorized

        fn_cls = vectorized._ParseBatchFn
        original = getattr(fn_cls, "_gemline_original_process", fn_cls.process)
        marker = self.marker

        def process(self, *args, **kwargs):
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return original(self, *args, **kwargs)
            os._exit(17)  # the worker process dies mid-task, as on a lost machine

        fn_cls._gemline_original_process = original
        fn_cls.process = process

    def teardown(self, worker) -> None:
        from ingest import vectorized

        fn_cls = vectorized._ParseBatchFn
        if hasattr(fn_cls, "_gemline_original_process"):
            fn_cls.process = fn_cls._gemline_original_process


@pytest.mark.integration
def test_worker_killed_mid_job_leaves_the_lake_of_a_clean_run(produced, ingested, cluster, tmp_path):
    from distributed import Client

    from ingest.pipeline import run_ingest

    bootstrap, _ = produced
    marker = tmp_path / "killed"
    # Bounded: a job stuck on the dead worker's task fails within JOB_BOUND_S (ClusterJobTimeoutError,
    # caught below like any failure of the first run), so the test ends even when Dask never reruns it.
    beam_args = [*dask_beam_args(cluster.scheduler_address), f"--dask_job_timeout={JOB_BOUND_S}"]
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    lake = tmp_path / "lake"
    with Client(cluster.scheduler_address) as client:
        client.register_plugin(_DieOnceInParse(str(marker)), name="die-once")
        try:
            try:
                first = run_ingest(*ingest_args(_config(lake)), bootstrap=bootstrap, beam_args=beam_args, now_ms=NOW_MS)
            except Exception:  # noqa: BLE001 - the job may fail with the worker; the rerun must finish it
                first = None
            rerun = run_ingest(*ingest_args(_config(lake)), bootstrap=bootstrap, beam_args=beam_args, now_ms=NOW_MS)
        finally:
            client.unregister_worker_plugin("die-once")
            cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert marker.exists(), "the fault was not injected"
    # Dask reran the lost task elsewhere (the job committed; the rerun finds nothing new), or the
    # job failed before committing and the rerun did batch 0.
    if first is not None:
        assert first.events_written > 0 and rerun.skipped
    else:
        assert not rerun.skipped and rerun.batch_version == 0
    print(f"first run {'completed' if first is not None else 'failed'} after the worker died")
    for table in INGEST_TABLES:
        assert _sorted_rows(lake, table) == _sorted_rows(ingested["direct"], table), table


# --- CLI -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["build"], []),
    (["build", "--runner", "dask"], [f"--runner={RUNNER}"]),
    (["build", "--runner", "dask", "--dask-address", "h:1", "--direct_num_workers=2"],
     [f"--runner={RUNNER}", "--dask_client_address=tcp://h:1", "--direct_num_workers=2"]),
    (["ingest", "--runner", "FlinkRunner", "--flink_master=h:8081"], ["--runner=FlinkRunner", "--flink_master=h:8081"]),
])
def test_cli_maps_runner_flags_to_beam_args(argv, expected):
    from gemline.cli import _beam_args, build_parser

    args, extra = build_parser().parse_known_args(argv)
    assert _beam_args(args, extra) == expected


def test_cli_rejects_a_dask_address_without_the_dask_runner(capsys, tmp_path):
    from gemline.cli import main

    assert main(["build", "--lake", str(tmp_path), "--dask-address", "h:1"]) == 2
    assert "--dask-address needs --runner dask" in capsys.readouterr().err


@pytest.mark.integration
def test_cluster_up_serves_workers_until_sigint():
    import signal
    import subprocess

    from distributed import Client

    proc = subprocess.Popen([sys.executable, "-m", "gemline.cli", "cluster", "up", "--workers", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("Dask scheduler at tcp://127.0.0.1:"), line
        address = line.split()[3]
        with Client(address) as client:
            assert len(client.scheduler_info()["workers"]) == 1
            assert client.submit(sum, [1, 2, 3]).result() == 6
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
