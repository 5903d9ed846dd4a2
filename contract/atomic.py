"""Atomic writes: a temporary file or folder in the same directory, fsync, then rename.

A reader never sees a half-written file at the final name. Every temporary is named
``.tmp-<final name>.own<boot>-<pid>-<start>.<suffix>`` — the owner's boot id (8 hex digits of
``/proc/sys/kernel/random/boot_id``), process id and process start time (clock ticks after boot, field 22 of
``/proc/<pid>/stat``) — and its owner holds an exclusive ``flock`` on it while writing. :func:`clean_stale`
removes a temporary only when it is provably stale: its owner process is gone (no such pid, a pid reused by a
process that started at another time, or another boot) **and** no process holds its lock. A live writer's
temporary is never touched, also not by a process in another PID namespace (the lock covers that case); names
without an owner tag are not ours to judge and are left alone.

:func:`atomic_dir` replaces an existing folder (or file) in one step on Linux: ``renameat2(RENAME_EXCHANGE)``
(glibc ≥ 2.28, called through ctypes) swaps the new folder and the old one, then the old one, now under the
temporary name, is removed. Where the exchange is not available (another OS, a file system that refuses it) it
falls back to two renames; a crash between them leaves the old folder parked as ``….old``, and the next
:func:`clean_stale` in that folder (every :func:`atomic_dir` starts with one) renames it back. At no point of a
crash is the final name's data lost. See docs/design.md, "Atomic writes".
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

TMP_PREFIX = ".tmp-"
OLD = "old"  # last name part of a replaced folder while it is being swapped out


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


_UMASK = _umask()
FILE_MODE = 0o666 & ~_UMASK  # what open() would give: mkstemp/mkdtemp make 0600/0700 files
DIR_MODE = 0o777 & ~_UMASK


# ------------------------------------------------------------------------------------------- owner identity

def _read_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip().replace("-", "")[:8].lower()
    except OSError:
        return "00000000"  # no /proc: liveness falls back to os.kill(pid, 0)


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks after boot (``/proc/<pid>/stat`` field 22); None without /proc.
    Raises ProcessLookupError when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        if os.path.isdir("/proc/self"):
            raise ProcessLookupError(pid) from None
        return None
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may itself hold spaces or ")"
    return int(stat[stat.rindex(b")") + 2:].split()[19])


_BOOT = _read_boot_id()
_OWNER_RE = re.compile(r"\.own([0-9a-f]{8})-(\d+)-(\d+)\.")


def owner_tag(pid: int | None = None) -> str:
    """``own<boot>-<pid>-<start>`` for ``pid`` (default this process): the part of a temporary's name that
    identifies the process writing it (module doc). Raises ProcessLookupError for a pid that does not run."""
    pid = os.getpid() if pid is None else pid
    return f"own{_BOOT}-{pid}-{_start_time(pid) or 0}"


def tmp_prefix(final_name: str) -> str:
    """The name prefix of this process's temporaries for ``final_name``: ``.tmp-<final_name>.<owner tag>.``."""
    return f"{TMP_PREFIX}{final_name}.{owner_tag()}."


def _owner_alive(boot: str, pid: int, start: int) -> bool | None:
    """True: the process that wrote the temporary runs; False: it provably does not; None: cannot tell from the
    name (another boot, or another machine sharing the folder)."""
    if boot != _BOOT:
        return None
    try:
        now = _start_time(pid)
    except ProcessLookupError:
        return False
    if now is None:  # no /proc (not Linux): a signal-0 probe, which cannot see pid reuse, so it errs to alive
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True
    return now == start


def _hold(fd: int) -> None:
    """The owner's exclusive flock on its temporary (released when ``fd`` closes or the process dies). Where the
    file system has no flock, the owner tag in the name is the only guard."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _unheld(fd: int) -> bool:
    """Take the flock on a candidate temporary without waiting: False when some process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return True  # no flock on this file system: its owner could not hold one either
    return True


# ------------------------------------------------------------------------------------------- fsync helpers

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


# ------------------------------------------------------------------------------------------- stale temporaries

