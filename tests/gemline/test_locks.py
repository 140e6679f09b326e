"""gemline.locks: one holder at a time, released on exit and on a crash, object stores untouched."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gemline.locks import LakeBusyError, exclusive
from tests.conftest import build_args, ingest_args


def test_second_holder_is_refused_with_the_first_named(tmp_path):
    with exclusive(tmp_path, "ingest"):
        with pytest.raises(LakeBusyError, match=r"another ingest is running on this lake \(pid \d+ on "):
            with exclusive(tmp_path, "ingest"):
                pass
        with exclusive(tmp_path, "build"):  # another stage's lock is independent
            pass
    with exclusive(tmp_path, "ingest"):  # released on exit
        pass


def test_lock_of_a_killed_process_is_free_at_once(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom gemline.locks import exclusive\n"
         f"with exclusive({str(tmp_path)!r}, 'ingest'):\n    print('held', flush=True)\n    time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LakeBusyError, match=f"pid {holder.pid} "):
            with exclusive(tmp_path, "ingest"):
                pass
    finally:
        holder.kill()  # SIGKILL: no cleanup code runs in the holder
        holder.wait()
    with exclusive(tmp_path, "ingest"):
        pass


def test_object_store_lakes_are_not_locked():
    with exclusive("s3://bucket/lake", "ingest"):
        with exclusive("s3://bucket/lake", "ingest"):
            pass


def test_ingest_and_build_take_their_lock_before_anything_else(tmp_path):
    from gemline.config import GemlineConfig
    from ingest.pipeline import run_ingest
    from sequences.pipeline import run_build

    config = GemlineConfig(lake=str(tmp_path))
    with exclusive(tmp_path, "ingest"):
        with pytest.raises(LakeBusyError, match="another ingest"):
            run_ingest(*ingest_args(config), bootstrap="127.0.0.1:1")  # refused before any Kafka request
    with exclusive(tmp_path, "build"):
        with pytest.raises(LakeBusyError, match="another build"):
            run_build(*build_args(config))  # refused before reading the (missing) events table
