"""Freshness of the whole pipeline on this machine: ``gemline run`` fed by ``gemline generate --rate R``.

``python -m benchmarks.freshness [--minutes M] [--rate R] [--label-mode defer|window] [--publish-delay-ms D]
[--producer-batch-messages B] [--set KEY=VALUE ...]``

``gemline run`` (gemline.run: embedded broker, generator, streaming ingest, validation, build, continuous
trainer, every stage its own process) runs for M minutes (default 10) on a temporary lake. The generator
stamps events with the wall clock (``generate.wall_clock``) and is sized to last the run at R events/s
(default 2000), in Kafka record batches of up to ``--producer-batch-messages`` (default 1000, see
:data:`PRODUCER_BATCH_MESSAGES`). Labels: ``--label-mode defer`` passes ``build.label_mode=defer`` and
``build.publish_delay_ms=D`` (default 60 s) to every stage, and stops with a clear message when this
checkout's config has no such keys; ``--label-mode window`` instead sets both attribution windows
(``build.click_window_ms``, ``build.conversion_window_ms``) to D, so an impression is published about D after
it happened, its labels final.

Windows (``--windows real|compressed``, default real). The generator compresses ``generate.days`` of behaviour
into the run (:func:`time_compression`: ~1,070x at 2000 events/s, whatever the minutes), its label delays with
it, but event times are the wall clock, so the default attribution windows (click 1 day, conversion 7 days) span the
whole run: 1,070x more generated behaviour than in real time. The label join attributes a click to every earlier
impression of the same (user, item, domain) in the window (sequences.labels, multi-touch), so each click labels
the user's exposures to that ad over the whole run, most of them published long before: late positives whose
number grows with the time run so far (measured 2026-12-04 on a 10-minute run: correction rows were 6 % of the
rows committed in its third minute and 20 % in its tenth; of its 65k late clicks, 53k came more than 81 s, a
compressed day, after their impression). Under ``--windows compressed`` the windows shrink by the compression
(:func:`compressed_windows`; the compression is proportional to the rate: click 81 s, conversion 567 s at 2000
events/s), so a window holds what it would in real time; DEFER then also publishes its real-negative duplicates
(each impression's click negative a compressed day after it), the load DEFER has in its steady state.
The rows each minute's ``examples`` commits published (first publications + corrections) are printed after the
run.

Every ~30 s it samples each stage's backlog:

* ingest: Kafka high watermarks minus the end offsets of the newest ``events`` commit (messages);
* validate: versions not validated yet (the newest ``events`` version when unjudged, every unjudged ``examples``
  version: ``gemline.progress.validate_progress``, as ``gemline run``'s status view counts them);
* build: newest ``events`` version minus the events version the newest ``examples`` commit built (versions);
* trainer: newest ``examples`` version minus the newest version the continuous run consumed (versions; every
  version counts before the run's first checkpoint);
* distill (when ``gemline run`` starts it): the versions the teacher trained that the students have not distilled
  yet (:func:`gemline.progress.distill_progress`, their newest checkpoint's cursor).

A stage's backlog is "growing" when each input waits longer for it than the one before (gemline.waits: with a
steady arrival rate, backlog = rate x wait): over the inputs that arrived in the last 5 minutes (the last half of
a shorter run), the least-squares line of wait against arrival time rises by at least ``--rise-s`` (default 10 s,
one build interval: a stage ~3 % short of its input's rate) and its slope is > 0 with one-sided p < 0.05
(``gemline.waits.wait_trend``). Each input's wait is read afterwards from what the stages committed (commit
timestamps, ``quality`` runs, ``freshness`` rows, the students' checkpoint), one value per input, so it does not
alias as a count of versions sampled every 30 s against a version every ~10 s did (until 2026-12-04 the verdict
was that count's slope: it flagged a stage in 3 of 5 runs where no stage's waits rose by more than 5 s over the
window). The samples above are still printed, for a look during the run.

CPU budget: every ~5 s it reads the CPU time (user + system, ``psutil``) of every process under ``gemline run``,
each counted to its stage (the ``gemline.cli`` subcommand in its command line, or its nearest such ancestor's:
the embedded broker's ``tansu`` child counts as ``broker``; the supervisor itself as ``run``), and of this
benchmark process (``benchmark``: its backlog sampling). After the run it prints, per stage, over the last
window and the whole run: cores used (CPU-s per wall s) and CPU-s per 1,000 events the generator produced
(Kafka high watermarks). On the 2-core machine the total must stay well under 2 cores (~1.7) for the
pipeline to keep up; wall-clock freshness is noisy on a shared machine, CPU-s per event much less so.

After the run it prints the ``freshness`` table (trainer.freshness) per examples version and, last, one line:

    freshness impression->trained p50=X p95=Y p99=Z s; backlog growing: yes|no

after one line per stage with its inputs' waits over the window (median, max, fitted rise, p). X, Y, Z are the
row-weighted means of the versions' p50, p95 and p99 (the table keeps quantiles per version, not rows, so this
approximates the quantiles of all rows pooled). Goal on the 2-core dev machine:
p50 <= 90 s, p99 <= 240 s, no backlog growing over the last 5 minutes of a 10-minute run.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]  # pinned in requirements.lock

from gemline.config import GemlineConfig, load_config
from gemline.increments import Cursor, read_from, table_id
from gemline.lake import Lake, read_table
from gemline.progress import build_progress, distill_progress, ingest_progress, train_progress, validate_progress
from gemline.run import runs_distill
from gemline.tables import Table
from gemline.waits import Trend, commits, stage_waits, wait_trend
from ingest.broker import free_port
from ingest.generate import GenerateConfig
from ingest.kafka_clients import make_client
from ingest.pipeline import app_id_for
from sequences.config import MS_PER_DAY, BuildConfig
from trainer.freshness import HOPS

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_EVERY_S = 30.0
CPU_EVERY_S = 5.0
"""How often the process tree's CPU times are read: a process that exits between reads loses at most this much."""
EVENTS_PER_SESSION = 8.1
"""Mean events of a generated session: 5 ads + 3 organic events + the clicks and conversions (ingest.generate)."""
USERS = 10_000
PRODUCER_BATCH_MESSAGES = 1000
"""The generator's messages per Kafka record batch. A producer batches as any Kafka deployment does: one
message per batch (the config's default, kept for tansu's high watermark, ingest.config.KafkaConfig) made the
embedded broker the costliest stage, 0.244 CPU-s per 1,000 events against 0.005 with batches of up to 500
(16k events at 2000/s, measured 2026-12-02). The watermark quirk costs a stream nothing: the tail of each
partition's newest batch is ingested with the next batch, a second later at most."""


