"""Training batches from a pointer-layout lake (examples + history) equal those of a fat-layout lake
built from the same events: same ids, same jagged sequences, same dense features and labels."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from gemline.config import GemlineConfig
from gemline.errors import InputSchemaError
from sequences.config import BuildConfig
from sequences.pipeline import run_build
from tests.conftest import build_args
from tests.sequences.conftest import event
from tests.sequences.test_pipeline import write_events
from trainer.data import encode_examples, fit_normalizer, load_split, make_batch

DAY = 86_400_000
BUILD = BuildConfig(max_seq_len=4, max_same_domain_seq_len=2, click_window_ms=3_600_000,
                    conversion_window_ms=2 * 3_600_000, events_gate="off")


def _events(seed: int) -> list[list[dict]]:
    """Two builds of 60 events of four users over two days; one in eight appended hours late."""
    rng = random.Random(seed)
    rows = []
    for i in range(60):
        t = rng.randint(0, 2 * DAY - 1)
        late = rng.randint(0, 7) == 0
        rows.append(event(f"e{i}", t, rng.choice(["impression", "impression", "click", "engagement"]),
                          user=rng.choice(["u1", "u2", "u3", "u4"]), item=rng.choice(["i1", "i2", "i3"]),
                          domain=rng.choice(["d1", "d2"]), category=rng.choice([None, "c1", "c2"]),
                          created_ts_ms=t + (5 * 3_600_000 if late else 1)))
    rows.sort(key=lambda e: e["created_ts_ms"])
    return [rows[:30], rows[30:]]


@pytest.fixture(scope="module")
def lakes(tmp_path_factory) -> dict[str, str]:
    """A fat and a pointer lake built from the same two batches of events."""
    out = {}
    for layout in ("fat", "pointer"):
        lake = str(tmp_path_factory.mktemp(layout) / "lake")
        config = GemlineConfig(lake=lake, build=dataclasses.replace(BUILD, examples_layout=layout))
        batches = _events(3)
        for version, rows in enumerate(batches):
            write_events(lake, rows, version=version)
            run_build(*build_args(config), final=version == len(batches) - 1)
        out[layout] = lake
    return out


def _batches(lake: str, layout: str, *, sequence_extras: bool = False):
    split = load_split(lake, 2)  # examples@0 is the CREATE TABLE commit, @1 and @2 the builds
    assert (split.pointers is None) == (layout == "fat")
    normalizer = fit_normalizer(split.train)
    out = []
    for table in (split.train, split.eval):
        data = encode_examples(table, 1_000, normalizer, split.pointers, sequence_extras=sequence_extras)
        out.append(make_batch(data, np.arange(len(data))))
    return out, split


@pytest.mark.slow
@pytest.mark.parametrize("sequence_extras", [False, True], ids=["sequence", "with_extras"])
def test_pointer_batches_equal_fat_batches(lakes, sequence_extras):
    """With ``sequence_extras`` (GEM's time-delta buckets and same-domain stream) the pointer rows rebuild
    those lists from history too."""
    fat, fat_split = _batches(lakes["fat"], "fat", sequence_extras=sequence_extras)
    pointer, split = _batches(lakes["pointer"], "pointer", sequence_extras=sequence_extras)
    if sequence_extras:
        assert "seq_same_domain_item_ids" in fat[0].sequence.keys()
        assert split.pointers.same_domain_seq_len == 2
        same = fat[0].sequence["seq_same_domain_item_ids"]
        assert same.lengths().sum().item() > 0  # the same-domain histories are not all empty
    assert "seq_item_ids" not in split.train.column_names
    assert sum(b.sequence.lengths().sum().item() for b in fat) > 0  # the sequences are not all empty
    for want, got in zip(fat, pointer, strict=True):
        assert want.sequence.keys() == got.sequence.keys()
        assert torch.equal(want.sequence.values(), got.sequence.values())
        assert torch.equal(want.sequence.lengths(), got.sequence.lengths())
        assert torch.equal(want.sparse.values(), got.sparse.values())
        assert torch.equal(want.dense, got.dense) and torch.equal(want.labels, got.labels)
        assert want.domains == got.domains

    with pytest.raises(InputSchemaError, match="pointer layout"):
        encode_examples(split.train, 1_000, fit_normalizer(split.train))
    assert fat_split.train.num_rows == split.train.num_rows
    assert isinstance(split.pointers.history, pa.Table) and split.pointers.max_seq_len == 4


@pytest.mark.slow
@pytest.mark.parametrize("mapping", ["hash", "managed"])
def test_continuous_run_on_pointer_lake_equals_fat_lake(lakes, tmp_path, mapping):
    """run_once over the builds' examples versions: the pointer lake trains GEM to the same parameters. Managed ids
    (trainer.ids.mapping): the tables are sized by, and admit, the history's ids as well on both layouts, so the
    saved vocabularies are equal too, and the ids admitted include history-only ones (hashed ids are not admitted:
    their statistics count the history's ids on fat rows only, as the module docstring of trainer.id_mapping says)."""
    import shutil

    from gemline.config import load_config
    from tests.conftest import trainer_args
    from trainer.continuous import run_once
    from trainer.id_mapping import MAPPING_FILE, IdMapping

    from .conftest import mark_quality

    params, vocab = {}, {}
    for layout in ("fat", "pointer"):
        lake = str(tmp_path / layout)
        shutil.copytree(lakes[layout], lake)  # each run on its own copy: the module's lakes stay untrained
        for version in (0, 1, 2):
            mark_quality(lake, version, passed=True)
        config = load_config(overrides={
            "lake": str(lake), "trainer.num_embeddings": "1000", "trainer.batch_size": "16", "trainer.seed": "0",
            "trainer.model": "gem", "ingest.domains": '["d1", "d2"]', "trainer.ids.mapping": mapping,
            "trainer.ids.min_count": "2"})
        out = run_once(*trainer_args(config))
        assert out.rows_trained_total > 0
        params[layout] = torch.load(f"{out.checkpoint_path}/state.pt", weights_only=True)["model"]
        vocab[layout] = IdMapping.from_bytes((Path(out.checkpoint_path) / MAPPING_FILE).read_bytes()).vocabularies
    assert params["fat"].keys() == params["pointer"].keys()
    assert all(torch.equal(params["fat"][k], params["pointer"][k]) for k in params["fat"])
    if mapping == "managed":
        assert {ns: (v.rows, v.assigned) for ns, v in vocab["fat"].items()} == {
            ns: (v.rows, v.assigned) for ns, v in vocab["pointer"].items()}
        assert set(vocab["pointer"]["event_type"].assigned) >= {"click", "engagement"}, "only histories hold them"


@pytest.mark.slow
def test_pointer_reader_equals_the_whole_history(lakes):
    """A long-running reader's history (read once, then by increments) encodes each build's rows, and the first
    build's again, as the whole history does (compaction and its fallback: tests/sequences/test_history_tail.py)."""
    from gemline.increments import rows_added
    from gemline.lake import read_table
    from sequences.history_tail import HistoryTail
    from trainer.data import PointerReader, pointer_history

    lake = lakes["pointer"]
    reader = PointerReader(lake, sorted_history=False)
    reader.tail = HistoryTail(lake, 4, 2, margin_builds=0, min_compact_rows=0)
    tables = [rows_added(lake, "examples", version) for version in (1, 2, 1)]
    for table in tables:
        assert table is not None and table.num_rows
        normalizer = fit_normalizer(table)
        got = encode_examples(table, 1_000, normalizer, reader(table), sequence_extras=True)
        want = encode_examples(table, 1_000, normalizer, pointer_history(lake, table), sequence_extras=True)
        for key in ("seq_item_ids", "seq_same_domain_item_ids"):
            g, w = (make_batch(d, np.arange(len(d))).sequence[key] for d in (got, want))
            assert torch.equal(g.values(), w.values()) and torch.equal(g.lengths(), w.lengths())
    history = read_table(lake, "history")
    assert history is not None and reader.tail.rows.height == history.num_rows  # each event once, nothing cut


def test_a_pointer_reader_on_the_sorted_history_encodes_as_the_whole_history(lakes):
    """PointerReader's default, the sorted history (sequences.sorted_history): each build's rows, and the first build's
    again, encode as with the whole history, sequence extras included."""
    from gemline.increments import rows_added
    from trainer.data import PointerReader, pointer_history

    lake = lakes["pointer"]
    reader = PointerReader(lake)
    for version in (1, 2, 1):
        table = rows_added(lake, "examples", version)
        assert table is not None and table.num_rows
        pointers = reader(table)
        assert pointers is not None and pointers.sorted_history is not None
        normalizer = fit_normalizer(table)
        got = encode_examples(table, 1_000, normalizer, pointers, sequence_extras=True)
        want = encode_examples(table, 1_000, normalizer, pointer_history(lake, table), sequence_extras=True)
        g, w = (make_batch(d, np.arange(len(d))) for d in (got, want))
        for key in w.sequence.keys():
            assert torch.equal(g.sequence[key].values(), w.sequence[key].values()), key
            assert torch.equal(g.sequence[key].lengths(), w.sequence[key].lengths()), key
