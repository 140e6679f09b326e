"""trainer.id_mapping: collisions counted on hand cases, the occurrence filter, stable rows, exact resume."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from gemline.errors import BadConfigError
from trainer.config import IdsConfig, TrainerConfig
from trainer.data import HASH_NAMESPACE, hash_ids
from trainer.id_mapping import (
    FIRST_ID_ROW,
    NULL_ROW,
    OOV_ROW,
    IdMapping,
    cardinality_width,
    table_rows,
    table_widths,
    with_rows,
)

COLUMNS = {"item_id": "item", "seq_item_ids": "item"}


def _table(items: list[str | None], histories: list[list[str]]) -> pa.Table:
    return pa.table({"item_id": pa.array(items, pa.string()), "seq_item_ids": pa.array(histories, pa.list_(pa.string()))})


def _managed(rows: int = 10, min_count: int = 2) -> IdMapping:
    return IdMapping("managed", {"item": rows}, min_count=min_count, columns=COLUMNS)


def test_managed_hand_case_rows_oov_and_collision_counts():
    # a: 3 times (candidate + history), b: 2, c and d: once each; "" and null are no ids.
    mapping = _managed()
    mapping.observe(_table(["a", "b", "c", None], [["a", "b"], ["a"], ["d", ""], []]))
    assert mapping.lookup(pa.array(["a", "b", "c", "d", "zz", "", None]), "item_id").tolist() == [
        FIRST_ID_ROW, FIRST_ID_ROW + 1, OOV_ROW, OOV_ROW, OOV_ROW, NULL_ROW, NULL_ROW]
    # The history column shares the candidate's namespace, hence its rows.
    assert mapping.lookup(pa.array([["b", "a"], []], pa.list_(pa.string())), "seq_item_ids").tolist() == [3, 2]
    stats = mapping.stats()["item"]
    # 4 distinct ids: a, b alone on their rows; c, d share the OOV row.
    assert stats == {"distinct_ids": 4, "rows": 10, "width": 0, "rows_used": 3, "colliding_ids": 2, "collision_share": 0.5,
                     "oov_ids": 2, "oov_share": 0.5}


def test_hash_hand_case_counts_ids_that_share_a_bucket():
    # Two rows besides null: three ids cannot all be alone; which share is blake2b's, computed here by hand.
    mapping = IdMapping("hash", {"item": 3}, min_count=2, columns=COLUMNS)
    ids = ["a", "b", "c"]
    mapping.observe(_table(ids, [[], [], ["a"]]))
    buckets = hash_ids(pa.array(ids), 3, "item").tolist()
    expected_colliding = sum(1 for b in buckets if buckets.count(b) > 1)
    assert expected_colliding >= 2  # pigeonhole: 3 ids, 2 buckets
    stats = mapping.stats()["item"]
    assert stats["colliding_ids"] == expected_colliding and stats["oov_ids"] == 0
    assert stats["collision_share"] == pytest.approx(expected_colliding / 3)
    assert mapping.lookup(pa.array(ids), "item_id").tolist() == buckets


def test_rows_never_change_and_rare_ids_are_admitted_once_seen_often_enough():
    mapping = _managed()
    mapping.observe(_table(["a", "a", "c"], [[], [], []]))
    assert mapping.lookup(pa.array(["a", "c"]), "item_id").tolist() == [2, OOV_ROW]
    # The next increment: c reaches 2 and gets the next free row; a keeps its row; b arrives (lexicographic
    # order decides between ids admitted by one call: b before c).
    mapping.observe(_table(["c", "b", "b"], [["a"], [], []]))
    assert mapping.lookup(pa.array(["a", "b", "c"]), "item_id").tolist() == [2, 3, 4]


def test_a_full_table_sends_new_ids_to_the_oov_row():
    mapping = _managed(rows=FIRST_ID_ROW + 1)  # room for one id
    mapping.observe(_table(["b", "b", "a", "a"], [[], [], [], []]))
    assert mapping.lookup(pa.array(["a", "b"]), "item_id").tolist() == [2, OOV_ROW]
    assert mapping.stats()["item"]["oov_ids"] == 1


def test_round_trip_gives_the_same_mapping_and_continues_the_same_way():
    straight, saved = _managed(), _managed()
    first, second = _table(["a", "a", "c"], [["x"], [], []]), _table(["c", "x", "q"], [[], [], []])
    straight.observe(first)
    saved.observe(first)
    resumed = IdMapping.from_bytes(saved.to_bytes())
    assert resumed.to_bytes() == saved.to_bytes()
    straight.observe(second)
    resumed.observe(second)
    assert resumed.to_bytes() == straight.to_bytes()
    with pytest.raises(ValueError, match="not a saved id mapping"):
        IdMapping.from_bytes(b'{"mode": "managed"}')


def test_sizing_rule_and_per_feature_table_rows():
    # 3 items seen twice or more, 1 once; 2 categories.
    first = pa.table({
        "item_id": pa.array(["a", "a", "b", "b", "c", "c", "d"]),
        "category": pa.array(["x", "x", "y", "y", "x", "y", "x"]),
    })
    config = IdsConfig(mapping="managed", min_count=2, headroom=2.0, min_rows=3, table_rows=("user_id=7",))
    mapping = IdMapping.sized(config, 1000, first, HASH_NAMESPACE)
    rows = {ns: v.rows for ns, v in mapping.vocabularies.items()}
    assert rows["item"] == 2 + 2 * 3 and rows["category"] == 2 + 2 * 2
    assert rows["user_id"] == 7 and rows["event_type"] == 3  # pinned; nothing seen: min_rows
    assert IdMapping.sized(config, 5, first, HASH_NAMESPACE).vocabularies["item"].rows == 5  # num_embeddings caps
    tc = with_rows(TrainerConfig(ids=config), mapping)
    per_table = table_rows(tc)
    assert isinstance(per_table, dict)
    assert per_table["item_id"] == per_table["seq_item_ids"] == 8 and per_table["seq_categories"] == 6
    assert table_rows(TrainerConfig()) == TrainerConfig().num_embeddings


def test_models_get_the_mapping_rows_per_table():
    from trainer.models import build_model

    pinned = IdsConfig(mapping="managed", table_rows=("item=11", "category=5", "user_id=9"))
    tc = TrainerConfig(ids=pinned, num_embeddings=50, embedding_dim=4, hidden_dims=(4,), tower_hidden=2)
    for model_name in ("gem", "dlrm", "lr", "ranker"):
        model = build_model(TrainerConfig(**{**tc.__dict__, "model": model_name}), 3, ("feed",))
        shapes = {name.split(".")[-2]: tuple(p.shape) for name, p in model.named_parameters() if ".t_" in name}
        assert shapes["t_item_id"][0] == 11 and shapes["t_user_id"][0] == 9 and shapes["t_age"][0] == 50, model_name
        if model_name in ("gem", "ranker"):
            assert shapes["t_item"][0] == 11 and shapes["t_category"][0] == 5


def test_cardinality_width_rule_on_hand_cases():
    # round(6 * U ** 0.25): 2 ids -> 6 * 1.189 = 7.1; 19 genres -> 6 * 2.088 = 12.5; 1,682 movies -> 6 * 6.404 = 38.4.
    assert [cardinality_width(u, least=1, most=64) for u in (0, 1, 2, 19, 1682)] == [1, 6, 7, 13, 38]
    assert cardinality_width(1682, least=2, most=16) == 16 and cardinality_width(0, least=4, most=16) == 4
    assert cardinality_width(16, factor=3.0, least=1, most=64) == 6  # 3 * 2
    with pytest.raises(ValueError, match="min width 8 > max width 4"):
        cardinality_width(10, least=8, most=4)


@pytest.mark.parametrize("mode", ["hash", "managed"])
def test_cardinality_widths_per_namespace_reach_the_models(mode):
    from trainer.models import build_model

    # item: 4 distinct ids (3 seen twice); category: 2; event_type: none seen.
    first = pa.table({"item_id": pa.array(["a", "a", "b", "b", "c", "c", "d"]),
                      "category": pa.array(["x", "x", "y", "y", "x", "y", "x"])})
    config = IdsConfig(mapping=mode, min_count=2, min_rows=3, widths="cardinality", min_width=2,
                       table_widths=("user_id=3",))
    mapping = IdMapping.sized(config, 1000, first, HASH_NAMESPACE, embedding_dim=8)
    widths = {ns: v.width for ns, v in mapping.vocabularies.items()}
    # hash counts every distinct id (4 items: 6 * 1.414 = 8.5 -> capped at 8); managed those seen twice (3: 7.9 -> 8)
    assert widths["item"] == 8 and widths["category"] == 7  # 6 * 2 ** 0.25 = 7.1
    assert widths["event_type"] == 2 and widths["user_id"] == 3  # nothing seen: min_width; pinned
    assert mapping.stats()["category"]["width"] == 7
    assert IdMapping.from_bytes(mapping.to_bytes()).vocabularies["category"].width == 7  # resumes keep widths
    tc = with_rows(TrainerConfig(ids=config, embedding_dim=8, num_embeddings=50, hidden_dims=(8,), tower_hidden=2), mapping)
    per_table = table_widths(tc)
    assert isinstance(per_table, dict)
    assert per_table["item_id"] == per_table["seq_item_ids"] == 8 and per_table["seq_categories"] == 7
    for model_name in ("gem", "dlrm"):
        model = build_model(TrainerConfig(**{**tc.__dict__, "model": model_name}), 3, ("feed",))
        bags = {name.split(".")[-2]: p.shape[1] for name, p in model.sparse_arch.named_parameters() if "bags" in name or model_name == "dlrm"}
        assert bags["t_user_id"] == 3 and bags["t_category"] == 7, model_name
        assert bags["t_item_id"] == 8 and bags["t_age"] == 2, model_name  # age: no id seen, min_width
        if model_name == "dlrm":
            assert bags["t_seq_categories"] == 7 and bags["t_seq_event_types"] == 2
        else:  # GEM's history tables are one EmbeddingCollection: one width, D
            assert {p.shape[1] for p in model.sparse_arch.sequence.parameters()} == {8}
        batch = _tiny_batch()
        logits = model(*batch, torch.zeros((2, 3)), torch.zeros(2, dtype=torch.int64))
        assert logits.shape == (2, 2) and bool(torch.isfinite(logits).all())
    assert table_widths(TrainerConfig()) == TrainerConfig().embedding_dim


def _tiny_batch():
    """(sparse, sequence) KJTs of 2 examples, row 1 everywhere, histories of 2 and 0 events."""
    from torchrec import KeyedJaggedTensor

    from sequences.schema import SPARSE_FEATURES
    from trainer.data import SEQUENCE_KEYS

    sparse = KeyedJaggedTensor.from_lengths_sync(keys=list(SPARSE_FEATURES), values=torch.ones(2 * len(SPARSE_FEATURES), dtype=torch.int64),
                                                 lengths=torch.ones(2 * len(SPARSE_FEATURES), dtype=torch.int64))
    sequence = KeyedJaggedTensor.from_lengths_sync(keys=list(SEQUENCE_KEYS), values=torch.ones(2 * len(SEQUENCE_KEYS), dtype=torch.int64),
                                                   lengths=torch.tensor([2, 0] * len(SEQUENCE_KEYS)))
    return sparse, sequence


def test_widths_wider_than_the_models_are_refused():
    with pytest.raises(BadConfigError, match="exceed trainer.embedding_dim=8"):
        TrainerConfig(embedding_dim=8, ids=IdsConfig(table_widths=("item=9",)))


BAD = [
    ({"mapping": "zch"}, "trainer.ids.mapping"),
    ({"widths": "auto"}, "trainer.ids.widths"),
    ({"table_widths": ("item=0",)}, "namespace=width"),
    ({"width_factor": 0.0}, "width_factor must be > 0"),
    ({"min_count": 0}, "min_count must be >= 1"),
    ({"headroom": 0.5}, "headroom must be >= 1"),
    ({"table_rows": ("item",)}, "namespace=rows"),
    ({"table_rows": ("item=2",)}, "rows >= 3"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_bad_ids_config_is_refused(kwargs, message):
    with pytest.raises(BadConfigError, match=message):
        IdsConfig(**kwargs)


def test_bad_mapping_arguments_are_refused():
    with pytest.raises(BadConfigError, match="unknown|namespaces"):
        IdMapping.sized(IdsConfig(mapping="managed", table_rows=("nope=9",)), 100, pa.table({}), HASH_NAMESPACE)
    with pytest.raises(BadConfigError, match="missing"):
        IdMapping("managed", {}, min_count=1, columns=COLUMNS)
    with pytest.raises(BadConfigError, match="trainer.ids.mapping"):
        with_rows(TrainerConfig(), _managed())
    with pytest.raises(TypeError, match="strings"):
        _managed().lookup(pa.array([1, 2]), "item_id")
    assert np.array_equal(_managed().lookup(pa.array([], pa.string()), "item_id"), np.zeros(0, dtype=np.int64))


def test_run_report_shows_the_newest_collision_counts_of_the_run():
    from trainer.continuous import _id_metric_rows
    from trainer.run_report import id_collision_rows, render_run_report

    mapping = _managed()
    mapping.observe(_table(["a", "a", "c"], [[], [], ["d"]]))
    older = _id_metric_rows("r1", 3, 0, _managed(), 1)
    newer = _id_metric_rows("r1", 5, 1, mapping, 2)
    other_run = _id_metric_rows("r2", 9, 7, mapping, 3)
    version, rows = id_collision_rows(older + newer + other_run, "r1")
    assert version == 1 and rows == [{"namespace": "item", "collision_share": 2 / 3, "oov_share": 2 / 3,
                                      "distinct_ids": 3.0, "rows": 10.0, "width": 0.0}]
    page = render_run_report("r1", [], older + newer, step=5, rows_trained_total=3, checkpoint=None)
    assert "<td>item</td><td>3</td><td>10</td><td>D</td><td>66.67%</td><td>66.67%</td>" in page  # D: fixed widths
    mapping.vocabularies["item"].width = 12
    page = render_run_report("r1", [], _id_metric_rows("r1", 5, 1, mapping, 2), step=5, rows_trained_total=3, checkpoint=None)
    assert "<td>item</td><td>3</td><td>10</td><td>12</td><td>66.67%</td>" in page
