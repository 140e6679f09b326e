"""Fixtures shared by the gemline tests: a moto S3 server on 127.0.0.1, started and stopped here."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from ingest.broker import free_port


@pytest.fixture(scope="module")
def moto_endpoint():
    """``http://127.0.0.1:PORT`` of a moto_server running for the module."""
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # readiness poll, bounded by attempts
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {proc.returncode}")
            try:
                urllib.request.urlopen(endpoint, timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"moto_server did not answer on {endpoint}")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def s3_bucket(endpoint: str, bucket: str) -> dict[str, str]:
    """Create ``bucket`` on the moto server at ``endpoint``; the delta-rs storage options that reach it."""
    admin = pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1", scheme="http",
                              endpoint_override=endpoint.removeprefix("http://"), allow_bucket_creation=True)
    admin.create_dir(bucket)
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
        "AWS_CONDITIONAL_PUT": "etag",  # commits are put-if-absent: a second writer of version N conflicts
    }
