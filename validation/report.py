"""Per-batch quality reports: ``LAKE/_quality/<table>/<version>/report.json`` and ``report.html``.

The JSON names the table, its Delta version, the verdict (PASSED / QUARANTINED: a critical check
failed), every check with severity, success and observed value, the code version and the source of
the data (the Kafka offset ranges of an ``events`` commit, the ``events_version`` of an
``examples`` build), read from that Delta version's commit metadata.

The HTML page is self-contained (inline CSS, plots as base64 PNG drawn with matplotlib's Agg
backend) and shows the verdict at the top in large text.
"""

from __future__ import annotations

import functools
import html
import json
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

import gemline
from gemline.lake import StorageOptions, is_remote, lake_fs, open_table
from gemline.plots import png_base64, subplots
from gemline.tables import Table
from validation.suites import CheckResult

PASSED = "PASSED"
QUARANTINED = "QUARANTINED"
REPORT_DIR = "_quality"


def verdict(results: Sequence[CheckResult]) -> str:
    """QUARANTINED if any critical check failed, else PASSED (warnings never quarantine)."""
    return QUARANTINED if any(r.severity == "critical" and not r.success for r in results) else PASSED


def report_dir(lake: str | Path, table: str, table_version: int) -> Path:
    """``LAKE/_quality/<table>/<version>/`` (``table`` may contain '/', e.g. ``features/user``)."""
    return Path(lake) / REPORT_DIR / table / str(table_version)


def code_version() -> dict[str, str]:
    """``{"gemline": __version__, "git": HEAD commit or "unknown"}`` of the running code: the checkout's HEAD
    when first asked (once per process: a validator judging version after version runs the code it imported,
    whatever the checkout moves to, and need not start ``git`` per version)."""
    return dict(_code_version())


@functools.cache
def _code_version() -> dict[str, str]:
    repo = Path(gemline.__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10, check=True
        )
        sha = out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        sha = "unknown"
    return {"gemline": gemline.__version__, "git": sha}


def source_metadata(lake: str | Path, table: str, table_version: int, *,
                    storage_options: StorageOptions | None = None) -> dict[str, Any] | None:
    """The gemline custom metadata of the commit that made ``table_version`` (see ``gemline.lake.commit_once``).

    Reads that exact version's log entry (its ``commitInfo``) rather than the app's newest commit, so a
    report on an older version names that version's Kafka offset ranges / ``events_version``; one file,
    where the table's history is one file per commit. Returns None when the commit carries none (a table
    written outside ``commit_once``). A log entry already cleaned up (after a checkpoint) is looked for in
    the history, :func:`source_metadata_from_history`, which answers the same.
    """
    fs, root = lake_fs(lake, storage_options)
    try:
        with fs.open_input_stream(f"{root}/{table}/_delta_log/{table_version:020d}.json") as stream:
            text = stream.read().decode("utf-8")
    except (FileNotFoundError, OSError):
        return source_metadata_from_history(lake, table, table_version, storage_options=storage_options)
    for line in text.splitlines():
        info = json.loads(line).get("commitInfo") if line.strip() else None
        if info is not None:
            raw = info.get("gemline")
            return None if raw is None else json.loads(raw)
    return None


def source_metadata_from_history(lake: str | Path, table: str, table_version: int, *,
                                 storage_options: StorageOptions | None = None) -> dict[str, Any] | None:
    """:func:`source_metadata` from the Delta history (every commit's log entry): its reference twin, and
    its answer when the version's own log entry is gone."""
    dt = open_table(lake, table, storage_options=storage_options)
    if dt is None:
        return None
    # Only the commits from the newest back to table_version: the whole history grows with the run.
    for entry in dt.history(limit=max(dt.version() - table_version + 1, 1)):
        if entry.get("version") == table_version and "gemline" in entry:
            return json.loads(entry["gemline"])
    return None


def build_report(
    *,
    table: str,
    table_version: int,
    num_rows: int,
    results: Sequence[CheckResult],
    run_id: str,
    run_ts_ms: int,
    source: dict[str, Any] | None,
    profile: dict[str, float] | None = None,
    history: Sequence[tuple[int, dict[str, float]]] = (),
) -> dict[str, Any]:
    """The JSON-serialisable report of one validation run (``run_ts_ms``: ms since epoch UTC).

    ``profile`` is the batch's profile and ``history`` the (version, profile) pairs drift compared
    it with (``validation.profiles``), both kept in the report for its drift plot.
    """
    return {
        "table": table,
        "table_version": table_version,
        "verdict": verdict(results),
        "num_rows": num_rows,
        "run_id": run_id,
        "run_ts_ms": run_ts_ms,
        "code_version": code_version(),
        "source": source,
        "profile": dict(profile or {}),
        "history": [{"table_version": v, "profile": p} for v, p in history],
        "expectations": [
            {
                "expectation": r.name,
                "severity": r.severity,
                "success": r.success,
                "observed": r.observed,
                "kind": r.kind,
                "details": r.details,
            }
            for r in results
        ],
    }


# ---------------------------------------------------------------- plots


