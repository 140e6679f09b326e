"""One self-contained HTML page per continuous training run: ``LAKE/_runs/<run_id>/report.html``.

It shows what a person checks after a daily run: the progressive AUC and NE per domain over examples
versions (each measured before the model trained on that version, from the ``training_metrics`` table), the
id collisions, table rows and widths per id namespace after the newest version (its ``task = "ids"`` rows:
trainer.id_mapping),
the rows trained per version with its quality verdict (passed, released, quarantined and skipped), the mean
training loss per version, the freshness of the trained rows per version (p50/p95/p99 of impression ->
published -> trained, from the ``freshness`` table: trainer.freshness) and the lineage table. Plots are matplotlib (Agg) PNGs inlined as base64, as
in the data-quality reports (``validation.report``), so the page opens anywhere without a server.

Beside it, ``LAKE/_runs/<run_id>/tensorboard/`` holds the same numbers as TensorBoard scalars
(``torch.utils.tensorboard``; ``tensorboard --logdir LAKE/_runs`` compares runs), rewritten whole after
each run so that a resumed run never doubles a point.
"""

from __future__ import annotations

import html
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.ticker import MaxNLocator

from gemline.lake import Lake, lake_fs, read_table
from gemline.plots import png_base64, subplots
from gemline.tables import Table
from trainer.freshness import HOPS

_COLOURS = {"passed": "#2b8a3e", "released": "#e67700", "quarantined": "#c92a2a"}