def remove_path(p: Path) -> None:
    """Remove a file, link or folder tree at ``p`` (nothing when absent; errors inside a tree are ignored)."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def _stale_candidates(parent: Path) -> list[tuple[Path, re.Match]]:
    try:
        entries = [p for p in Path(parent).iterdir() if p.name.startswith(TMP_PREFIX)]
    except OSError:
        return []
    out = []
    for p in entries:
        tags = list(_OWNER_RE.finditer(p.name))
        m = tags[-1] if tags else None  # the last tag: a final name may itself look like one
        if m is not None and not _owner_alive(m.group(1), int(m.group(2)), int(m.group(3))):
            out.append((p, m))
    return out


def clean_stale(parent: Path) -> list[Path]:
    """Remove the provably stale temporaries in ``parent`` (module doc) and return the paths removed.

    A replaced folder parked under ``….old`` whose final name is free (the process died between the two renames
    of the fallback swap) is renamed back to its final name instead: the old data is restored, never deleted.
    Never raises for an entry it cannot judge or remove; it leaves that entry.
    """
    done: list[Path] = []
    for p, m in _stale_candidates(parent):
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not _unheld(fd):
                continue
            final = p.with_name(p.name[len(TMP_PREFIX):m.start()])
            if p.name.endswith("." + OLD) and not os.path.lexists(final):
                try:  # put the old data back where it was
                    os.rename(p, final)
                except OSError:
                    continue
                fsync_dir(p.parent)
            else:
                remove_path(p)
            done.append(p)
        finally:
            os.close(fd)
    return done


# ------------------------------------------------------------------------------------------- atomic files

@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file path beside ``path`` for the caller to write (by name, so a library that opens the
    file itself can write it); on success fsync it, give it umask permissions (:data:`FILE_MODE`), rename it to
    ``path`` and fsync the folder. On an exception the temporary is removed and ``path`` is untouched. The parent
    folder is created when missing. Raises OSError as the file system does.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=tmp_prefix(path.name), dir=path.parent)
    tmp = Path(name)
    try:
        _hold(fd)
        os.fchmod(fd, FILE_MODE)
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_path`: a temporary in the same folder, fsync, rename,
    umask permissions). Raises OSError as the file system does; ``path`` is then untouched."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj, indent: int | None = 2) -> None:
    """JSON (UTF-8, not ASCII-escaped, one trailing newline) version of :func:`atomic_write_bytes`."""
    atomic_write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


# ------------------------------------------------------------------------------------------- atomic folders

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h


def _load_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc before 2.28, or another libc
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Swap the entries ``a`` and ``b`` (both must exist; a folder and a file may swap) in one atomic step with
    Linux ``renameat2(RENAME_EXCHANGE)``. Returns False where that is not available (not Linux, an old libc, or a
    file system that refuses it: EINVAL, ENOSYS, EOPNOTSUPP), and then nothing was changed. Raises OSError for
    any other failure (missing entry, permissions)."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _replace(tmp: Path, final: Path) -> None:
    """Put the finished folder ``tmp`` at the existing ``final`` (module doc), removing the old entry."""
    if exchange(tmp, final):        # tmp now names the old entry, under this (live) process's tag
        fsync_dir(final.parent)
        remove_path(tmp)
        return
    old = final.with_name(tmp_prefix(final.name) + OLD)
    fd = os.open(final, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        _hold(fd)                   # the parked old entry is ours while we swap
        os.rename(final, old)       # a crash from here until the next rename: clean_stale puts it back
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(old, final)
            raise
        fsync_dir(final.parent)
    finally:
        os.close(fd)
    remove_path(old)


@contextlib.contextmanager
def atomic_dir(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``final``; on success fsync it and rename it to ``final``.

    On an exception the temporary folder is removed and ``final`` is untouched. An existing ``final`` (folder or
    file) is replaced only when ``overwrite`` is true, in one atomic step where the OS allows (module doc), and
    leaves nothing behind. Raises FileExistsError when ``final`` exists and ``overwrite`` is false (checked before
    any work), OSError as the file system does. Stale temporaries of dead writers in the parent are cleaned (or
    restored) first (:func:`clean_stale`); a live writer's are left alone.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final.parent)
    if os.path.lexists(final) and not overwrite:
        raise FileExistsError(f"{final} already exists (use --force to replace it)")
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix(final.name), dir=final.parent))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        _hold(fd)
        os.chmod(tmp, DIR_MODE)
        yield tmp
        fsync_tree(tmp)
        if os.path.lexists(final):
            _replace(tmp, final)
        else:
            os.rename(tmp, final)
            fsync_dir(final.parent)
    except BaseException:
        remove_path(tmp)
        raise
    finally:
        os.close(fd)


def sha256_file(path: str | Path) -> str:
    """sha256 hex digest of a file's bytes, read in 1 MiB blocks (memory stays flat for multi-GB weights). The one
    implementation: checkpoints' SHA256SUMS, data caches and bundle manifests (``contract.bundle`` re-exports it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
