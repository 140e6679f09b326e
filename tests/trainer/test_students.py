"""trainer.students and trainer.distill.join_teacher: the auxiliary head's gradient scaling by hand, the label-only
loss without a teacher, each bad teacher prediction of issue 14, and the Student Adapter against a stale teacher."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F

from gemline.errors import BadConfigError, InputSchemaError
from sequences.schema import SPARSE_FEATURES
from trainer.distill import join_teacher, pooled
from trainer.students import (
    DistillConfig,
    Student,
    StudentAdapter,
    TeacherInputs,
    adapter_step,
    predict,
    scale_gradient,
    student_loss,
    student_optimizers,
    teacher_logits,
)
from trainer.teacher_log import TEACHER_PREDICTIONS_SCHEMA

S = len(SPARSE_FEATURES)


def _student(variant="aux_head", dim=4, hidden=3):
    torch.manual_seed(0)
    return Student(variant=variant, num_embeddings=8, dim=dim, num_dense=2, teacher_width=2 * dim + hidden,
                   hidden_dims=(5,))


def _teacher(probs, has, width=11):
    probs = torch.tensor(probs, dtype=torch.float32)
    return TeacherInputs(probs, torch.tensor(has), torch.zeros(len(probs), width))


def test_scale_gradient_is_the_identity_forward_and_scales_backward():
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    y = scale_gradient(x, 0.25)
    assert torch.equal(y, x)
    (y * torch.tensor([4.0, 8.0, -12.0])).sum().backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 2.0, -3.0]))  # 0.25 x the upstream gradient, by hand


def test_the_aux_heads_gradient_into_the_shared_layers_is_scaled_and_its_own_is_not():
    ids = torch.randint(0, 8, (6, S))
    dense = torch.randn(6, 2)
    teacher = _teacher([[0.3, 0.1]] * 6, [True] * 6)

    def grads(scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        student = _student()
        _, aux = student(ids, dense, teacher, gradient_scale=scale)
        assert aux is not None
        F.binary_cross_entropy_with_logits(aux, teacher.probs).backward()
        shared = student.shared[0].weight.grad
        assert student.aux is not None and shared is not None and student.aux.weight.grad is not None
        return shared.clone(), student.aux.weight.grad.clone()

    shared_1, head_1 = grads(1.0)
    shared_s, head_s = grads(0.3)
    assert shared_1.abs().sum() > 0
    assert torch.allclose(shared_s, 0.3 * shared_1, atol=1e-7)
    assert torch.equal(head_s, head_1), "the auxiliary head itself learns at full rate"


def test_without_a_teacher_prediction_the_loss_is_the_labels_alone():
    student = _student()
    ids, dense = torch.randint(0, 8, (4, S)), torch.randn(4, 2)
    labels = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    none = _teacher([[0.0, 0.0]] * 4, [False] * 4)
    serving, _ = student(ids, dense, none)
    reference = F.binary_cross_entropy_with_logits(serving, labels, reduction="none").mean(dim=0).sum()
    got = student_loss(student, ids, dense, labels, none, DistillConfig(), adapter=StudentAdapter(4))
    assert torch.allclose(got, reference)
    half = _teacher([[0.9, 0.2], [0.0, 0.0]] * 2, [True, False] * 2)
    _, aux = student(ids, dense, half)
    assert aux is not None
    distill = (F.binary_cross_entropy_with_logits(aux, half.probs, reduction="none")
               * torch.tensor([[1.0], [0.0], [1.0], [0.0]])).mean(dim=0).sum()
    dc = DistillConfig(aux_loss_weight=2.0)
    assert torch.allclose(student_loss(student, ids, dense, labels, half, dc), reference + 2.0 * distill)


def test_a_student_and_its_adapter_learn_a_label_only_once_its_window_closed():
    """Hand case (trainer.labels, as the teacher): row 0's conversion and row 1's click and conversion are still open;
    they add nothing to the label loss, while the teacher's prediction still supervises every row."""
    student = _student()
    ids, dense = torch.randint(0, 8, (3, S)), torch.randn(3, 2)
    labels = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    final = torch.tensor([[True, False], [False, False], [True, True]])
    none = _teacher([[0.0, 0.0]] * 3, [False] * 3)
    serving, _ = student(ids, dense, none)
    bce = F.binary_cross_entropy_with_logits(serving, labels, reduction="none")
    # Per task: the closed labels' BCE summed over the batch of 3: click rows 0 and 2, conversion row 2 alone.
    reference = (bce[0, 0] + bce[2, 0]) / 3 + bce[2, 1] / 3
    got = student_loss(student, ids, dense, labels, none, DistillConfig(), final=final)
    assert torch.allclose(got, reference)
    flipped = labels.clone()
    flipped[1] = 1.0  # an open label turning positive later changes nothing now
    flipped[0, 1] = 1.0
    assert torch.allclose(student_loss(student, ids, dense, flipped, none, DistillConfig(), final=final), reference)
    everything = student_loss(student, ids, dense, labels, none, DistillConfig())
    assert torch.allclose(everything, bce.mean(dim=0).sum()) and not torch.allclose(everything, reference)

    teacher = _teacher([[0.3, 0.1], [0.6, 0.4], [0.2, 0.7]], [True] * 3)
    _, aux = student(ids, dense, teacher)
    assert aux is not None
    distill = F.binary_cross_entropy_with_logits(aux, teacher.probs, reduction="none").mean(dim=0).sum()
    assert torch.allclose(student_loss(student, ids, dense, labels, teacher, DistillConfig(), final=final),
                          reference + distill), "the teacher's target on every row, open labels included"

    adapter = StudentAdapter(4)
    optimizer = torch.optim.SGD(adapter.parameters(), lr=0.1)
    open_only = torch.tensor([[False, False], [False, False], [False, False]])
    before = [p.detach().clone() for p in adapter.parameters()]
    assert adapter_step(adapter, optimizer, teacher, labels, open_only) is None
    assert all(torch.equal(a, b) for a, b in zip(before, adapter.parameters())), "no closed label: no step"
    logits = teacher_logits(teacher.probs)  # the adapter starts as the identity
    terms = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    expected = float((terms[0, 0] + terms[2, 0] + terms[2, 1]) / 3)
    assert adapter_step(adapter, optimizer, teacher, labels, final) == pytest.approx(expected, rel=1e-6)