@dataclass(frozen=True)
class Sample:
    """Each stage's backlog at ``t_s`` seconds into the run (None: the stage has no output to compare yet)."""

    t_s: float
    ingest: int | None
    build: int | None
    trainer: int | None
    generated: int | None = None
    """Messages in the topic (sum of the Kafka high watermarks): the events generated so far."""
    cpu_s: dict[str, float] | None = None
    """CPU-seconds each stage used since the run began (:class:`CpuMeter`)."""
    validate: int | None = None
    """Versions not validated yet (:func:`gemline.progress.validate_progress`: the newest ``events`` version when
    unjudged, every unjudged ``examples`` version)."""
    distill: int | None = None
    """Examples versions the teacher trained that the students have not distilled yet; None when ``gemline run``
    starts no ``distill --follow`` or the teacher has trained nothing yet."""


CPU_ORDER = ("broker", "generate", "ingest", "validate", "build", "train", "distill", "run", "benchmark")


def stage_of(cmdline: Sequence[str]) -> str | None:
    """The gemline subcommand a command line runs (``python -m gemline.cli build ...`` -> ``build``), None for
    any other program."""
    for i, arg in enumerate(cmdline[:-1]):
        if arg == "gemline.cli" or arg.endswith("/gemline/cli.py"):
            return cmdline[i + 1]
    return None