def progressive_series(metrics: list[dict[str, Any]], run_id: str, task: str, metric: str) -> dict[str, list[tuple[int, float]]]:
    """``{domain: [(examples_version, value), ...]}`` of one task and metric of a run, versions ascending;
    undefined values (null) are left out."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in metrics:
        if row["run_id"] == run_id and row["task"] == task and row["metric"] == metric and row["value"] is not None:
            out.setdefault(row["domain"], []).append((int(row["examples_version"]), float(row["value"])))
    return {domain: sorted(points) for domain, points in sorted(out.items())}


def _line_plot(series: dict[str, list[tuple[int, float]]], title: str, ylabel: str) -> str:
    fig, ax = subplots(figsize=(6, 3))
    for domain, points in series.items():
        ax.plot([v for v, _ in points], [y for _, y in points], marker="o",
                linewidth=2.5 if domain == "all" else 1, label=domain)
    ax.set(title=title, xlabel="examples version (evaluated before training on it)", ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if series:
        ax.legend(fontsize=7)
    return png_base64(fig)


def _rows_plot(lineage: Sequence[dict[str, Any]]) -> str:
    fig, ax = subplots(figsize=(6, 3))
    ax.bar([r["version"] for r in lineage], [r["rows_trained"] for r in lineage],
           color=[_COLOURS.get(r["quality"], "grey") for r in lineage])
    skipped = [r["version"] for r in lineage if r["quality"] == "quarantined"]
    ax.scatter(skipped, [0] * len(skipped), marker="x", s=80, color=_COLOURS["quarantined"], zorder=3,
               label="quarantined, skipped")
    ax.set(title="rows trained per examples version (orange: released)", xlabel="examples version", ylabel="rows")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if skipped:
        ax.legend(fontsize=7)
    return png_base64(fig)


def _loss_plot(lineage: Sequence[dict[str, Any]]) -> str:
    fig, ax = subplots(figsize=(6, 3))
    points = [(r["version"], r["mean_loss"]) for r in lineage if r.get("mean_loss") is not None]
    ax.plot([v for v, _ in points], [y for _, y in points], marker="o")
    ax.set(title="mean training loss per version (BCE, click + conversion)", xlabel="examples version",
           ylabel="loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return png_base64(fig)


_QUANTILES = (("p50_s", "p50", "-"), ("p95_s", "p95", "--"), ("p99_s", "p99", ":"))


def freshness_series(rows: list[dict[str, Any]], run_id: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{hop: {"p50_s" | "p95_s" | "p99_s": [(examples_version, seconds), ...]}}`` of a run's ``freshness`` rows,
    versions ascending."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for row in rows:
        if row["run_id"] == run_id:
            for column, _, _ in _QUANTILES:
                out.setdefault(row["hop"], {}).setdefault(column, []).append((int(row["examples_version"]), float(row[column])))
    return {hop: {c: sorted(points) for c, points in by_q.items()} for hop, by_q in out.items()}


def _freshness_plot(series: dict[str, dict[str, list[tuple[int, float]]]], hops: Sequence[str]) -> str:
    fig, axes = subplots(1, len(hops), figsize=(12, 3), sharex=True)
    for ax, hop in zip(axes, hops):
        for column, label, style in _QUANTILES:
            points = series.get(hop, {}).get(column, [])
            ax.plot([v for v, _ in points], [y for _, y in points], style, marker="o", markersize=3, label=label)
        ax.set(title=hop, xlabel="examples version", ylabel="seconds")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    return png_base64(fig)


def _loss_text(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def id_collision_rows(metrics: list[dict[str, Any]], run_id: str) -> tuple[int | None, list[dict[str, Any]]]:
    """The run's newest id-mapping counts (``task = "ids"`` rows of ``training_metrics``, trainer.id_mapping):
    ``(examples_version, [{"namespace", <metric>: value, ...}])`` sorted by namespace; ``(None, [])`` without any."""
    rows = [r for r in metrics if r["run_id"] == run_id and r["task"] == "ids"]
    if not rows:
        return None, []
    newest = max(int(r["examples_version"]) for r in rows)
    by_ns: dict[str, dict[str, Any]] = {}
    for r in rows:
        if int(r["examples_version"]) == newest:
            by_ns.setdefault(r["domain"], {"namespace": r["domain"]})[r["metric"]] = r["value"]
    return newest, [by_ns[ns] for ns in sorted(by_ns)]


def _id_table(metrics: list[dict[str, Any]], run_id: str) -> str:
    version, rows = id_collision_rows(metrics, run_id)
    if version is None:
        return "<p>no id-mapping counts recorded for this run</p>"

    def cell(r: dict[str, Any], key: str, share: bool) -> str:
        value = r.get(key)
        return "" if value is None else (f"{100 * value:.2f}%" if share else f"{int(value)}")

    def width(r: dict[str, Any]) -> str:  # 0: every table trainer.embedding_dim wide (trainer.ids.widths=fixed)
        value = r.get("width")
        return "" if value is None else ("D" if not value else f"{int(value)}")

    body = "".join(f"<tr><td>{html.escape(r['namespace'])}</td><td>{cell(r, 'distinct_ids', False)}</td>"
                   f"<td>{cell(r, 'rows', False)}</td><td>{width(r)}</td><td>{cell(r, 'collision_share', True)}</td>"
                   f"<td>{cell(r, 'oov_share', True)}</td></tr>" for r in rows)
    return (f"<p>after training on examples version {version}; shares of the distinct ids seen in training</p>"
            "<table><tr><th>id namespace</th><th>distinct ids</th><th>table rows</th><th>width</th><th>sharing a row</th>"
            f"<th>on the OOV row</th></tr>{body}</table>")


def render_run_report(run_id: str, lineage: Sequence[dict[str, Any]], metrics: list[dict[str, Any]], *,
                      step: int, rows_trained_total: int, checkpoint: str | None,
                      freshness: list[dict[str, Any]] | None = None) -> str:
    """The report page as an HTML string (see the module docstring); ``freshness``: rows of the ``freshness``
    table (none: an empty freshness plot)."""
    images = {
        "progressive click AUC per domain": _line_plot(progressive_series(metrics, run_id, "click", "auc"),
                                                       "click AUC", "AUC"),
        "progressive click NE per domain": _line_plot(progressive_series(metrics, run_id, "click", "ne"),
                                                      "click NE (lower is better)", "NE"),
        "progressive conversion AUC per domain": _line_plot(progressive_series(metrics, run_id, "conversion", "auc"),
                                                            "conversion AUC", "AUC"),
        "rows and verdicts": _rows_plot(lineage),
        "training loss": _loss_plot(lineage),
        "freshness of the trained rows (p50/p95/p99 per hop)": _freshness_plot(
            freshness_series(freshness or [], run_id), HOPS),
    }
    rows = "".join(
        f"<tr><td>{r['version']}</td><td>{r['quality']}</td><td>{r['rows_trained']}</td><td>{r['evaluated']}</td>"
        f"<td>{_loss_text(r.get('mean_loss'))}</td><td>{r.get('step', '')}</td></tr>"
        for r in lineage)
    figures = "".join(f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' src='data:image/png;base64,{png}'>"
                      for title, png in images.items())
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>gemline run "
        f"{html.escape(run_id)}</title><style>body{{font-family:sans-serif;margin:2em}}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px}</style></head><body>"
        f"<h1>continuous run {html.escape(run_id)}</h1><p>step {step}, {rows_trained_total} examples trained, "
        f"checkpoint {html.escape(str(checkpoint))}</p>{figures}<h2>id collisions</h2>{_id_table(metrics, run_id)}"
        "<h2>lineage</h2><table><tr><th>examples version</th>"
        "<th>quality</th><th>rows trained</th><th>evaluated first</th><th>mean loss</th><th>step after</th></tr>"
        f"{rows}</table></body></html>"
    )


TENSORBOARD_FILE = "events.out.tfevents.gemline"
"""The one event file of a run's TensorBoard folder (TensorBoard reads any file whose name holds ``tfevents``)."""


