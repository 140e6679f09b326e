"""``gemline train --nproc 2`` on an object-store lake (moto S3, two gloo ranks on CPU), and the
rule that the lake's secrets never travel on a command line nor show in any output.

The secret access key is a distinctive string (moto accepts any); the test watches every process
the CLI starts (``/proc/<pid>/cmdline`` and ``environ`` of the CLI, torchrun and both ranks) while
it runs and checks that the string is in none of them, nor in stdout or stderr.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from gemline.config import load_config, parse_set_flags
from gemline.lake import Lake, commit_once, open_table
from tests.conftest import trainer_args
from tests.trainer.conftest import mark_quality, synthetic_examples

from .conftest import s3_bucket

REPO = Path(__file__).resolve().parents[2]
SECRET = "testing-secret-zzz"
"""The secret access key's value: must appear in no argv, environment, message or output."""
TRAINER = {
    "trainer.model": "ranker", "trainer.embedding_dim": "4", "trainer.num_embeddings": "64", "trainer.hidden_dims": "8",
    "trainer.batch_size": "32", "trainer.epochs": "1", "trainer.seed": "3", "trainer.torch_threads": "1",
}
"""A tiny sharded ranker (as in tests/trainer/test_multinode.py), one epoch: 2 steps on 48 train rows."""


def _options(endpoint: str, bucket: str) -> dict[str, str]:
    return {**s3_bucket(endpoint, bucket), "AWS_SECRET_ACCESS_KEY": SECRET}


def _toml(lake: str, options: dict[str, str]) -> str:
    lines = [f"lake = {json.dumps(lake)}", "[lake_storage_options]"]
    return "\n".join([*lines, *(f"{k} = {json.dumps(v)}" for k, v in options.items())]) + "\n"


def test_torchrun_command_keeps_storage_options_off_argv(tmp_path):
    from trainer.launch import torchrun_command, write_private_config

    options = {"AWS_REGION": "us-east-1", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": 'to"k\\en'}
    config = load_config(overrides={**TRAINER, "lake": "s3://bucket/lake",
                                    **{f"lake_storage_options.{k}": v for k, v in options.items()}})
    with pytest.raises(ValueError, match="never go on a command line"):
        torchrun_command(*trainer_args(config), 2, result_json=tmp_path / "r.json")
    private = write_private_config(trainer_args(config)[0], tmp_path / "private.toml")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):  # created, never reused
        write_private_config(trainer_args(config)[0], private)
    cmd = torchrun_command(*trainer_args(config), 2, result_json=tmp_path / "r.json", private_config=private)
    assert not any(SECRET in arg or "lake_storage_options" in arg for arg in cmd)
    assert cmd[cmd.index("--config") + 1] == str(private)
    # What a rank loads (trainer.launch.main: the private file, then the --set flags) is this config.
    sets = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"]
    assert load_config(private, parse_set_flags(sets)) == config
    assert config.lake_storage_options == options


def test_train_nproc_2_on_s3_keeps_the_secret_out_of_argv_and_output(moto_endpoint, tmp_path):
    options = _options(moto_endpoint, "nproc")
    lake = Lake("s3://nproc/lake", options)
    examples = synthetic_examples(["2026-01-01", "2026-01-02"], 48, seed=5)
    assert commit_once(lake, "examples", examples, app_id="test", version=0, partition_by=["event_date"])
    version = open_table(lake, "examples").version()
    mark_quality(lake, version, passed=True)  # the trainer refuses never-validated versions
    config_path = tmp_path / "s3.toml"
    config_path.write_text(_toml(lake.root, options))

    cmd = [str(Path(sys.executable).with_name("gemline")), "train", "--config", str(config_path), "--nproc", "2",
           *(arg for key, value in TRAINER.items() for arg in ("--set", f"{key}={value}"))]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = _watch_descendants(proc)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{stderr[-6000:]}"

    # Both ranks and torchrun were seen, and none of them had the secret in its argv or environment.
    ranks = [c for c in seen["cmdlines"] if "trainer.launch" in c and "torch.distributed.run" not in c]
    assert len(ranks) == 2, seen["cmdlines"]
    assert any("torch.distributed.run" in c for c in seen["cmdlines"])
    for text in [stdout, stderr, *seen["cmdlines"], *seen["environs"]]:
        assert SECRET not in text
    # The ranks read the options from a private file (0600 in a 0700 directory), gone after the run.
    private = Path(ranks[0].split("\0")[ranks[0].split("\0").index("--config") + 1])
    assert seen["modes"][str(private)] == (0o600, 0o700)
    assert not private.exists()

    result = json.loads(stdout[stdout.index("{"):])
    step_dir = result["checkpoint_path"]
    assert step_dir == "s3://nproc/lake/_checkpoints/step-2" and result["steps"] == 2  # 48 train rows, batches of 32
    in_bucket = lake.fs_path(step_dir.removeprefix(f"{lake.root}/"))
    names = {i.base_name for i in lake.fs.get_file_info(pafs.FileSelector(in_bucket))}
    assert {"meta.json", "state.pt", "loss_curve.png"} <= names
    with lake.fs.open_input_stream(f"{in_bucket}/meta.json") as src:
        meta = json.loads(src.read())
    assert (meta["examples_version"], meta["extra"]["world_size"], meta["extra"]["sharded"]) == (version, 2, None)


def _watch_descendants(proc: subprocess.Popen) -> dict:
    """Poll /proc until ``proc`` exits: the NUL-joined cmdline and the environment of ``proc`` and
    every descendant, and (mode, parent directory mode) of each ``--config`` file a rank was given."""
    cmdlines: dict[int, str] = {}
    environs: dict[int, str] = {}
    modes: dict[str, tuple[int, int]] = {}
    while True:
        try:
            proc.wait(timeout=0.05)
            break
        except subprocess.TimeoutExpired:
            pass
        for pid in _descendants(proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            except OSError:  # exited meanwhile
                continue
            if cmdline:
                cmdlines[pid], environs[pid] = cmdline, environ
            args = cmdline.split("\0")
            if "trainer.launch" in args and "--config" in args:
                config = Path(args[args.index("--config") + 1])
                try:
                    modes[str(config)] = (stat.S_IMODE(config.stat().st_mode), stat.S_IMODE(config.parent.stat().st_mode))
                except OSError:
                    pass
    return {"cmdlines": list(cmdlines.values()), "environs": list(environs.values()), "modes": modes}


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (from each /proc/<pid>/stat's parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(text[text.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out
