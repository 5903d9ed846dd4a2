"""train.atomic: temporaries of live writers survive a neighbour's cleaning; a dead writer's are cleaned; writes
are atomic (docs/design.md, "Atomic writes")."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from train import atomic as A

ROOT = Path(__file__).resolve().parent.parent


def _writer(parent: Path, name: str, then: str) -> subprocess.Popen:
    """A process that opens ``atomic_dir(parent/name)`` and ``atomic_path(parent/name.txt)``, writes into both,
    prints "ready", then either waits for a line on stdin and finishes (``then="finish"``) or dies (``"die"``)."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from train.atomic import atomic_dir, atomic_path
        parent = Path({str(parent)!r})
        with atomic_dir(parent / {name!r}) as tmp, atomic_path(parent / ({name!r} + ".txt")) as f:
            (tmp / "data").write_text({name!r})
            f.write_text({name!r})
            print("ready", flush=True)
            if {then!r} == "die":
                os._exit(9)
            sys.stdin.readline()
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    return p


def _tmps(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(A.TMP_PREFIX))


def test_two_live_writers_in_one_parent_keep_their_temporaries(tmp_path):
    a = _writer(tmp_path, "a", "finish")
    try:
        assert len(_tmps(tmp_path)) == 2                      # a's folder and a's file, both in flight
        with A.atomic_dir(tmp_path / "b") as tmp:             # b cleans the parent first: a's must survive
            (tmp / "data").write_text("b")
        A.atomic_write_text(tmp_path / "c.txt", "c")
        assert A.clean_stale(tmp_path) == []
        assert len(_tmps(tmp_path)) == 2
        out, err = a.communicate("go\n", timeout=60)
    finally:
        a.kill()
    assert a.returncode == 0, err
    assert (tmp_path / "a" / "data").read_text() == "a" and (tmp_path / "a.txt").read_text() == "a"
    assert (tmp_path / "b" / "data").read_text() == "b" and (tmp_path / "c.txt").read_text() == "c"
    assert _tmps(tmp_path) == []


def test_a_crashed_writers_leftovers_are_cleaned(tmp_path):
    a = _writer(tmp_path, "a", "die")
    assert a.wait(timeout=60) == 9
    left = _tmps(tmp_path)
    assert len(left) == 2 and all(".own" in n for n in left)
    with A.atomic_dir(tmp_path / "b") as tmp:                 # the next writer in the parent cleans them
        (tmp / "data").write_text("b")
    assert _tmps(tmp_path) == [] and not (tmp_path / "a").exists() and not (tmp_path / "a.txt").exists()


def test_a_held_lock_protects_a_temporary_whose_pid_looks_dead(tmp_path):
    """An owner in another PID namespace: its pid means nothing here, its flock does."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    tag = f"own{A._BOOT}-{int(dead.stdout)}-1"
    held = tmp_path / f".tmp-x.{tag}.abc"
    held.mkdir()
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE,
                              pass_fds=(fd,))   # a second process holding the same lock, as a live owner would
    os.close(fd)
    try:
        assert A.clean_stale(tmp_path) == [] and held.is_dir()
    finally:
        holder.communicate(b"\n", timeout=30)
    assert A.clean_stale(tmp_path) == [held] and not held.exists()


def test_pid_reuse_untagged_and_live_names(tmp_path):
    reused = tmp_path / f".tmp-y.own{A._BOOT}-{os.getpid()}-1.abc"     # our pid, another start time: stale
    mine = tmp_path / f".tmp-z.{A.owner_tag()}.abc"                    # this live process: kept
    other_boot = tmp_path / ".tmp-w.ownffffffff-1-1.abc"              # another boot, no lock: stale
    untagged = tmp_path / ".tmp-v.abc"                                 # not ours to judge: kept
    for p in (reused, mine, other_boot, untagged):
        p.write_text("x")
    if A._BOOT == "ffffffff":
        pytest.skip("this machine's boot id starts with ffffffff")
    assert sorted(A.clean_stale(tmp_path)) == sorted([reused, other_boot])
    assert mine.exists() and untagged.exists()


def test_atomic_write_keeps_umask_permissions_and_leaves_nothing(tmp_path):
    A.atomic_write_json(tmp_path / "sub" / "x.json", {"a": "অ"})
    p = tmp_path / "sub" / "x.json"
    assert p.read_text(encoding="utf-8") == '{\n  "a": "অ"\n}\n'
    assert (p.stat().st_mode & 0o777) == A.FILE_MODE
    with pytest.raises(RuntimeError), A.atomic_path(p) as t:
        t.write_text("half")
        raise RuntimeError("boom")
    assert p.read_text(encoding="utf-8").startswith("{") and _tmps(p.parent) == []
