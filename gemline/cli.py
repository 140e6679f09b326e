"""The `gemline` command: thin wrappers that load the config (TOML + flags) and call one function.

    gemline broker [--port P]
    gemline replay --dataset NAME [--path FILE] [--limit N] [--bootstrap HOST:PORT]
    gemline generate [--rate EVENTS_PER_S] [--set generate.num_users=N ...] [--bootstrap HOST:PORT]
    gemline ingest [--bootstrap HOST:PORT] [--streaming [--commit-interval-s S] [--max-batches N] [--metrics-port P]]
                   [--runner dask --dask-address HOST:PORT] [beam flags ...]
    gemline build [--follow [--interval-s S] [--watch-s S] [--metrics-port P]] [--runner dask --dask-address HOST:PORT] [beam pipeline flags ...]
    gemline backfill --late-events
    gemline cluster up [--workers N] [--port P]
    gemline validate --table T [--version V] | --follow [--table T1,T2] [--interval-s S] [--watch-s S]
    gemline report [--table T] [--version V]
    gemline quality release V --reason "..." [--table T]
    gemline train [--holdout-last-day] [--version V] [--nproc N] | --once | --follow [--poll-interval-s S] [--watch-s S]
                  [--from-scratch]
    gemline run [--bootstrap HOST:PORT] [--generate-rate R] [--interval-s S] [--poll-interval-s S] [--watch-s S] [--no-train]
                [--metrics-port P]
    gemline lineage [--json]
    gemline audit [--json]
    gemline distill --once | --follow [--poll-interval-s S] [--watch-s S] [--from-scratch]
                  [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT [--rdzv-id JOB]]
    gemline demo [--dataset NAME] [--path FILE] [--limit N] [--nproc N]

Every command but `broker` and `cluster up` takes --config FILE, --lake DIR and --set section.key=value
(repeatable).
Flags that gemline does not know are passed to Beam's PipelineOptions (ingest, build, demo).
Stage modules are imported inside each command so that `gemline broker` starts without torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from gemline.config import GemlineConfig, load_stage_config, parse_set_flags
from gemline.errors import BadConfigError, GemlineError, MissingInputError, RetentionGapError
from gemline.lake import Lake
from gemline.process import SUPERVISOR_FD_ENV, run_and_exit, watch_lifeline
from gemline.tables import Table


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (defaults apply to what it leaves out)")
    parser.add_argument("--lake", help="lake root directory (overrides config 'lake'; default ./lake)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one config key, e.g. --set build.max_seq_len=512 (repeatable)",
    )


def _positive_rate(text: str) -> float:
    """argparse type: events/s, a finite number > 0 (0 or less would never send, or divide by zero)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected events/s > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected events/s > 0, got {text!r}")
    return value


def _metrics_flag(parser: argparse.ArgumentParser, when: str) -> None:
    parser.add_argument("--metrics-port", type=int, default=None,
                        help=f"{when}serve Prometheus metrics (gemline.metrics) on this port, 0: a free one (printed); "
                             "default: none")
    parser.add_argument("--metrics-addr", default="127.0.0.1",
                        help="the interface --metrics-port listens on (default 127.0.0.1: this machine only; "
                             "0.0.0.0: every interface, for a scraper on another host)")


def _watch_seconds(value: str) -> float | None:
    """A ``--watch-s`` value: seconds > 0, or ``none`` (no watching: a pass every interval)."""
    if value.strip().lower() == "none":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0 or none, got {value!r}")
    return seconds


def _watch_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--watch-s", type=_watch_seconds, default=1.0,
                        help=f"--follow: seconds between looks for {what}, which starts the next pass at once "
                             "(default 1; none: a pass every interval)")


def _kafka_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", help="HOST:PORT of a Kafka cluster (overrides kafka.bootstrap)")
    parser.add_argument("--topic", help="topic (overrides kafka.topic)")


def _nproc_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc", type=int, default=1,
        help="train with N local processes through torchrun (TorchRec sharding + FSDP2; config section trainer.distributed)",
    )


def _multinode_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, default=1, help="launchers (machines) in the job; >1 needs --rdzv-endpoint")
    parser.add_argument("--node-rank", type=int, default=0, help="this launcher's index in [0, nnodes)")
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous, the same on every node")
    parser.add_argument("--rdzv-id", default="gemline", help="job id shared by the launchers of one run")


def _runner_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runner", help="Beam runner: 'dask' (gemline.cluster.GemlineDaskRunner) or any Beam runner name")
    parser.add_argument("--dask-address", help="with --runner dask: HOST:PORT of a Dask scheduler "
                        "(`gemline cluster up`); default: a private LocalCluster per pipeline")


