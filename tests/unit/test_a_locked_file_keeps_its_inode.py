"""A save beside a reader on this node moves the name to a fresh inode (decision 0031)
-- but the kernel keeps ``flock`` and POSIX locks per inode (this daemon takes no lock
requests), so locks held on the readers' inode stopped excluding the name's next
openers: a real-mount probe (stop 50) had a writer granted LOCK_EX beside a reader's
LOCK_SH, an evaluator load a half-written save, two lock-then-save writers tear one
file in the store, and ``flock -x`` and ``filelock`` both hold one lock file
(``tests/integration/test_locks_beside_a_moved_name.py``).  A locked file's name now
stays on its inode, and the save goes on in place at once, as on a disk.

And a moved-away inode opened again by the same task right after its ESTALE is a
descriptor's magic link (``/proc/self/fd/N``), not a path walk: it opens (for reading)
where it answered ESTALE for good."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.procstat import Opener, locked_in_kernel
from ckptfs.store import MemoryStore
from support.core import Core, open_core, two_cores
from test_save_beside_a_reader_of_a_version_not_uploaded import ASYNC, owed_beside_a_reader
from test_save_beside_a_reader_on_its_node import NEW, OLD, save_over, step_by_name


LOCKS = b"""1: POSIX  ADVISORY  WRITE 28010 fe:00:3892287 28010 28010
2: FLOCK  ADVISORY  READ  12208 00:2d:17 0 EOF
3: -> FLOCK  ADVISORY  WRITE 12209 00:2d:18 0 EOF
"""


def test_proc_locks_is_read_by_device_and_inode():
    assert locked_in_kernel(b"0:45", 17, LOCKS)         # 45 = 0x2d
    assert locked_in_kernel(b"0:45", 18, LOCKS)         # (a waiter: a holder too)
    assert not locked_in_kernel(b"0:45", 1, LOCKS)
    assert not locked_in_kernel(b"0:46", 17, LOCKS)
    assert locked_in_kernel(b"254:0", 3892287, LOCKS)
    assert not locked_in_kernel(b"254:0", 389228, LOCKS)


@pytest.mark.trio
@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_save_beside_a_reader_of_a_locked_file_stays_on_its_inode(
        tmp_path, durability: str):
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, Config(durability=durability)) as fs:
        core = Core(fs, store)
        ino = await core.save(ROOT_INO, b"f0", OLD)
        with trio.fail_after(30):
            await fs.wait_idle()
        reader = await fs.open(ino, os.O_RDONLY, core.me())
        fs.st.locked_in_kernel = lambda locked: locked == ino      # flock(reader, SH)
        with trio.fail_after(1.0):              # at once: no wait for the reader
            acted = await step_by_name(core, lambda at: save_over(core, at))
        assert acted == ino, "the name moved away from the inode its lock is on"
        assert await core.resolve("f0") == ino
        assert await core.load(ino) == NEW
        await fs.release(reader.fh)


@pytest.mark.trio
async def test_a_moved_away_inode_opened_again_at_once_by_the_same_task_opens(tmp_path):
    """The kernel's retry of an open through ``/proc/self/fd/N``: the reader's
    version.  A writer, or another task, still gets ESTALE."""
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, Config(durability="async")) as fs:
        core = Core(fs, store)
        ino = await core.save(ROOT_INO, b"f0", OLD)
        with trio.fail_after(30):
            await fs.wait_idle()
        reader = await fs.open(ino, os.O_RDONLY, core.me())
        acted = await step_by_name(core, lambda at: save_over(core, at))
        assert acted != ino and ino in fs.st.moved_away
        me, other = core.me(), Opener(tid=os.getpid() + 1, tgid=os.getpid() + 1)
        for opener, flags in ((me, os.O_WRONLY), (me, os.O_WRONLY),   # a writer: never
                              (me, os.O_RDONLY),       # a reader's first try
                              (other, os.O_RDONLY)):   # another task's: its own first
            with pytest.raises(FsError) as refused:
                await fs.open(ino, flags, opener)
            assert refused.value.errno == errno.ESTALE
        again = await fs.open(ino, os.O_RDONLY, me)     # the kernel's retry
        assert await fs.read(again.fh, 0, len(OLD) + 1) == OLD
        await fs.release(again.fh)
        await fs.release(reader.fh)


def _lock(fs, ino: int) -> None:
    fs.st.locked_in_kernel = lambda locked: locked == ino      # flock(reader, SH)


@pytest.mark.trio
async def test_a_locked_readers_version_is_never_cut_by_a_save_in_place(tmp_path):
    """Found by a review of the change above: the save went on in place, but the
    reader kept reading the version it opened, through the kernel's size of the new
    one -- the old bytes cut at the new size (torn; a disk gives the new bytes).  Its
    readers now read the file as it is (``live``), as on a disk.  Here with a version
    still owed to the store (async), which lands all the same."""
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, ASYNC) as fs:
        core = Core(fs, store)
        uploading, old, reader = await owed_beside_a_reader(core, store)
        _lock(fs, old)
        with trio.fail_after(1.0):
            acted = await step_by_name(core, lambda ino: save_over(core, ino))
        assert acted == old
        size = fs.getattr(old).size
        seen = (await fs.read(reader.fh, 0, len(OLD) + 1))[:size]   # (the kernel's cut)
        uploading.release()
        with trio.fail_after(30):
            await fs.wait_idle()
        await fs.release(reader.fh)
    assert seen == NEW, f"the locked reader read {len(seen)} bytes (size {size}): " \
        f"OLD cut at the new size: {seen == OLD[:size]}"
    async with open_core(tmp_path / "b", store, ASYNC) as fs:
        other = Core(fs, store)
        assert await other.load(await other.resolve("f0")) == NEW


@pytest.mark.trio
async def test_another_nodes_version_keeps_a_locked_files_name_on_its_inode(tmp_path):
    """A reader here holds ``f0`` with a lock on it; another node's save arrives (a
    listing).  The name moved to a fresh inode, where the next local opener's lock was
    granted beside the reader's (found by the same review).  It stays, and the reader
    reads the new version, as on a disk."""
    store = MemoryStore()
    async with two_cores(tmp_path, store, Config(durability="sync")) as (a, b):
        ino = await a.save(ROOT_INO, b"f0", OLD)
        reader = await a.fs.open(ino, os.O_RDONLY, a.me())
        _lock(a.fs, ino)
        await b.fs.refresh_dir(ROOT_INO, force=True)
        await b.save(ROOT_INO, b"f0", NEW)
        await a.fs.refresh_dir(ROOT_INO, force=True)
        now = await a.resolve("f0")
        got = await a.fs.read(reader.fh, 0, len(OLD) + 1)
        await a.fs.release(reader.fh)
    assert now == ino, "the name moved off the locked inode: its lock stops excluding"
    assert got == NEW
