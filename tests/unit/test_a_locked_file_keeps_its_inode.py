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
from support.core import Core, open_core
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
