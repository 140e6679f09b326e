"""Train GEM and the baselines on one ``examples`` version and compare them on its held-out last day.

``gemline compare [--version V] [--models gem,dlrm,lr]`` trains each model with
:func:`trainer.train.run_training` (same split, same normalizer, same seed and optimiser settings;
only ``trainer.model`` differs) and writes ``LAKE/_runs/<run_id>/compare.json`` (every metric),
``compare.md`` (one table) and ``compare.png`` (AUC per task and domain, one bar per model).

Metrics are those of trainer/metrics.py: AUC, NE (He et al. 2014, §2) and calibration
(sum of predictions / sum of labels), per task (click, conversion) overall and per domain.
Each training run also leaves its checkpoint under ``LAKE/_checkpoints`` as usual, so the lake's
latest checkpoint afterwards is the last model compared.
"""

from __future__ import annotations

import io
import json
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from gemline.config import GemlineConfig
from gemline.errors import BadConfigError
from gemline.lake import Lake
from trainer.config import ModelName
from trainer.data import latest_examples_version
from trainer.metrics import TASKS

log = logging.getLogger(__name__)

MODELS: tuple[str, ...] = ("gem", "dlrm", "lr")
"""Models compared by default."""


@dataclass(frozen=True)
class CompareResult:
    """What was compared and where the report is.

    Attributes:
        run_id: directory name under ``LAKE/_runs``.
        examples_version: Delta version of ``examples`` every model trained on.
        eval_date: held-out day (YYYY-MM-DD UTC).
        rows: one dict per (model, task, domain) with auc, ne, calibration, num_examples, base_rate;
            domain "overall" for the whole eval day.
        paths: {"json", "md", "png"} -> file path.
    """

    run_id: str
    examples_version: int
    eval_date: str
    rows: list[dict]
    paths: dict[str, str]


def comparison_rows(metrics_by_model: dict[str, dict]) -> list[dict]:
    """Flatten ``{model: run_training metrics}`` to rows (model, task, domain, auc, ne, calibration, num_examples, base_rate).

    Row order: model order as given, then task (click, conversion), then "overall" and domains sorted.
    """
    rows = []
    for model, metrics in metrics_by_model.items():
        for task in TASKS:
            groups = {"overall": metrics[task]["overall"], **dict(sorted(metrics[task]["by_domain"].items()))}
            for domain, m in groups.items():
                rows.append({"model": model, "task": task, "domain": domain, **{k: m[k] for k in ("auc", "ne", "calibration", "num_examples", "base_rate")}})
    return rows


def _fmt(value: float) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


def markdown_table(rows: list[dict]) -> str:
    """A GitHub markdown table of ``rows`` (see :func:`comparison_rows`); NaN shows as n/a."""
    lines = ["| model | task | domain | AUC | NE | calibration | examples | base rate |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['task']} | {r['domain']} | {_fmt(r['auc'])} | {_fmt(r['ne'])} | "
            f"{_fmt(r['calibration'])} | {r['num_examples']} | {_fmt(r['base_rate'])} |"
        )
    return "\n".join(lines) + "\n"


def auc_plot_png(rows: list[dict]) -> bytes:
    """PNG bytes: grouped bars of AUC per (task, domain), one colour per model; undefined AUCs are left out."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    models = list(dict.fromkeys(r["model"] for r in rows))
    groups = list(dict.fromkeys((r["task"], r["domain"]) for r in rows))
    fig = Figure(figsize=(max(6, 1.1 * len(groups)), 4))
    ax = fig.add_subplot()
    width = 0.8 / max(len(models), 1)
    for i, model in enumerate(models):
        by_group = {(r["task"], r["domain"]): r["auc"] for r in rows if r["model"] == model}
        xs = [g + i * width for g, key in enumerate(groups) if by_group.get(key) is not None and not math.isnan(by_group[key])]
        ys = [by_group[key] for key in groups if by_group.get(key) is not None and not math.isnan(by_group[key])]
        ax.bar(xs, ys, width=width, label=model)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{t}\n{d}" for t, d in groups], fontsize=8)
    ax.set_ylim(0.4, 1.0)
    ax.axhline(0.5, color="grey", linewidth=0.8)
    ax.set_ylabel("AUC on the held-out last day")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def write_report(run_dir: Path, summary: dict, rows: list[dict]) -> dict[str, str]:
    """Write compare.json (``summary`` plus ``rows``), compare.md and compare.png into ``run_dir``; return their paths."""
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": run_dir / "compare.json", "md": run_dir / "compare.md", "png": run_dir / "compare.png"}
    safe = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
    paths["json"].write_text(json.dumps({**summary, "rows": safe}, indent=2))
    header = f"# examples@{summary['examples_version']}, eval day {summary['eval_date']}\n\n"
    paths["md"].write_text(header + markdown_table(rows))
    paths["png"].write_bytes(auc_plot_png(rows))
    return {k: str(v) for k, v in paths.items()}


def run_compare(
    config: GemlineConfig, *, examples_version: int | None = None, models: tuple[str, ...] = MODELS,
    run_id: str | None = None, progress: bool = True,
) -> CompareResult:
    """Train every model of ``models`` on ``examples@examples_version`` (latest when None) and write the report.

    Args:
        config: the whole config; only ``trainer.model`` is changed per run (``trainer.init_from``
            is forced to "scratch" so no model starts from another's checkpoint).
        examples_version: Delta version of ``examples``.
        models: names accepted by ``trainer.model``.
        run_id: report directory under ``LAKE/_runs``; None: ``compare-<UTC time>``.
        progress: show tqdm bars.

    Raises:
        ValueError: an empty or unknown model name (before any training).
        trainer.train.QuarantinedError, FileNotFoundError: as run_training.
    """
    from trainer.train import run_training

    if not models:
        raise BadConfigError("models must name at least one of gem, dlrm, lr, ranker")
    if config.trainer.init_from != "scratch":
        log.warning("trainer.init_from=%r is overridden at run time: using 'scratch' (compare trains every model "
                    "from fresh parameters, so none starts from another's checkpoint)", config.trainer.init_from)
    # A name is any str here: TrainerConfig.__post_init__ (run by replace) rejects an unknown one.
    trainer_configs = {m: replace(config.trainer, model=cast(ModelName, m), init_from="scratch") for m in models}
    version = latest_examples_version(config.lake) if examples_version is None else examples_version
    run_id = run_id or time.strftime("compare-%Y%m%dT%H%M%SZ", time.gmtime())
    metrics: dict[str, dict] = {}
    summary: dict[str, Any] = {"run_id": run_id, "examples_version": version, "models": {}}
    for model, tc in trainer_configs.items():
        log.info("compare: training %s on examples@%d", model, version)
        started = time.perf_counter()
        result = run_training(tc, Lake.for_config(config), examples_version=version, progress=progress)
        metrics[model] = result.metrics
        summary["eval_date"] = result.eval_date
        summary["models"][model] = {
            "train_examples": result.train_examples, "eval_examples": result.eval_examples, "steps": result.steps,
            "train_seconds": round(time.perf_counter() - started, 1), "checkpoint_path": result.checkpoint_path,
        }
    rows = comparison_rows(metrics)
    paths = write_report(Path(config.lake) / "_runs" / run_id, summary, rows)
    return CompareResult(run_id=run_id, examples_version=version, eval_date=summary["eval_date"], rows=rows, paths=paths)
