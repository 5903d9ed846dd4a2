"""Atomic writes: a temporary file or folder in the same directory, fsync, then rename.

A reader never sees a half-written file at the final name; a crash leaves at most a ``.tmp-*`` leftover, which
the next write in that directory removes (``clean_stale``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

TMP_PREFIX = ".tmp-"


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


_UMASK = _umask()
FILE_MODE = 0o666 & ~_UMASK  # what open() would give: mkstemp/mkdtemp make 0600/0700 files
DIR_MODE = 0o777 & ~_UMASK


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it is durable (no-op where the OS does not allow it)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and folder under ``path`` (before renaming a freshly written folder into place)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(root))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file in the same folder, fsync, ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj, indent: int | None = 2) -> None:
    """JSON (UTF-8, not ASCII-escaped) version of :func:`atomic_write_bytes`."""
    atomic_write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def clean_stale(parent: Path) -> None:
    """Remove ``.tmp-*`` leftovers of interrupted writes in ``parent``."""
    if not parent.is_dir():
        return
    for p in parent.glob(TMP_PREFIX + "*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


@contextlib.contextmanager
def atomic_dir(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``final``; on success fsync it and rename it to ``final``.

    On an exception the temporary folder is removed and ``final`` is untouched. Raises FileExistsError when
    ``final`` exists and ``overwrite`` is false (checked before any work).
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} already exists (use --force to replace it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=final.parent))
    os.chmod(tmp, DIR_MODE)
    try:
        yield tmp
        fsync_tree(tmp)
        if final.exists():
            old = final.with_name(f"{TMP_PREFIX}{final.name}-old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: str | Path) -> str:
    """sha256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
