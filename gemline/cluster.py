"""Beam pipelines on a Dask cluster: a corrected Dask runner, its CLI flags, and ``gemline cluster up``.

Beam 2.77's ``apache_beam.runners.dask.dask_runner.DaskRunner`` translates a pipeline into
``dask.bag`` operations, but five gaps make it lose or mix data in gemline's jobs (found by
reading ``runners/dask/transform_evaluator.py`` and ``dask_runner.py`` of apache-beam 2.77.0):

1. it computes only the *last* bag of the graph, so a pipeline with several sinks (ingest stages
   ``events`` and ``dead_letter``; build stages nine tables) runs only one of them;
2. a multi-output ``ParDo`` (``with_outputs``) hands *every* tagged output to every consumer;
3. it collects a bundle's outputs before ``finish_bundle``, dropping what ``finish_bundle``
   emits (a DoFn that buffers within a bundle emits its last buffer there);
4. splittable DoFns are invoked without a restriction (``ingest.kafka_source.ReadPartitionFn``
   fails on its missing tracker);
5. ``GroupByKey`` partitions keys with Python's ``hash()`` of arbitrary objects, which for
   ``str``/``bytes`` is salted per process unless every worker shares ``PYTHONHASHSEED``.

:class:`GemlineDaskRunner` keeps Beam's Dask option parsing and override set and replaces the
translation: every bag element is a ``(tag, WindowedValue)`` pair, consumers select their tag,
bundles (Dask partitions) are collected after ``finish_bundle``, an SDF element runs its initial
restriction to completion (deferred residuals are resumed in the same task; no dynamic splitting),
keys are grouped by a deterministic Beam coder's bytes, and every sink is computed.

Still unsupported here (as in Beam's runner): state and timers (stateful DoFns), unbounded
pipelines and watermark-driven triggers (batch, global-window semantics only), ``Read`` of
``BoundedSource`` (gemline does not use it), metrics. Side inputs are materialised whole in
each task that uses them.

Select it with ``--runner=gemline.cluster.GemlineDaskRunner --dask_client_address=HOST:PORT``
(:func:`dask_beam_args`); ``gemline ingest|build --runner dask --dask-address HOST:PORT`` does this.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import signal
import threading
import time
import typing as t
from dataclasses import dataclass

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.coders import coders
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.pipeline import AppliedPTransform, PipelineVisitor
from apache_beam.runners.common import DoFnContext, DoFnInvoker, DoFnSignature, Receiver, _OutputHandler
from apache_beam.runners.dask.dask_runner import DaskOptions, DaskRunner
from apache_beam.runners.dask.overrides import _Create, _Flatten, _GroupByKeyOnly, dask_overrides
from apache_beam.runners.runner import PipelineResult, PipelineState
from apache_beam.transforms.sideinputs import SideInputMap
from apache_beam.transforms.window import GlobalWindow, GlobalWindows
from apache_beam.utils.timestamp import MIN_TIMESTAMP
from apache_beam.utils.windowed_value import WindowedValue

from gemline.errors import BadConfigError, ClusterJobTimeoutError

log = logging.getLogger(__name__)

RUNNER = "gemline.cluster.GemlineDaskRunner"
"""Fully qualified runner name for Beam's ``--runner`` flag."""

PARTITIONS_PER_WORKER = 2
"""Default Dask partitions per worker for Create and after a GroupByKey (``--dask_npartitions`` overrides).

Each partition is a Beam bundle and a Dask task per step; a task-based shuffle costs
O(partitions_in x partitions_out) tasks, so more partitions than workers can use only add overhead."""

JOB_TIMEOUT_S = 6 * 3600.0
"""Default ``--dask_job_timeout`` (s): the longest a job may run before it is cancelled and fails."""

NO_WORKER_TIMEOUT_S = 120.0
"""Default ``--dask_no_worker_timeout`` (s): how long a job waits on a scheduler with no worker at all
(a nanny restarts a killed worker within seconds; minutes without one means none is coming)."""

POLL_S = 0.5
"""How often (s) a waiting job looks at its sinks' futures; the worker count is read every 10 polls."""

