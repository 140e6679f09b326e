"""Multi-node launch: two torchrun launchers joined by a c10d rendezvous on 127.0.0.1 train exactly
like one standalone launcher with the same world size.

The two "nodes" are two launcher processes on this machine (nproc_per_node 1 each); the one-node
reference is ``--standalone --nproc_per_node 2``. Both train the sharded ranker on the same tiny
examples lake; the comparison uses the tolerances of tests/trainer/test_distributed.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import trainer_args
from tests.trainer.test_distributed import KNOWN_LOOSE, LOSS_RTOL, PARAM_ATOL

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = {
    "trainer.model": "ranker", "trainer.embedding_dim": "4", "trainer.num_embeddings": "64", "trainer.hidden_dims": "8",
    "trainer.batch_size": "32", "trainer.epochs": "1", "trainer.seed": "3", "trainer.learning_rate": "0.02",
}


def _config(lake: str):
    from gemline.config import load_config

    return load_config(overrides={**OVERRIDES, "lake": lake})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BAD_LAUNCHES = [
    ({"nnodes": 0}, "--nnodes must be >= 1"),
    ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "127.0.0.1:29400"}, r"--node-rank must be in \[0, 2\)"),
    ({"nnodes": 2, "node_rank": -1, "rdzv_endpoint": "127.0.0.1:29400"}, r"--node-rank must be in \[0, 2\)"),
    ({"nnodes": 2}, "needs --rdzv-endpoint"),
    ({"nnodes": 2, "rdzv_endpoint": "127.0.0.1"}, "must be HOST:PORT"),
    ({"nnodes": 2, "rdzv_endpoint": ":29400"}, "must be HOST:PORT"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_LAUNCHES)
def test_torchrun_command_rejects(kwargs, message, tmp_path):
    from trainer.launch import torchrun_command

    with pytest.raises(ValueError, match=message):
        torchrun_command(*trainer_args(_config(str(tmp_path))), 1, result_json=tmp_path / "r.json", **kwargs)


def test_world_size_counts_every_node(tmp_path):
    """batch_size is checked against nnodes * nproc, not nproc alone."""
    from trainer.launch import torchrun_command

    config = _config(str(tmp_path))
    kwargs = {"result_json": tmp_path / "r.json", "rdzv_endpoint": "h:1"}
    torchrun_command(*trainer_args(config), 16, nnodes=2, **kwargs)
    with pytest.raises(ValueError, match="batch_size 32 must be >= the number of processes 34"):
        torchrun_command(*trainer_args(config), 17, nnodes=2, **kwargs)


def test_torchrun_command_flags(tmp_path):
    from trainer.launch import torchrun_command

    config = _config(str(tmp_path))
    one = torchrun_command(*trainer_args(config), 2, result_json=tmp_path / "r.json")
    assert one[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node"] and "--rdzv_backend" not in one
    multi = torchrun_command(
        *trainer_args(config), 1, result_json=tmp_path / "r.json", examples_version=4, nnodes=2, node_rank=1,
        rdzv_endpoint="10.0.0.1:29400", rdzv_id="job7",
    )
    head = multi[3 : multi.index("-m", 3)]
    assert head == [
        "--nnodes", "2", "--node_rank", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", "10.0.0.1:29400",
        "--rdzv_id", "job7", "--nproc_per_node", "1",
    ]
    assert multi[multi.index("--version") + 1] == "4" and "--standalone" not in multi


def test_cli_accepts_multinode_flags():
    from gemline.cli import build_parser

    args = build_parser().parse_args(
        ["train", "--nproc", "1", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-id", "j"]
    )
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id) == (2, 1, "10.0.0.1:29400", "j")
    args = build_parser().parse_args(["train"])
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == (1, 0, None)


def _state(checkpoint_path: str) -> dict[str, torch.Tensor]:
    return torch.load(Path(checkpoint_path) / "state.pt", weights_only=True)["model"]


def _two_launchers(config, version: int, out: Path) -> dict:
    """Start node 0 and node 1 as separate torchrun launchers; return the one result rank 0 wrote."""
    from trainer.launch import torchrun_command

    endpoint = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = []
    for node in (0, 1):
        cmd = torchrun_command(
            *trainer_args(config), 1, result_json=out / f"node{node}.json", examples_version=version, nnodes=2, node_rank=node,
            rdzv_endpoint=endpoint, rdzv_id="multinode-test", local_addr="127.0.0.1",
        )
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {node} exit {p.returncode}:\n{text[-6000:]}"
    written = [f for f in (out / "node0.json", out / "node1.json") if f.exists()]
    assert len(written) == 1, f"exactly one node hosts global rank 0, got results {written}"
    return json.loads(written[0].read_text())


@pytest.mark.slow
@pytest.mark.integration
def test_two_nodes_match_one_node(make_lake, tmp_path):
    from trainer.launch import train_with_torchrun

    lake, version = make_lake(dates=("2026-01-01", "2026-01-02"), rows_per_date=96, seed=5)
    config = _config(lake)

    one = train_with_torchrun(*trainer_args(config), 2, examples_version=version)
    one_state = _state(one.checkpoint_path)  # read now: the second run rewrites the same step-N
    two = _two_launchers(config, version, tmp_path)
    two_state = _state(two["checkpoint_path"])

    assert one.steps == two["steps"] == 3 and one.train_examples == two["train_examples"] == 96
    np.testing.assert_allclose(two["loss_curve"], one.loss_curve, rtol=LOSS_RTOL)
    assert set(two_state) == set(one_state)
    for key, value in one_state.items():
        torch.testing.assert_close(two_state[key], value, rtol=0, atol=KNOWN_LOOSE.get(key, PARAM_ATOL), msg=lambda m: f"{key}: {m}")
    meta = json.loads((Path(two["checkpoint_path"]) / "meta.json").read_text())
    assert meta["extra"]["world_size"] == 2
    for task in ("click", "conversion"):
        for name in ("auc", "ne", "calibration"):
            np.testing.assert_allclose(
                two["metrics"][task]["overall"][name], one.metrics[task]["overall"][name], rtol=1e-5, err_msg=f"{task} {name}"
            )