def _beam_args(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """Beam flags from --runner/--dask-address, followed by the flags passed through untouched."""
    runner = getattr(args, "runner", None)
    if getattr(args, "dask_address", None) and runner != "dask":
        raise BadConfigError(f"--dask-address needs --runner dask, got --runner {runner!r}")
    if runner == "dask":
        from gemline.cluster import dask_beam_args

        return [*dask_beam_args(args.dask_address), *extra]
    return [f"--runner={runner}", *extra] if runner else list(extra)


def _config(args: argparse.Namespace) -> GemlineConfig:
    overrides: dict[str, Any] = parse_set_flags(args.overrides)
    if getattr(args, "lake", None) is not None:  # `--lake ""` is refused (GemlineConfig), not taken as no flag
        overrides["lake"] = args.lake
    if getattr(args, "bootstrap", None):
        overrides["kafka.bootstrap"] = args.bootstrap
    if getattr(args, "topic", None):
        overrides["kafka.topic"] = args.topic
    # `ingest --streaming` flags are spellings of [ingest.streaming] keys; given, they win over the file.
    if getattr(args, "commit_interval_s", None) is not None:
        overrides["ingest.streaming.commit_interval_s"] = args.commit_interval_s
    if getattr(args, "max_batches", None) is not None:
        overrides["ingest.streaming.max_batches"] = args.max_batches
    if getattr(args, "build_interval_s", None) is not None:  # `build --follow --interval-s`, likewise
        overrides["build.interval_s"] = args.build_interval_s
    if hasattr(args, "build_watch_s"):  # `build --follow --watch-s` (absent when not given: `none` is a value)
        overrides["build.watch_s"] = args.build_watch_s
    # The settings the last `gemline run` saved with the lake are the defaults, so a stage started alone there
    # later builds and trains as that run did (gemline.config.load_stage_config).
    return load_stage_config(args.config, overrides, say=lambda line: print(line, file=sys.stderr, flush=True))


def _require_bootstrap(config: GemlineConfig) -> str:
    if not config.kafka.bootstrap:
        raise SystemExit("error: no Kafka cluster given: pass --bootstrap HOST:PORT (start one with `gemline broker`)")
    return config.kafka.bootstrap


def cmd_broker(args: argparse.Namespace, extra: list[str]) -> int:
    from ingest.broker import serve_forever

    return serve_forever(args.port)


def cmd_replay(args: argparse.Namespace, extra: list[str]) -> int:
    from ingest.replay import replay_dataset

    config = _config(args)
    result = replay_dataset(
        args.dataset,
        bootstrap=_require_bootstrap(config),
        topic=config.kafka.topic,
        partitions=config.kafka.partitions,
        path=args.path,
        limit=args.limit,
        batch_messages=config.kafka.producer_batch_messages,
    )
    print(json.dumps(result.__dict__ if hasattr(result, "__dict__") else str(result), default=str))
    from ingest.datasets import EARLIEST_EVENT_MS

    floor = EARLIEST_EVENT_MS.get(args.dataset)
    if floor is not None and floor < config.ingest.min_event_time_ms:
        print(f"note: {args.dataset} events start before ingest.min_event_time_ms; ingest them with "
              f"--set ingest.min_event_time_ms={floor}", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace, extra: list[str]) -> int:
    import threading

    from ingest.generate import generate_records, stream_records
    from ingest.replay import ReplayInterrupted
    from ingest.streaming import install_stop_signals

    config = _config(args)
    records = generate_records(config.generate)
    # Ctrl-C/SIGTERM only set ``stop``, so the producer stops where its count is exact (a KeyboardInterrupt raised
    # inside a delivery callback would lose that message's report); a second signal raises at once.
    stop = threading.Event()
    restore = install_stop_signals(stop)
    try:
        produced = stream_records(
            records, bootstrap=_require_bootstrap(config), topic=config.kafka.topic, partitions=config.kafka.partitions,
            rate_per_s=args.rate, batch_messages=config.kafka.producer_batch_messages,
            wall_clock=config.generate.wall_clock, stop=stop,
        )
    except ReplayInterrupted as exc:  # what the topic now holds of this run, then main's one line and exit 130
        print(json.dumps({"produced": exc.acknowledged, "unacknowledged": exc.unacknowledged, "interrupted": True,
                          "topic": config.kafka.topic, "seed": config.generate.seed}), flush=True)
        raise
    finally:
        restore()
    print(json.dumps({"produced": produced, "topic": config.kafka.topic, "seed": config.generate.seed}))
    return 0


def cmd_ingest(args: argparse.Namespace, extra: list[str]) -> int:
    from ingest.pipeline import ingest_backlog, run_ingest

    config = _config(args)
    extra = _beam_args(args, extra)
    if args.streaming:
        return _ingest_streaming(args, config, extra)
    if args.metrics_port is not None:
        raise BadConfigError("--metrics-port is for the long-running `ingest --streaming`")
    if config.ingest.max_offsets_per_partition is not None:
        # Capped batches: read the whole backlog, one bounded batch (one JSON line) at a time, each
        # printed as it commits: a run killed later still shows what it committed.
        results = ingest_backlog(Lake.for_config(config), config.kafka, config.ingest,
                                 bootstrap=_require_bootstrap(config), beam_args=extra, reset_topic=args.reset_topic,
                                 on_batch=lambda result: print(_json_line(result), flush=True))
    else:
        results = [run_ingest(Lake.for_config(config), config.kafka, config.ingest,
                              bootstrap=_require_bootstrap(config), beam_args=extra, reset_topic=args.reset_topic)]
        print(_as_json(results[0]))
    gaps = [gap for result in results for gap in result.gaps]
    if gaps and not config.ingest.accept_gaps:
        lost = sum(end - start for _, start, end in gaps)
        where = ", ".join(f"[{p}] {start}..{end - 1}" for p, start, end in gaps)
        raise RetentionGapError(
            f"{lost} record(s) of {config.kafka.topic} were deleted by retention before they were ingested "
            f"(offsets {where}); the gap is recorded in the events commit and ingest went on after it. "
            "Pass --set ingest.accept_gaps=true to accept gaps without this exit code.")
    return 0


def _ingest_streaming(args: argparse.Namespace, config: GemlineConfig, extra: list[str]) -> int:
    import threading

    from gemline.run import serving_metrics
    from ingest.streaming import install_stop_signals, run_streaming

    bootstrap = _require_bootstrap(config)
    stop = threading.Event()
    restore = install_stop_signals(stop)
    try:
        with serving_metrics(config, args.metrics_port, bootstrap=bootstrap, addr=args.metrics_addr):
            summary = run_streaming(Lake.for_config(config), config.kafka, config.ingest, config.ingest.streaming,
                                    bootstrap=bootstrap, stop=stop, beam_args=extra)
    finally:
        restore()
    print(_as_json(summary))
    return 0


def cmd_build(args: argparse.Namespace, extra: list[str]) -> int:
    from sequences.pipeline import run_build

    if args.follow:
        from gemline.follow import follow_build
        from gemline.run import serving_metrics

        config = _config(args)
        with serving_metrics(config, args.metrics_port, bootstrap=config.kafka.bootstrap, addr=args.metrics_addr):
            follow_build(config, beam_args=_beam_args(args, extra), on_pass=_print_new_work())
        return 0
    if args.metrics_port is not None:
        raise BadConfigError("--metrics-port is for the long-running `build --follow`")

    # Quarantined or never-validated events: gemline.gate.GateClosedError, exit 3 (see main).
    config = _config(args)
    result = run_build(Lake.for_config(config), config.build, events_version=args.events_version,
                       beam_args=_beam_args(args, extra), final=args.final)
    print(_as_json(result))
    return 0


def cmd_export(args: argparse.Namespace, extra: list[str]) -> int:
    from sequences.materialize import export_examples

    config = _config(args)
    lake = Lake.for_config(config)
    print(_json_line(export_examples(lake, args.out, version=args.version, materialize=args.materialize,
                                     storage_options=lake.delta_options)), flush=True)
    return 0


def cmd_backfill(args: argparse.Namespace, extra: list[str]) -> int:
    from ingest.backfill import backfill_late_events

    config = _config(args)
    print(_json_line(backfill_late_events(Lake.for_config(config), config.kafka, config.ingest)), flush=True)
    return 0


def cmd_cluster(args: argparse.Namespace, extra: list[str]) -> int:
    from gemline.cluster import cluster_up

    def ready(address: str) -> None:
        print(f"Dask scheduler at {address} with {args.workers} worker processes; Ctrl-C stops it.\n"
              f"  gemline ingest --runner dask --dask-address {address.removeprefix('tcp://')} ...", flush=True)

    return cluster_up(args.workers, host=args.host, port=args.port, on_ready=ready)


def _print_new_work():
    """An ``on_pass`` for the follow loops: one JSON line per version built or validated, as it happens."""
    shown = {"n": 0}

    def on_pass(state: Any) -> None:
        for record in state.done[shown["n"]:]:
            print(json.dumps(record, default=str), flush=True)
        shown["n"] = len(state.done)

    return on_pass


def cmd_validate(args: argparse.Namespace, extra: list[str]) -> int:
    from validation.run import validate_table

    if args.follow:
        from gemline.follow import follow_validate

        follow_validate(_config(args), [t.strip() for t in args.table.split(",")], interval_s=args.interval_s,
                        watch_s=args.watch_s, on_pass=_print_new_work())
        return 0

    config = _config(args)
    result = validate_table(Lake.for_config(config), args.table, args.version, validation=config.validation,
                            ingest=config.ingest, build=config.build)
    print(f"{result.table}@{result.table_version}: {'PASSED' if result.passed else 'QUARANTINED'}  report: {result.report_html}")
    return 0 if result.passed else 3


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from gemline.gate import gate_decision, require_version
    from gemline.lake import open_table
    from validation.run import VALIDATED_TABLES, latest_report

    lake = Lake.for_config(_config(args))
    # Checked before the report is looked for, whose "run gemline validate" hint would fail the same way.
    if args.table in VALIDATED_TABLES and open_table(lake, args.table, storage_options=lake.delta_options) is None:
        raise MissingInputError(f"no {args.table} table in {lake} yet, so no report: `gemline ingest` writes events, "
                                "`gemline build` the others")
    if args.version is not None:
        require_version(lake, args.table, args.version, storage_options=lake.delta_options)  # names the versions
    verdict, html = latest_report(lake, args.table, args.version)

    version = args.version if args.version is not None else int(Path(str(html)).parent.name)
    decision = gate_decision(lake, args.table, version)
    print(f"{args.table}@{version}: {verdict}  report: {html}")
    print(f"gate: {'allowed' if decision.allowed else 'refused'}: {decision.reason}")
    return 0


def cmd_quality(args: argparse.Namespace, extra: list[str]) -> int:
    from gemline.gate import gate_decision, release

    config = _config(args)
    options = config.lake_storage_options or None
    release(config.lake, args.table, args.version, args.reason, storage_options=options)
    decision = gate_decision(config.lake, args.table, args.version, storage_options=options)
    if not decision.allowed:
        print(f"error: {decision.reason}", file=sys.stderr)
        return 2
    print(decision.reason)
    return 0


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    if args.once or args.follow:
        return _train_continuous(args)
    if args.nnodes > 1 or args.rdzv_endpoint is not None:
        from trainer.launch import train_with_torchrun

        config = _config(args)
        result = train_with_torchrun(
            Lake.for_config(config), config.trainer, args.nproc, examples_version=args.version, nnodes=args.nnodes, node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        )
        # Only the node that hosted global rank 0 has a result; the others print nothing.
        if result is not None:
            print(_train_summary(result))
        return 0
    from trainer.train import run_training

    if args.nproc > 1:
        from trainer.data import latest_examples_version
        from trainer.launch import train_with_torchrun
        from trainer.train import check_gate

        config = _config(args)
        # Check here what every rank would check, so a missing table or a quarantined version is
        # one line, not torchrun's dump of each rank's traceback.
        opts = config.lake_storage_options or None
        version = latest_examples_version(config.lake, storage_options=opts) if args.version is None else args.version
        check_gate(config.lake, version, storage_options=opts)  # QuarantinedError: exit 3 (see main)
        result = train_with_torchrun(Lake.for_config(config), config.trainer, args.nproc, examples_version=version)
        print(_train_summary(result))
        return 0
    config = _config(args)
    # QuarantinedError: exit 3 (see main)
    result = run_training(config.trainer, Lake.for_config(config), examples_version=args.version)
    print(_train_summary(result))
    return 0


def _version_span(versions: list[int]) -> str:
    """``examples@3 holds`` / ``examples@0..4 hold`` / ``examples@1,3 hold`` for sorted, distinct ``versions``."""
    if len(versions) == 1:
        return f"examples@{versions[0]} holds"
    contiguous = versions[-1] - versions[0] == len(versions) - 1
    named = f"{versions[0]}..{versions[-1]}" if contiguous else ",".join(map(str, versions))
    return f"examples@{named} hold"


def _train_continuous(args: argparse.Namespace) -> int:
    """``train --once`` / ``--follow``: the continuous trainer (trainer.continuous), one JSON line per run."""
    from sequences.config import NOTHING_PUBLISHED
    from trainer.continuous import follow, run_once

    if args.version is not None:
        raise BadConfigError("train --once/--follow consume every new examples version; --version is for one-shot runs")
    if args.nnodes > 1 or args.rdzv_endpoint is not None:
        raise BadConfigError("train --once/--follow run on one node (--nproc N); --nnodes and --rdzv-endpoint are "
                             "for one-shot runs")
    config = _config(args)
    lake = Lake.for_config(config)

    def show(result: object) -> None:
        record = _as_dict(result)
        print(json.dumps({k: record[k] for k in ("run_id", "step", "rows_trained_total", "versions", "progressive",
                                                 "waiting_for", "checkpoint_path", "report_path")}, default=str),
              flush=True)

    if args.follow:
        follow(lake, config.trainer, poll_interval_s=args.poll_interval_s, from_scratch=args.from_scratch,
               on_result=show, nproc=args.nproc, watch_s=args.watch_s)
        return 0
    result = run_once(lake, config.trainer, from_scratch=args.from_scratch, nproc=args.nproc)
    show(result)
    if not result.versions and result.waiting_for is not None:
        if result.waiting_quarantined:
            print(f"train: nothing trained: {result.waiting_reason}; `gemline report --table examples --version "
                  f"{result.waiting_for}` shows why, `gemline quality release {result.waiting_for} --table examples "
                  "--reason ...` lets it through", file=sys.stderr)
        else:
            print(f"train: nothing trained: examples@{result.waiting_for} is not validated yet; run `gemline validate "
                  "--table examples`, then this command again", file=sys.stderr)
    if not result.versions and result.empty_versions:
        print(f"train: nothing trained: {_version_span(sorted(result.empty_versions))} no rows: {NOTHING_PUBLISHED}",
              file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace, extra: list[str]) -> int:
    from gemline.run import RunPlan, run_pipeline

    plan = RunPlan(bootstrap=args.bootstrap, broker_port=args.broker_port, generate_rate=args.generate_rate,
                   interval_s=args.interval_s, poll_interval_s=args.poll_interval_s, watch_s=args.watch_s,
                   train=not args.no_train,
                   metrics_port=args.metrics_port, metrics_addr=args.metrics_addr, drain_timeout_s=args.drain_timeout_s,
                   distill_nice=args.distill_nice)
    code = run_pipeline(_config(args), plan)
    return _interrupted(args.command) if code == 130 else code


def cmd_lineage(args: argparse.Namespace, extra: list[str]) -> int:
    from trainer.continuous import lineage

    record = lineage(Lake.for_config(_config(args)))
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    versions = record["examples_versions"]
    print(f"continuous run {record['run_id']}: step {record['step']}, {record['rows_trained_total']} rows trained"
          + _rows_split(versions))
    for v in versions:
        offsets = ", ".join(f"{o['topic']}[{o['partition']}] {o['start']}..{o['end']}{_generation_tag(o)}"
                            for o in v.get("kafka_offsets", []))
        print(f"  examples@{v['version']}: {v['quality']}, {v['rows_trained']} rows{_rows_split([v])}; events versions "
              f"{v.get('events_versions', [])}; Kafka {offsets or '-'}")
    return 0


def _generation_tag(offsets: dict[str, Any]) -> str:
    """`` (gen G, id ID)`` of a lineage ``kafka_offsets`` entry: which generation of the topic the batch read (the
    id where the broker gave one); empty where the batch predates generations."""
    if offsets.get("generation") is None:
        return ""
    return f" (gen {offsets['generation']}" + (f", id {offsets['topic_id']})" if offsets.get("topic_id") else ")")


def cmd_audit(args: argparse.Namespace, extra: list[str]) -> int:
    from ingest.audit import audit, format_report

    result = audit(Lake.for_config(_config(args)))
    print(json.dumps(result) if args.json else format_report(result))
    return 0 if result["clean"] else 1


def _rows_split(versions: list[dict[str, Any]]) -> str:
    """`` (E examples, F with final labels; C corrections)`` summed over lineage ``versions``; empty where a record
    predates these counts (trainer.continuous.lineage)."""
    keys = ("examples", "examples_final", "corrections")
    if not all(k in v for v in versions for k in keys):
        return ""
    examples, final, corrections = (sum(v[k] for v in versions) for k in keys)
    return f" ({examples} examples, {final} with final labels; {corrections} corrections)"


def cmd_distill(args: argparse.Namespace, extra: list[str]) -> int:
    """``distill --once`` / ``--follow``: the per-domain students (trainer.distill), one JSON line per run."""
    from trainer.distill import follow, run_distill_once

    config = _config(args)
    lake = Lake.for_config(config)

    def show(result: object) -> None:
        record = _as_dict(result)
        print(json.dumps({k: record[k] for k in ("run_id", "cursor", "versions", "waiting_for", "report_path")}),
              flush=True)

    if args.follow:
        follow(lake, config.trainer, config.distill, poll_interval_s=args.poll_interval_s,
               from_scratch=args.from_scratch, on_result=show, watch_s=args.watch_s)
        return 0
    show(run_distill_once(lake, config.trainer, config.distill, from_scratch=args.from_scratch))
    return 0


def cmd_compare(args: argparse.Namespace, extra: list[str]) -> int:
    from trainer.compare import run_compare, run_holdout_compare

    models = tuple(args.models.split(","))
    ablations = tuple(a for a in (args.ablate or "").split(",") if a)
    config = _config(args)
    result: Any
    if args.version is not None or args.holdout_last_day:
        if ablations or args.json or args.max_versions is not None or args.seeds is not None:
            raise BadConfigError("--ablate, --json, --max-versions and --seeds go with the progressive protocol, not --holdout-last-day/--version")
        result = run_holdout_compare(Lake.for_config(config), config.trainer, examples_version=args.version,
                                     models=models)
    else:
        result = run_compare(Lake.for_config(config), config.trainer, models=models, resamples=args.resamples,
                             seed=args.bootstrap_seed, ablations=ablations, max_versions=args.max_versions,
                             seeds=args.seeds)
    if args.json:
        print(open(result.paths["summary"]).read())
        return 0
    print(open(result.paths["md"]).read())
    print(_as_json(result.paths))
    return 0


def cmd_demo(args: argparse.Namespace, extra: list[str]) -> int:
    from gemline.demo import run_demo

    summary = run_demo(
        _config(args), dataset=args.dataset, path=args.path, limit=args.limit, beam_args=extra, nproc=args.nproc,
        increments=args.increments,
    )
    return 0 if summary["quality_passed"] else 3


def _as_dict(result: object) -> Any:
    import dataclasses

    return dataclasses.asdict(result) if dataclasses.is_dataclass(result) and not isinstance(result, type) else result


def _as_json(result: object) -> str:
    return json.dumps(_as_dict(result), indent=2, default=str)


def _json_line(result: object) -> str:
    """``result`` (a dataclass) as one line of JSON."""
    return json.dumps(_as_dict(result), default=str)


def _train_summary(result: object) -> str:
    """A training result as JSON with the per-step loss curve cut to its ends: the curve is a plot
    (``loss_curve.png`` in the checkpoint), not thousands of printed numbers. Undefined metrics are
    null, and ``undefined_metrics`` lists why each overall one is (trainer.metrics.describe_undefined)."""
    from trainer.metrics import describe_undefined, nan_to_none

    data = dict(_as_dict(result))
    # An undefined metric (AUC of an eval day without positives) is null with its reason, not NaN.
    data["metrics"] = nan_to_none(data.get("metrics"))
    notes = describe_undefined(data["metrics"] or {}, scope=f"eval day {data.get('eval_date')}")
    if notes:
        data["undefined_metrics"] = notes
    curve = data.get("loss_curve") or []
    if curve:
        data["loss_curve"] = {"steps": len(curve), "first": curve[0], "last": curve[-1],
                              "plot": str(Path(str(data.get("checkpoint_path", ""))) / "loss_curve.png")}
    return json.dumps(data, indent=2, default=str)


def _at_least_one(text: str) -> int:
    """argparse type: an int >= 1 (argparse turns the ValueError into a usage error naming the flag)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seed_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated distinct ints >= 0 (training seeds: numpy's generators take no negative
    one), at least one. An ArgumentTypeError (not a ValueError) so argparse prints its message, not this function's
    name."""
    try:
        seeds = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are comma-separated integers >= 0, got {text!r}") from None
    if min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"seeds must be >= 0, got {text!r}")
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds must be distinct, got {text}")
    return seeds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gemline", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("broker", help="run the embedded Kafka-compatible broker (tansu) until Ctrl-C")
    p.add_argument("--port", type=int, default=None, help="TCP port on 127.0.0.1 (default: a free one)")
    p.set_defaults(func=cmd_broker, passthrough=False)

    p = sub.add_parser("replay", help="produce a real dataset's events to Kafka in event-time order")
    _common(p)
    _kafka_flags(p)
    p.add_argument("--dataset", required=True, help="movielens | taobao | openbandit")
    p.add_argument("--path", help="input file (taobao)")
    p.add_argument("--limit", type=int, help="first N source records only")
    p.set_defaults(func=cmd_replay, passthrough=False)

    p = sub.add_parser("generate", help="produce synthetic three-domain traffic (config section [generate])")
    _common(p)
    _kafka_flags(p)
    p.add_argument("--rate", type=_positive_rate, default=None, help="target events/s, > 0 (default: as fast as possible)")
    p.set_defaults(func=cmd_generate, passthrough=False)

    p = sub.add_parser("ingest", help="Kafka -> events / dead_letter (one bounded snapshot, exactly once)")
    _common(p)
    _kafka_flags(p)
    p.add_argument("--streaming", action="store_true",
                   help="run until SIGINT/SIGTERM, one exactly-once micro-batch per --commit-interval-s")
    p.add_argument("--commit-interval-s", type=float, default=None,
                   help="streaming: seconds between micro-batches (sets ingest.streaming.commit_interval_s, default 5)")
    p.add_argument("--max-batches", type=int, default=None,
                   help="streaming: stop after N micro-batches (sets ingest.streaming.max_batches; tests)")
    _metrics_flag(p, "streaming: ")
    p.add_argument("--reset-topic", action="store_true",
                   help="the topic was recreated on purpose: forget the committed offsets and start over from its "
                        "beginning (recorded in the events commit)")
    _runner_flags(p)
    p.set_defaults(func=cmd_ingest, passthrough=True)

    p = sub.add_parser("build", help="events -> sequences, features, examples")
    _common(p)
    p.add_argument("--events-version", type=int, default=None, help="events table version (default latest)")
    p.add_argument(
        "--final", action="store_true",
        help="end of a bounded replay: close every attribution window now and publish all impressions "
             "(labels marked not final); default waits for windows to close by the watermark",
    )
    p.add_argument("--follow", action="store_true",
                   help="keep building each new gate-allowed events version until Ctrl-C/SIGTERM (gemline.follow)")
    p.add_argument("--interval-s", type=float, default=None, dest="build_interval_s",
                   help="--follow: the longest wait between passes (sets build.interval_s, default 10)")
    p.add_argument("--watch-s", type=_watch_seconds, default=argparse.SUPPRESS, dest="build_watch_s",
                   help="--follow: seconds between looks for a newly validated events version, which starts a pass "
                        "(sets build.watch_s, default 1; none: a pass every --interval-s)")
    _metrics_flag(p, "--follow: ")
    _runner_flags(p)
    p.set_defaults(func=cmd_build, passthrough=True)

    p = sub.add_parser("export", help="write examples as plain Parquet (fat rows with --materialize)")
    _common(p)
    p.add_argument("table", choices=[Table.EXAMPLES])
    p.add_argument("--out", required=True, help="directory for part-NNNNN.parquet (must hold none yet)")
    p.add_argument("--version", type=int, default=None, help="examples version (default latest)")
    p.add_argument("--materialize", action="store_true",
                   help="pointer-layout rows (build.examples_layout=pointer) rebuilt with their sequence lists")
    p.set_defaults(func=cmd_export, passthrough=False)

    p = sub.add_parser("backfill", help="re-admit late_events rows into events, exactly once (ingest.backfill)")
    _common(p)
    p.add_argument("--late-events", action="store_true", required=True,
                   help="the rows late_events gained since the last backfill (the only source so far)")
    p.set_defaults(func=cmd_backfill, passthrough=False)

    p = sub.add_parser("cluster", help="a local Dask cluster for Beam pipelines (--runner dask)")
    csub = p.add_subparsers(dest="action", required=True)
    c = csub.add_parser("up", help="start a scheduler and N worker processes, print the address, stop on Ctrl-C")
    c.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    c.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    c.add_argument("--port", type=int, default=0, help="scheduler TCP port (default: a free one)")
    c.set_defaults(func=cmd_cluster, passthrough=False)

    p = sub.add_parser("validate", help="run the quality suite on a table version; exit 3 if quarantined")
    _common(p)
    p.add_argument("--table", default=Table.EXAMPLES, help=" | ".join(
        (Table.EVENTS, Table.SEQUENCES, Table.EXAMPLES, Table.FEATURES_USER, Table.FEATURES_ITEM))
        + "; with --follow a comma-separated list")
    p.add_argument("--version", type=int, default=None, help="Delta version (default latest)")
    p.add_argument("--follow", action="store_true",
                   help="keep validating every new version of --table until Ctrl-C/SIGTERM (gemline.follow)")
    p.add_argument("--interval-s", type=float, default=30.0,
                   help="--follow: the longest wait between passes (default 30)")
    _watch_flag(p, "a new version of --table")
    p.set_defaults(func=cmd_validate, passthrough=False)

    p = sub.add_parser("report", help="print the quality verdict and the path of the HTML report")
    _common(p)
    p.add_argument("--table", default=Table.EXAMPLES)
    p.add_argument("--version", type=int, default=None)
    p.set_defaults(func=cmd_report, passthrough=False)

    p = sub.add_parser("quality", help="gate actions")
    qsub = p.add_subparsers(dest="action", required=True)
    q = qsub.add_parser("release", help="release a quarantined version, with a recorded reason")
    _common(q)
    q.add_argument("version", type=int)
    q.add_argument("--reason", required=True)
    q.add_argument("--table", default=Table.EXAMPLES)
    q.set_defaults(func=cmd_quality, passthrough=False)

    p = sub.add_parser("train", help="train on a version of examples (refuses quarantined versions)")
    _common(p)
    p.add_argument("--version", type=int, default=None, help="examples version (default latest)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--holdout-last-day", action="store_true",
                      help="one-shot (the default mode): train on every day of --version but the last, evaluate on "
                           "the last day")
    mode.add_argument("--once", action="store_true",
                      help="continuous: consume every new gate-allowed examples version once, checkpoint, exit")
    mode.add_argument("--follow", action="store_true",
                      help="continuous: keep consuming new versions until Ctrl-C/SIGTERM")
    p.add_argument("--poll-interval-s", type=float, default=30.0, help="--follow: the longest wait between runs")
    _watch_flag(p, "a newly validated examples version")
    p.add_argument("--from-scratch", action="store_true", help="--once/--follow: start a new continuous run")
    _nproc_flag(p)
    _multinode_flags(p)
    p.set_defaults(func=cmd_train, passthrough=False)

    p = sub.add_parser("run", help="keep every stage running (ingest, validate, build, train), restart what crashes")
    _common(p)
    _kafka_flags(p)
    p.add_argument("--broker-port", type=int, default=0,
                   help="without --bootstrap: the embedded broker's port (default: a free one)")
    p.add_argument("--generate-rate", type=_positive_rate, default=None,
                   help="also produce synthetic traffic at this many events/s ([generate] settings)")
    p.add_argument("--interval-s", type=float, default=None,
                   help="the longest wait between build/validate passes (default: build.interval_s, validation 10 s)")
    p.add_argument("--poll-interval-s", type=float, default=10.0,
                   help="the longest wait between continuous training (and distill) runs")
    p.add_argument("--watch-s", type=_watch_seconds, default=1.0,
                   help="seconds between each follower's looks for new input, which starts its next pass at once "
                        "(validate, build, train, distill; default 1; none: a pass every interval)")
    p.add_argument("--no-train", action="store_true", help="run every stage but the trainer (and its students, distill --follow)")
    p.add_argument("--drain-timeout-s", type=float, default=60.0,
                   help="embedded broker: at a stop, wait at most this long for ingest to consume what it holds")
    p.add_argument("--distill-nice", type=int, default=10,
                   help="niceness added to distill --follow, off the freshness path: on a full machine it takes "
                        "what the other stages leave (default 10; 0: the same priority)")
    _metrics_flag(p, "")
    p.set_defaults(func=cmd_run, passthrough=False)

    p = sub.add_parser("lineage", help="what the newest continuous checkpoint was trained on")
    _common(p)
    p.add_argument("--json", action="store_true", help="the lineage as JSON")
    p.set_defaults(func=cmd_lineage, passthrough=False)

    p = sub.add_parser("audit", help="reconcile the Kafka offsets the lake read with events, dead_letter, late_events, "
                                     "dropped duplicates and backfills; exit 1 if any is lost or doubled")
    _common(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=cmd_audit, passthrough=False)

    p = sub.add_parser("distill", help="per-domain students learn each new examples version from its labels and the "
                                       "logged teacher predictions; report under LAKE/_runs")
    _common(p)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--once", action="store_true", help="distill every version the teacher has consumed, then stop")
    mode.add_argument("--follow", action="store_true", help="--once again every --poll-interval-s until Ctrl-C")
    p.add_argument("--poll-interval-s", type=float, default=30.0,
                   help="--follow: the longest wait between runs (default 30)")
    _watch_flag(p, "a version the teacher consumed (a new training_metrics commit)")
    p.add_argument("--from-scratch", action="store_true", help="new students instead of resuming the checkpoint")
    p.set_defaults(func=cmd_distill, passthrough=False)

    p = sub.add_parser("compare", help="GEM, DLRM and LR through the continuous trainer's progressive validation over "
                                       "every examples version, with paired bootstrap intervals; report under LAKE/_runs")
    _common(p)
    p.add_argument("--models", default="gem,dlrm,lr",
                   help="comma-separated trainer.model names; the first is subtracted from (default gem,dlrm,lr)")
    p.add_argument("--resamples", type=_at_least_one, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--bootstrap-seed", type=int, default=0, help="numpy seed of the bootstrap draws (default 0)")
    p.add_argument("--ablate", default="",
                   help="comma-separated ablations (trainer.compare.ABLATIONS, e.g. final_labels, sequence_len, "
                        "interformer_cross; an unknown name lists them all): the first model again without each "
                        "change, reported as its difference from the full model")
    p.add_argument("--json", action="store_true",
                   help='print only {"models": {m: {auc, ne, ...}}, "gem_minus_dlrm_auc": {mean, ci95}, ..., "ablations"}')
    p.add_argument("--max-versions", type=_at_least_one, default=None,
                   help="consume only the first N examples versions (a short screen: the N - 1 after the first are judged)")
    p.add_argument("--seeds", type=_seed_list, default=None,
                   help="comma-separated training seeds (e.g. 0,1,2): every model once per seed; means over seeds and "
                        "intervals that resample seeds too (default: one run at trainer.seed)")
    p.add_argument("--holdout-last-day", action="store_true",
                   help="instead: train on one examples version's days but the last, evaluate on the last")
    p.add_argument("--version", type=int, default=None,
                   help="with --holdout-last-day (implied): the examples version (default latest)")
    p.set_defaults(func=cmd_compare, passthrough=False)

    p = sub.add_parser("demo", help="broker + replay + ingest + build + validate + train, end to end")
    _common(p)
    _kafka_flags(p)
    p.add_argument("--dataset", default="movielens", help="movielens (default) | taobao | openbandit")
    p.add_argument("--path", help="input file (taobao)")
    p.add_argument("--limit", type=int, help="first N source records only")
    p.add_argument("--increments", type=int, default=6,
                   help="replay the data in N time-ordered parts, each built and consumed by a continuous run")
    _nproc_flag(p)
    p.set_defaults(func=cmd_demo, passthrough=True)
    return parser


def _reportable(exc: BaseException) -> GemlineError | KeyboardInterrupt | None:
    """The :class:`GemlineError` or ``KeyboardInterrupt`` that ends the command in one line: ``exc``
    itself, or what a Beam step raised that ``exc`` wraps; None for anything else (a bug: its
    traceback stays).

    Beam re-raises an exception from inside a step (``apache_beam.runners.common.DoFnRunner.
    _reraise_augmented``, Beam 2.77) as its own class with `` [while running 'Step']`` appended or,
    where that class cannot be built from one message (``KeyboardInterrupt()``,
    ``GateClosedError(decision, reader)``), as a ``RuntimeError``; either way it marks the new
    exception ``_tagged_with_step`` and raises it while handling the original, which so becomes its
    ``__context__``. Only that marked link is followed: any error raised while a GemlineError was
    being handled has it as ``__context__`` too, and reporting such an error as the GemlineError
    would hide a bug.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (GemlineError, KeyboardInterrupt)):
            return seen
        if not getattr(seen, "_tagged_with_step", False):
            return None
        seen = seen.__context__
    return None


def _from_worker(exc: BaseException) -> tuple[type[GemlineError], str] | None:
    """The class and message of a :class:`GemlineError` that a Beam worker thread or process raised,
    or None.

    With more than one worker (``--direct_num_workers=N``, ``--direct_running_mode=multi_processing``)
    the FnApiRunner receives a failed bundle as text and raises ``RuntimeError(<the worker's
    traceback>)``: no class, no chain. The traceback's last line is ``<module>.<Class>: <message>``
    of the exception that ended the bundle, or ``RuntimeError: <module>.<Class>: <message>`` where
    Beam could not rebuild the class (see :func:`_reportable`). Only the exact names of GemlineError
    classes count, so an error raised while a worker handled a GemlineError (the last line is then
    that error's) keeps its traceback.
    """
    if type(exc) is not RuntimeError or not exc.args or not isinstance(exc.args[0], str):
        return None
    text = exc.args[0].rstrip()
    if not text.startswith("Traceback (most recent call last):"):
        return None
    name, _, message = text.rpartition("\n")[2].partition(": ")
    if name == "RuntimeError":
        name, _, message = message.partition(": ")
    classes: list[type[GemlineError]] = [GemlineError]
    for cls in classes:
        if f"{cls.__module__}.{cls.__qualname__}" == name:
            return cls, message
        classes.extend(cls.__subclasses__())
    return None


def _interrupted(command: str) -> int:
    if command == "generate":
        # A producer is not a stage: it commits nothing, and a rerun sends its traffic again from the start.
        print(f"\ninterrupted: {command} stopped; the records it sent stay in the topic. Running it again sends the "
              "traffic again from its start: into the same topic, give it a later generate.start_ms (or another "
              "topic), else its events sit behind the first run's and go to late_events", file=sys.stderr)
        return 130
    if command == "replay":
        # A producer too, but of a dataset's own event ids: a rerun sends them again and ingest keeps one copy.
        print(f"\ninterrupted: {command} stopped; the records it sent stay in the topic. Running it again sends the "
              "dataset again from its start: ingest keeps one copy of each event id (a repeat within "
              "ingest.dedup_window_ms of event time is dropped as a duplicate)", file=sys.stderr)
        return 130
    # Every stage commits idempotently, so a rerun finishes an interrupted batch; no traceback.
    print(f"\ninterrupted: {command} stopped; run the same command again to finish "
          "(committed work is kept, a half-done batch is redone, nothing is written twice)", file=sys.stderr)
    return 130


class _DropInterrupts(logging.Filter):
    """Drops a log record about a KeyboardInterrupt or a :class:`GemlineError`: Beam's DoFn runner logs
    the failed step with its whole traceback (``apache_beam.runners.common``) before the exception
    reaches the CLI, which then says in one line what happened and what to do."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) for a record about an exception the CLI reports in one line."""
        exc = record.exc_info[0] if record.exc_info else None
        if exc is not None and issubclass(exc, (KeyboardInterrupt, GemlineError)):
            return False
        return not str(record.msg).startswith("KeyboardInterrupt")


INTERRUPT_LOGGERS = ("apache_beam.runners.common", "apache_beam.runners.worker.sdk_worker",
                     "apache_beam.runners.portability.fn_api_runner.fn_runner")
"""Loggers whose records about a KeyboardInterrupt or a GemlineError the CLI drops (:class:`_DropInterrupts`)."""


def _quiet_interrupts() -> None:
    for name in INTERRUPT_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropInterrupts) for f in logger.filters):
            logger.addFilter(_DropInterrupts())


