"""File locks, and reopening a descriptor, after a save on this node moved the name to a
fresh inode beside a reader (decision 0031, addenda of stops 48 and 50).

The daemon takes no lock requests: the kernel keeps ``flock`` and POSIX locks per kernel
inode.  A writer's open beside a reader moves the name to a fresh inode, so a lock held
through the reader's descriptor (or any descriptor opened read-only) stops excluding
whoever locks the name afterwards.  On a local disk every one of these writers is
refused; here they got the lock, and a reader read a half-written save, two writers
tore one file, and a shell ``flock -x`` and Python's ``filelock`` both held one lock
file.  Reopening a reader's descriptor through ``/proc/self/fd/N`` answers ESTALE where a
disk gives the file.

All found by a real-mount probe (stop 50); each test failed before.  A locked file's
name now stays on its inode (the save goes on in place, as on a disk), and a
moved-away inode opens again for its own task's retry.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from support.mounts import run_ckptfs

V1 = os.urandom(1_000_000)
V2 = os.urandom(1_000_000)

# A chunk upload delayed: the version the reader holds is still owed to the store when
# the writer comes (async mode hands it over to the fresh inode).
OWED = {"rules": [{"op": "put", "prefix": "chunks/", "kind": "delay", "delay": 3.0}]}

# Holds a POSIX read lock on argv[1] through an O_RDONLY descriptor until stdin closes
# (POSIX locks are per process: the test's own would never conflict).
HOLD_READ_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.lockf(fd, fcntl.LOCK_SH)
print("locked", flush=True)
sys.stdin.read()
"""


def _mount(local_store, make_mount, owed: bool):
    return make_mount(local_store, name="a", durability="async",
                      faults=OWED if owed else None)


def _save_v1(mnt, name: str, owed: bool):
    path = mnt.path / name
    path.write_bytes(V1)
    if not owed:
        run_ckptfs("wait", str(mnt.path), check=True)
    return path