def test_a_new_students_heads_start_at_the_domains_label_rates():
    student = _student()
    rates = torch.tensor([0.004, 0.25], dtype=torch.float64)
    student.init_output_bias(rates)
    assert student.aux is not None
    for head in (student.serving, student.aux):
        assert torch.allclose(torch.sigmoid(head.bias.double()), rates, rtol=1e-5)
    with torch.no_grad():
        student.serving.weight.zero_()
    probs = predict(student, torch.randint(0, 8, (3, S)), torch.randn(3, 2), _teacher([[0.0, 0.0]] * 3, [False] * 3), 2)
    assert np.allclose(probs, np.tile(rates.numpy(), (3, 1)), rtol=1e-5), "a student without signal predicts the prior"
    with pytest.raises(ValueError, match="rates in"):
        student.init_output_bias(torch.tensor([0.0, 0.5]))


def _predictions(rows: list[dict]) -> pa.Table:
    base = {"run_id": "r", "teacher_step": 1, "teacher_checkpoint_ms": 5, "domain": "feed", "user_vector": [0.5] * 2,
            "candidate_vector": [0.25] * 2, "representation": [1.0] * 3}
    return pa.Table.from_pylist([{**base, **r} for r in rows], schema=TEACHER_PREDICTIONS_SCHEMA)


