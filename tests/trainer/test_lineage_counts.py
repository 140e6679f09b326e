"""The lineage counts examples (impressions, each once), those with final labels, and corrections apart."""

from __future__ import annotations

import pyarrow as pa

from gemline.config import load_config
from tests.conftest import trainer_args
from trainer.continuous import lineage, run_once

from .conftest import mark_quality, synthetic_examples, write_examples
from .test_continuous import SMALL
from .test_delayed import _early_columns, click_corrections

OPEN = 30
"""Rows of examples@0 whose attribution window was still open when it was built (``build --final``)."""
EARLY = 20
"""Rows of examples@0 published early (``build.label_mode=defer``) with an open click window."""


def _lake(tmp_path):
    """examples@0: 200 impressions, the first OPEN with open windows, the next EARLY published early with an open
    click window, the rest final; examples@1: only corrections (late clicks) of examples@0's clicked rows.
    Returns the lake and the number of corrections."""
    lake = tmp_path / "lake"
    base = synthetic_examples(["2026-01-01"], 200, seed=1)
    n = base.num_rows
    early = [OPEN <= i < OPEN + EARLY for i in range(n)]
    first = _early_columns(
        base.set_column(base.schema.get_field_index("label_window_closed"), "label_window_closed",
                        pa.array([i >= OPEN for i in range(n)])),
        label_mode=["defer" if e else "wait" for e in early], click_open=early, conversion_open=[False] * n)
    corrections, ids = click_corrections(first)
    for table in (first, corrections):
        mark_quality(lake, write_examples(lake, table), passed=True)
    return lake, len(ids)


def test_lineage_counts_examples_final_labels_and_corrections_apart(tmp_path, capsys):
    from gemline.cli import main

    lake, num_corrections = _lake(tmp_path)
    assert num_corrections > 20
    run_once(*trainer_args(load_config(overrides={"lake": str(lake), **SMALL})))
    records = lineage(trainer_args(load_config(overrides={"lake": str(lake), **SMALL}))[0])["examples_versions"]
    keys = ("version", "rows_trained", "examples", "examples_final", "corrections")
    assert [tuple(r[k] for k in keys) for r in records] == [
        (0, 200, 200, 200 - OPEN - EARLY, 0), (1, num_corrections, 0, 0, num_corrections)]
    assert all(r["rows_trained"] == r["examples"] + r["corrections"] for r in records)

    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]
    assert main(["lineage", "--lake", str(lake), *sets]) == 0
    lines = capsys.readouterr().out.splitlines()
    total = 200 + num_corrections
    assert lines[0].endswith(f", {total} rows trained (200 examples, {200 - OPEN - EARLY} with final labels; "
                             f"{num_corrections} corrections)")
    assert lines[1].startswith(f"  examples@0: passed, 200 rows (200 examples, {200 - OPEN - EARLY} with final labels; "
                               "0 corrections); ")
    assert lines[2].startswith(f"  examples@1: passed, {num_corrections} rows (0 examples, 0 with final labels; "
                               f"{num_corrections} corrections); ")