def _a_writers_lock_is_refused(path, lock) -> None:
    """A writer's open of ``path`` (not truncating), then ``lock`` (``fcntl.flock`` or
    ``fcntl.lockf``) exclusive, not waiting: refused, as on a disk."""
    writer = os.open(path, os.O_WRONLY)
    try:
        with pytest.raises(BlockingIOError):
            lock(writer, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(writer)


@pytest.mark.parametrize("owed", [False, True], ids=["uploaded", "owed"])
def test_a_writers_flock_is_refused_while_a_reader_holds_a_shared_flock(
        local_store, make_mount, owed):
    mnt = _mount(local_store, make_mount, owed)
    path = _save_v1(mnt, "latest.pt", owed)
    reader = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(reader, fcntl.LOCK_SH)
        _a_writers_lock_is_refused(path, fcntl.flock)
    finally:
        os.close(reader)


def test_a_writers_posix_lock_is_refused_while_a_reader_holds_a_read_lock(
        local_store, make_mount):
    mnt = _mount(local_store, make_mount, owed=False)
    path = _save_v1(mnt, "latest.pt", owed=False)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_READ_LOCK, str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        _a_writers_lock_is_refused(path, fcntl.lockf)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_reader_holding_a_shared_lock_never_loads_a_half_written_save(
        local_store, make_mount):
    """The evaluator locks ``latest.pt`` shared through one descriptor and loads it by
    name (``torch.load(path)``); the trainer locks it exclusive before it rewrites it.
    On a disk the trainer waits (here: is refused) and the evaluator loads v1; here the
    trainer got the lock and the evaluator loaded the first half of the trainer's save."""
    mnt = _mount(local_store, make_mount, owed=False)
    path = _save_v1(mnt, "latest.pt", owed=False)
    lock = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_SH)
        trainer = os.open(path, os.O_RDWR)
        try:
            try:
                fcntl.flock(trainer, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                locked = False
            if locked:
                os.ftruncate(trainer, 0)
                os.pwrite(trainer, V2[:500_000], 0)
            loaded = path.read_bytes()
            if locked:
                os.pwrite(trainer, V2[500_000:], 500_000)
        finally:
            os.close(trainer)
    finally:
        os.close(lock)
    whole = loaded in (V1, V2)
    assert whole, f"the evaluator loaded {len(loaded)} bytes of neither version " \
        f"(the first half of the trainer's: {loaded == V2[:500_000]})"
    assert not locked, "the trainer got LOCK_EX while the evaluator held LOCK_SH"


def test_two_savers_locking_through_read_only_descriptors_do_not_tear_the_file(
        local_store, make_mount):
    """Each saver opens the file read-only, takes ``LOCK_EX`` on that descriptor, then
    rewrites the file by name.  The first saver's own descriptor is a reader: its save
    moved the name, and the second saver's lock (on the fresh inode) was granted."""
    mnt = _mount(local_store, make_mount, owed=False)
    path = _save_v1(mnt, "latest.pt", owed=False)
    v3 = os.urandom(200)
    lock1 = os.open(path, os.O_RDONLY)
    fcntl.flock(lock1, fcntl.LOCK_EX)
    w1 = os.open(path, os.O_WRONLY | os.O_TRUNC)
    os.pwrite(w1, V2[:500_000], 0)
    lock2 = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(lock2, fcntl.LOCK_EX | fcntl.LOCK_NB)
        second_locked = True
    except BlockingIOError:
        second_locked = False
    if second_locked:                    # it believes it is alone: it saves v3
        with open(path, "wb") as f:
            f.write(v3)
    os.pwrite(w1, V2[500_000:], 500_000)
    os.close(w1)
    os.close(lock2)
    os.close(lock1)
    final = path.read_bytes()
    run_ckptfs("wait", str(mnt.path), check=True)
    whole = final in (V2, v3)
    assert whole, f"the file is torn: {len(final)} bytes of neither save " \
        f"(the second saver's, zeros, then the first saver's second half: " \
        f"{final == v3 + bytes(500_000 - len(v3)) + V2[500_000:]})"
    assert not second_locked, "two savers held LOCK_EX on one file at once"


def test_a_lock_file_held_by_the_flock_command_excludes_filelock(local_store, make_mount):
    """An empty lock file: ``flock -x job.lock CMD`` in a shell (util-linux opens it
    O_RDONLY) and ``filelock.FileLock("job.lock")`` in the job (O_RDWR).  The job's open
    is a writer's beside a reader: the name moved, and both held the lock."""
    filelock = pytest.importorskip("filelock")
    mnt = _mount(local_store, make_mount, owed=False)
    path = mnt.path / "job.lock"
    path.write_bytes(b"")
    shell = subprocess.Popen(["flock", "-x", str(path), "sh", "-c", "echo held; sleep 30"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert shell.stdout.readline().strip() == "held"
        acquired = True
        try:
            with filelock.FileLock(str(path), timeout=1.0):
                pass
        except filelock.Timeout:
            acquired = False
    finally:
        shell.kill()
        shell.wait(timeout=30)
    assert not acquired, "filelock got job.lock while `flock -x` held it"


@pytest.mark.parametrize("how", ["save", "truncate"])
def test_reopening_a_readers_descriptor_through_proc_after_a_save(
        local_store, make_mount, how):
    """``open("/proc/self/fd/N")`` of a reader's descriptor (``/dev/stdin`` of
    ``eval.py < latest.pt``, a descriptor handed to a child as ``/dev/fd/N``): a disk
    opens the same file.  Here the reader's inode was moved away from the name and the
    open answered ESTALE (the kernel's retry walks the same magic link)."""
    mnt = _mount(local_store, make_mount, owed=False)
    path = _save_v1(mnt, "latest.pt", owed=False)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 10, 0) == V1[:10]
        if how == "save":
            path.write_bytes(V2[:100])
        else:
            os.truncate(path, 100)
        with open(f"/proc/self/fd/{fd}", "rb") as again:
            data = again.read()
    finally:
        os.close(fd)
    # the reader's version (as a replaced file's reopen gives) or the file's new one
    whole = data in (V1, V2[:100], V1[:100])
    assert whole, f"reopened: {len(data)} bytes of no version"


@pytest.mark.parametrize("new_len", [300_000, 1_000_000], ids=["shorter", "same-size"])
def test_a_locked_readers_next_read_after_a_locked_save_is_the_save(
        local_store, make_mount, new_len):
    """A reader and a writer take turns by their locks.  On ext4 and tmpfs the
    reader's next locked read through its descriptor reads the writer's save whole;
    here it read the version before cut at the save's size (a review found it)."""
    v2 = os.urandom(new_len)
    mnt = make_mount(local_store, name="a", durability="async")
    path = mnt.path / "latest.pt"
    path.write_bytes(V1)
    run_ckptfs("wait", str(mnt.path), check=True)
    reader = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(reader, fcntl.LOCK_SH)
        assert os.pread(reader, len(V1) + 1, 0) == V1
        writer = os.open(path, os.O_WRONLY)          # lock first, then truncate
        try:
            with pytest.raises(BlockingIOError):     # the reader holds LOCK_SH
                fcntl.flock(writer, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(reader, fcntl.LOCK_UN)       # the reader's turn ends
            fcntl.flock(writer, fcntl.LOCK_EX)
            os.ftruncate(writer, 0)
            os.pwrite(writer, v2, 0)
            fcntl.flock(writer, fcntl.LOCK_UN)
        finally:
            os.close(writer)
        fcntl.flock(reader, fcntl.LOCK_SH)
        size = os.fstat(reader).st_size
        got = os.pread(reader, size + 1, 0)
        fcntl.flock(reader, fcntl.LOCK_UN)
    finally:
        os.close(reader)
    by_name = path.read_bytes()
    assert by_name == v2
    assert got in (v2, V1), (
        f"the locked reader read {len(got)} bytes (fstat {size}) of neither version: "
        f"V1 cut at the new size: {got == V1[:new_len]}; "
        f"V1 prefix: {V1.startswith(got)}; v2 prefix: {v2.startswith(got)}")
    assert got == v2, "the reader read the version before (a disk gives the save)"


def test_a_writer_beside_a_locked_passthrough_reader_opens(local_store, make_mount):
    """A reader opened the file while its writer wrote it through the kernel
    (passthrough) and holds ``LOCK_SH`` on it; the next saver opens the file to take
    its turn by ``LOCK_EX``.  On a disk the open succeeds (and the lock waits); here it
    was refused with EBUSY after 2 s (the locked file no longer moved, and the kernel
    reads the version before through its backing file).  It moves, locks or not."""
    mnt = make_mount(local_store, name="a", durability="async")
    path = mnt.path / "latest.pt"
    first = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.pwrite(first, V1, 0)
    reader = os.open(path, os.O_RDONLY)          # beside the writer: passthrough
    os.close(first)
    run_ckptfs("wait", str(mnt.path), check=True)
    try:
        fcntl.flock(reader, fcntl.LOCK_SH)
        assert os.pread(reader, len(V1) + 1, 0) == V1
        try:
            writer = os.open(path, os.O_WRONLY)
        except OSError as exc:
            pytest.fail(f"the next saver's open failed: {exc!r} (a disk opens it)")
        os.close(writer)
    finally:
        os.close(reader)