def test_each_bad_teacher_prediction_is_dropped_and_counted_and_its_example_trains_on_labels():
    examples = pa.table({"example_id": ["none", "quarantined", "nan", "inf", "future", "two", "ok"],
                         "event_time_ms": [100] * 7})
    predictions = _predictions([
        {"example_id": "quarantined", "examples_version": 4, "teacher_data_ms": 50, "p_click": 0.2, "p_conversion": 0.1},
        {"example_id": "nan", "examples_version": 3, "teacher_data_ms": 50, "p_click": math.nan, "p_conversion": 0.1},
        {"example_id": "inf", "examples_version": 3, "teacher_data_ms": 50, "p_click": 0.2, "p_conversion": math.inf},
        {"example_id": "future", "examples_version": 3, "teacher_data_ms": 100, "p_click": 0.2, "p_conversion": 0.1},
        {"example_id": "two", "examples_version": 3, "teacher_data_ms": 40, "p_click": 0.6, "p_conversion": 0.1},
        {"example_id": "two", "examples_version": 3, "teacher_data_ms": 60, "p_click": 0.7, "p_conversion": 0.3},
        {"example_id": "two", "examples_version": 3, "teacher_data_ms": 120, "p_click": 0.9, "p_conversion": 0.3},
        {"example_id": "ok", "examples_version": 3, "teacher_data_ms": 99, "p_click": 0.4, "p_conversion": 0.05},
        {"example_id": "elsewhere", "examples_version": 3, "teacher_data_ms": 1, "p_click": 0.4, "p_conversion": 0.05},
    ])
    joined = join_teacher(examples, predictions, lambda v: v != 4, dim=2, hidden=3)
    assert joined.inputs.has.tolist() == [False, False, False, False, False, True, True]
    assert joined.counts == {"with_teacher": 2, "label_only": 5, "dropped_quarantined": 1, "dropped_nonfinite": 2,
                             "dropped_future": 2}
    # "two": the newest teacher that had trained only on events before the example's (60 < 100; 120 leaks).
    assert joined.inputs.probs[5].tolist() == pytest.approx([0.7, 0.3])
    assert joined.inputs.probs[6].tolist() == pytest.approx([0.4, 0.05])
    assert joined.inputs.probs[:5].abs().sum() == 0 and joined.inputs.vectors[:5].abs().sum() == 0
    assert joined.inputs.vectors[6].tolist() == [0.5, 0.5, 0.25, 0.25, 1.0, 1.0, 1.0]
    assert joined.data_ms.tolist() == [-1, -1, -1, -1, -1, 60, 99]
    with pytest.raises(InputSchemaError, match="width 2"):
        join_teacher(examples, predictions, lambda v: True, dim=4, hidden=3)


def test_representation_student_adopts_each_teacher_row_once():
    student = _student("representation", dim=2)
    ids = torch.zeros(3, S, dtype=torch.int64)
    ids[:, SPARSE_FEATURES.index("user_id")] = torch.tensor([5, 5, 0])
    ids[:, SPARSE_FEATURES.index("item_id")] = torch.tensor([3, 4, 4])
    users = torch.tensor([[1.0, 2.0], [9.0, 9.0], [7.0, 7.0]])
    items = torch.tensor([[3.0, 4.0], [5.0, 6.0], [8.0, 8.0]])
    assert student.adopt_rows(ids, users, items, torch.tensor([True, True, True])) == 3  # user 5, items 3 and 4
    user_table = student.table(SPARSE_FEATURES.index("user_id")).weight
    item_table = student.table(SPARSE_FEATURES.index("item_id")).weight
    assert user_table[5].tolist() == [1.0, 2.0], "the first row of user 5; null id 0 is never set"
    assert item_table[3].tolist() == [3.0, 4.0] and item_table[4].tolist() == [5.0, 6.0]
    assert student.adopt_rows(ids, users + 1, items + 1, torch.tensor([True, True, True])) == 0, "once per row"


