"""contract.atomic: temporaries of live writers survive a neighbour's cleaning; a dead writer's are cleaned; writes
are atomic (docs/design.md, "Atomic writes")."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from contract import atomic as A

ROOT = Path(__file__).resolve().parent.parent


def _writer(parent: Path, name: str, then: str) -> subprocess.Popen:
    """A process that opens ``atomic_dir(parent/name)`` and ``atomic_path(parent/name.txt)``, writes into both,
    prints "ready", then either waits for a line on stdin and finishes (``then="finish"``) or dies (``"die"``)."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from contract.atomic import atomic_dir, atomic_path
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


# ---------------------------------------------------------------- replacing a folder: a kill at every point

_KILL = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from contract import atomic as A
    mode, kill_at, parent = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    if mode == "fallback":
        A._renameat2 = None                  # as on an OS or file system without RENAME_EXCHANGE
    events = [0]

    def traced(name, fn):
        def call(*a, **k):
            for when in ("before", "after"):
                if when == "after":
                    out = fn(*a, **k)
                if events[0] == kill_at:
                    print(name, when, flush=True)
                    os._exit(9)
                events[0] += 1
            return out
        return call

    for name in ("fsync_tree", "fsync_dir", "exchange", "remove_path"):
        setattr(A, name, traced(name, getattr(A, name)))
    A.os.rename = traced("rename", os.rename)
    with A.atomic_dir(parent / "bundle", overwrite=True) as tmp:
        (tmp / "a").write_text("new")
        (tmp / "b").write_text("new")
    print("events", events[0], flush=True)
""")


def _kill_run(mode: str, kill_at: int, parent: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _KILL.format(root=str(ROOT)), mode, str(kill_at), str(parent)],
                          capture_output=True, text=True, timeout=60)


def _bundle_state(parent: Path) -> str:
    files = {p.name: p.read_text() for p in (parent / "bundle").iterdir()}
    assert set(files) == {"a", "b"} and len(set(files.values())) == 1, files   # complete, never a mixture
    return files["a"]


@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_replace_survives_a_kill_at_every_point(tmp_path, mode):
    if mode == "exchange" and A._renameat2 is None:
        pytest.fail("renameat2 is not available through libc here (glibc >= 2.28 on Linux has it)")
    seen = []
    for kill_at in range(100):
        parent = tmp_path / f"k{kill_at}"
        (parent / "bundle").mkdir(parents=True)
        for n in ("a", "b"):
            (parent / "bundle" / n).write_text("old")
        res = _kill_run(mode, kill_at, parent)
        if res.returncode == 0:                         # ran past every event: done
            assert _bundle_state(parent) == "new" and _tmps(parent) == []
            break
        assert res.returncode == 9, res.stderr
        seen.append(res.stdout.strip())
        if not (parent / "bundle").exists():            # only between the fallback's two renames
            assert mode == "fallback" and seen[-1].startswith("rename")
            A.clean_stale(parent)                       # what the next write in this folder does first
        state = _bundle_state(parent)
        A.clean_stale(parent)
        assert _tmps(parent) == [] and _bundle_state(parent) == state
        with A.atomic_dir(parent / "bundle", overwrite=True) as tmp:   # and the next export succeeds
            (tmp / "a").write_text("next")
            (tmp / "b").write_text("next")
        assert _bundle_state(parent) == "next" and _tmps(parent) == []
    else:
        pytest.fail("the write never finished")
    swap = "exchange after" if mode == "exchange" else "rename after"
    assert swap in seen                                  # the kill points did include the swap itself
    assert len(seen) >= 6


def test_replace_a_file_leaves_no_leftover(tmp_path):
    (tmp_path / "bundle").write_text("a file")
    with A.atomic_dir(tmp_path / "bundle", overwrite=True) as tmp:
        (tmp / "a").write_text("new")
    assert (tmp_path / "bundle" / "a").read_text() == "new" and _tmps(tmp_path) == []
    A._renameat2, saved = None, A._renameat2
    try:
        (tmp_path / "f").write_text("a file")
        with A.atomic_dir(tmp_path / "f", overwrite=True) as tmp:
            (tmp / "a").write_text("new")
    finally:
        A._renameat2 = saved
    assert (tmp_path / "f" / "a").read_text() == "new" and _tmps(tmp_path) == []