Tagged = tuple[str | None, WindowedValue]
"""One bag element: (output tag or None for the main output, the windowed value)."""


def dask_beam_args(address: str | None) -> list[str]:
    """Beam pipeline flags selecting :class:`GemlineDaskRunner` on the scheduler at ``address``.

    Args:
        address: ``HOST:PORT`` (or ``tcp://HOST:PORT``) of a Dask scheduler; None lets the runner
            start a private ``distributed.LocalCluster`` for the one pipeline.

    Raises:
        ValueError: ``address`` is not ``HOST:PORT`` with a numeric port.
    """
    args = [f"--runner={RUNNER}"]
    if address is None:
        return args
    bare = address.removeprefix("tcp://")
    host, _, port = bare.rpartition(":")
    if not host or not port.isdigit():
        raise BadConfigError(f"--dask-address: expected HOST:PORT of a Dask scheduler, got {address!r} "
                             "(start one with `gemline cluster up`)")
    return [*args, f"--dask_client_address=tcp://{bare}"]


# ---------------------------------------------------------------------------------------------
# Pure per-partition functions (run inside Dask tasks; unit-tested without a cluster).


class _ListReceiver(Receiver):
    """Collects a DoFn's outputs of one tag as ``(tag, WindowedValue)`` pairs."""

    def __init__(self, tag: str | None, out: list[Tagged]) -> None:
        self._tag = tag
        self._out = out

    def receive(self, windowed_value: WindowedValue) -> None:
        self._out.append((self._tag, windowed_value))


class _Receivers(dict):
    def __init__(self, out: list[Tagged]) -> None:
        super().__init__()
        self._out = out

    def __missing__(self, tag: str | None) -> _ListReceiver:
        self[tag] = _ListReceiver(tag, self._out)
        return self[tag]


def select_tag(items: t.Iterable[Tagged], tag: str | None) -> list[WindowedValue]:
    """The windowed values of output ``tag`` among ``(tag, value)`` pairs, in order."""
    return [wv for item_tag, wv in items if item_tag == tag]


def _run_sdf(invoker: t.Any, signature: DoFnSignature, wv: WindowedValue) -> None:
    """Process one element of a splittable DoFn over its whole initial restriction.

    A deferred remainder (``tracker.defer_remainder``) is resumed at once in this task, which is
    correct for bounded restrictions; an unbounded one would never finish, so it is refused.
    Source: Beam programming guide, "Splittable DoFns" (12.1-12.3); residual layout from
    ``apache_beam.runners.common.PerWindowInvoker._invoke_process_per_window``.
    """
    provider = signature.get_restriction_provider()
    restriction = provider.initial_restriction(wv.value)
    wm_provider = signature.get_watermark_estimator_provider()
    state = wm_provider.initial_estimator_state(wv.value, restriction)
    pending = [(restriction, state)]
    while pending:
        restriction, state = pending.pop()
        tracker = provider.create_tracker(restriction)
        if not tracker.is_bounded():
            raise ValueError(f"GemlineDaskRunner runs bounded pipelines only: SDF restriction {restriction} is unbounded")
        for residual in invoker.invoke_process(wv, restriction=restriction, watermark_estimator_state=state) or ():
            (_, (rest, est_state)), _size = residual.residual_value.value
            pending.append((rest, est_state))


