"""The bundle's output folder: what ``--out`` (and ``--force``) may point at, and what a failed write means.

An existing ``--out`` is replaced only with ``--force`` and only when it is a Shalik bundle (``manifest.json``
with ``format: "shalik-bundle"``) or an empty folder: ``--force`` never deletes other data. A target under a
regular file, on a read-only file system or where the file system refuses folders (``/proc``) is refused before
any work; a write that fails later (a full disk) is reported with its errno name (ENOSPC), never as an exporter
failure.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from contract.atomic import tmp_prefix
from contract.bundle import FORMAT, MANIFEST, is_bundle
from export.errors import ExportError


def write_error(out: Path, e: OSError) -> ExportError:
    """An ExportError (exit code 2) for an OSError met while writing the bundle at ``out``: the path, the
    system's message and the errno name, e.g. ``No space left on device (ENOSPC)``."""
    name = errno.errorcode.get(e.errno, "") if e.errno is not None else ""
    where = e.filename or out
    return ExportError(f"cannot write the bundle at {out}: {where}: {e.strerror or e}"
                       + (f" ({name})" if name else "") + "; no bundle was written")


def os_error_in(e: BaseException) -> OSError | None:
    """The OSError that ``e`` is or was raised from (following ``__cause__``/``__context__``), else None: an
    exporter that failed because the disk is full did not fail to export."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def check_target(out: Path, force: bool) -> None:
    """Refuse an ``--out`` that cannot or may not become a bundle folder, before any work.

    Raises ExportError naming the path: an existing entry without ``force``; with ``force``, an existing file, or
    a non-empty folder that is not a Shalik bundle; a parent that is a file, not writable or on a read-only file
    system; a file system that refuses to create a folder there (a probe folder is made and removed).
    """
    if os.path.lexists(out):
        if not force:
            raise ExportError(f"{out} already exists (use --force to replace it)")
        if not out.is_dir() or out.is_symlink():
            raise ExportError(f"--out {out} is a file, not a bundle folder; --force replaces only a Shalik bundle "
                              "(remove the file yourself or choose another --out)")
        if any(out.iterdir()) and not is_bundle(out):
            raise ExportError(f"--out {out} is a folder that is not a Shalik bundle (no {MANIFEST} with format "
                              f"{FORMAT!r}); --force would delete it, so it is refused (remove it yourself or "
                              "choose another --out)")
    anc = out.parent
    while not os.path.lexists(anc) and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ExportError(f"--out {out}: {anc} is a file, not a folder")
    if hasattr(os, "statvfs") and os.statvfs(anc).f_flag & os.ST_RDONLY:
        raise ExportError(f"--out {out}: {anc} is on a read-only file system (EROFS)")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ExportError(f"--out {out}: {anc} is not writable by this user (EACCES)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=tmp_prefix(out.name), dir=out.parent))
    except OSError as e:
        raise ExportError(f"--out {out}: cannot create a folder in {out.parent}: {e.strerror or e}"
                          f" ({errno.errorcode.get(e.errno, '?')})") from None
