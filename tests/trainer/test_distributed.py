"""Sharded training (TorchRec DMP + FSDP2 HSDP) on CPU/gloo against the one-process trainer.

The multi-process cases run this file as a torchrun script (``__main__`` below): each rank trains
a tiny ShardableRanker on its slice of fixed global batches and saves its loss curve, the
gathered full parameters and its local dense shards; the test then compares them with
trainer.train.train_step run in this process on the same global batches.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import trainer_args

REPO = Path(__file__).resolve().parents[2]
SEED = 3
STEPS = 3
GLOBAL_BATCH = 32
MODEL = {"num_embeddings": 64, "embedding_dim": 4, "hidden_dims": (8,)}
LR = 0.02
# Loss curves: equal to ~1e-6 relative over 3 steps (float reduction order differs: all-to-all and
# reduce-scatter sums vs one matmul); measured 1e-6 with 2 ranks, 7e-7 with 4.
LOSS_RTOL = 1e-5
# Parameters: a sharded run with one rank matches the one-process trainer to 1e-8, and with 2 or
# 4 ranks every other table and the heads match to ~3e-6. Three weights are looser, measured and
# explained: candidate-only rows of t_item (ids 6, 30, 40 in the first batch) get gradients of
# ~1e-8 (the median is ~2e-4), sums of attention-score terms that nearly cancel, so their value is
# float noise that changes with the reduction order; Adagrad divides by |g| + 1e-10 and turns that
# noise into steps of up to a few % of lr (5.6e-4 with 2 ranks, 1.6e-3 with 4). The attention
# weight and the MLP input weight then drift by 1e-4 / 3e-5. They get lr / 5 (a missing or doubled
# lr-sized step still fails); everything else the tight bound.
PARAM_ATOL = 1e-5
KNOWN_LOOSE = {key: LR / 5 for key in ("sequence_arch.embeddings.t_item.weight", "attention.weight", "mlp.0.weight")}

CASES = {
    # name: (world size, mesh (replicate, shard), allowed sharding types)
    "tw_1x2": (2, (1, 2), ("table_wise",)),
    "cw_2x1": (2, (2, 1), ("column_wise",)),
    "mixed_2x2": (4, (2, 2), ("table_wise", "column_wise")),
    "gem_tw_1x2": (2, (1, 2), ("table_wise",)),
    "dlrm_cw_2x1": (2, (2, 1), ("column_wise",)),
    "gem_managed_ids_tw_1x2": (2, (1, 2), ("table_wise",)),
    "adagrad_tw_1x2": (2, (1, 2), ("table_wise",)),
}
CASE_OPTIMIZER = {"adagrad_tw_1x2": "adagrad"}
"""trainer.embedding_optimizer of a case; the others run the default, rowwise_adagrad.
(With embedding_dim 4 the planner keeps each column-wise table in one shard, so no case here splits a table's
columns: the row-wise state per column shard of trainer.sparse_optim is not exercised.)"""
# Row-wise accumulators, fused (fbgemm) against trainer.sparse_optim.RowWiseAdagrad: sums of squared gradients
# over 3 steps, so they carry the gradients' reduction-order noise (~1e-6 relative); near-zero rows (the
# candidate-only t_item rows above, ~1e-16) are within the absolute bound.
ACC_RTOL, ACC_ATOL = 1e-4, 1e-12
CASE_MODEL = {"gem_tw_1x2": "gem", "dlrm_cw_2x1": "dlrm", "gem_managed_ids_tw_1x2": "gem"}
"""trainer.model of a case; the others train the ranker."""
MANAGED_IDS = {"gem_managed_ids_tw_1x2"}
"""Cases whose ids go through a managed trainer.id_mapping: tables of different rows per feature."""
# A tiny GEM of the default preset (gem_cpu): every block present (2 interleaved layers, recency branches over both
# streams, Cross Arch, task towers), small enough for seconds.
# Without the same-domain stream: with it, one row of t_item ends 0.84 lr away from the one-process run after 3 steps
# (losses equal to 1e-5); not understood yet (issue 18 report).
GEM = {"preset": "gem_cpu", "same_domain_stream": False, "layers": 2, "heads": 2, "max_sequence_len": 8, "dense_tokens": 1, "fm_outputs": 2, "lcb_outputs": 2, "fm_rank": 2}
"""trainer.gem of the GEM cases (trainer.tower_hidden is 4 for every model)."""
# GEM and DLRM (measured over 3 steps): losses within 4e-7 (GEM) / 9e-8 (DLRM) relative; 99.8% of
# GEM's 4,996 parameter elements and all of DLRM's within 1e-4 (median 0). The rest are weights
# whose exact gradient is ~0, so their float-noise gradient changes with the reduction order and
# Adam / Adagrad (which divide by |g|) turn it into steps of a fraction of lr: the key part of each
# attention's qkv bias and the summaries' key bias (softmax is invariant to q·b_k, the same for
# every key: gradient exactly 0) and rows touched by a single example; measured max 2.1e-3 (GEM)
# and 3.4e-5 (DLRM). Bound: every element within lr / 5 (a missing or doubled step of size lr
# fails) and at most 1% of elements beyond 1e-4.
NOISE_FRACTION = 0.01


def _mapping(table):
    """A managed mapping sized tightly (headroom 1, min_rows 3) on ``table``: its 40 items, 45 users and 8 categories
    get tables of 42, 47 and 10 rows (2 reserved rows each)."""
    from trainer.config import IdsConfig
    from trainer.data import HASH_NAMESPACE
    from trainer.id_mapping import IdMapping

    config = IdsConfig(mapping="managed", min_count=1, headroom=1.0, min_rows=3)
    mapping = IdMapping.sized(config, MODEL["num_embeddings"], table, HASH_NAMESPACE)
    mapping.observe(table)
    return mapping


def _data(managed=False):
    from tests.trainer.conftest import synthetic_examples, with_build_columns
    from trainer.data import encode_examples, fit_normalizer

    # With the build's time deltas and same-domain history, which only GEM reads (its tables shard with the rest).
    table = with_build_columns(synthetic_examples(["2026-01-01"], GLOBAL_BATCH * STEPS, SEED))
    ids = _mapping(table) if managed else None
    return encode_examples(table, MODEL["num_embeddings"], fit_normalizer(table), ids=ids, sequence_extras=True), ids


def _global_rows(step: int) -> np.ndarray:
    return np.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)


def _trainer_config(mesh=None, types=None, compile_dense=False, model="ranker", ids=None, optimizer="rowwise_adagrad"):
    from trainer.config import DistributedConfig, GemConfig, IdsConfig, TrainerConfig
    from trainer.id_mapping import with_rows

    if ids is not None:
        tc = _trainer_config(mesh, types, compile_dense, model, optimizer=optimizer)
        return with_rows(replace(tc, ids=IdsConfig(mapping="managed")), ids)
    return TrainerConfig(
        embedding_dim=MODEL["embedding_dim"], num_embeddings=MODEL["num_embeddings"], hidden_dims=MODEL["hidden_dims"],
        learning_rate=LR, seed=SEED, compile=compile_dense, model=model, tower_hidden=4, gem=GemConfig(**GEM),
        distributed=DistributedConfig(mesh_shape=mesh, sharding_types=types), embedding_optimizer=optimizer,
    )


def _local_accumulators(sharded) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    """This rank's shards of the fused optimiser's row-wise accumulators: table FQN -> [(offsets, (rows,) values)]."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    for table, state in sharded.sparse_optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if key.endswith(".momentum1") and isinstance(value, ShardedTensor):
                out[table] = [(list(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
    return out


def _domains(data) -> tuple[str, ...]:
    return tuple(sorted(set(data.domains.tolist())))


def _worker(out_dir: Path, cases: list[str]) -> None:
    """One rank under torchrun: train every case, save what the test compares."""
    import torch.distributed as dist

    from trainer.data import make_batch
    from trainer.distributed import (
        build_shardable_model,
        distributed_train_step,
        full_state_dict,
        shard_model,
        split_rows,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in cases:
        _, mesh, types = CASES[case]
        data, ids = _data(case in MANAGED_IDS)
        tc = _trainer_config(mesh, types, model=CASE_MODEL.get(case, "ranker"), ids=ids,
                             optimizer=CASE_OPTIMIZER.get(case, "rowwise_adagrad"))
        torch.manual_seed(SEED)
        sharded = shard_model(build_shardable_model(tc, data.dense.shape[1], _domains(data)), tc, world)
        losses = []
        for step in range(STEPS):
            rows = _global_rows(step)
            losses.append(distributed_train_step(sharded, make_batch(data, split_rows(rows, rank, world)), len(rows)))
        local = {
            name: p.to_local().detach().clone()
            for name, p in sharded.model.named_parameters()
            if name.split(".")[0] in sharded.dense_modules
        }
        state = full_state_dict(sharded)
        torch.save(
            {"losses": losses, "state": state, "local": local, "coord": sharded.mesh.get_coordinate(),
             "accumulators": _local_accumulators(sharded)},
            out_dir / f"{case}-rank{rank}.pt",
        )
        dist.barrier()
    dist.destroy_process_group()


def _resume_worker(out_dir: Path) -> None:
    """One rank under torchrun: GEM trained 4 steps straight, and 2 steps + DCP save + fresh model + load + 2 steps."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from trainer.data import make_batch
    from trainer.distributed import build_shardable_model, distributed_train_step, shard_model, split_rows
    from trainer.sharded_checkpoint import load_sharded, save_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data, _ = _data()
    tc = _trainer_config((1, 2), ("table_wise",), model="gem")
    batches = [0, 1, 2, 0]  # 4 steps over the 3 fixed global batches

    def fresh():
        torch.manual_seed(SEED)
        return shard_model(build_shardable_model(tc, data.dense.shape[1], _domains(data)), tc, world)

    def steps(sharded, which):
        return [
            distributed_train_step(sharded, make_batch(data, split_rows(_global_rows(b), rank, world)), GLOBAL_BATCH)
            for b in which
        ]

    straight = steps(fresh(), batches)
    first = fresh()
    head = steps(first, batches[:2])
    save_sharded(first, out_dir / "dcp")
    resumed = fresh()
    load_sharded(resumed, out_dir / "dcp")
    tail = steps(resumed, batches[2:])
    # Control: the same parameters without the optimiser state must not continue the same way.
    no_optim = fresh()
    model_only = {"model": no_optim.model.state_dict()}
    dcp.load(model_only, checkpoint_id=str(out_dir / "dcp"))
    no_optim.model.load_state_dict(model_only["model"])
    control = steps(no_optim, batches[2:])
    torch.save({"straight": straight, "resumed": head + tail, "control": head + control}, out_dir / f"resume-rank{rank}.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, cases: list[str], out_dir: Path) -> None:
    """torchrun this file with ``world`` CPU ranks; the launcher, not the code, sets the rendezvous address.

    ``cases == ["resume"]`` runs :func:`_resume_worker` instead of the cases.
    """
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(world),
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        __file__, "--out", str(out_dir), "--cases", ",".join(cases),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _reference(num_steps: int, model_name: str = "ranker", managed: bool = False, optimizer: str = "rowwise_adagrad"):
    """Loss curve, final and initial state_dict and the tables' accumulators (FQN -> the optimiser's "sum") of the
    one-process trainer (trainer.loop.local_optimizers) on the same global batches."""
    from trainer.data import make_batch
    from trainer.loop import local_optimizers
    from trainer.models import build_model
    from trainer.train import train_step

    data, ids = _data(managed)
    torch.manual_seed(SEED)
    tc = _trainer_config(model=model_name, ids=ids, optimizer=optimizer)
    model = build_model(tc, data.dense.shape[1], _domains(data))
    optimizers = local_optimizers(tc, model)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses = [train_step(model, optimizers, make_batch(data, _global_rows(step))) for step in range(num_steps)]
    table = optimizers["embeddings"].state
    accumulators = {name: table[p]["sum"].clone() for name, p in model.named_parameters() if p in table}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, initial, accumulators


def _check_case(out_dir: Path, case: str, reference) -> None:
    world, mesh, _ = CASES[case]
    ranks = [torch.load(out_dir / f"{case}-rank{r}.pt", weights_only=True) for r in range(world)]
    ref_losses, ref_state, ref_initial, ref_accumulators = reference
    for r in ranks:
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=LOSS_RTOL, err_msg=f"{case}: loss curve")
    state = ranks[0]["state"]
    assert set(state) == set(ref_state), f"{case}: {sorted(set(state) ^ set(ref_state))}"
    for key, value in ref_state.items():
        atol = KNOWN_LOOSE.get(key, PARAM_ATOL) if case not in CASE_MODEL else LR / 5
        torch.testing.assert_close(state[key], value, rtol=0, atol=atol, msg=lambda m: f"{case} {key}: {m}")
        assert not torch.equal(state[key], ref_initial[key]), f"{case} {key}: never updated"
    if CASE_OPTIMIZER.get(case, "rowwise_adagrad") == "rowwise_adagrad":
        _check_accumulators(case, ranks, ref_accumulators)
    if case in CASE_MODEL:
        diff = torch.cat([(state[k] - v).abs().flatten() for k, v in ref_state.items()])
        assert (diff > 1e-4).float().mean() <= NOISE_FRACTION, f"{case}: {(diff > 1e-4).sum()} of {diff.numel()} elements beyond 1e-4"
    # Replicas (same shard coordinate, different replicate coordinate) hold identical dense shards.
    replicate, shard = mesh
    assert sorted(tuple(r["coord"]) for r in ranks) == sorted((i, j) for i in range(replicate) for j in range(shard))
    for a in ranks:
        for b in ranks:
            if a["coord"][1] == b["coord"][1]:
                for name in a["local"]:
                    assert torch.equal(a["local"][name], b["local"][name]), f"{case}: replicas differ in {name}"


def _check_accumulators(case: str, ranks: list[dict], reference: dict[str, torch.Tensor]) -> None:
    """The fused row-wise accumulators, put together from every rank's shards, equal the one-process ones."""
    fused: dict[str, torch.Tensor] = {}
    for r in ranks:
        for table, shards in r["accumulators"].items():
            full = fused.setdefault(table, torch.full_like(reference[table], float("nan")))
            for (offset,), values in shards:
                full[offset : offset + len(values)] = values
    assert set(fused) == set(reference), f"{case}: {sorted(set(fused) ^ set(reference))}"
    for table, value in reference.items():
        assert value.dim() == 1 and bool((value > 0).any()), f"{case} {table}: not a stepped row-wise accumulator"
        torch.testing.assert_close(fused[table], value, rtol=ACC_RTOL, atol=ACC_ATOL, msg=lambda m: f"{case} {table}: {m}")


# ---- selection logic and pure helpers (no process group) ----

BAD_CONFIGS = [
    ({"mesh_shape": (2, 2, 1)}, "two sizes"),
    ({"mesh_shape": (0, 2)}, "two sizes"),
    ({"sharding_types": ()}, "non-empty subset"),
    ({"sharding_types": ("table_wise", "diagonal")}, "non-empty subset"),
    ({"sharding_types": ("row_wise",)}, "need device='cuda'"),
    ({"sharding_types": ("table_row_wise", "table_wise")}, "need device='cuda'"),
    ({"sharding_types": ("data_parallel",)}, "data_parallel is not supported"),
    ({"sharding_group_size": 2}, "needs device='cuda'"),
    ({"sharding_group_size": 0, "device": "cuda"}, ">= 1 or none"),
    ({"device": "tpu"}, "'cpu' or 'cuda'"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_CONFIGS)
def test_distributed_config_rejects(kwargs, message):
    from trainer.config import DistributedConfig

    with pytest.raises(ValueError, match=message):
        DistributedConfig(**kwargs)


def test_config_loads_from_flags_and_picks_backend():
    from gemline.config import load_config

    config = load_config(overrides={
        "trainer.distributed.mesh_shape": "2,1", "trainer.distributed.sharding_types": "column_wise", "trainer.compile": "true",
    })
    dc = config.trainer.distributed
    assert (dc.mesh_shape, dc.sharding_types, dc.backend, config.trainer.compile) == ((2, 1), ("column_wise",), "gloo", True)
    from trainer.config import DistributedConfig

    assert DistributedConfig(device="cuda").backend == "nccl"


@pytest.mark.parametrize(
    ("world", "shape", "expected"), [(4, None, (1, 4)), (4, (2, 2), (2, 2)), (2, (2, 1), (2, 1)), (1, None, (1, 1))]
)
def test_resolve_mesh_shape(world, shape, expected):
    from trainer.distributed import resolve_mesh_shape

    assert resolve_mesh_shape(world, shape) == expected


@pytest.mark.parametrize(("world", "shape"), [(4, (3, 1)), (2, (2, 2)), (4, (4,))])
def test_resolve_mesh_shape_rejects(world, shape):
    from trainer.distributed import resolve_mesh_shape

    with pytest.raises(ValueError, match="multiply to the world size"):
        resolve_mesh_shape(world, shape)


def test_sharding_type_and_wrapper_selection():
    """The GPU path (row-wise, DMPCollection) is chosen by config; here only the choice is checked."""
    from trainer.config import DistributedConfig
    from trainer.distributed import allowed_sharding_types, choose_sparse_wrapper

    assert allowed_sharding_types(DistributedConfig()) == ("table_wise", "column_wise")
    assert allowed_sharding_types(DistributedConfig(device="cuda")) == ("table_wise", "column_wise", "row_wise", "table_row_wise")
    assert allowed_sharding_types(DistributedConfig(sharding_types=("column_wise",))) == ("column_wise",)
    assert choose_sparse_wrapper(DistributedConfig(), 4) == "dmp"
    assert choose_sparse_wrapper(DistributedConfig(device="cuda", sharding_group_size=4), 4) == "dmp"
    assert choose_sparse_wrapper(DistributedConfig(device="cuda", sharding_group_size=2), 8) == "dmp_collection"
    with pytest.raises(ValueError, match="must divide"):
        choose_sparse_wrapper(DistributedConfig(device="cuda", sharding_group_size=3), 4)


@given(st.lists(st.integers(0, 10_000), min_size=0, max_size=64), st.integers(1, 8))
def test_split_rows_partitions_a_global_batch(rows, world):
    from trainer.distributed import split_rows

    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) < world:
        with pytest.raises(ValueError, match="cannot give each"):
            split_rows(rows, 0, world)
        return
    parts = [split_rows(rows, r, world) for r in range(world)]
    assert np.array_equal(np.concatenate(parts), rows)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def _tiny_batch():
    from trainer.data import make_batch

    data, _ = _data()
    return data, make_batch(data, _global_rows(0))


def test_shardable_ranker_equals_two_task_ranker_unsharded():
    """Same seed -> same parameters; one merged lookup call gives the same logits and gradients."""
    from trainer.distributed import ShardableRanker
    from trainer.model import TwoTaskRanker

    data, batch = _tiny_batch()
    torch.manual_seed(SEED)
    ref = TwoTaskRanker(num_dense=data.dense.shape[1], **MODEL)
    torch.manual_seed(SEED)
    new = ShardableRanker(num_dense=data.dense.shape[1], **MODEL)
    for a, b in zip(ref.state_dict().values(), new.state_dict().values()):
        assert torch.equal(a, b)
    out_ref, out_new = ref(batch.sparse, batch.sequence, batch.dense), new(batch.sparse, batch.sequence, batch.dense)
    torch.testing.assert_close(out_new, out_ref, rtol=1e-6, atol=1e-7)
    out_ref.sum().backward()
    out_new.sum().backward()
    for (name, a), b in zip(ref.named_parameters(), new.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(("model_name", "dense_modules"), [("gem", ("dense_arch",)), ("dlrm", ("dense_arch",)), ("ranker", ("attention", "mlp", "heads"))])
def test_shardable_models_and_their_dense_modules(model_name, dense_modules):
    from trainer.distributed import ShardableRanker, build_shardable_model, dense_module_names

    model = build_shardable_model(_trainer_config(model=model_name), 3, ("feed",))
    assert dense_module_names(model) == dense_modules
    assert isinstance(model, ShardableRanker) == (model_name == "ranker")
    sharded_names = {n.split(".")[0] for n, _ in model.named_parameters()} - {"sparse_arch", "sequence_arch"}
    assert sharded_names == set(dense_modules)  # every dense parameter gets wrapped


def test_logistic_regression_is_not_shardable():
    from trainer.distributed import build_shardable_model, dense_module_names
    from trainer.models import build_model

    with pytest.raises(ValueError, match="got 'lr'. Train it in one process"):
        build_shardable_model(_trainer_config(model="lr"), 3, ("feed",))
    with pytest.raises(TypeError, match="LogisticRegression has no dense module"):
        dense_module_names(build_model(_trainer_config(model="lr"), 3, ("feed",)))


def test_dlrm_reads_pooled_embeddings_by_key():
    """Reading the KeyedTensor by key (what a sharded EBC needs) gives the unsharded layout, feature by feature."""
    from sequences.schema import SPARSE_FEATURES
    from trainer.data import SEQUENCE_KEYS
    from trainer.models import build_model
    from trainer.models.towers import merge_sequence_kjt

    data, batch = _tiny_batch()
    model = build_model(_trainer_config(model="dlrm"), data.dense.shape[1], _domains(data))
    kt = model.sparse_arch(merge_sequence_kjt(batch.sparse, batch.sequence))
    by_key = torch.stack([kt[k] for k in (*SPARSE_FEATURES, *SEQUENCE_KEYS)], dim=1)
    assert torch.equal(by_key, kt.values().view(batch.batch_size, -1, MODEL["embedding_dim"]))


def test_compiled_dense_forward_matches_eager():
    from trainer.distributed import ShardableRanker, compile_dense

    data, batch = _tiny_batch()
    torch.manual_seed(SEED)
    model = ShardableRanker(num_dense=data.dense.shape[1], **MODEL)
    eager = model(batch.sparse, batch.sequence, batch.dense).detach()
    compile_dense(model)
    compiled = model(batch.sparse, batch.sequence, batch.dense).detach()
    assert all(getattr(model, name)._compiled_call_impl is not None for name in ("attention", "mlp", "heads"))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_config_overrides_round_trip():
    """train_with_torchrun ships the config as --set flags; they must rebuild the same config."""
    from gemline.config import load_config, parse_set_flags
    from trainer.launch import config_overrides

    config = load_config(overrides={
        "lake": "/tmp/some lake", "trainer.hidden_dims": "8,4", "trainer.compile": "true", "trainer.torch_threads": "none",
        "trainer.distributed.mesh_shape": "2,1", "trainer.embedding_learning_rate": "0.125",
    })
    assert load_config(overrides=parse_set_flags(config_overrides(config))) == config


@pytest.mark.parametrize(
    ("overrides", "nproc", "message"),
    [
        ({"trainer.model": "lr"}, 2, r"shards trainer.model in \(.gem., .dlrm., .ranker.\); got .lr."),
        ({"trainer.model": "ranker", "trainer.batch_size": "2"}, 4, "must be >= the number of processes"),
        ({"trainer.model": "ranker"}, 0, "must be >= 1"),
        pytest.param({"trainer.model": "gem", "trainer.distributed.device": "cuda"}, 2,
                     "trainer.distributed.device='cuda' but torch sees no CUDA device here",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    ],
)
def test_train_with_torchrun_rejects_before_launching(overrides, nproc, message):
    from gemline.config import load_config
    from trainer.launch import train_with_torchrun

    with pytest.raises(ValueError, match=message):
        train_with_torchrun(*trainer_args(load_config(overrides=overrides)), nproc)


def test_cli_accepts_nproc():
    from gemline.cli import build_parser

    assert build_parser().parse_args(["train", "--nproc", "2"]).nproc == 2
    assert build_parser().parse_args(["demo"]).nproc == 1


@pytest.fixture(scope="module")
def reference():
    return _reference(STEPS)


@pytest.fixture(scope="module")
def adagrad_reference():
    return _reference(STEPS, optimizer="adagrad")


@pytest.mark.slow
@pytest.mark.integration
def test_world_size_2_matches_one_process(tmp_path, reference, adagrad_reference):
    """The ranker, row-wise Adagrad (tables and accumulators) and Adagrad, 2 ranks against one process."""
    cases = [c for c, (world, _, _) in CASES.items() if world == 2 and c not in CASE_MODEL]
    _launch(2, cases, tmp_path)
    for case in cases:
        _check_case(tmp_path, case, adagrad_reference if CASE_OPTIMIZER.get(case) == "adagrad" else reference)


@pytest.mark.integration
def test_world_size_2_gem_and_dlrm_match_one_process(tmp_path):
    """GEM (table-wise, mesh (1, 2)) and DLRM (column-wise, mesh (2, 1)) sharded over 2 ranks vs one process."""
    _launch(2, list(CASE_MODEL), tmp_path)
    for case, model_name in CASE_MODEL.items():
        _check_case(tmp_path, case, _reference(STEPS, model_name, case in MANAGED_IDS))
    # The managed case's tables have the mapping's rows per feature, not trainer.num_embeddings.
    state = torch.load(tmp_path / "gem_managed_ids_tw_1x2-rank0.pt", weights_only=True)["state"]
    rows = {k.split(".")[-2]: v.shape[0] for k, v in state.items() if ".t_" in k}
    assert rows["t_item_id"] == rows["t_item"] == 42 and rows["t_user_id"] == 47 and rows["t_category"] == 10, rows


@pytest.mark.integration
def test_sharded_gem_resumes_from_dcp_bit_for_bit(tmp_path):
    """DCP save after 2 of 4 steps, load into a freshly sharded model: steps 3-4 give the same losses.

    Without the optimiser state (control) step 4 differs, so the test sees a lost Adam/Adagrad state.
    """
    _launch(2, ["resume"], tmp_path)
    for rank in range(2):
        out = torch.load(tmp_path / f"resume-rank{rank}.pt", weights_only=True)
        assert out["resumed"] == out["straight"], out
        assert out["control"][:3] == out["straight"][:3] and out["control"][3] != out["straight"][3], out


@pytest.mark.slow
@pytest.mark.integration
def test_world_size_4_hsdp_matches_one_process(tmp_path, reference):
    _launch(4, ["mixed_2x2"], tmp_path)
    _check_case(tmp_path, "mixed_2x2", reference)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.cases == "resume":
        _resume_worker(args.out)
    else:
        _worker(args.out, args.cases.split(","))
