"""Fetching dataset files that ship inside packages on PyPI, with a local cache.

Some public datasets are easiest to reach through a Python package that bundles them
(MovieLens-100K inside the ``recbole`` wheel, the Open Bandit sample inside the ``obp`` sdist).
We download the distribution with pip (the ordinary client, so proxies and indexes configured for
pip apply), copy out only the files we need, and keep them in a cache directory. A complete cache
is never downloaded again; files are written atomically so that an interrupted fetch leaves no
half-written file that would later pass as cached.

The data is never redistributed: it lives only in the user's cache, never in the repository.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

DEFAULT_CACHE_ROOT = Path("~/.cache/gemline")
"""Parent of the per-dataset default cache directories."""


def resolve_cache_dir(cache_dir: str | os.PathLike | None, default_name: str) -> Path:
    """``cache_dir`` as a Path, or ``~/.cache/gemline/<default_name>`` when None."""
    if cache_dir is None:
        return (DEFAULT_CACHE_ROOT / default_name).expanduser()
    return Path(cache_dir).expanduser()


def is_cached(cache_dir: Path, names: list[str]) -> bool:
    """Whether every file in ``names`` (paths relative to ``cache_dir``) exists."""
    return all((cache_dir / name).is_file() for name in names)


def download(pip_args: list[str], dest: Path) -> Path:
    """Run ``python -m pip download <pip_args> -d dest`` and return the single file it saved.

    Raises:
        RuntimeError: pip failed (no network, unknown version), with pip's output; or pip saved
            not exactly one file.
    """
    cmd = [sys.executable, "-m", "pip", "download", *pip_args, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"pip download failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}"
            f"{proc.stderr[-2000:]}\nCheck network access to PyPI, or pass a cache_dir that "
            "already holds the dataset files."
        )
    files = [p for p in dest.iterdir() if p.is_file()]
    if len(files) != 1:
        raise RuntimeError(f"pip download saved {len(files)} files in {dest}, expected exactly 1: {files}")
    return files[0]


def read_member(archive: Path, member: str) -> bytes:
    """The bytes of ``member`` inside a wheel/zip or a .tar.gz sdist.

    Raises:
        KeyError: the archive has no such member (message lists the archive).
        ValueError: the archive is neither a zip nor a tar file.
    """
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            return zf.read(member)
    if tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tf:
            handle = tf.extractfile(member)
            if handle is None:
                raise KeyError(f"{member} is not a regular file in {archive}")
            return handle.read()
    raise ValueError(f"expected a wheel/zip or tar.gz archive, got {archive}")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary sibling and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fetch_files(pip_args: list[str], members: dict[str, str], cache_dir: Path) -> Path:
    """Ensure ``cache_dir`` holds the given archive members, downloading the package at most once.

    Args:
        pip_args: arguments to ``pip download`` naming exactly one distribution, e.g.
            ``["--no-deps", "recbole==1.2.1"]``.
        members: cache-relative file name -> member path inside the downloaded archive.
        cache_dir: where the files are kept.

    Returns:
        ``cache_dir``.

    Raises:
        RuntimeError: from :func:`download`.
        KeyError: a member is missing from the archive.
    """
    if is_cached(cache_dir, list(members)):
        return cache_dir
    with tempfile.TemporaryDirectory(prefix="gemline-pip-") as tmp:
        archive = download(pip_args, Path(tmp))
        for name, member in members.items():
            write_atomic(cache_dir / name, read_member(archive, member))
    return cache_dir