KNOWN_NOISE: tuple[tuple[str, str], ...] = (
    # torch 2.x tells TorchRec's authors (torchrec.modules.regroup, feature_processor) to call a newer function; once
    # per process, whatever the model does.
    ("torch.fx._symbolic_trace", "is_fx_tracing will return true for both fx.symbolic_trace and torch.export"),
    # GX names the temporary folder of the ephemeral context's docs site (validation.suites), which gemline never
    # builds: its reports are its own HTML. INFO, shown once a Beam worker set the root logger to INFO.
    ("great_expectations.data_context.types.base", "Created temporary directory"),
    # Beam's optional BigQuery client, which no gemline pipeline uses, is missing a dependency.
    ("root", "apitools not found, and bigquery client libraries are not available"),
)
"""(logger name, start of message) of the log lines every command would print to no purpose: each is dropped at its
logger (:class:`_DropNoise`), so another message of the same logger still shows."""


class _DropNoise(logging.Filter):
    """Drops the records of one logger whose message starts with ``prefix`` (:data:`KNOWN_NOISE`)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) for a record whose unformatted message starts with ``prefix``."""
        return not str(record.msg).startswith(self.prefix)


def _quiet_known_noise() -> None:
    for name, prefix in KNOWN_NOISE:
        logger = logging.getLogger(None if name == "root" else name)
        if not any(isinstance(f, _DropNoise) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropNoise(prefix))