def run_dofn_bundle(
    items: t.Iterable[Tagged],
    tag: str | None,
    dofn: beam.DoFn,
    args: t.Sequence[t.Any],
    kwargs: dict[str, t.Any],
    label: str,
    window_fn: t.Any,
    side_views: t.Sequence[tuple[type, dict[str, t.Any]]],
    *side_values: list[WindowedValue],
) -> list[Tagged]:
    """Run ``dofn`` over one bundle (a Dask partition) of input ``tag``.

    Lifecycle as in Beam's bundle model: setup, start_bundle, process per element, finish_bundle,
    teardown; outputs (including those of finish_bundle) come back as ``(tag, WindowedValue)``.

    Args:
        items: the producer's partition, ``(tag, WindowedValue)`` pairs.
        tag: the output tag of the producer this ParDo consumes.
        args, kwargs: the ParDo's extra arguments, side inputs as Beam's placeholders
            (``ParDo.args`` / ``ParDo.kwargs``, as the DirectRunner passes them).
        side_views: ``(view class, view options)`` per side input, in ``side_values`` order.
        side_values: each side input's windowed values, whole.
    """
    out: list[Tagged] = []
    receivers = _Receivers(out)
    # Beam annotates view_class as an AsSideInput instance; it takes the class, as its DirectRunner passes it.
    side_inputs = [SideInputMap(view, options, values)  # type: ignore[arg-type]
                   for (view, options), values in zip(side_views, side_values)]
    signature = DoFnSignature(dofn)
    handler = _OutputHandler(
        window_fn=window_fn, main_receivers=receivers[None], tagged_receivers=receivers,
        per_element_output_counter=None, output_batch_converter=None,
        process_yields_batches=False, process_batch_yields_elements=False)
    invoker = DoFnInvoker.create_invoker(
        signature, handler, context=DoFnContext(label, state=None), side_inputs=side_inputs,
        input_args=list(args), input_kwargs=kwargs, user_state_context=None,
        bundle_finalizer_param=beam.DoFn.BundleFinalizerParam())
    splittable = signature.is_splittable_dofn()
    invoker.invoke_setup()
    invoker.invoke_start_bundle()
    for wv in select_tag(items, tag):
        if splittable:
            _run_sdf(invoker, signature, wv)
        else:
            invoker.invoke_process(wv)
    invoker.invoke_finish_bundle()
    invoker.invoke_teardown()
    return out


def stable_key_hash(encoded_key: bytes) -> int:
    """A process-independent 63-bit hash of a key's coder bytes (``hash()`` of str/bytes is salted per process)."""
    return int.from_bytes(hashlib.blake2b(encoded_key, digest_size=8).digest(), "big") >> 1


def _keyed(item: Tagged, tag: str | None, coder: coders.Coder) -> tuple[int, bytes, WindowedValue] | None:
    item_tag, wv = item
    if item_tag != tag:
        return None
    encoded = coder.encode(wv.value[0])
    return stable_key_hash(encoded), encoded, wv


def group_partition(groups: t.Iterable[tuple[int, list[tuple[int, bytes, WindowedValue]]]]) -> list[Tagged]:
    """Finish a GroupByKey on one partition of hash groups: split hash groups by exact key bytes.

    Output: one ``(None, WindowedValue((key, [values...])))`` per key in the global window, the
    form Beam's ``_GroupAlsoByWindowDoFn`` consumes (values still carry their reified windows).
    """
    out: list[Tagged] = []
    for _, members in groups:
        by_key: dict[bytes, tuple[t.Any, list[t.Any]]] = {}
        for _, encoded, wv in members:
            key, value = wv.value
            by_key.setdefault(encoded, (key, []))[1].append(value)
        for key, values in by_key.values():
            out.append((None, WindowedValue((key, values), MIN_TIMESTAMP, (GlobalWindow(),))))
    return out


def _count(items: list[t.Any]) -> list[int]:
    return [len(items)]


def _whole(parts: list[list[Tagged]], tag: str | None) -> list[WindowedValue]:
    return [wv for part in parts for wv in select_tag(part, tag)]


# ---------------------------------------------------------------------------------------------
# Graph translation.