def tensorboard_scalars(run_id: str, lineage: Sequence[dict[str, Any]],
                        metrics: list[dict[str, Any]]) -> list[tuple[str, float, int]]:
    """The run's scalars as ``(tag, value, examples_version)``, the version being TensorBoard's step axis.

    Tags: ``progressive/<task>/<metric>/<domain>`` for every non-null ``training_metrics`` value of the run
    (measured before training on that version), ``train/rows_trained`` and ``train/mean_loss`` per consumed
    version of the lineage (quarantined versions appear with 0 rows and no loss).
    """
    out = [(f"progressive/{r['task']}/{r['metric']}/{r['domain']}", float(r["value"]), int(r["examples_version"]))
           for r in metrics if r["run_id"] == run_id and r["value"] is not None]
    for r in lineage:
        out.append(("train/rows_trained", float(r["rows_trained"]), int(r["version"])))
        if r.get("mean_loss") is not None:
            out.append(("train/mean_loss", float(r["mean_loss"]), int(r["version"])))
    return sorted(out, key=lambda s: (s[2], s[0]))


def write_tensorboard(scalars: Sequence[tuple[str, float, int]]) -> bytes:
    """The bytes of one TensorBoard event file holding ``scalars`` (``(tag, value, step)``), written with
    ``torch.utils.tensorboard.SummaryWriter`` in a temporary folder (it writes local files only; the caller
    puts the bytes on the lake's filesystem)."""
    from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when a report is written

    with tempfile.TemporaryDirectory() as tmp:
        writer = SummaryWriter(log_dir=tmp, filename_suffix=".gemline")
        for tag, value, step in scalars:
            writer.add_scalar(tag, value, global_step=step)
        writer.close()
        (written,) = Path(tmp).glob("*tfevents*")
        return written.read_bytes()


def write_run_report(lake: Lake, run_id: str, *, lineage: Sequence[dict[str, Any]], step: int,
                     rows_trained_total: int, checkpoint: str | None) -> str:
    """Write ``LAKE/_runs/<run_id>/report.html`` and ``LAKE/_runs/<run_id>/tensorboard/`` of ``lake`` (local or
    object-store) and return the page's path.

    Raises:
        OSError: the lake's filesystem refuses a write.
    """
    table = read_table(lake, Table.TRAINING_METRICS)
    metrics = [] if table is None else table.to_pylist()
    fresh = read_table(lake, Table.FRESHNESS)
    page = render_run_report(run_id, lineage, metrics, step=step, rows_trained_total=rows_trained_total,
                             checkpoint=checkpoint, freshness=[] if fresh is None else fresh.to_pylist())
    fs, root = lake_fs(lake)
    folder = f"{root}/_runs/{run_id}"
    fs.create_dir(folder, recursive=True)
    path = f"{folder}/report.html"
    with fs.open_output_stream(path) as out:
        out.write(page.encode())
    events = write_tensorboard(tensorboard_scalars(run_id, lineage, metrics))
    fs.create_dir(f"{folder}/tensorboard", recursive=True)
    with fs.open_output_stream(f"{folder}/tensorboard/{TENSORBOARD_FILE}") as out:
        out.write(events)
    return path