class CpuMeter:
    """CPU-seconds (user + system) per stage of the process tree under ``root_pid``, plus this process as
    ``benchmark``. Each process is counted to its own stage (:func:`stage_of`) or its nearest ancestor's, and
    its last reading is kept after it exits, so a restarted stage's earlier processes still count (up to the
    last read before they exited)."""

    def __init__(self, root_pid: int) -> None:
        self.root = psutil.Process(root_pid)
        self.me = psutil.Process()
        self.seen: dict[tuple[int, float], tuple[str, float]] = {}
        """(pid, create time) -> (stage, CPU-s at the last read)."""

    def read(self) -> dict[str, float]:
        """Read every live process of the tree now; return the CPU-seconds of each stage so far."""
        self._walk(self.root, "run")
        times = self.me.cpu_times()
        totals = {"benchmark": times.user + times.system}
        for stage, cpu_s in self.seen.values():
            totals[stage] = totals.get(stage, 0.0) + cpu_s
        return totals

    def _walk(self, proc: psutil.Process, inherited: str) -> None:
        try:
            with proc.oneshot():
                stage = stage_of(proc.cmdline()) or inherited
                times = proc.cpu_times()
                self.seen[(proc.pid, proc.create_time())] = (stage, times.user + times.system)
            children = proc.children()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            return
        for child in children:
            self._walk(child, stage)


def cpu_budget(first: Sample, last: Sample) -> list[tuple[str, float, float | None]]:
    """(stage, cores used, CPU-s per 1,000 generated events) per stage between two samples, then ``total``;
    the per-event figure is None when no event was generated in between.

    Raises:
        ValueError: a sample without CPU times, or ``last`` not after ``first``.
    """
    if first.cpu_s is None or last.cpu_s is None or last.t_s <= first.t_s:
        raise ValueError("cpu_budget: needs two samples with CPU times, the second later")
    wall_s = last.t_s - first.t_s
    events = None if first.generated is None or last.generated is None else last.generated - first.generated
    stages = sorted(set(first.cpu_s) | set(last.cpu_s),
                    key=lambda n: (CPU_ORDER.index(n) if n in CPU_ORDER else len(CPU_ORDER), n))
    used = {n: last.cpu_s.get(n, 0.0) - first.cpu_s.get(n, 0.0) for n in stages}
    used["total"] = sum(used.values())
    return [(n, cpu / wall_s, cpu / events * 1000 if events else None) for n, cpu in used.items()]


def budget_lines(first: Sample, last: Sample, title: str) -> list[str]:
    """The printed CPU budget between two samples (:func:`cpu_budget`)."""
    events = None if first.generated is None or last.generated is None else last.generated - first.generated
    rate = "" if events is None else f", {events:,} events generated = {events / (last.t_s - first.t_s):.0f} events/s"
    lines = [f"CPU budget {title} (t={first.t_s:.0f}-{last.t_s:.0f} s{rate}; {psutil.cpu_count()} cores here, "
             f"keeping up needs a total well under that):",
             f"  {'stage':<10} {'cores':>6} {'CPU-s per 1k events':>20}"]
    for name, cores, per_k in cpu_budget(first, last):
        lines.append(f"  {name:<10} {cores:6.2f} {'-' if per_k is None else f'{per_k:.3f}':>20}")
    lines.append("  (CPU the stages spent; a stage whose backlog grew did less than its share of the work, so it "
                 "needs more than this: read it with the backlog line below and `uptime`)")
    return lines


def window_start_s(run_s: float, window_s: float = 300.0) -> float:
    """Where the judged window of a ``run_s``-second run starts, s into the run: its last ``window_s`` seconds,
    or its last half when the run is shorter than two windows."""
    return run_s - window_s if run_s >= 2 * window_s else run_s / 2


def last_window(samples: Sequence[Sample], run_s: float, window_s: float = 300.0) -> list[Sample]:
    """The samples of the window of a ``run_s``-second run (:func:`window_start_s`)."""
    start = window_start_s(run_s, window_s)
    return [s for s in samples if s.t_s >= start]