@dataclass
class _Translator(PipelineVisitor):
    """Builds one Dask bag per primitive transform (see the module docstring for the element form)."""

    npartitions: int | None
    partition_size: int | None
    workers: int

    def __post_init__(self) -> None:
        import dask.bag as db

        self._db = db
        self.bags: dict[AppliedPTransform, t.Any] = {}
        self.consumed: set[AppliedPTransform] = set()

    def _input(self, value: pvalue.PValue) -> tuple[t.Any, str | None]:
        producer = value.producer
        assert producer is not None, f"{value} has no producing transform"
        self.consumed.add(producer)
        return self.bags[producer], value.tag

    def visit_transform(self, node: AppliedPTransform) -> None:
        transform = node.transform
        inputs = [v for v in node.inputs if not isinstance(v, pvalue.PBegin)]
        if isinstance(transform, _Create):
            bag = self._create(list(transform.values))
        elif isinstance(transform, beam.ParDo):
            bag = self._pardo(node, *self._input(inputs[0]))
        elif isinstance(transform, _GroupByKeyOnly):
            bag = self._group(node, *self._input(inputs[0]))
        elif isinstance(transform, _Flatten):
            bags = []
            for value in inputs:
                bag_in, tag = self._input(value)
                bags.append(bag_in.map_partitions(lambda part, tg: [(None, wv) for wv in select_tag(part, tg)], tag))
            bag = self._db.concat(bags) if bags else self._create([])
        elif len(inputs) == 1 and type(transform).__name__ in ("_Reshuffle",):
            bag_in, tag = self._input(inputs[0])
            bag = bag_in.map_partitions(lambda part, tg: [(None, wv) for wv in select_tag(part, tg)], tag)
        else:
            raise NotImplementedError(
                f"GemlineDaskRunner cannot run primitive {type(transform).__name__} ({node.full_label}); "
                "supported: Create, ParDo (incl. splittable, multi-output, side inputs), GroupByKey, Flatten, Reshuffle")
        self.bags[node] = bag

    def _create(self, values: list[t.Any]) -> t.Any:
        items = [(None, GlobalWindows.windowed_value(v)) for v in values]
        if self.partition_size:
            return self._db.from_sequence(items, partition_size=self.partition_size)
        # Create feeds gemline's source transforms (a few Kafka ranges, or one seed element), whose
        # elements are the unit of parallelism: spread them over the workers.
        nparts = self.npartitions or max(1, min(len(items), PARTITIONS_PER_WORKER * self.workers))
        return self._db.from_sequence(items, npartitions=nparts) if items else self._db.from_sequence([], npartitions=1)

    def _pardo(self, node: AppliedPTransform, bag: t.Any, tag: str | None) -> t.Any:
        import dask

        transform = t.cast(beam.ParDo, node.transform)  # visit_transform sends only ParDo nodes here
        main = next(iter(node.main_inputs.values()))
        window_fn = main.windowing.windowfn if hasattr(main, "windowing") else None
        views, values = [], []
        for si in node.side_inputs:
            side_bag, side_tag = self._input(si.pvalue)
            views.append((type(si), si._view_options()))
            values.append(dask.delayed(_whole)(side_bag.to_delayed(optimize_graph=False), side_tag))
        # Only the DoFn and its arguments travel with each task: the ParDo object references the
        # whole pipeline graph, which made every task carry (and unpickle) all of it.
        return bag.map_partitions(run_dofn_bundle, tag, transform.fn, list(transform.args), dict(transform.kwargs),
                                  node.full_label, window_fn, views, *values)

    def _group(self, node: AppliedPTransform, bag: t.Any, tag: str | None) -> t.Any:
        main = next(iter(node.main_inputs.values()))
        key_type = _key_type(main.element_type)
        coder = beam.coders.registry.get_coder(key_type).as_deterministic_coder(node.full_label)
        keyed = bag.map(_keyed, tag, coder).filter(lambda x: x is not None)
        nparts = self.npartitions or PARTITIONS_PER_WORKER * self.workers
        grouped = keyed.groupby(lambda k: k[0], npartitions=nparts, shuffle="tasks")
        return grouped.map_partitions(group_partition)


def _key_type(element_type: t.Any) -> t.Any:
    from apache_beam.typehints import trivial_inference, typehints

    try:
        key_type, _ = trivial_inference.key_value_types(element_type)
    except Exception:  # noqa: BLE001 - untyped PCollections have no KV hint: fall back to Any
        return typehints.Any
    return key_type


