"""Compare GEM and the baselines: on the progressive protocol over every examples version (default), or on
one version's held-out last day (``--version V`` / ``--holdout-last-day``).

**Progressive** (:func:`run_compare`, ``gemline compare [--models gem,dlrm,lr]``): every model goes through the
continuous trainer (:func:`trainer.continuous.run_once`, a new run per model, its checkpoints under
``LAKE/_runs/<run_id>/<model>/``, so the lake's own continuous run is untouched), which before training on each
examples version evaluates the current model on that version's rows (train on t, evaluate on t+1). Every model
sees the same versions in the same order with the same settings; only ``trainer.model`` differs. Each
evaluation is a row of ``training_metrics`` under that model's run id, as for any continuous run.

Per model and task (click, conversion; labels exist for both on every row, but a version without a positive
has no AUC or NE and is left out of that task's means), the report gives the **row-weighted mean over
versions** of the progressive AUC and NE, ``sum_v n_v m_v / sum_v n_v`` (n_v: rows version v added; the
first version is never evaluated: there is no model before it), and a 95% **paired bootstrap interval** of
the first model's mean minus each other model's (GEM - DLRM, GEM - LR by default), over the evaluated rows:
every resample draws row indices with replacement within each version, the same indices for all models
(:mod:`trainer.bootstrap`; Efron & Tibshirani, "An Introduction to the Bootstrap", 1993, ch. 6 and 13). An
interval that excludes 0 says the lead is larger than what resampling the evaluated rows explains (it does
not cover retraining noise: one seed per model). With ``--seeds 0,1,2`` every model is trained once per seed,
the means are over seeds, and each resample also draws the seeds with replacement (the pigeonhole bootstrap of
:func:`trainer.bootstrap.seeded_difference_interval`), so the interval covers training noise as well; the
per-seed values are reported beside it.

Writes ``LAKE/_runs/<run_id>/compare.json`` (every number, per version too), ``compare.md`` (the tables) and
``compare.png`` (progressive AUC per version, one line per model).

**Held-out last day** (:func:`run_holdout_compare`): each model is trained with
:func:`trainer.train.run_training` on one version's days but the last and evaluated on the last; the report
has AUC, NE and calibration per task overall and per domain. Each run leaves its checkpoint under
``LAKE/_checkpoints`` as usual. One day is a small test set (536 examples on MovieLens-100K, 76 clicks on the
Taobao sample): too few to tell these models apart, hence the progressive default.

**Ablations** (``gemline compare --ablate collisions,sequence_len``): besides the models, the first model (the
full one: the config as given) is run again once per named ablation with that ablation's config overrides
(:data:`ABLATIONS`: one change switched off, everything else, seeds included, the same), as
``<model>-no-<ablation>``; the report gives the full model minus each ablated run with the same paired bootstrap
interval. An ablation that would not change the config (its change is already off) is refused. ``--json``
prints :func:`compare_json`.

Metrics are those of trainer/metrics.py: AUC, NE (He et al. 2014, §2) and calibration
(sum of predictions / sum of labels).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np

from gemline.configtree import build, config_overrides, set_dotted
from gemline.errors import BadConfigError
from gemline.lake import Lake
from gemline.plots import png_bytes, subplots
from trainer.config import ModelName, TrainerConfig
from trainer.data import latest_examples_version
from trainer.metrics import TASKS, nan_to_none

log = logging.getLogger(__name__)

MODELS: tuple[str, ...] = ("gem", "dlrm", "lr")
"""Models compared by default."""

ABLATIONS: dict[str, dict[str, str]] = {
    "collisions": {"trainer.ids.mapping": "hash"},
    "sequence_len": {"trainer.gem.max_sequence_len": "32"},
    "time_delta_buckets": {"trainer.gem.time_delta_buckets": "0"},
    "same_domain_stream": {"trainer.gem.same_domain_stream": "false"},
    "recency_branches": {"trainer.gem.recency_branches": "", "trainer.gem.same_domain_stream": "false"},
    "interformer_cross": {"trainer.gem.interformer_cross": "false"},
    "personalized_ffn": {"trainer.gem.personalized_ffn_rank": "0"},
    "fmb_mlp_layers": {"trainer.gem.fmb_mlp_layers": "1"},
    "task_towers": {"trainer.gem.task_towers": "false"},
    "pooled_history": {"trainer.gem.pooled_history": "false"},
    "gem_learning_rate": {"trainer.gem.learning_rate": "none"},
    "final_labels": {"trainer.final_labels": "false"},
    "widths": {"trainer.ids.widths": "fixed"},
    "wide": {"trainer.gem.wide": "false", "trainer.gem.deep_gate": "false", "trainer.gem.wide_loss": "joint"},
    "deep_gate": {"trainer.gem.deep_gate": "false"},
    "wide_loss": {"trainer.gem.wide_loss": "joint"},
    "target_match": {"trainer.gem.target_match": "false"},
}
"""Ablation name -> ``--set`` overrides (full keys, string values as on the command line) that switch one change of
the full model off (issue 18's switches at their gem_small values; ``recency_branches`` off is gem_small's pyramid,
which reads one stream; ``widths`` off: every table trainer.embedding_dim wide; ``pooled_history`` off: no whole-history
means; ``gem_learning_rate`` off: GEM's dense part at ``trainer.learning_rate`` as the other models; ``wide`` off: no
Wide & Deep linear term, so no deep gate and no wide loss of its own either (they need one); ``deep_gate`` off: the
deep logits added ungated; ``wide_loss`` off: the wide part trained jointly with the deep part, on the summed logits; ``target_match`` off: no
target-match counts of the candidate in the history)."""


def ablated_config(tc: TrainerConfig, name: str) -> TrainerConfig:
    """``tc`` with ablation ``name``'s overrides (:data:`ABLATIONS`) applied, rebuilt and checked as a config file is.

    Raises:
        gemline.errors.BadConfigError: an unknown name (the known ones listed), an override the config does not
            know, or an ablation that leaves ``tc`` unchanged (its change is already off in this config).
    """
    if name not in ABLATIONS:
        raise BadConfigError(f"unknown ablation {name!r}; known: {', '.join(sorted(ABLATIONS))}")
    tree: dict[str, Any] = {}
    for flag in config_overrides(tc):
        key, _, value = flag.partition("=")
        set_dotted(tree, key, value)
    for key, value in ABLATIONS[name].items():
        if not key.startswith("trainer."):
            raise BadConfigError(f"ablation {name!r}: {key!r} is not a trainer.* key; compare varies the trainer only")
        set_dotted(tree, key.removeprefix("trainer."), value)
    ablated = build(TrainerConfig, tree, "trainer.")
    # Resolved: a switch set by hand to its preset's value (time_delta_buckets=0 on gem_small) changes nothing either.
    if replace(ablated, gem=ablated.gem.resolved()) == replace(tc, gem=tc.gem.resolved()):
        sets = ", ".join(f"{k}={v}" for k, v in ABLATIONS[name].items())
        raise BadConfigError(f"ablation {name!r} ({sets}) changes nothing: this config has it already; switch the "
                             "change on in the config (the full model) to measure what it brings")
    return ablated


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
    models = list(dict.fromkeys(r["model"] for r in rows))
    groups = list(dict.fromkeys((r["task"], r["domain"]) for r in rows))
    fig, ax = subplots(figsize=(max(6, 1.1 * len(groups)), 4))
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
    return png_bytes(fig, dpi=100)


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


def _trainer_configs(tc: TrainerConfig, models: tuple[str, ...], ablations: tuple[str, ...] = ()) -> dict[str, TrainerConfig]:
    """``{model: tc with trainer.model = model}`` (from scratch), then ``{<first model>-no-<ablation>: its
    ablated config}`` (:func:`ablated_config`), checked before any training."""
    if len(set(ablations)) != len(ablations):
        raise BadConfigError(f"ablations must not repeat a name, got {','.join(ablations)}")
    if not models:
        raise BadConfigError("models must name at least one of gem, dlrm, lr, ranker")
    if len(set(models)) != len(models):
        raise BadConfigError(f"models must not repeat a name, got {','.join(models)}")
    if tc.init_from != "scratch":
        log.warning("trainer.init_from=%r is overridden at run time: using 'scratch' (compare trains every model "
                    "from fresh parameters, so none starts from another's checkpoint)", tc.init_from)
    # A name is any str here: TrainerConfig.__post_init__ (run by replace) rejects an unknown one.
    configs = {m: replace(tc, model=cast(ModelName, m), init_from="scratch") for m in models}
    full = configs[models[0]]
    configs.update({f"{models[0]}-no-{name}": ablated_config(full, name) for name in ablations})
    return configs


def run_holdout_compare(
    lake: Lake, tc: TrainerConfig, *, examples_version: int | None = None, models: tuple[str, ...] = MODELS,
    run_id: str | None = None, progress: bool = True,
) -> CompareResult:
    """Train every model of ``models`` on ``examples@examples_version`` (latest when None), evaluate each on
    its last day and write the report (module docstring, "Held-out last day") under ``LAKE/_runs`` (a local lake).

    Args:
        lake: the lake whose examples are trained on.
        tc: the trainer section; only ``model`` is changed per run (``init_from`` is forced to "scratch" so no
            model starts from another's checkpoint).
        examples_version: Delta version of ``examples``.
        models: names accepted by ``trainer.model``.
        run_id: report directory under ``LAKE/_runs``; None: ``compare-<UTC time>``.
        progress: show tqdm bars.

    Raises:
        ValueError: an empty or unknown model name (before any training).
        trainer.train.QuarantinedError, FileNotFoundError: as run_training.
    """
    from trainer.train import run_training

    trainer_configs = _trainer_configs(tc, models)
    version = latest_examples_version(lake) if examples_version is None else examples_version
    run_id = run_id or time.strftime("compare-%Y%m%dT%H%M%SZ", time.gmtime())
    metrics: dict[str, dict] = {}
    summary: dict[str, Any] = {"run_id": run_id, "examples_version": version, "models": {}}
    for model, model_tc in trainer_configs.items():
        log.info("compare: training %s on examples@%d", model, version)
        started = time.perf_counter()
        result = run_training(model_tc, lake, examples_version=version, progress=progress)
        metrics[model] = result.metrics
        summary["eval_date"] = result.eval_date
        summary["models"][model] = {
            "train_examples": result.train_examples, "eval_examples": result.eval_examples, "steps": result.steps,
            "train_seconds": round(time.perf_counter() - started, 1), "checkpoint_path": result.checkpoint_path,
        }
    rows = comparison_rows(metrics)
    paths = write_report(Path(lake.root) / "_runs" / run_id, summary, rows)
    return CompareResult(run_id=run_id, examples_version=version, eval_date=summary["eval_date"], rows=rows, paths=paths)


@dataclass(frozen=True)
class ProgressiveCompareResult:
    """What :func:`run_compare` compared and where the report is.

    Attributes:
        run_id: directory name under ``LAKE/_runs`` (``compare-<UTC time>`` unless given).
        versions: the examples versions every model was evaluated on (before training on them).
        rows: one dict per (model, task): ``auc`` and ``ne`` (row-weighted means over versions, None when no
            version defines them), ``versions`` (how many define the AUC), ``rows`` (their rows),
            ``continuous_run_id`` (the model's run in ``training_metrics``).
        differences: one dict per (other model, task): ``a``, ``b`` (first model, other), ``task``, and per
            metric ``auc`` / ``ne`` a :class:`trainer.bootstrap.BootstrapInterval` as a dict.
        paths: {"json", "md", "png", "summary"} -> file path (summary: :func:`compare_json`).
    """

    run_id: str
    versions: list[int]
    rows: list[dict]
    differences: list[dict]
    paths: dict[str, str]


def row_weighted_mean(values: Sequence[float | None], weights: Sequence[int]) -> float | None:
    """``sum w_i v_i / sum w_i`` over the entries whose value is defined (not None or NaN); None when none is."""
    pairs = [(v, w) for v, w in zip(values, weights, strict=True) if v is not None and not math.isnan(v)]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if pairs and total > 0 else None


def _final_rows(predictions: Any, task: int) -> np.ndarray:
    """(N,) bool: the rows of ``predictions`` (a ProgressivePredictions) whose label of task ``task`` is final."""
    final = getattr(predictions, "final", None)
    return np.ones(len(predictions.labels), dtype=bool) if final is None else np.asarray(final[:, task], dtype=bool)


def progressive_summary(predictions: dict[str, dict[int, Any]], *, resamples: int = 1000, seed: int = 0,
                        confidence: float = 0.95) -> tuple[list[int], list[dict], list[dict], dict]:
    """Per-model means and paired bootstrap intervals of progressive predictions of one training seed (module
    docstring): :func:`seeded_summary` of that one seed, without its per-seed lists.

    Args:
        predictions: model -> examples version -> :class:`trainer.continuous.ProgressivePredictions`; the first
            model is the one the others are subtracted from.
        resamples, seed, confidence: of the bootstrap (:mod:`trainer.bootstrap`).

    Returns:
        (versions, rows, differences, per_version) as in :class:`ProgressiveCompareResult`;
        per_version: ``{model: {task: [{"examples_version", "rows", "auc", "ne"}]}}``.

    Raises:
        ValueError: no model, or the models were not evaluated on the same rows of a version (their labels differ).
    """
    return seeded_summary({0: predictions}, resamples=resamples, seed=seed, confidence=confidence, per_seed=False)


def _check_same_rows(by_seed: Mapping[int, Mapping[str, Mapping[int, Any]]], versions: list[int]) -> None:
    """ValueError unless every run of ``by_seed`` scored the same rows (labels) of every version in ``versions``."""
    first_seed = next(iter(by_seed))
    first = next(iter(by_seed[first_seed]))
    for v in versions:
        reference = by_seed[first_seed][first][v].labels
        for s, predictions in by_seed.items():
            for model, runs in predictions.items():
                if not np.array_equal(runs[v].labels, reference):
                    raise ValueError(f"compare: {model} (seed {s}) and {first} (seed {first_seed}) were evaluated on "
                                     f"different rows of examples@{v} ({len(runs[v].labels)} and {len(reference)} "
                                     "rows); the paired bootstrap needs the same rows in the same order")


def _seed_mean(values: Sequence[float | None]) -> float | None:
    """The mean of the defined (not None or NaN) values; None when none is."""
    defined = [v for v in values if v is not None and not math.isnan(v)]
    return sum(defined) / len(defined) if defined else None


def seeded_summary(by_seed: Mapping[int, Mapping[str, Mapping[int, Any]]], *, resamples: int = 1000, seed: int = 0,
                   confidence: float = 0.95, per_seed: bool = True) -> tuple[list[int], list[dict], list[dict], dict]:
    """Per-model means over training seeds and pigeonhole-bootstrap intervals of progressive predictions.

    Each model's ``auc`` / ``ne`` is the mean over seeds of its row-weighted mean over versions; each difference is
    the mean over seeds of the per-seed difference, with the interval of
    :func:`trainer.bootstrap.seeded_difference_interval` (rows and seeds resampled; with one seed the paired
    interval of the module docstring, draw for draw).

    Args:
        by_seed: training seed -> model -> examples version -> :class:`trainer.continuous.ProgressivePredictions`;
            every seed has the same models, the first is the one the others are subtracted from.
        resamples, seed, confidence: of the bootstrap.
        per_seed: add ``per_seed_auc`` / ``per_seed_ne`` (rows, per_version) and ``per_seed`` (each interval's
            per-seed differences) in seed order.

    Returns:
        (versions, rows, differences, per_version) as :func:`progressive_summary`; versions every run evaluated.

    Raises:
        ValueError: no seed or model, seeds with different models, or runs evaluated on different rows.
    """
    from trainer.bootstrap import bootstrap_means, seeded_difference_interval
    from trainer.metrics import auc, normalized_entropy

    seeds = list(by_seed)
    models = list(by_seed[seeds[0]]) if seeds else []
    if not models:
        raise ValueError("compare: expected the predictions of at least one model, got none")
    if any(list(by_seed[s]) != models for s in seeds):
        raise ValueError(f"compare: every seed needs the same models, got {({s: list(p) for s, p in by_seed.items()})}")
    runs = {(m, s): by_seed[s][m] for s in seeds for m in models}
    versions = sorted(set.intersection(*(set(p) for p in runs.values())))
    for (model, s), p in runs.items():
        extra = sorted(set(p) - set(versions))
        if extra:
            log.warning("compare: %s (seed %d) was also evaluated on examples versions %s, which not every run was; "
                        "they are left out", model, s, extra)
    _check_same_rows(by_seed, versions)
    first = models[0]
    key = {run: f"{run[0]}@{run[1]}" for run in runs}
    rows: list[dict] = []
    differences: list[dict] = []
    per_version: dict[str, dict[str, list[dict]]] = {m: {} for m in models}
    for j, task in enumerate(TASKS):
        # Each task judged on its final labels only (trainer.labels); the same rows for every run.
        reference = runs[(first, seeds[0])]
        judged = [_final_rows(reference[v], j) for v in versions]
        labels = [reference[v].labels[keep, j] for v, keep in zip(versions, judged, strict=True)]
        sizes = [len(y) for y in labels]
        scores = {key[run]: [p[v].probs[keep, j] for v, keep in zip(versions, judged, strict=True)]
                  for run, p in runs.items()}
        for model in models:
            aucs = [[auc(y, s) for y, s in zip(labels, scores[key[(model, sd)]], strict=True)] for sd in seeds]
            nes = [[normalized_entropy(y, s) for y, s in zip(labels, scores[key[(model, sd)]], strict=True)] for sd in seeds]
            points = []
            for k, (v, n) in enumerate(zip(versions, sizes, strict=True)):
                point: dict[str, Any] = {"examples_version": v, "rows": n, "auc": _seed_mean([a[k] for a in aucs]),
                         "ne": _seed_mean([e[k] for e in nes])}
                if per_seed:
                    point.update(per_seed_auc=[nan_to_none(a[k]) for a in aucs], per_seed_ne=[nan_to_none(e[k]) for e in nes])
                points.append(point)
            per_version[model][task] = points
            defined = [n for n, a in zip(sizes, aucs[0], strict=True) if not math.isnan(a)]
            seed_aucs = [row_weighted_mean(a, sizes) for a in aucs]
            seed_nes = [row_weighted_mean(e, sizes) for e in nes]
            row: dict[str, Any] = {"model": model, "task": task, "auc": _seed_mean(seed_aucs), "ne": _seed_mean(seed_nes),
                   "versions": len(defined), "rows": sum(defined)}
            if per_seed:
                row.update(seeds=seeds, per_seed_auc=seed_aucs, per_seed_ne=seed_nes)
            rows.append(row)
        intervals: dict[str, dict[str, Any]] = {m: {} for m in models[1:]}
        for metric in ("auc", "ne"):
            if not versions or len(models) < 2:
                break
            estimates, replicates = bootstrap_means(labels, scores, metric=metric, resamples=resamples, seed=seed)
            for model in models[1:]:
                interval = asdict(seeded_difference_interval(
                    estimates, replicates, [key[(first, s)] for s in seeds], [key[(model, s)] for s in seeds],
                    metric=metric, confidence=confidence, seed=seed))
                if not per_seed:
                    del interval["per_seed"]
                intervals[model][metric] = nan_to_none(interval)
        for model in models[1:]:
            if intervals[model]:
                differences.append({"a": first, "b": model, "task": task, **intervals[model]})
    return versions, rows, differences, per_version


def _interval(d: dict | None) -> str:
    if not d or d.get("estimate") is None:
        return "n/a"
    if d.get("low") is None:
        return f"{d['estimate']:+.4f} (no interval)"
    return f"{d['estimate']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"


def progressive_markdown(summary: dict, rows: list[dict], differences: list[dict]) -> str:
    """The report's markdown: a title, the per-model means table and the differences table."""
    versions = summary["versions"]
    span = f"examples@{versions[0]}..{versions[-1]}" if versions else "no examples version"
    lines = [f"# Progressive comparison: {span} ({len(versions)} versions evaluated before training on them)", "",
             "Means over versions weighted by each version's rows.", "",
             "| model | task | mean progressive AUC | mean progressive NE | versions | rows |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['task']} | {_fmt(r['auc'])} | {_fmt(r['ne'])} | {r['versions']} | {r['rows']} |")
    if differences:
        b = summary["bootstrap"]
        seeded = "per_seed" in (differences[0].get("auc") or {})
        lines += ["", f"Paired bootstrap ({b['resamples']} resamples of the evaluated rows within each version, "
                      f"seed {b['seed']}): difference and {round(100 * b['confidence'])}% percentile interval. "
                      "AUC: higher is better; NE: lower is better.", ""]
        if seeded:
            lines += [f"Training seeds {', '.join(map(str, summary['seeds']))}: means over seeds; each resample also "
                      "draws the seeds with replacement (pigeonhole bootstrap, Owen 2007), so the interval covers "
                      "training noise.", "", "| difference | task | AUC | NE | AUC per seed |", "|---|---|---|---|---|"]
        else:
            lines += ["| difference | task | AUC | NE |", "|---|---|---|---|"]
        for d in differences:
            cells = f"| {d['a']} - {d['b']} | {d['task']} | {_interval(d.get('auc'))} | {_interval(d.get('ne'))} |"
            if seeded:
                cells += " " + ", ".join("n/a" if x is None else f"{x:+.4f}" for x in d["auc"]["per_seed"]) + " |"
            lines.append(cells)
    return "\n".join(lines) + "\n"


def progressive_plot_png(per_version: dict[str, dict[str, list[dict]]]) -> bytes:
    """PNG bytes: progressive AUC per examples version, one line per model, one panel per task."""
    fig, axes = subplots(1, len(TASKS), figsize=(10, 3.5), squeeze=False)
    for ax, task in zip(axes[0], TASKS):
        for model, by_task in per_version.items():
            points = [(p["examples_version"], p["auc"]) for p in by_task.get(task, []) if p["auc"] is not None]
            ax.plot([v for v, _ in points], [a for _, a in points], marker="o", label=model)
        ax.axhline(0.5, color="grey", linewidth=0.8)
        ax.set(title=f"{task}", xlabel="examples version (evaluated before training on it)", ylabel="progressive AUC")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return png_bytes(fig, dpi=100)


def _mean_and_interval(interval: dict | None, ci_key: str) -> dict[str, Any]:
    interval = interval or {}
    out = {"mean": interval.get("estimate"), ci_key: [interval.get("low"), interval.get("high")]}
    if "per_seed" in interval:
        out["per_seed"] = interval["per_seed"]
    return out


def compare_json(rows: list[dict], differences: list[dict], *, ablated: Mapping[str, str] | None = None,
                 confidence: float = 0.95) -> dict[str, Any]:
    """What ``gemline compare --json`` prints: the click task at the top, the conversion task beside it.

    ``{"models": {model: {"auc", "ne", "conversion_auc", "conversion_ne"}}, "<a>_minus_<b>_auc": {"mean",
    "ci95": [low, high]}, "<a>_minus_<b>_ne": {...}`` for every other model b, and ``"ablations": {name: {"run",
    "auc": {"mean", "ci95"}, "ne": {...}, "conversion_auc": ..., "conversion_ne": ...}}`` (the full model minus the
    run without that change). Means are row-weighted over versions; intervals paired bootstrap
    (:func:`progressive_summary`); ``ci95`` is named after ``confidence``; None where undefined.

    Args:
        rows, differences: of :func:`progressive_summary`.
        ablated: run name -> ablation name of the ablated runs among the models.
    """
    ablated = dict(ablated or {})
    ci_key = f"ci{round(100 * confidence)}"
    models: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {"models": models}
    for r in rows:
        prefix = "" if r["task"] == TASKS[0] else f"{r['task']}_"
        models.setdefault(r["model"], {}).update({f"{prefix}auc": r["auc"], f"{prefix}ne": r["ne"]})
        if "per_seed_auc" in r:
            models[r["model"]].update({f"per_seed_{prefix}auc": r["per_seed_auc"], f"per_seed_{prefix}ne": r["per_seed_ne"]})
            out["seeds"] = r["seeds"]
    ablations: dict[str, dict[str, Any]] = {}
    for d in differences:
        prefix = "" if d["task"] == TASKS[0] else f"{d['task']}_"
        for metric in ("auc", "ne"):
            value = _mean_and_interval(d.get(metric), ci_key)
            if d["b"] in ablated:
                ablations.setdefault(ablated[d["b"]], {"run": d["b"]})[f"{prefix}{metric}"] = value
            else:
                out[f"{d['a']}_minus_{d['b']}_{prefix}{metric}"] = value
    out["ablations"] = ablations
    return nan_to_none(out)


def run_compare(
    lake: Lake, tc: TrainerConfig, *, models: tuple[str, ...] = MODELS, run_id: str | None = None, resamples: int = 1000,
    seed: int = 0, confidence: float = 0.95, ablations: tuple[str, ...] = (), max_versions: int | None = None,
    seeds: tuple[int, ...] | None = None,
) -> ProgressiveCompareResult:
    """Run every model of ``models`` through the continuous trainer over every gate-allowed examples version and
    write the progressive comparison (module docstring, "Progressive").

    Args:
        lake: the lake whose examples are consumed; its gate decides which versions, as for ``gemline train
            --once``. The report goes to ``LAKE/_runs/<run_id>`` (a local lake).
        tc: the trainer section; only ``model`` changes per run (``init_from`` is forced to "scratch").
        models: names accepted by ``trainer.model``; the first is the one the others are subtracted from.
        run_id: report directory under ``LAKE/_runs``; None: ``compare-<UTC time>``.
        resamples, seed, confidence: of the paired bootstrap.
        ablations: names of :data:`ABLATIONS`; each adds a run of the first model without that change
            (module docstring, "Ablations").
        max_versions: consume only the first this many versions (every model the same ones); None: all.
        seeds: training seeds (``trainer.seed``): every model (and ablation) is trained once per seed, its runs
            under ``LAKE/_runs/<run_id>/<model>/seed-<s>``, and the report is :func:`seeded_summary`'s (means over
            seeds, intervals resampling seeds and rows, the per-seed values); None: one run at ``tc.seed``.

    Raises:
        gemline.errors.BadConfigError: an empty, repeated or unknown model or ablation name, or an ablation that
            changes nothing (before any training).
        ValueError: ``resamples < 1``, ``confidence`` not in (0, 1), ``max_versions < 2`` (nothing to evaluate)
            or an empty or repeated ``seeds`` (before any training).
        gemline.errors.MissingInputError: no ``examples`` table (a FileNotFoundError).
        gemline.locks.LakeBusyError: a continuous trainer runs on this lake (each model's run takes its lock).
    """
    from trainer.continuous import ProgressivePredictions, run_once

    trainer_configs = _trainer_configs(tc, models, ablations)
    if resamples < 1 or not 0 < confidence < 1:
        raise ValueError(f"compare: expected resamples >= 1 and 0 < confidence < 1, got {resamples} and {confidence}")
    if max_versions is not None and max_versions < 2:
        raise ValueError(f"compare: max_versions must be >= 2 (the first version is trained, never evaluated), got {max_versions}")
    run_id = run_id or time.strftime("compare-%Y%m%dT%H%M%SZ", time.gmtime())
    run_dir = Path(lake.root) / "_runs" / run_id
    if seeds is not None and (not seeds or len(set(seeds)) != len(seeds)):
        raise ValueError(f"compare: seeds must be distinct and at least one, got {list(seeds)}")
    by_seed: dict[int, dict[str, dict[int, ProgressivePredictions]]] = {}
    runs: dict[str, dict[str, Any]] = {}
    for s in seeds or (tc.seed,):
        by_seed[s] = {}
        for model, model_tc in trainer_configs.items():
            log.info("compare: %s (seed %d) through the continuous trainer", model, s)
            store: dict[int, ProgressivePredictions] = {}
            by_seed[s][model] = store

            def keep(p: ProgressivePredictions, store: dict[int, ProgressivePredictions] = store) -> None:
                store[p.version] = p

            started = time.perf_counter()
            root = run_dir / model if seeds is None else run_dir / model / f"seed-{s}"
            result = run_once(lake, replace(model_tc, seed=s), from_scratch=True, keep_checkpoints=1,
                              max_versions=max_versions, root=str(root), on_predictions=keep)
            run = {"continuous_run_id": result.run_id, "steps": result.step,
                   "rows_trained": result.rows_trained_total, "seconds": round(time.perf_counter() - started, 1),
                   "checkpoint_path": result.checkpoint_path, "report_path": result.report_path,
                   "waiting_for": result.waiting_for}
            if seeds is None:
                runs[model] = run
            else:
                runs.setdefault(model, {"per_seed": {}})["per_seed"][s] = run
    versions, rows, differences, per_version = seeded_summary(by_seed, resamples=resamples, seed=seed,
                                                              confidence=confidence, per_seed=seeds is not None)
    for r in rows:
        model_runs = runs[r["model"]]
        if seeds is None:
            r["continuous_run_id"] = model_runs["continuous_run_id"]
        else:
            r["continuous_run_ids"] = [model_runs["per_seed"][s]["continuous_run_id"] for s in seeds]
    ablated = {f"{models[0]}-no-{name}": name for name in ablations}
    summary = {"run_id": run_id, "protocol": "progressive", "versions": versions, "models": runs,
               "seeds": list(seeds) if seeds is not None else [tc.seed],
               "ablations": {name: ABLATIONS[name] for name in ablations},
               "bootstrap": {"resamples": resamples, "seed": seed, "confidence": confidence,
                             "method": "paired percentile bootstrap of the row-weighted mean difference, rows "
                                       "resampled within each version (Efron & Tibshirani 1993)" + (
                                           "; mean over seeds, seeds resampled too (pigeonhole bootstrap, Owen "
                                           "2007)" if seeds is not None else "")}}
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": run_dir / "compare.json", "md": run_dir / "compare.md", "png": run_dir / "compare.png",
             "summary": run_dir / "summary.json"}
    paths["json"].write_text(json.dumps(nan_to_none({**summary, "rows": rows, "differences": differences,
                                                     "per_version": per_version}), indent=2))
    paths["summary"].write_text(json.dumps(compare_json(rows, differences, ablated=ablated, confidence=confidence),
                                           indent=2))
    paths["md"].write_text(progressive_markdown(summary, rows, differences))
    paths["png"].write_bytes(progressive_plot_png(per_version))
    return ProgressiveCompareResult(run_id=run_id, versions=versions, rows=rows, differences=differences,
                                    paths={k: str(v) for k, v in paths.items()})