def trend_lines(trends: dict[str, Trend | None]) -> list[str]:
    """One line per stage: its inputs' waits over the window (:func:`gemline.waits.wait_trend`)."""
    lines = []
    for stage, t in trends.items():
        if t is None:
            lines.append(f"  {stage:9s} fewer than 3 inputs in the window")
        else:
            verdict = "STALLED (an input waits longer than any done)" if t.stalled else (
                "GROWING" if t.growing else "keeps up")
            lines.append(f"  {stage:9s} {t.inputs:4d} inputs, wait median {t.median_s:6.1f} max {t.max_s:6.1f} s, "
                         f"fitted rise {t.rise_s:+7.1f} s (p={t.p:.3f}): {verdict}")
    return lines


def pooled(rows: list[dict[str, Any]], hop: str) -> tuple[float, float, float, int] | None:
    """(p50, p95, p99, rows) of ``hop``: the row-weighted means of the versions' quantiles (None: no rows)."""
    mine = [r for r in rows if r["hop"] == hop and r["rows"] > 0]
    total = sum(r["rows"] for r in mine)
    if not total:
        return None
    p50, p95, p99 = (sum(r[q] * r["rows"] for r in mine) / total for q in ("p50_s", "p95_s", "p99_s"))
    return p50, p95, p99, total


def label_settings(label_mode: str, publish_delay_ms: int) -> dict[str, str]:
    """The settings (``--set`` keys and values) of the label mode (module docstring)."""
    if label_mode == "window":
        return {"build.click_window_ms": str(publish_delay_ms), "build.conversion_window_ms": str(publish_delay_ms)}
    return {"build.label_mode": label_mode, "build.publish_delay_ms": str(publish_delay_ms)}


def time_compression(settings: dict[str, str], minutes: float) -> float:
    """Generated seconds per wall second of a run sized by :func:`generator_settings` (its ``settings``): the
    generator streams 1.1 x rate x ``minutes`` x 60 events at the rate, so ``generate.days`` of generated
    behaviour (sessions, clicks, conversions) pass in 1.1 x ``minutes`` x 60 wall seconds."""
    return float(settings["generate.days"]) * MS_PER_DAY / 1000 / (1.1 * minutes * 60)


def compressed_windows(compression: float) -> dict[str, str]:
    """The settings that shrink the attribution windows (``build.click_window_ms``, ``build.conversion_window_ms``
    and the trainer's ``trainer.click_window_ms``, which must equal the build's) by ``compression``
    (:func:`time_compression`), so that they span as much generated behaviour as the default windows span in real
    time (module docstring, "Windows")."""
    build = BuildConfig()
    click, conversion = (str(round(w / compression)) for w in (build.click_window_ms, build.conversion_window_ms))
    return {"build.click_window_ms": click, "build.conversion_window_ms": conversion, "trainer.click_window_ms": click}


