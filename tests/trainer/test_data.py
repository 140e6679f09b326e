"""Examples table -> hashed ids, normalized dense features, KeyedJaggedTensor batches."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec import KeyedJaggedTensor

from sequences.schema import SPARSE_FEATURES
from trainer.data import (
    SEQUENCE_KEYS,
    DenseNormalizer,
    encode_examples,
    fit_normalizer,
    hash_ids,
    make_batch,
    signed_log1p,
    temporal_split,
    validate_batch,
)

N = 1000


def reference_id(s: str | None, namespace: str, n: int = N) -> int:
    if not s:
        return 0
    digest = hashlib.blake2b(s.encode(), digest_size=8, person=namespace.encode()).digest()
    return 1 + int.from_bytes(digest, "little") % (n - 1)


def test_hash_ids_matches_reference_and_reserves_zero():
    values = pa.array(["a", None, "", "a", "zz"])
    got = hash_ids(values, N, "item")
    assert got.tolist() == [reference_id(v, "item") for v in values.to_pylist()]
    assert got[1] == 0 and got[2] == 0 and got[0] == got[3] != 0
    # Another namespace gives another row for the same string (with overwhelming probability).
    assert hash_ids(pa.array(["a"]), 10**9, "user_id")[0] != hash_ids(pa.array(["a"]), 10**9, "item")[0]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(max_size=8)), max_size=30), st.integers(2, 50))
def test_hash_ids_in_range_and_stable(strings, n):
    got = hash_ids(pa.array(strings, pa.string()), n, "category")
    assert got.dtype == np.int64 and got.shape == (len(strings),)
    assert np.all((got >= 0) & (got < n))
    assert got.tolist() == [reference_id(s, "category", n) for s in strings]


@pytest.mark.parametrize(
    ("values", "n", "error", "message"),
    [(pa.array(["a"]), 1, ValueError, ">= 2"), (pa.array([1, 2]), 10, TypeError, "string array")],
)
def test_hash_ids_rejects(values, n, error, message):
    with pytest.raises(error, match=message):
        hash_ids(values, n, "x")


def test_signed_log1p_and_normalizer_are_finite():
    raw = np.array([[0.0, np.nan], [np.e - 1, np.inf], [-(np.e - 1), -np.inf], [0.0, 5.0]])
    logged = signed_log1p(raw)
    np.testing.assert_allclose(logged[:, 0], [0, 1, -1, 0])
    np.testing.assert_allclose(logged[:3, 1], [0, 0, 0])
    norm = DenseNormalizer.fit(("f_a", "f_b"), raw)
    out = norm.transform(raw)
    assert out.dtype == np.float32 and np.all(np.isfinite(out))
    np.testing.assert_allclose(out.mean(axis=0), 0, atol=1e-6)
    # A constant column gets std 1 and stays finite.
    const = DenseNormalizer.fit(("f_c",), np.full((3, 1), 7.0))
    assert const.std.tolist() == [1.0] and np.all(np.isfinite(const.transform(np.full((3, 1), 7.0))))
    assert DenseNormalizer.from_dict(norm.to_dict()).to_dict() == norm.to_dict()


def test_temporal_split(make_examples):
    table = make_examples(["2026-01-02", "2026-01-01", "2026-01-03"], 5, 0)
    split = temporal_split(table, 4)
    assert split.eval_date == "2026-01-03" and split.train_dates == ("2026-01-01", "2026-01-02")
    assert split.train.num_rows == 10 and split.eval.num_rows == 5
    assert set(split.eval["event_date"].to_pylist()) == {"2026-01-03"}


def test_temporal_split_needs_two_dates(make_examples):
    with pytest.raises(ValueError, match=r"2026-01-01"):
        temporal_split(make_examples(["2026-01-01"], 5, 0), 0)


def three_example_table(make_examples) -> pa.Table:
    """Rows with histories of length 2, 0 and 1, hand-chosen ids."""
    rows = make_examples(["2026-01-01"], 3, 0).to_pylist()
    histories = [["i1", "i2"], [], ["i3"]]
    for row, hist in zip(rows, histories):
        row["seq_item_ids"] = hist
        row["seq_categories"] = ["c1"] * len(hist)
        row["seq_event_types"] = ["click"] * len(hist)
        row["seq_domains"] = ["feed"] * len(hist)
        row["seq_event_time_ms"] = list(range(len(hist)))
        row["seq_length"] = len(hist)
    rows[1]["age"] = None
    return pa.Table.from_pylist(rows, schema=make_examples(["2026-01-01"], 1, 0).schema)


def test_batch_kjt_hand_checked(make_examples):
    table = three_example_table(make_examples)
    norm = fit_normalizer(table)
    batch = make_batch(encode_examples(table, N, norm), np.array([0, 1, 2]))
    seq = batch.sequence
    assert seq.keys() == list(SEQUENCE_KEYS)
    assert seq["seq_item_ids"].lengths().tolist() == [2, 0, 1]
    assert seq["seq_item_ids"].values().tolist() == [reference_id(s, "item") for s in ["i1", "i2", "i3"]]
    assert seq["seq_categories"].values().tolist() == [reference_id("c1", "category")] * 3
    assert seq["seq_event_types"].offsets().tolist() == [0, 2, 2, 3]
    sparse = batch.sparse
    assert sparse.keys() == list(SPARSE_FEATURES)
    assert sparse.lengths().tolist() == [1] * (3 * len(SPARSE_FEATURES))
    rows = table.to_pylist()
    assert sparse["item_id"].values().tolist() == [reference_id(r["item_id"], "item") for r in rows]
    assert sparse["age"].values().tolist() == [0, 0, 0]  # all null
    assert batch.dense.shape == (3, 3) and batch.dense.dtype.is_floating_point
    assert batch.labels.tolist() == [[r["label_click"], r["label_conversion"]] for r in rows]
    assert batch.domains == [r["domain"] for r in rows]


def test_encoding_without_sequences_leaves_every_other_field_equal(make_examples):
    table = make_examples(["2026-01-01", "2026-01-02"], 40, 3)
    norm = fit_normalizer(table)
    whole = encode_examples(table, N, norm, final_labels=True, click_window_ms=3_600_000, sequence_extras=True)
    bare = encode_examples(table.drop_columns(list(SEQUENCE_KEYS)), N, norm, final_labels=True,
                           click_window_ms=3_600_000, sequence_extras=True, sequences=False)
    assert whole.seq_values and bare.seq_values == {} and bare.same_domain_offsets is None
    assert bare.seq_offsets.tolist() == [0] * (len(table) + 1)
    for name in ("sparse_ids", "dense", "labels", "domains", "final"):
        assert np.array_equal(getattr(whole, name), getattr(bare, name)), name
    assert whole.delayed is None and bare.delayed is None, "synthetic rows carry no late-label columns"
    assert whole.final is not None and len(whole.sparse_ids) == len(table) == 80


def test_batch_gathers_shuffled_rows(make_examples):
    table = three_example_table(make_examples)
    batch = make_batch(encode_examples(table, N, fit_normalizer(table)), np.array([2, 1, 0]))
    assert batch.sequence["seq_item_ids"].lengths().tolist() == [1, 0, 2]
    assert batch.sequence["seq_item_ids"].values().tolist() == [reference_id(s, "item") for s in ["i3", "i1", "i2"]]


def test_misaligned_sequence_is_rejected(make_examples):
    rows = three_example_table(make_examples).to_pylist()
    rows[0]["seq_categories"] = ["c1"]  # seq_length says 2
    table = pa.Table.from_pylist(rows, schema=make_examples(["2026-01-01"], 1, 0).schema)
    with pytest.raises(ValueError, match=r"seq_categories row 0 has 1 elements but seq_length=2"):
        encode_examples(table, N, fit_normalizer(table))


def test_non_numeric_dense_feature_is_rejected(make_examples):
    table = make_examples(["2026-01-01"], 3, 0)
    table = table.append_column("f_bad", pa.array(["x", "y", "z"]))
    with pytest.raises(TypeError, match="f_bad must be float64"):
        fit_normalizer(table)


def _replace(batch, **changes):
    import dataclasses

    return dataclasses.replace(batch, **changes)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: {"dense": b.dense[:, :2]}, r"dense must be \(3, 3\) float32, got \(3, 2\)"),
        (lambda b: {"dense": b.dense.double()}, "float32"),
        (lambda b: {"labels": b.labels[:, :1]}, r"labels must be \(3, 2\), got \(3, 1\)"),
        (lambda b: {"domains": b.domains[:1]}, "domains must have B=3"),
        (
            lambda b: {"sequence": KeyedJaggedTensor(keys=list(SEQUENCE_KEYS), values=torch.arange(7), lengths=torch.tensor([2, 0, 1, 2, 0, 1, 1, 0, 0]))},
            "share one length",
        ),
        (
            lambda b: {"sparse": KeyedJaggedTensor(keys=["user_id"], values=torch.arange(3), lengths=torch.ones(3, dtype=torch.int64))},
            "sparse keys",
        ),
    ],
    ids=["dense-width", "dense-dtype", "labels", "domains", "misaligned-seq", "sparse-keys"],
)
def test_validate_batch_rejects(make_examples, change, message):
    table = three_example_table(make_examples)
    batch = make_batch(encode_examples(table, N, fit_normalizer(table)), np.array([0, 1, 2]))
    validate_batch(batch, 3)
    with pytest.raises(ValueError, match=message):
        validate_batch(_replace(batch, **change(batch)), 3)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=12), st.randoms(use_true_random=False))
def test_make_batch_gathers_any_rows(lengths, random):
    """For any histories (empty ones included) and any row order, the KJT equals the per-row slices."""
    from trainer.data import EncodedExamples

    n = len(lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    data = EncodedExamples(
        sparse_ids=np.arange(n * len(SPARSE_FEATURES), dtype=np.int64).reshape(n, len(SPARSE_FEATURES)),
        seq_values={k: np.arange(total, dtype=np.int64) + 1000 * j for j, k in enumerate(SEQUENCE_KEYS)},
        seq_offsets=offsets,
        dense=np.zeros((n, 2), dtype=np.float32),
        labels=np.zeros((n, 2), dtype=np.float32),
        domains=np.array(["d"] * n, dtype=object),
    )
    rows = np.array(random.sample(range(n), k=random.randint(0, n)), dtype=np.int64)
    batch = make_batch(data, rows)
    validate_batch(batch, 2)
    for j, key in enumerate(SEQUENCE_KEYS):
        expected = [v for r in rows for v in range(offsets[r] + 1000 * j, offsets[r + 1] + 1000 * j)]
        assert batch.sequence[key].values().tolist() == expected
        assert batch.sequence[key].lengths().tolist() == [lengths[r] for r in rows]
    assert batch.sparse["item_id"].values().tolist() == data.sparse_ids[rows, SPARSE_FEATURES.index("item_id")].tolist()
