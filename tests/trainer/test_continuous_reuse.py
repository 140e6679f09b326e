"""A version's reads and encoding, kept from its progressive evaluation for its training
(trainer.continuous.REUSE_MAX_ROWS), give the predictions, metrics, losses and parameters of reading it twice."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

import trainer.continuous as continuous
from gemline.config import load_config
from tests.conftest import trainer_args
from trainer.continuous import run_once
from trainer.data import encode_examples, fit_normalizer, make_batch, take_rows

from .conftest import mark_quality, synthetic_examples, with_build_columns, write_examples
from .test_continuous import SMALL
from .test_delayed import _early_columns, click_corrections

BATCH = 4
"""trainer.batch_size: a read is 64 batches, 256 rows, so examples@2's 300 rows take two reads."""


def _lake(tmp_path):
    """examples@0: 200 impressions, some published early; @1: 100 new impressions and corrections (late clicks) of
    @0's clicked rows, interleaved; @2: 300 impressions (two reads)."""
    lake = tmp_path / "lake"
    base = synthetic_examples(["2026-01-01"], 200, seed=1)
    n = base.num_rows
    first = _early_columns(base, label_mode=["defer" if i % 5 == 0 else "wait" for i in range(n)],
                           click_open=[i % 5 == 0 for i in range(n)], conversion_open=[False] * n)
    corrections, ids = click_corrections(first)
    fresh = _early_columns(synthetic_examples(["2026-01-02"], 100, seed=2), click_open=[False] * 100,
                           conversion_open=[False] * 100)
    # One partition (event_date), so one file: a version's files of several partitions may be read in any order.
    corrections = corrections.set_column(corrections.schema.get_field_index("event_date"), "event_date",
                                         pa.array(["2026-01-02"] * corrections.num_rows))
    mixed = pa.concat_tables([fresh, corrections.cast(fresh.schema)])
    mixed = mixed.take(np.random.default_rng(0).permutation(mixed.num_rows))
    third = synthetic_examples(["2026-01-03"], 300, seed=3)
    third = _early_columns(third, click_open=[False] * third.num_rows, conversion_open=[False] * third.num_rows)
    for table in (first, mixed, third):
        mark_quality(lake, write_examples(lake, table), passed=True)
    return lake, len(ids)