def load_lines(lake: Lake, began_ms: float) -> list[str]:
    """Per minute of the run, the ``examples`` rows the build published: first publications and correction rows
    (``corrects_example_id`` set), each counted at the Delta commit that added it (its commit timestamp, the
    minute being ``(commit ms - began_ms) // 60,000``); a load rising through the run shows here. Rows carry no
    publication time of their own (``created_ts_ms`` is the impression's arrival, copied into its corrections)."""
    tid = table_id(lake.root, Table.EXAMPLES, storage_options=lake.storage_options)
    if tid is None:
        return []
    committed = {c.version: c.timestamp_ms for c in commits(lake, Table.EXAMPLES)}
    counts: dict[int, list[int]] = {}
    for version, batch, _ in read_from(lake.root, Table.EXAMPLES, Cursor(tid, 0), columns=["corrects_example_id"],
                                       storage_options=lake.storage_options):
        if batch is None or batch.num_rows == 0:
            continue
        corrections = batch.num_rows - batch.column(0).null_count
        minute = counts.setdefault(int((committed[version] - began_ms) // 60_000), [0, 0])
        minute[0] += batch.num_rows - corrections
        minute[1] += corrections
    if not counts:
        return []
    parts = []
    for m in range(max(0, min(counts)), max(counts) + 1):
        first, corrections = counts.get(m, [0, 0])
        parts.append(f"{m}: {first:,}+{corrections:,}")
    return ["examples rows published per minute of the run, by commit (first publications + corrections): "
            + ", ".join(parts)]


def generator_settings(rate: float, minutes: float, batch_messages: int = 1) -> dict[str, str]:
    """Settings that size ``gemline generate`` to last the run at ``rate`` events/s (10 % spare), with the wall
    clock as event time, producing up to ``batch_messages`` messages per record batch
    (``kafka.producer_batch_messages``)."""
    sessions = USERS * GenerateConfig().sessions_per_user_per_day
    days = 1.1 * rate * minutes * 60 / (sessions * EVENTS_PER_SESSION)
    return {"generate.wall_clock": "true", "generate.num_users": str(USERS), "generate.days": f"{days:.4f}",
            "kafka.producer_batch_messages": str(batch_messages)}


def sample(config: GemlineConfig, bootstrap: str, t_s: float, cpu_s: dict[str, float] | None = None) -> Sample:
    """Each stage's backlog now (module docstring; read as ``gemline run``'s status table reads it,
    :mod:`gemline.progress`), the events generated so far and ``cpu_s``."""
    lake = Lake.for_config(config)
    try:
        high = make_client(config.kafka.client, bootstrap, timeout_s=10).end_offsets(config.kafka.topic)
    except (ValueError, TimeoutError, OSError):  # no topic yet
        high = {}
    ingest = ingest_progress(lake, app_id_for(config.kafka.topic), lambda: high).lag if high else None
    generated = sum(h for _, h in high.values()) if high else None
    distill = distill_progress(lake).lag if runs_distill(config) else None
    return Sample(t_s, ingest, build_progress(lake).lag, train_progress(lake).lag, generated, cpu_s,
                  validate=validate_progress(lake).lag, distill=distill)


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """SIGTERM ``gemline run`` (it stops its stages), then SIGKILL its process group after ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the run (default 10)")
    parser.add_argument("--rate", type=float, default=2000.0, help="events/s the generator produces (default 2000)")
    parser.add_argument("--label-mode", choices=("defer", "window"), default="defer")
    parser.add_argument("--publish-delay-ms", type=int, default=60_000)
    parser.add_argument("--producer-batch-messages", type=int, default=PRODUCER_BATCH_MESSAGES,
                        help=f"kafka.producer_batch_messages of the generator (default {PRODUCER_BATCH_MESSAGES}; "
                             "1 costs the broker ~50x more CPU per event)")
    parser.add_argument("--interval-s", type=float, default=10.0, help="gemline run --interval-s (build, validate)")
    parser.add_argument("--poll-interval-s", type=float, default=10.0, help="gemline run --poll-interval-s (train)")
    parser.add_argument("--watch-s", default="1", help="gemline run --watch-s (every follower; none: no watching)")
    parser.add_argument("--rise-s", type=float, default=10.0,
                        help="a stage's backlog grows when its inputs' waits rise by this much over the window (s)")
    parser.add_argument("--windows", choices=("real", "compressed"), default="real",
                        help="attribution windows: the defaults (real), or shrunk by the generator's time compression "
                             "(module docstring, \"Windows\")")
    parser.add_argument("--lake", help="lake folder (default: a new temporary one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="more settings for every stage, e.g. --set trainer.model=dlrm (repeatable)")
    args = parser.parse_args(argv)
    lake = args.lake or tempfile.mkdtemp(prefix="gemline-bench-freshness-")
    extra = dict(pair.split("=", 1) for pair in args.set)
    generator = generator_settings(args.rate, args.minutes, args.producer_batch_messages)
    compression = time_compression(generator, args.minutes)
    windows = compressed_windows(compression) if args.windows == "compressed" else {}
    settings = {**label_settings(args.label_mode, args.publish_delay_ms), **generator, **windows, **extra}
    config = load_config(overrides={"lake": lake, **settings})
    flags = ["--lake", lake, *(f for key, value in settings.items() for f in ("--set", f"{key}={value}"))]
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    log_path = Path(lake) / "_run" / "benchmark.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "gemline.cli", "run", "--broker-port", str(port), "--generate-rate", str(args.rate),
               "--interval-s", str(args.interval_s), "--poll-interval-s", str(args.poll_interval_s),
               "--watch-s", args.watch_s, "--drain-timeout-s", "0", *flags]  # measured already: the stop need not wait for ingest's backlog
    print(f"lake {lake}; {' '.join(command[2:])}; stage logs in {lake}/_run/logs", flush=True)
    print(f"generated behaviour passes {compression:,.0f}x faster than the wall clock; attribution windows "
          f"{'shrunk by that: ' + ', '.join(f'{k}={v}' for k, v in windows.items()) if windows else 'as configured'}",
          flush=True)
    run_s = args.minutes * 60
    samples: list[Sample] = []
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        began, began_ms = time.monotonic(), time.time() * 1000
        meter = CpuMeter(proc.pid)
        samples.append(Sample(0.0, None, None, None, 0, meter.read()))
        try:
            while (elapsed := time.monotonic() - began) < run_s and proc.poll() is None:
                until = time.monotonic() + min(SAMPLE_EVERY_S, max(0.0, run_s - elapsed))
                while (left := until - time.monotonic()) > 0 and proc.poll() is None:
                    time.sleep(min(CPU_EVERY_S, left))
                    cpu_s = meter.read()
                s = sample(config, bootstrap, time.monotonic() - began, cpu_s)
                samples.append(s)
                trained = read_table(lake, Table.FRESHNESS)
                print(f"t={s.t_s:5.0f} s backlog: ingest {s.ingest} messages, validate {s.validate} versions, "
                      f"build {s.build} events versions, "
                      f"trainer {s.trainer} examples versions, distill {s.distill} examples versions; versions measured: "
                      f"{0 if trained is None else len(set(trained['examples_version'].to_pylist()))}", flush=True)
        finally:
            ran_s, ended_ms = time.monotonic() - began, int(time.time() * 1000)
            _stop(proc)
    if proc.returncode not in (0, 130, -signal.SIGTERM) and time.monotonic() - began < run_s:
        raise SystemExit(f"gemline run exited early ({proc.returncode}); its log: {log_path}")
    table = read_table(lake, Table.FRESHNESS)
    rows = [] if table is None else sorted(table.to_pylist(), key=lambda r: (r["examples_version"], HOPS.index(r["hop"])))
    for r in rows:
        print(f"examples@{r['examples_version']} {r['hop']:>22}: {r['rows']:7d} rows p50 {r['p50_s']:7.1f} "
              f"p95 {r['p95_s']:7.1f} p99 {r['p99_s']:7.1f} s (steps {r['step_first']}-{r['step_last']})")
    written = Lake.for_config(config)
    print("\n".join(load_lines(written, began_ms)))
    window = last_window(samples, run_s)
    measured = [s for s in samples if s.cpu_s is not None]
    if len(window) >= 2:
        print("\n".join(budget_lines(window[0], window[-1], "over the backlog window")))
    if len(measured) >= 2:
        print("\n".join(budget_lines(measured[0], measured[-1], "over the whole run")))
    since_ms = int(began_ms + window_start_s(ran_s) * 1000)
    waits = stage_waits(written, ingest_app_id=app_id_for(config.kafka.topic), until_ms=ended_ms,
                        ingest_pending=bool(samples[-1].ingest), distill=runs_distill(config))
    trends = {stage: wait_trend(w, since_ms, ended_ms, rise_s=args.rise_s) for stage, w in waits.items()}
    print(f"each input's wait for its stage, inputs arrived t={window_start_s(ran_s):.0f}-{ran_s:.0f} s "
          f"(growing: a fitted rise of at least {args.rise_s:g} s, p < 0.05):")
    print("\n".join(trend_lines(trends)))
    growing = [stage for stage, t in trends.items() if t is not None and t.growing]
    print(f"backlog growing in {', '.join(growing) or 'no stage'}")
    total = pooled(rows, "impression->trained")
    if total is None:
        print(f"no trained rows measured: see the stage logs in {lake}/_run/logs")
        print(f"freshness impression->trained p50=nan p95=nan p99=nan s; backlog growing: {'yes' if growing else 'no'}")
        return
    p50, p95, p99, _ = total
    print(f"freshness impression->trained p50={p50:.1f} p95={p95:.1f} p99={p99:.1f} s; "
          f"backlog growing: {'yes' if growing else 'no'}")


if __name__ == "__main__":
    main()