def plot_seq_length(data: pa.Table) -> str:
    """Histogram of ``seq_length`` as a base64 PNG."""
    fig, ax = subplots()
    ax.hist(data.column("seq_length").drop_null().to_numpy(), bins=30)
    ax.set_xlabel("seq_length (events)")
    ax.set_ylabel("examples")
    return png_base64(fig)


def plot_label_rate(data: pa.Table) -> str:
    """Click rate per domain (mean of ``label_click``) as a base64 PNG bar chart."""
    grouped = data.group_by("domain").aggregate([("label_click", "mean")]).sort_by("domain")
    fig, ax = subplots()
    domains = [str(d) for d in grouped.column("domain").to_pylist()]
    ax.bar(domains, grouped.column("label_click_mean").to_numpy(zero_copy_only=False))
    ax.set_ylabel("click rate")
    return png_base64(fig)


def plot_per_domain_day(data: pa.Table) -> str:
    """Rows per (event_date, domain) as a base64 PNG line chart, one line per domain."""
    grouped = data.group_by(["event_date", "domain"]).aggregate([([], "count_all")]).sort_by("event_date")
    fig, ax = subplots()
    days = sorted(set(grouped.column("event_date").to_pylist()), key=str)
    for domain in sorted(set(grouped.column("domain").to_pylist()), key=str):
        sub = grouped.filter(pc.equal(grouped.column("domain"), domain)) if domain is not None else grouped.filter(
            pc.is_null(grouped.column("domain"))
        )
        counts = dict(zip(sub.column("event_date").to_pylist(), sub.column("count_all").to_pylist()))
        ax.plot([str(d) for d in days], [counts.get(d, 0) for d in days], marker="o", label=str(domain))
    ax.set_ylabel("rows")
    ax.legend(fontsize="small")
    ax.tick_params(axis="x", labelrotation=45)
    return png_base64(fig)


def plot_seq_length_by_domain(data: pa.Table) -> str:
    """p50 and p99 of ``seq_length`` per domain as a base64 PNG grouped bar chart."""
    from validation.profiles import seq_length_by_domain

    stats = seq_length_by_domain(data)
    domains = sorted({k.split(":", 1)[1] for k in stats})
    fig, ax = subplots()
    x = range(len(domains))
    ax.bar([i - 0.2 for i in x], [stats[f"seq_length_p50:{d}"] for d in domains], width=0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [stats[f"seq_length_p99:{d}"] for d in domains], width=0.4, label="p99")
    ax.set_xticks(list(x), domains)
    ax.set_ylabel("seq_length (events)")
    ax.legend(fontsize="small")
    return png_base64(fig)