def test_adopt_rows_sets_what_a_loop_over_the_rows_in_order_sets():
    """The vectorised adoption against the loop it replaced, on random ids with repeats, null ids, rows without a
    teacher prediction and rows adopted by an earlier call."""
    g = torch.Generator().manual_seed(3)
    fast, slow = _student("representation", dim=2), _student("representation", dim=2)
    slow.load_state_dict(fast.state_dict())
    for call in range(3):
        ids = torch.randint(0, fast.num_embeddings, (40, S), generator=g)
        users, items = torch.randn(40, 2, generator=g), torch.randn(40, 2, generator=g)
        has = torch.rand(40, generator=g) < 0.7
        expected = 0
        with torch.no_grad():  # the reference: the loop over the rows in order
            for k, (feature, vectors) in enumerate((("user_id", users), ("item_id", items))):
                table, column = slow.table(SPARSE_FEATURES.index(feature)), ids[:, SPARSE_FEATURES.index(feature)]
                for i in range(40):
                    row = int(column[i])
                    if bool(has[i]) and row > 0 and not bool(slow.adopted[k, row]):
                        table.weight[row], slow.adopted[k, row] = vectors[i], True
                        expected += 1
        assert fast.adopt_rows(ids, users, items, has) == expected and (call > 0 or expected > 0)
        for name, value in slow.state_dict().items():
            assert torch.equal(fast.state_dict()[name], value), name