class GemlineDaskOptions(PipelineOptions):
    """The bounds of :class:`GemlineDaskRunner`'s wait on a job (Beam flags, beside Beam's ``DaskOptions``)."""

    @classmethod
    def _add_argparse_args(cls, parser: t.Any) -> None:
        parser.add_argument("--dask_job_timeout", type=float, default=JOB_TIMEOUT_S,
                            help="seconds a Dask job may run before its tasks are cancelled and it fails "
                                 f"(ClusterJobTimeoutError); default {JOB_TIMEOUT_S:.0f}")
        parser.add_argument("--dask_no_worker_timeout", type=float, default=NO_WORKER_TIMEOUT_S,
                            help="seconds a Dask job waits while the scheduler has no worker before it fails; "
                                 f"default {NO_WORKER_TIMEOUT_S:.0f}")


class GemlineDaskRunnerResult(PipelineResult):
    """Waits on the sinks' futures, within bounds; closes the Dask client when done (or failed).

    Args:
        client: the job's ``distributed.Client``.
        futures: one future per sink.
        job_timeout_s: the longest :meth:`wait_until_finish` waits in all (s, > 0).
        no_worker_timeout_s: the longest it waits while the scheduler has no worker (s, > 0).
    """

    def __init__(self, client: t.Any, futures: list[t.Any], *, job_timeout_s: float = JOB_TIMEOUT_S,
                 no_worker_timeout_s: float = NO_WORKER_TIMEOUT_S) -> None:
        super().__init__(PipelineState.RUNNING)
        if job_timeout_s <= 0 or no_worker_timeout_s <= 0:
            raise BadConfigError(f"--dask_job_timeout and --dask_no_worker_timeout must be > 0 s, got "
                                 f"{job_timeout_s}, {no_worker_timeout_s}")
        self._client = client
        self._futures = futures
        self._job_timeout_s = job_timeout_s
        self._no_worker_timeout_s = no_worker_timeout_s
        self._started = time.monotonic()

    def wait_until_finish(self, duration: int | None = None) -> str:
        """Block until every sink is computed, at most ``duration`` ms (None: the job timeout) and at most
        until the job timeout counted from submission.

        A lost worker's tasks are rerun by Dask on the other workers (up to
        ``distributed.scheduler.allowed-failures`` deaths per task, then the task errs with KilledWorker);
        the bounds here end the waits where that never happens.

        Raises:
            ClusterJobTimeoutError: the bound passed with sinks unfinished, or the scheduler had no worker for
                ``--dask_no_worker_timeout``; the job's tasks are cancelled (the state becomes FAILED).
            Exception: the first task error, as raised by Dask (the state becomes FAILED).
        """
        if self._state in (PipelineState.DONE, PipelineState.FAILED, PipelineState.CANCELLED):
            return self._state  # TestPipeline and Pipeline.__exit__ both wait; the client is closed by then
        deadline = self._started + self._job_timeout_s
        if duration is not None:
            deadline = min(deadline, time.monotonic() + duration / 1000)
        try:
            self._wait(deadline)
            self._state = PipelineState.DONE
        except BaseException:
            self._state = PipelineState.FAILED
            # Cancelled so that a rerun of the same graph (the same keys) does not attach to stuck tasks.
            self._client.cancel(self._futures)
            raise
        finally:
            self._client.close(timeout=30)
        return self._state

    def _wait(self, deadline: float) -> None:
        no_worker_since: float | None = None
        for polls in itertools.count():
            if all(f.status == "finished" for f in self._futures):
                return
            for future in self._futures:
                if future.status in ("error", "cancelled"):
                    future.result()  # raises the task's error (CancelledError when cancelled)
            now = time.monotonic()
            unfinished = sum(f.status != "finished" for f in self._futures)
            if now >= deadline:
                raise ClusterJobTimeoutError(
                    f"the Dask job did not finish in {now - self._started:.0f} s ({unfinished} of "
                    f"{len(self._futures)} sinks unfinished) on {self._client.scheduler.address}; its tasks are "
                    "cancelled. Rerun the command (it resumes where it stopped); raise --dask_job_timeout for "
                    "a longer job")
            if polls % 10 == 0:
                workers = len(self._client.nthreads())
                no_worker_since = None if workers else (no_worker_since or now)
            if no_worker_since is not None and now - no_worker_since >= self._no_worker_timeout_s:
                raise ClusterJobTimeoutError(
                    f"the Dask scheduler at {self._client.scheduler.address} has had no worker for "
                    f"{now - no_worker_since:.0f} s ({unfinished} of {len(self._futures)} sinks unfinished); "
                    "its tasks are cancelled. Start workers (`gemline cluster up`) and rerun the command")
            time.sleep(min(POLL_S, max(0.0, deadline - now)))

    def cancel(self) -> str:
        """Cancel outstanding tasks and close the client."""
        self._client.cancel(self._futures)
        self._client.close(timeout=30)
        self._state = PipelineState.CANCELLED
        return self._state