def _sigterm_as_interrupt() -> None:
    """SIGTERM (a service manager or ``kill``) stops a command as Ctrl-C does: one line, exit 130,
    committed work kept. ``ingest --streaming`` installs its own handlers over this one.

    Ctrl-C (SIGINT) goes through the same handler unless it is ignored (a background job keeps ignoring it):
    Python's own handler sets a KeyboardInterrupt without an instance, and on Python 3.11 confluent-kafka 2.16
    keeps only the instance of an exception raised in a delivery callback (``cfl_exception_fetch``), so a Ctrl-C
    landing there came out of ``Producer.flush`` as "SystemError: ... returned NULL without setting an exception"
    instead of an interrupt (`gemline generate`)."""
    import signal
    import threading

    def _raise(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _raise)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gemline` console script; returns the process exit code.

    A :class:`~gemline.errors.GemlineError`, raised by the command or inside one of its Beam steps,
    ends it with one line, ``error: <message>``, on stderr and returns the error's ``exit_code``;
    Ctrl-C or SIGTERM ends it with one line and 130. Any other exception is a bug and propagates
    with its traceback (the console script then exits 1): it is never shortened to one line.
    Flags argparse rejects exit 2 with its usage message, as always.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not args.passthrough:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "nproc", 1) < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    _sigterm_as_interrupt()
    # A stage of `gemline run`: stop with the supervisor, however it dies (gemline.supervisor). Popped, so a process
    # this one starts (a torchrun rank) does not take the number for a descriptor it never inherited.
    lifeline = os.environ.pop(SUPERVISOR_FD_ENV, None)
    if lifeline is not None and lifeline.isdigit():
        watch_lifeline(int(lifeline))
    _quiet_interrupts()
    _quiet_known_noise()
    try:
        return args.func(args, extra)
    except (Exception, KeyboardInterrupt) as exc:
        reported = _reportable(exc)
        if isinstance(reported, KeyboardInterrupt):
            return _interrupted(args.command)
        # Bad input, a missing table, an unreachable broker, a busy lake, a refused version...: the
        # message says what to do; a traceback would add nothing.
        if reported is not None:
            print(f"error: {reported}", file=sys.stderr)
            return reported.exit_code
        remote = _from_worker(exc)
        if remote is None:
            raise
        print(f"error: {remote[1]}", file=sys.stderr)
        return remote[0].exit_code


def entry() -> None:
    """The ``gemline`` console script: :func:`main`, then the exit without native teardown
    (:mod:`gemline.process`: the deltalake/pyarrow abort at exit would turn a finished run into exit 134)."""
    run_and_exit(main)


if __name__ == "__main__":
    entry()