@pytest.fixture
def one_thread():
    """Torch on one thread, as trainer.torch_threads sets it for every run: these tiny ops run ~8x slower with
    more threads on a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_the_adapter_corrects_a_stale_teacher_after_a_shift_in_the_label_rate(one_thread):
    """Teacher p = sigmoid(2x - 2.5), right before increment 3; from increment 3 on the click logit is 1.5 higher
    and the teacher does not know: it predicts about half the clicks. The adapter, trained on the fresh labels,
    brings its corrected prediction back to calibration, and the auxiliary head that distills it follows."""
    rng = np.random.default_rng(0)

    def increment(shift: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TeacherInputs]:
        x = rng.normal(size=(2000, 1)).astype(np.float32)
        logit = 2 * x[:, 0] - 2.5
        y = (rng.random(2000) < 1 / (1 + np.exp(-(logit + shift)))).astype(np.float32)
        probs = np.stack([1 / (1 + np.exp(-logit)), np.full(2000, 0.01)], axis=1).astype(np.float32)
        return (torch.zeros((2000, S), dtype=torch.int64), torch.from_numpy(x), torch.from_numpy(np.stack([y, 0 * y], 1)),
                TeacherInputs(torch.from_numpy(probs), torch.ones(2000, dtype=torch.bool), torch.zeros(2000, 1)))

    dc = DistillConfig(aux_gradient_scale=1.0, batch_size=128)
    students: dict[str, Student] = {}
    calibration: dict[str, list[float]] = {"aux_head": [], "adapter": [], "adapter_output": [], "teacher": []}
    for variant in ("aux_head", "adapter"):
        torch.manual_seed(0)
        students[variant] = Student(variant=variant, num_embeddings=8, dim=4, num_dense=1, teacher_width=0,
                                    hidden_dims=(16,))
    torch.manual_seed(0)
    adapter = StudentAdapter(8)
    optimizers = {v: student_optimizers(s, dc.learning_rate) for v, s in students.items()}
    adapter_optimizer = torch.optim.Adam(adapter.parameters(), lr=dc.adapter_learning_rate)
    for k in range(8):
        ids, x, labels, teacher = increment(0.0 if k < 3 else 1.5)
        clicks = float(labels[:, 0].sum())
        if k >= 5:  # progressive: predicted before this increment is trained on, two increments after the shift
            with torch.no_grad():
                for variant, student in students.items():
                    aux = student(ids, x, teacher)[1]
                    assert aux is not None
                    calibration[variant].append(float(torch.sigmoid(aux[:, 0]).sum()) / clicks)
                corrected = torch.sigmoid(adapter(teacher_logits(teacher.probs)))[:, 0]
            calibration["adapter_output"].append(float(corrected.sum()) / clicks)
            calibration["teacher"].append(float(teacher.probs[:, 0].sum()) / clicks)
        for i in range(0, 2000, dc.batch_size):
            rows = slice(i, i + dc.batch_size)
            part = TeacherInputs(teacher.probs[rows], teacher.has[rows], teacher.vectors[rows])
            adapter_step(adapter, adapter_optimizer, part, labels[rows])
            for variant, student in students.items():
                loss = student_loss(student, ids[rows], x[rows], labels[rows], part, dc,
                                    adapter=adapter if variant == "adapter" else None)
                for optimizer in optimizers[variant]:
                    optimizer.zero_grad()
                loss.backward()
                for optimizer in optimizers[variant]:
                    optimizer.step()
    assert all(c < 0.6 for c in calibration["teacher"]), calibration
    assert all(abs(c - 1) < 0.1 for c in calibration["adapter_output"]), calibration
    for with_adapter, without in zip(calibration["adapter"], calibration["aux_head"]):
        assert abs(with_adapter - 1) < abs(without - 1) - 0.1, calibration


def test_pooled_ne_is_the_ne_of_the_concatenated_rows():
    from trainer.distill import _scores
    from trainer.metrics import calibration, normalized_entropy

    labels, probs = np.array([1.0, 0, 0, 1, 0, 0]), np.array([0.8, 0.3, 0.1, 0.4, 0.5, 0.2])
    got = pooled([_scores(labels[:2], probs[:2]), _scores(labels[2:], probs[2:])])
    assert got["rows"] == 6
    assert got["ne"] == pytest.approx(normalized_entropy(labels, probs))
    assert got["calibration"] == pytest.approx(calibration(labels, probs))


def test_bad_distill_config_is_one_line():
    with pytest.raises(BadConfigError, match="distill.variants"):
        DistillConfig(variants=("alone", "alone"))
    with pytest.raises(BadConfigError, match="aux_gradient_scale"):
        DistillConfig(aux_gradient_scale=-1.0)


def test_only_the_representation_student_reads_the_teachers_vectors():
    ids, dense = torch.randint(0, 8, (3, S)), torch.randn(3, 2)
    a = TeacherInputs(torch.full((3, 2), 0.5), torch.tensor([True, True, False]), torch.zeros(3, 11))
    b = TeacherInputs(a.probs, a.has, torch.ones(3, 11))
    rep, aux = _student("representation"), _student("aux_head")
    assert not torch.allclose(rep(ids, dense, a)[0], rep(ids, dense, b)[0])
    assert torch.equal(aux(ids, dense, a)[0], aux(ids, dense, b)[0])
    with pytest.raises(ValueError, match="teacher's vectors"):
        rep(ids, dense, None)


def test_teacher_vectors_come_out_as_a_loop_over_the_rows_puts_them():
    """``_vectors`` against the per-row loop it replaced: a chunked list<float32> column with null rows (zeros),
    and a vector of another width refused by name and width."""
    from trainer.distill import _vectors

    rng = np.random.default_rng(5)
    rows = [None if rng.random() < 0.3 else rng.standard_normal(3).astype(np.float32).tolist() for _ in range(50)]
    column = pa.chunked_array([pa.array(rows[:20], pa.list_(pa.float32())), pa.array(rows[20:], pa.list_(pa.float32()))])
    expected = np.zeros((50, 3), dtype=np.float32)
    for i, value in enumerate(rows):
        if value is not None:
            expected[i] = value
    assert np.array_equal(_vectors(column, 50, 3, "user_vector"), expected) and expected.any()
    assert np.array_equal(_vectors(pa.array([None, None], pa.list_(pa.float32())), 2, 3, "x"), np.zeros((2, 3)))
    with pytest.raises(InputSchemaError, match="user_vector has vectors of width 2"):
        _vectors(pa.array([[1.0, 2.0, 3.0], None, [1.0, 2.0]], pa.list_(pa.float32())), 3, 3, "user_vector")


def test_the_default_students_are_the_baseline_and_the_served_one():
    from gemline.config import load_config
    from trainer.students import VARIANTS

    assert DistillConfig().variants == ("alone", "aux_head") == load_config().distill.variants
    assert set(VARIANTS) == {"alone", "aux_head", "adapter", "representation"}, "all four stay selectable"
    assert load_config(overrides={"distill.variants": ",".join(VARIANTS)}).distill.variants == VARIANTS