class GemlineDaskRunner(DaskRunner):
    """Beam's DaskRunner with the translation fixes listed in the module docstring.

    Options are Beam's ``DaskOptions`` (``--dask_client_address``, ``--dask_npartitions``,
    ``--dask_partition_size``, ``--dask_connection_timeout``...) and :class:`GemlineDaskOptions`
    (``--dask_job_timeout``, ``--dask_no_worker_timeout``: the bounds of the wait on the job). Runs bounded, globally windowed
    pipelines; raises NotImplementedError at submission for primitives it cannot run.
    """

    def run_pipeline(self, pipeline: beam.Pipeline, options: t.Any) -> GemlineDaskRunnerResult:
        import dask
        import distributed

        dask_options = options.view_as(DaskOptions).get_all_options(drop_default=True, current_only=True)
        bag_kwargs = DaskOptions._extract_bag_kwargs(dask_options)
        client = distributed.Client(**dask_options)
        try:
            workers = max(1, len(client.scheduler_info().get("workers", {})))
            pipeline.replace_all(dask_overrides())
            translator = _Translator(bag_kwargs.get("npartitions"), bag_kwargs.get("partition_size"), workers)
            pipeline.visit(translator)
            sinks = [bag for node, bag in translator.bags.items() if node not in translator.consumed]
            # Reduce each sink to its size so that no element travels back to the driver.
            counts = [bag.map_partitions(_count) for bag in sinks]
            graphs = dask.optimize(*counts)
        except BaseException:
            client.close()
            raise
        log.info("GemlineDaskRunner: %d sinks on %s", len(sinks), client.scheduler.address)
        bounds = options.view_as(GemlineDaskOptions)
        futures = client.compute(list(graphs))
        return GemlineDaskRunnerResult(client, futures, job_timeout_s=bounds.dask_job_timeout,
                                       no_worker_timeout_s=bounds.dask_no_worker_timeout)


# ---------------------------------------------------------------------------------------------
# `gemline cluster up`


def cluster_up(workers: int = 2, *, host: str = "127.0.0.1", port: int = 0, threads_per_worker: int = 1,
               stop: threading.Event | None = None, on_ready: t.Callable[[str], None] | None = None) -> int:
    """Start a Dask scheduler and ``workers`` worker processes on this machine; block until stopped.

    Prints nothing itself: ``on_ready`` receives the scheduler address (``tcp://HOST:PORT``) once
    the workers are up. Stops on SIGINT/SIGTERM (or when ``stop`` is set) and closes the cluster.

    Args:
        workers: worker processes (>= 1).
        port: scheduler TCP port; 0 picks a free one.
        threads_per_worker: threads per worker process (1: Beam DoFns here are CPU-bound Python).

    Returns:
        0 on a clean stop.

    Raises:
        ValueError: ``workers`` or ``threads_per_worker`` < 1.
    """
    from distributed import LocalCluster

    if workers < 1 or threads_per_worker < 1:
        raise ValueError(f"cluster up: expected workers >= 1 and threads_per_worker >= 1, got {workers}, "
                         f"{threads_per_worker}")
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        with LocalCluster(n_workers=workers, threads_per_worker=threads_per_worker, processes=True,
                          host=host, scheduler_port=port, dashboard_address=None) as cluster:
            if on_ready is not None:
                on_ready(cluster.scheduler_address)
            while not stop.wait(0.5):
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


__all__ = ["RUNNER", "GemlineDaskOptions", "GemlineDaskRunner", "GemlineDaskRunnerResult", "cluster_up", "dask_beam_args",
           "group_partition", "run_dofn_bundle", "select_tag", "stable_key_hash"]