def plot_distributions(data: pa.Table, max_features: int = 6) -> str:
    """Histograms of the first ``max_features`` numeric feature columns as one base64 PNG."""
    import numpy as np

    from validation.profiles import numeric_features

    names = numeric_features(data.schema)[:max_features]
    if not names:
        raise ValueError("no numeric feature columns")
    fig, axes = subplots(1, len(names), figsize=(2.2 * len(names), 2.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        values = data.column(name).drop_null().to_numpy().astype(np.float64)
        ax.hist(values[np.isfinite(values)], bins=20)
        ax.set_title(name, fontsize="small")
    return png_base64(fig)


def plot_drift(report: dict[str, Any]) -> str:
    """Volume and label rates of the batches drift compared with, then this batch, as a base64 PNG."""
    points = [(str(h["table_version"]), h["profile"]) for h in report.get("history", [])]
    points.append((f'{report["table_version"]} (this)', report.get("profile", {})))
    fig, (left, right) = subplots(1, 2, figsize=(8, 3))
    labels = [p[0] for p in points]
    left.plot(labels, [p[1].get("num_rows", float("nan")) for p in points], marker="o")
    left.set_title("rows per batch", fontsize="small")
    rates = sorted({m for _, prof in points for m in prof if m.startswith("label_rate:")})
    for metric in rates:
        right.plot(labels, [p[1].get(metric, float("nan")) for p in points], marker="o", label=metric[len("label_rate:"):])
    right.set_title("label rates", fontsize="small")
    if rates:
        right.legend(fontsize="x-small")
    return png_base64(fig)


PLOTS: dict[str, dict[str, Callable[[pa.Table], str]]] = {
    Table.EVENTS: {"Events per domain and day": plot_per_domain_day},
    Table.EXAMPLES: {
        "Sequence length": plot_seq_length,
        "Sequence length p50/p99 per domain": plot_seq_length_by_domain,
        "Click rate per domain": plot_label_rate,
        "Examples per domain and day": plot_per_domain_day,
        "Feature distributions": plot_distributions,
    },
    Table.SEQUENCES: {"Sequence length": plot_seq_length},
    Table.FEATURES_USER: {"Feature distributions": plot_distributions},
    Table.FEATURES_ITEM: {"Feature distributions": plot_distributions},
}


def draw_plots(table: str, data: pa.Table, report: dict[str, Any] | None = None) -> dict[str, str]:
    """Title -> base64 PNG, or title -> ``"unavailable: <reason>"`` when a plot cannot be drawn (bad data).

    With ``report`` (which holds the profile history) a drift plot over recent batches comes last.
    """
    out = {}
    for title, fn in PLOTS.get(table, {}).items():
        try:
            out[title] = fn(data) if data.num_rows else "unavailable: empty batch"
        except Exception as exc:  # a broken plot must not hide the verdict
            out[title] = f"unavailable: {type(exc).__name__}: {exc}"
    if report is not None:
        try:
            out["Drift over recent batches"] = plot_drift(report)
        except Exception as exc:
            out["Drift over recent batches"] = f"unavailable: {type(exc).__name__}: {exc}"
    return out


# ---------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
.verdict{font-size:3em;font-weight:bold;padding:.3em .6em;border-radius:.2em;display:inline-block}
.PASSED{background:#d4f4d4;color:#145214}.QUARANTINED{background:#f8d0d0;color:#7a1010}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
tr.fail.critical{background:#fbe3e3}tr.fail.warning{background:#fff4d6}
.meta td:first-child{font-weight:bold}figure{display:inline-block;margin:.5em}
"""


def render_html(report: dict[str, Any], plots: dict[str, str]) -> str:
    """The self-contained HTML page of a report (verdict first, in large text)."""
    e = html.escape
    v = report["verdict"]
    rows = "".join(
        f'<tr class="{"pass" if x["success"] else "fail"} {e(x["severity"])}"><td>{e(x["expectation"])}</td>'
        f'<td>{e(x["severity"])}</td><td>{"pass" if x["success"] else "FAIL"}</td><td>{e(x["observed"])}</td></tr>'
        for x in report["expectations"]
    )
    code = report["code_version"]
    meta = {
        "table": report["table"],
        "Delta version": report["table_version"],
        "rows": report["num_rows"],
        "run": f'{report["run_id"]} at {report["run_ts_ms"]} ms',
        "code": f'gemline {code["gemline"]}, git {code["git"]}',
        "source": json.dumps(report["source"], sort_keys=True) if report["source"] else "not recorded",
    }
    meta_rows = "".join(f"<tr><td>{e(k)}</td><td>{e(str(val))}</td></tr>" for k, val in meta.items())
    figures = "".join(
        f'<figure><figcaption>{e(title)}</figcaption>'
        + (f"<p>{e(png)}</p>" if png.startswith("unavailable") else f'<img alt="{e(title)}" src="data:image/png;base64,{png}">')
        + "</figure>"
        for title, png in plots.items()
    )
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{e(report["table"])}@{report["table_version"]}: {v}</title>'
        f"<style>{_CSS}</style></head><body>"
        f'<div id="verdict" class="verdict {v}">{v}</div>'
        f'<h1>{e(report["table"])} @ version {report["table_version"]}</h1>'
        f'<table class="meta">{meta_rows}</table>'
        f"<h2>Expectations</h2><table><tr><th>expectation</th><th>severity</th><th>result</th><th>observed</th></tr>{rows}</table>"
        f"<h2>Plots</h2>{figures}</body></html>"
    )


NOT_DRAWN = ("unavailable: not drawn for a passed version under `validate --follow` (validation.follow_report_plots); "
             "`gemline validate --table T --version V` draws them")


def write_report(lake: str | Path, report: dict[str, Any], data: pa.Table, *,
                 storage_options: StorageOptions | None = None, plots: bool = True) -> tuple[Path | str, Path | str]:
    """Write ``report.json`` and ``report.html`` (replacing an earlier run's) and return their paths.

    ``plots``: draw the plots of ``data`` into the HTML; False writes the page without them (:data:`NOT_DRAWN`).

    On an object-store lake (``s3://...``) the files go through :func:`gemline.lake.lake_fs` with
    ``storage_options`` and the returned paths are URIs (``str``).
    """
    figures = draw_plots(report["table"], data, report) if plots else {"Plots": NOT_DRAWN}
    if is_remote(lake):
        return _write_remote_report(lake, report, figures, storage_options)
    out = report_dir(lake, report["table"], report["table_version"])
    out.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out / "report.json", out / "report.html"
    # Write to a temporary name then rename, so a reader never sees half a report.
    for path, text in (
        (json_path, json.dumps(report, indent=2, sort_keys=True)),
        (html_path, render_html(report, figures)),
    ):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return json_path, html_path


def _write_remote_report(lake: str | Path, report: dict[str, Any], figures: dict[str, str],
                         storage_options: StorageOptions | None) -> tuple[str, str]:
    """Object-store twin of :func:`write_report`; one PUT per object is atomic, so no rename."""
    fs, root = lake_fs(lake, storage_options)
    rel = f"{REPORT_DIR}/{report['table']}/{report['table_version']}"
    base = f"{str(lake).rstrip('/')}/{rel}"
    for name, text in (
        ("report.json", json.dumps(report, indent=2, sort_keys=True)),
        ("report.html", render_html(report, figures)),
    ):
        with fs.open_output_stream(f"{root}/{rel}/{name}") as out:
            out.write(text.encode("utf-8"))
    return f"{base}/report.json", f"{base}/report.html"