def _count_calls(monkeypatch, name: str) -> list[int]:
    """Wrap ``trainer.continuous.<name>`` so each call adds one to the returned one-item counter."""
    calls = [0]
    wrapped = getattr(continuous, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return wrapped(*args, **kwargs)

    monkeypatch.setattr(continuous, name, counted)
    return calls


def _run(tmp_path, monkeypatch, name: str, max_rows: int) -> dict:
    lake, corrections = _lake(tmp_path / name)
    monkeypatch.setattr(continuous, "REUSE_MAX_ROWS", max_rows)
    monkeypatch.setattr(continuous, "READ_ROWS", BATCH * 64)  # reads of 256 rows, so @2 takes two
    encodes = _count_calls(monkeypatch, "encode_for")
    seen = []
    config = load_config(overrides={"lake": str(lake), **SMALL, "trainer.batch_size": str(BATCH)})
    result = run_once(*trainer_args(config), on_predictions=seen.append)
    params = torch.load(f"{result.checkpoint_path}/state.pt", weights_only=True)["model"]
    return {"result": result, "seen": seen, "params": params, "encodes": encodes[0], "corrections": corrections}


def test_kept_reads_train_and_evaluate_as_reading_twice(tmp_path, monkeypatch):
    twice = _run(tmp_path, monkeypatch, "twice", 0)
    kept = _run(tmp_path, monkeypatch, "kept", 1_000_000)
    partly = _run(tmp_path, monkeypatch, "partly", 260)  # @2's second read passes the limit: read twice
    # Encodings: the bootstrap sample and @0 (2), then @1's one read and @2's two: kept, once each; partly, @2's first
    # read once, then its second for evaluation and both for training; twice, each read for both.
    assert (kept["encodes"], partly["encodes"], twice["encodes"]) == (2 + 1 + 2, 2 + 1 + 1 + 1 + 2, 2 + 2 + 4)
    assert twice["corrections"] > 10
    for other in (kept, partly):
        assert [v["version"] for v in other["result"].versions] == [0, 1, 2]
        assert other["result"].versions == twice["result"].versions  # rows, corrections, mean losses, steps
        assert other["result"].progressive == twice["result"].progressive
        assert [p.version for p in other["seen"]] == [1, 2]
        for got, want in zip(other["seen"], twice["seen"], strict=True):
            assert len(got.probs) == (100 if got.version == 1 else 300)  # corrections are not evaluated
            assert np.array_equal(got.probs, want.probs) and np.array_equal(got.labels, want.labels)
            assert list(got.example_ids) == list(want.example_ids) and list(got.domains) == list(want.domains)
            assert np.array_equal(got.final, want.final)
        assert other["params"].keys() == twice["params"].keys()
        assert all(torch.equal(other["params"][k], twice["params"][k]) for k in twice["params"])


@pytest.mark.parametrize("rows", [[3, 0, 7, 7, 1], [], [5]], ids=["shuffled-repeated", "none", "one"])
def test_take_rows_equals_encoding_those_rows(rows):
    """take_rows of an encoded table is the encoding of those rows of the table (fat layout with the sequence
    extras: history, time buckets and the same-domain stream at their own offsets)."""
    table = with_build_columns(synthetic_examples(["2026-01-01"], 10, seed=4))
    table = _early_columns(table, label_mode=["defer" if i % 2 else "wait" for i in range(table.num_rows)],
                           click_open=[i % 3 == 0 for i in range(table.num_rows)],
                           conversion_open=[False] * table.num_rows)
    normalizer = fit_normalizer(table)
    index = np.asarray(rows, dtype=np.int64)
    whole = encode_examples(table, 1_000, normalizer, sequence_extras=True, final_labels=True)
    got = take_rows(whole, index)
    want = encode_examples(table.take(index), 1_000, normalizer, sequence_extras=True, final_labels=True)
    assert len(got) == len(rows)
    if rows:
        a, b = (make_batch(d, np.arange(len(d))) for d in (got, want))
        for key in a.sequence.keys():
            assert torch.equal(a.sequence[key].values(), b.sequence[key].values()), key
            assert torch.equal(a.sequence[key].lengths(), b.sequence[key].lengths()), key
        assert torch.equal(a.sparse.values(), b.sparse.values()) and torch.equal(a.dense, b.dense)
        assert torch.equal(a.labels, b.labels) and a.domains == b.domains and torch.equal(a.final, b.final)
        for field in ("scheme", "mask", "biased", "share"):
            assert np.array_equal(getattr(got.delayed, field), getattr(want.delayed, field)), field
        assert np.array_equal(got.same_domain_offsets, want.same_domain_offsets)
    assert np.array_equal(got.seq_offsets, want.seq_offsets)  # [0] for no rows


def test_a_warm_engine_resumes_as_loading_its_checkpoint(tmp_path, monkeypatch):
    """Calls of one process keeping its engine (WarmEngine, as train --follow does) write the checkpoints and metrics
    of calls that each build the model and load the checkpoint; the engine is built again only after a call that
    raised or a checkpoint another process wrote."""
    built = _count_calls(monkeypatch, "local_engine")
    runs = {}
    for name, warm in (("cold", None), ("warm", continuous.WarmEngine())):
        lake = tmp_path / name / "lake"
        config = load_config(overrides={"lake": str(lake), **SMALL, "trainer.batch_size": "16"})
        args = trainer_args(config)
        built[0] = 0
        results, progressive, builds = [], [], []

        def call(warm=warm, fail: bool = False):
            def crash(_):
                raise RuntimeError("crash after the version's predictions")

            try:
                out = run_once(*args, warm=warm, on_predictions=crash if fail else None)
            except RuntimeError:
                builds.append(built[0])
                return
            results.append(out.versions)
            progressive.append(out.progressive)
            builds.append(built[0])

        for day in (1, 2, 3):
            _add_day(lake, day)
            call()
        _add_day(lake, 4)
        call(fail=True)  # raised mid-call: the engine it held had moved on, so the next call loads
        call()
        _add_day(lake, 5)
        call(warm=None)  # another process's call writes the newest checkpoint
        _add_day(lake, 6)
        call()
        runs[name] = {"versions": results, "progressive": progressive, "builds": builds,
                      "params": _params(results and continuous.latest_checkpoint(continuous.current_root(str(lake))))}
    cold, warm_run = runs["cold"], runs["warm"]
    assert cold["builds"] == [1, 2, 3, 4, 5, 6, 7]  # every call builds
    assert warm_run["builds"] == [1, 1, 1, 1, 2, 3, 4]  # first, after the crash, the foreign call, after it
    assert [[v["version"] for v in vs] for vs in warm_run["versions"]] == [[0], [1], [2], [3], [4], [5]]
    assert warm_run["versions"] == cold["versions"] and warm_run["progressive"] == cold["progressive"]
    assert warm_run["params"].keys() == cold["params"].keys()
    assert all(torch.equal(warm_run["params"][k], cold["params"][k]) for k in cold["params"])


def _add_day(lake, day: int) -> None:
    mark_quality(lake, write_examples(lake, synthetic_examples([f"2026-01-{day:02d}"], 120, seed=day)), passed=True)


def _params(path) -> dict[str, torch.Tensor]:
    return torch.load(f"{path}/state.pt", weights_only=True)["model"]


def test_a_versions_files_are_read_together_up_to_read_rows(tmp_path, monkeypatch):
    """Training shuffles within a read, so a read gathers an early-published version's files (the build writes one
    file per event date, corrections of older dates apart from the newest first publications): one read by default; split at READ_ROWS, the cursor
    after the first read resumes at the next file, and every row is read once. A wait version's files are read one
    by one, in log order."""
    from deltalake import DeltaTable

    from gemline.increments import Cursor
    from gemline.lake import Lake

    lake = tmp_path / "lake"
    table = synthetic_examples(["2026-01-01", "2026-01-02", "2026-01-03"], 100, seed=5)
    n = table.num_rows
    defer = _early_columns(table, label_mode=["defer"] * n, click_open=[True] * n, conversion_open=[True] * n)
    version = write_examples(lake, defer)
    files = DeltaTable(str(lake / "examples")).file_uris()
    assert len(files) == 3, "one file per event_date partition"
    table_id = str(DeltaTable(str(lake / "examples")).metadata().id)
    tc = load_config(overrides={"lake": str(lake), **SMALL, "trainer.batch_size": str(BATCH)}).trainer
    start, end = Cursor(table_id, version), Cursor(table_id, version + 1)

    reads = list(continuous._reads(Lake(str(lake)), tc, start, version))
    assert [(r.num_rows, after) for r, after in reads] == [(300, end)], "the three files in one read"

    monkeypatch.setattr(continuous, "READ_ROWS", 250)
    reads = list(continuous._reads(Lake(str(lake)), tc, start, version))
    assert [(r.num_rows, after) for r, after in reads] == [(200, Cursor(table_id, version, 2, 0)), (100, end)]
    rest = list(continuous._reads(Lake(str(lake)), tc, reads[0][1], version))
    assert [(r.num_rows, after) for r, after in rest] == [(100, end)]
    assert rest[0][0].equals(reads[1][0]), "resuming at the first read's cursor reads the second read's rows"
    ids = [i for r, _ in reads for i in r.column("example_id").to_pylist()]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 300

    waited = write_examples(lake, _early_columns(table, label_mode=["wait"] * n, click_open=[False] * n,
                                                 conversion_open=[False] * n))
    reads = list(continuous._reads(Lake(str(lake)), tc, Cursor(table_id, waited), waited))
    assert [(r.num_rows, after) for r, after in reads] == [
        (100, Cursor(table_id, waited, 1, 0)), (100, Cursor(table_id, waited, 2, 0)), (100, Cursor(table_id, waited + 1))]
